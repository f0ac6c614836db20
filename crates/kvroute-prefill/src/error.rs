//! The prefill router's one error type.

use kvroute_protocols::{RequestPhase, WorkerId};

use crate::phase::PhaseRouteError;

/// Why a disaggregated (or fallback) request could not be started.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PrefillError {
    /// Disaggregated serving is enforced but no prefill worker is registered.
    #[error(
        "disaggregated serving is enforced but no prefill worker is registered; expected at \
         least one worker with role prefill in discovery"
    )]
    NotActivated,
    /// The request pins a prefill worker that is not a registered prefill worker.
    #[error(
        "prefill_worker_id {worker_id} is not a registered prefill worker; expected one of the \
         workers with role prefill"
    )]
    UnknownPrefillWorker {
        /// The pinned worker.
        worker_id: WorkerId,
    },
    /// The router refused the request because every eligible worker of `phase` is saturated.
    /// Retryable: the client should back off and send it again.
    #[error("{phase} workers are saturated, retry later: {message}")]
    ResourceExhausted {
        /// The phase that was refused.
        phase: RequestPhase,
        /// The router's reason.
        message: String,
    },
    /// Routing one phase failed for a reason other than saturation.
    #[error("routing the {phase} phase failed: {source}")]
    Route {
        /// The phase.
        phase: RequestPhase,
        /// The router's error.
        source: PhaseRouteError,
    },
    /// The prefill worker failed the request (an error item, an error finish, or an empty
    /// stream).
    #[error("prefill worker {worker_id} failed the request: {message}")]
    PrefillFailed {
        /// The prefill worker.
        worker_id: WorkerId,
        /// What it reported.
        message: String,
    },
    /// The worker of `phase` was lost: it could not be reached, or (prefill) its connection
    /// dropped before the prefill ended, taking the prefilled KV with it. The request may be
    /// continued on another worker ([`PrefillError::lost_worker`] names the one to avoid).
    #[error("{phase} worker {worker_id} was lost: {message}")]
    WorkerLost {
        /// The phase that lost its worker.
        phase: RequestPhase,
        /// The lost worker.
        worker_id: WorkerId,
        /// What the transport said.
        message: String,
    },
    /// The prefill worker answered without `disaggregated_params`, so there is nothing to hand
    /// to the decode worker.
    #[error(
        "prefill worker {worker_id} returned no disaggregated_params in its first output; \
         expected the KV transfer parameters of the prefilled prompt"
    )]
    NoDisaggregatedParams {
        /// The prefill worker.
        worker_id: WorkerId,
    },
}

impl PrefillError {
    /// Whether the client may retry the same request later (router backpressure).
    pub fn is_retryable(&self) -> bool {
        matches!(self, PrefillError::ResourceExhausted { .. })
    }

    /// The error of routing `phase`, with backpressure kept distinct.
    pub fn from_route(phase: RequestPhase, source: PhaseRouteError) -> Self {
        match source {
            PhaseRouteError::ResourceExhausted { message, .. } => {
                PrefillError::ResourceExhausted { phase, message }
            }
            PhaseRouteError::WorkerLost {
                worker_id, message, ..
            } => PrefillError::WorkerLost {
                phase,
                worker_id,
                message,
            },
            source => PrefillError::Route { phase, source },
        }
    }

    /// The phase and worker of a worker loss, the one failure that another worker may recover
    /// from (the request's migration excludes that worker and routes it again).
    pub fn lost_worker(&self) -> Option<(RequestPhase, WorkerId)> {
        match self {
            PrefillError::WorkerLost {
                phase, worker_id, ..
            } => Some((*phase, *worker_id)),
            _ => None,
        }
    }

    /// Whether an optional (not enforced) disaggregation may fall back to aggregated serving
    /// after this prefill failure. Backpressure and a bad explicit pin are the client's to see:
    /// falling back would hide saturation on the decode fleet or ignore the pin.
    pub(crate) fn allows_fallback(&self) -> bool {
        match self {
            PrefillError::Route { source, .. } => {
                !matches!(source, PhaseRouteError::UnknownWorker { .. })
            }
            PrefillError::PrefillFailed { .. }
            | PrefillError::NoDisaggregatedParams { .. }
            | PrefillError::WorkerLost { .. } => true,
            _ => false,
        }
    }
}
