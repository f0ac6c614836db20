//! Routing without sending: [`KvPushRouter::pick`], for a front door whose proxy carries the
//! request to the engine itself (the Envoy endpoint picker, `kvroute-epp`).
//!
//! The request is routed and recorded exactly as [`KvPushRouter::generate`] records it (load,
//! approximate-mode prediction, sticky session, the load shared with other replicas); what the
//! proxy then sees of the response is fed back through the returned [`PickedRequest`]: the
//! first bytes (prefill done), output tokens, the engine's cached-token report, and the end.
//! Dropping it unfinished frees the request as cancelled, so a stream the proxy abandons can
//! never leak load.

use kvroute_protocols::{PreprocessedRequest, RequestPhase, WorkerWithDpRank};

use crate::error::KvRouterError;
use crate::guard::RequestGuard;
use crate::health::HealthFailure;
use crate::push::{KvPushRouter, QueryAnswer, Recorded};
use kvroute_router_core::Routed;

/// What [`KvPushRouter::pick`] decided.
#[derive(Debug)]
pub enum Pick {
    /// The request was routed and recorded; the caller sends it to [`PickedRequest::worker`]
    /// and reports what happens.
    Picked(PickedRequest),
    /// The request was a query (`query_instance_id`): nothing was recorded.
    Query(QueryAnswer),
}

/// A request routed by [`KvPushRouter::pick`] and held in the router's load until it ends.
///
/// Report its response as it passes: [`Self::on_first_bytes`] when the response starts,
/// [`Self::on_tokens`] per output token seen, [`Self::on_cache_report`] with the engine's
/// cached prompt tokens, then end it with [`Self::finish`], [`Self::reject`] or
/// [`Self::fail`]. Dropped without an end, it is freed as cancelled.
#[derive(Debug)]
pub struct PickedRequest {
    guard: RequestGuard,
    decision: Routed,
    cache_reported: bool,
}

impl KvPushRouter {
    /// Routes an aggregated `request` and records it, without sending it anywhere: the caller's
    /// proxy sends it to the chosen worker's engine. A request annotated `query_instance_id` is
    /// only answered ([`Pick::Query`]). The session's `open`, if the request opens one, runs on
    /// the worker before this returns.
    pub async fn pick(&self, request: &PreprocessedRequest) -> Result<Pick, KvRouterError> {
        match self
            .route_recorded(request, RequestPhase::Aggregated)
            .await?
        {
            Recorded::Query(decision) => Ok(Pick::Query(QueryAnswer {
                worker: decision.worker,
                token_ids: request.token_ids.clone(),
                decision,
            })),
            Recorded::Routed(decision, guard) => Ok(Pick::Picked(PickedRequest {
                guard,
                decision,
                cache_reported: false,
            })),
        }
    }
}

impl PickedRequest {
    /// The worker chosen.
    pub fn worker(&self) -> WorkerWithDpRank {
        self.decision.worker
    }

    /// The routing decision (overlap, cost breakdown of every candidate, timings).
    pub fn decision(&self) -> &Routed {
        &self.decision
    }

    /// The candidates best first: the chosen worker, then the others by rising cost (ties in
    /// slot order), each worker once. A proxy that can fall back sends to the next on failure.
    pub fn ranked_workers(&self) -> Vec<WorkerWithDpRank> {
        let mut others: Vec<_> = self
            .decision
            .candidates
            .iter()
            .filter(|c| c.worker != self.decision.worker)
            .collect();
        others.sort_by(|a, b| a.cost.total_cmp(&b.cost));
        let mut ranked = vec![self.decision.worker];
        for candidate in others {
            if !ranked.contains(&candidate.worker) {
                ranked.push(candidate.worker);
            }
        }
        ranked
    }

    /// The response started: the prefill is done (the worker's prefill load ends).
    pub fn on_first_bytes(&mut self) {
        if self.guard.first_seen() {
            return;
        }
        self.guard.on_tokens(0);
    }

    /// `tokens` more output tokens passed (the first call also marks the prefill done).
    pub fn on_tokens(&mut self, tokens: u64) {
        self.guard.on_tokens(tokens);
    }

    /// The engine reported `reported` of the prompt's tokens served from its cache: compared
    /// with the prediction (per-worker metrics; approximate mode learns from it). Only the first
    /// report counts.
    pub fn on_cache_report(&mut self, reported: u64) {
        if self.cache_reported {
            return;
        }
        self.cache_reported = true;
        let isl = self.decision.isl_tokens;
        let block_size = self.guard.inner().config.core.block_size();
        let predicted = self.decision.predicted_cached_tokens(block_size);
        self.guard
            .on_cache_report(isl, predicted, reported.min(isl));
    }

    /// The response ended well: frees the request (and clears the worker's health record).
    pub fn finish(self) {
        self.guard
            .inner()
            .on_worker_success(self.decision.worker.worker_id);
        self.guard.finish();
    }

    /// The engine refused the request (a 4xx): frees it, counted as `rejected`; says nothing of
    /// the worker's health.
    pub fn reject(self) {
        self.guard.reject();
    }

    /// The request failed on its worker (a 5xx, a reset): frees it, counted as `error`. With
    /// `health`, the failure also counts against the worker's passive health (a refused
    /// connection ejects it at once); `detail` says what happened, for the log.
    pub fn fail(self, health: Option<HealthFailure>, detail: &str) {
        if let Some(failure) = health {
            self.guard
                .inner()
                .on_health_failure(self.decision.worker.worker_id, failure, &detail);
        }
        self.guard.fail();
    }
}
