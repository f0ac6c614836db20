//! Why a request could not be routed ([`RouteError`], the core's), sent ([`KvRouterError`]),
//! or a router started ([`StartError`]).

use kvroute_protocols::{RequestPhase, WorkerWithDpRank};
use kvroute_runtime::EventPlaneError;
use kvroute_scheduler::{ConfigError, LoadError, SelectError};
use kvroute_sessions::SessionError;

/// Why [`crate::KvRouterCore::route`] (or `query`) failed. No state changes on error.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum RouteError {
    /// Direct routing needs a worker id for the request's phase.
    #[error(
        "direct routing needs a worker id for the {phase} phase: set backend_instance_id (or \
         prefill_worker_id / decode_worker_id, or the x-worker-instance-id header)"
    )]
    NoWorkerId {
        /// The phase being routed.
        phase: RequestPhase,
    },
    /// No eligible worker (none registered, filters, overload, a bad override).
    #[error(transparent)]
    Select(#[from] SelectError),
    /// The session's worker left (hard mode) or the affinity store refused the binding.
    #[error(transparent)]
    Session(#[from] SessionError),
    /// The request id is already in flight (ids must be unique among active requests).
    #[error(transparent)]
    Load(#[from] LoadError),
}

/// Why the router could not start.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum StartError {
    /// The core's configuration is invalid.
    #[error("invalid router configuration: {0}")]
    Config(#[from] ConfigError),
    /// The event plane refused the KV event subscription.
    #[error("cannot subscribe to KV events: {0}")]
    EventPlane(#[from] EventPlaneError),
}

/// Why a request was not started.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum KvRouterError {
    /// The core found no worker (or the request asked for something impossible).
    #[error(transparent)]
    Route(#[from] RouteError),
    /// The chosen worker could not be reached or refused the request.
    #[error("sending to worker {worker}: {source}")]
    Send {
        /// The chosen worker.
        worker: WorkerWithDpRank,
        /// What the transport said.
        source: kvroute_runtime::RouteError,
    },
}

/// Whether a failed send lost its worker (so another worker may take the continuation).
pub(crate) fn send_lost_worker(error: &kvroute_runtime::RouteError) -> bool {
    match error {
        kvroute_runtime::RouteError::Request { source, .. } => source.is_worker_unavailable(),
        kvroute_runtime::RouteError::UnknownWorker { .. } => true,
        _ => false,
    }
}
