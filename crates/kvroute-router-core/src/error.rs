//! Why a request could not be routed.

use kvroute_protocols::RequestPhase;
use kvroute_scheduler::{LoadError, SelectError};
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
