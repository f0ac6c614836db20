//! Why a request could not be sent ([`KvRouterError`]) or a router started ([`StartError`]).

use kvroute_protocols::WorkerWithDpRank;
use kvroute_router_core::RouteError;
use kvroute_runtime::EventPlaneError;
use kvroute_scheduler::ConfigError;

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
