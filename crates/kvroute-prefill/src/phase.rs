//! The seam below the prefill router: something that routes one request for one phase.
//!
//! The KV router implements [`PhaseRouter`] with its KV push router (indexer, scheduler and
//! request guard); tests implement it with kvroute-runtime's push router. The prefill router only
//! decides *what* to send for each phase and in which order; *where* it goes is this trait's job.

use std::pin::Pin;

use futures::Stream;
use futures::future::BoxFuture;
use kvroute_protocols::{
    Annotated, LLMEngineOutput, PreprocessedRequest, RequestPhase, WorkerId, WorkerWithDpRank,
};
use kvroute_runtime::RequestError;

/// The response items of one routed phase. What the engine says (tokens, error items) arrives as
/// `Ok` items; a transport failure ends the stream with a typed `Err`, so that a lost worker
/// ([`RequestError::is_worker_unavailable`]) can be told from an engine that refused. Dropping
/// the stream cancels the request on its worker and frees whatever load the router recorded for
/// it.
pub type PhaseStream =
    Pin<Box<dyn Stream<Item = Result<Annotated<LLMEngineOutput>, RequestError>> + Send + 'static>>;

/// A request that reached a worker: the worker chosen and its response stream.
pub struct Routed {
    /// The worker (and data-parallel rank) serving the request.
    pub worker: WorkerWithDpRank,
    /// Its responses.
    pub stream: PhaseStream,
}

impl std::fmt::Debug for Routed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Routed")
            .field("worker", &self.worker)
            .finish_non_exhaustive()
    }
}

/// Routes a request for one phase of serving. Object safe; the prefill router holds it in an
/// `Arc` so that a background prefill can outlive the call that started it.
///
/// Contract for implementations:
/// - `phase` is [`RequestPhase::Prefill`] (only prefill workers are eligible),
///   [`RequestPhase::Decode`] (only decode workers), or [`RequestPhase::Aggregated`] (the
///   fallback while no prefill worker exists: the workers that can serve both phases, i.e.
///   decode and aggregated ones).
/// - Pins are read from the request with [`kvroute_protocols::RoutingHints::pinned_worker`] and
///   [`kvroute_protocols::RoutingHints::pinned_dp_rank`] for `phase`, and honoured exactly (a pin
///   to an unknown worker is [`PhaseRouteError::UnknownWorker`], never a silent reroute).
/// - `request.router_config_override` and `routing.routing_constraints` apply to the decision.
/// - Both phases of one request carry the same `request_id`; an implementation that tracks load
///   per request must key it by `(request_id, phase)`.
/// - When the router refuses work because every eligible worker is saturated (admission queue
///   full, busy thresholds), it returns [`PhaseRouteError::ResourceExhausted`] so that the caller
///   can tell the client to retry.
/// - When the chosen worker cannot be reached, it returns [`PhaseRouteError::WorkerLost`]; a
///   stream whose worker goes away ends with the transport's [`RequestError`], not an error
///   item, so that the request can be continued elsewhere.
pub trait PhaseRouter: Send + Sync + 'static {
    /// Chooses a worker for `request` in `phase`, sends it there and returns the stream.
    fn route<'a>(
        &'a self,
        request_id: &'a str,
        request: PreprocessedRequest,
        phase: RequestPhase,
    ) -> BoxFuture<'a, Result<Routed, PhaseRouteError>>;

    /// The worker [`Self::route`] would choose now for `request` in `phase`, without sending it
    /// or recording any load (a peek). The prefill router uses it to learn the prefill worker up
    /// front, so that the decode worker can be told where to fetch the KV before prefill ends.
    fn select<'a>(
        &'a self,
        request: &'a PreprocessedRequest,
        phase: RequestPhase,
    ) -> BoxFuture<'a, Result<WorkerWithDpRank, PhaseRouteError>>;

    /// Where `request`'s prefill is cheaper, under conditional disaggregation
    /// ([`crate::DisaggMode::Conditional`]): on the decode worker it would be served on
    /// aggregated, or remotely on a prefill worker. Decides without sending anything or
    /// recording load. The default always answers [`PrefillSite::Remote`].
    fn place<'a>(
        &'a self,
        request: &'a PreprocessedRequest,
    ) -> BoxFuture<'a, Result<PrefillSite, PhaseRouteError>> {
        let _ = request;
        Box::pin(async { Ok(PrefillSite::Remote) })
    }
}

/// Where a request's prefill runs under conditional disaggregation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefillSite {
    /// On its decode worker: the request is served aggregated.
    Local,
    /// On a prefill worker, its KV then handed to the decode worker.
    Remote,
}

/// Why a [`PhaseRouter`] could not route a request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PhaseRouteError {
    /// No worker of the phase's kind is registered.
    #[error("no {phase} workers are available")]
    NoWorkers {
        /// The phase routed.
        phase: RequestPhase,
    },
    /// The request pins a worker that is not registered for the phase.
    #[error("{phase} worker {worker_id} named by the request is not registered")]
    UnknownWorker {
        /// The phase routed.
        phase: RequestPhase,
        /// The pinned worker.
        worker_id: WorkerId,
    },
    /// Every eligible worker is saturated and the router refused (or could not queue) the
    /// request; retrying later is sound.
    #[error("{phase} routing refused the request, every eligible worker is saturated: {message}")]
    ResourceExhausted {
        /// The phase routed.
        phase: RequestPhase,
        /// The router's reason (queue full, busy threshold, ...).
        message: String,
    },
    /// The chosen worker could not be reached (connection refused, timed out or dropped): it is
    /// most likely gone, and another worker may take the request.
    #[error("{phase} worker {worker_id} is unavailable: {message}")]
    WorkerLost {
        /// The phase routed.
        phase: RequestPhase,
        /// The worker that could not be reached.
        worker_id: WorkerId,
        /// What the transport said.
        message: String,
    },
    /// The request could not be sent, or the worker refused it.
    #[error("{phase} request failed{}: {message}", worker_id.map(|w| format!(" on worker {w}")).unwrap_or_default())]
    Failed {
        /// The phase routed.
        phase: RequestPhase,
        /// The worker it failed on, if one was chosen.
        worker_id: Option<WorkerId>,
        /// What went wrong.
        message: String,
    },
}

impl PhaseRouteError {
    /// Whether this is backpressure, which the client should retry after a while.
    pub fn is_resource_exhausted(&self) -> bool {
        matches!(self, PhaseRouteError::ResourceExhausted { .. })
    }
}
