//! [`KvPhaseRouter`]: the KV router placing each phase of disaggregated serving, so that
//! [`kvroute_prefill::PrefillRouter`] routes prefill and decode with KV awareness.
//!
//! One [`KvPushRouter`] serves the prefill workers and another the decode-capable ones (decode
//! and aggregated workers; [`role_filtered`] derives each one's discovery watch). Both phases of a
//! request get their own request id in their own router, so load is tracked per (request, phase).

use std::collections::BTreeMap;
use std::sync::Arc;

use futures::future::BoxFuture;
use kvroute_prefill::{PhaseRouteError, PhaseRouter, PrefillSite, Routed as PhaseRouted};
use kvroute_protocols::{PreprocessedRequest, RequestPhase, WorkerWithDpRank};
use kvroute_runtime::{InstanceSet, WorkerRole};
use kvroute_scheduler::SelectError;
use rand::SeedableRng;
use tokio::sync::watch;

use crate::error::{KvRouterError, send_lost_worker};
use crate::push::{KvPushRouter, KvResponse};
use kvroute_router_core::RouteError;
use kvroute_router_core::{ConditionalDisagg, PrefillPlacement, RouteRequest, Routed};

/// The KV routers of the two phases.
#[derive(Debug, Clone)]
pub struct KvPhaseRouter {
    prefill: KvPushRouter,
    decode: KvPushRouter,
    conditional: ConditionalDisagg,
}

impl KvPhaseRouter {
    /// Prefill requests go to `prefill` (over prefill workers), decode and aggregated requests
    /// to `decode` (over decode and aggregated workers). Conditional disaggregation places
    /// prefills with the default [`ConditionalDisagg`] thresholds.
    pub fn new(prefill: KvPushRouter, decode: KvPushRouter) -> Self {
        Self {
            prefill,
            decode,
            conditional: ConditionalDisagg::default(),
        }
    }

    /// The same router placing prefills, under conditional disaggregation, with `rule`.
    pub fn with_conditional(mut self, rule: ConditionalDisagg) -> Self {
        self.conditional = rule;
        self
    }

    /// Where `rule` places `request`'s prefill: both routers are queried (the decode one as
    /// for an aggregated request), nothing is recorded but the decision's metric.
    fn placement(
        &self,
        request: &PreprocessedRequest,
    ) -> Result<PrefillPlacement, PhaseRouteError> {
        let local = self.query(request, RequestPhase::Aggregated)?;
        let remote = self.query(request, RequestPhase::Prefill)?;
        let block_size = self.decode.with_core(|core| core.config().block_size());
        let placement = self.conditional.place_routed(&local, &remote, block_size);
        self.decode
            .metrics()
            .on_prefill_placement(placement.is_local(), placement.name());
        tracing::debug!(
            placement = placement.name(),
            local = %local.worker,
            remote = %remote.worker,
            "conditional disaggregation placed a prefill"
        );
        Ok(placement)
    }

    /// `phase`'s router's decision for `request`, recording nothing (a peek).
    fn query(
        &self,
        request: &PreprocessedRequest,
        phase: RequestPhase,
    ) -> Result<Routed, PhaseRouteError> {
        let router = self.router(phase);
        let now = router.now();
        let route_req = RouteRequest::from_preprocessed(kvroute_scheduler::RequestId(0), request)
            .with_phase(phase);
        // A peek must not advance the router's RNG, so it draws from its own.
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(now.as_nanos() as u64);
        router
            .with_core(|core| core.query(&route_req, now, &mut rng))
            .map_err(|e| phase_error(phase, KvRouterError::Route(e)))
    }

    /// The router of `phase`.
    pub fn router(&self, phase: RequestPhase) -> &KvPushRouter {
        match phase {
            RequestPhase::Prefill => &self.prefill,
            RequestPhase::Decode | RequestPhase::Aggregated => &self.decode,
        }
    }
}

/// A discovery watch that lists only the instances whose role is in `roles`, kept current by a
/// background task (which ends when `instances` closes). Must be called inside a tokio runtime.
pub fn role_filtered(
    instances: watch::Receiver<InstanceSet>,
    roles: &'static [WorkerRole],
) -> watch::Receiver<InstanceSet> {
    kvroute_runtime::filtered_instances(instances, move |set| {
        Arc::new(
            set.iter()
                .filter(|(_, i)| roles.contains(&i.role))
                .map(|(id, i)| (*id, i.clone()))
                .collect::<BTreeMap<_, _>>(),
        )
    })
}

fn phase_error(phase: RequestPhase, error: KvRouterError) -> PhaseRouteError {
    match error {
        KvRouterError::Route(RouteError::Select(SelectError::NoEndpoints { .. })) => {
            PhaseRouteError::NoWorkers { phase }
        }
        KvRouterError::Route(RouteError::Select(SelectError::PinnedWorkerUnknown {
            worker_id,
        })) => PhaseRouteError::UnknownWorker { phase, worker_id },
        KvRouterError::Route(RouteError::Select(
            e @ (SelectError::AllEligibleWorkersOverloaded { .. }
            | SelectError::PinnedWorkerOverloaded { .. }),
        )) => PhaseRouteError::ResourceExhausted {
            phase,
            message: e.to_string(),
        },
        KvRouterError::Send { worker, source } if send_lost_worker(&source) => {
            PhaseRouteError::WorkerLost {
                phase,
                worker_id: worker.worker_id,
                message: source.to_string(),
            }
        }
        KvRouterError::Send { worker, source } => PhaseRouteError::Failed {
            phase,
            worker_id: Some(worker.worker_id),
            message: source.to_string(),
        },
        other => PhaseRouteError::Failed {
            phase,
            worker_id: None,
            message: other.to_string(),
        },
    }
}

impl PhaseRouter for KvPhaseRouter {
    fn route<'a>(
        &'a self,
        _request_id: &'a str,
        mut request: PreprocessedRequest,
        phase: RequestPhase,
    ) -> BoxFuture<'a, Result<PhaseRouted, PhaseRouteError>> {
        // A query is answered by `select`; routing a phase always sends.
        request
            .annotations
            .retain(|a| !a.starts_with(crate::push::QUERY_INSTANCE_ID));
        Box::pin(async move {
            match self.router(phase).generate_phase(request, phase).await {
                Ok(KvResponse::Stream(stream)) => Ok(PhaseRouted {
                    worker: stream.worker(),
                    stream: Box::pin(stream),
                }),
                Ok(KvResponse::Query(answer)) => Err(PhaseRouteError::Failed {
                    phase,
                    worker_id: Some(answer.worker.worker_id),
                    message: "a query-only request cannot be routed".to_owned(),
                }),
                Err(e) => Err(phase_error(phase, e)),
            }
        })
    }

    fn select<'a>(
        &'a self,
        request: &'a PreprocessedRequest,
        phase: RequestPhase,
    ) -> BoxFuture<'a, Result<WorkerWithDpRank, PhaseRouteError>> {
        Box::pin(async move { self.query(request, phase).map(|decision| decision.worker) })
    }

    fn place<'a>(
        &'a self,
        request: &'a PreprocessedRequest,
    ) -> BoxFuture<'a, Result<PrefillSite, PhaseRouteError>> {
        Box::pin(async move {
            Ok(if self.placement(request)?.is_local() {
                PrefillSite::Local
            } else {
                PrefillSite::Remote
            })
        })
    }
}
