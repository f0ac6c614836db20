//! The prefill router: prefill on a prefill worker first, then decode on a decode worker.

use std::sync::{Arc, OnceLock};

use futures::StreamExt;
use kvroute_protocols::{
    Annotated, BootstrapInfo, PreprocessedRequest, PromptTokensDetails, RequestPhase, WorkerId,
    WorkerWithDpRank,
};
use kvroute_runtime::{InstanceSet, WorkerRole};
use parking_lot::Mutex;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tokio::sync::watch;

use crate::config::{DisaggMode, PrefillRouterConfig, TopologyMode};
use crate::error::PrefillError;
use crate::fleet::PrefillFleet;
use crate::phase::{PhaseRouter, PhaseStream, PrefillSite, Routed};
use crate::request::{Handoff, PrefillCollector, decode_request, prefill_request};
use crate::stream::{DisaggStream, PrefillLink, Served};

/// Routes requests through a prefill worker and then a decode worker while prefill workers are
/// registered, and aggregated otherwise. Cheap to clone.
///
/// `R` is the [`PhaseRouter`] that picks workers (the KV push router in `kvroute-router`); it may
/// be unsized, e.g. `PrefillRouter<dyn PhaseRouter>`.
pub struct PrefillRouter<R: ?Sized> {
    inner: Arc<Inner<R>>,
}

impl<R: ?Sized> Clone for PrefillRouter<R> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
        }
    }
}

struct Inner<R: ?Sized> {
    config: PrefillRouterConfig,
    instances: watch::Receiver<InstanceSet>,
    cached: Mutex<CachedFleet>,
    rng: Mutex<ChaCha8Rng>,
    phases: Arc<R>,
}

/// The fleet derived from one discovery snapshot, rebuilt only when the snapshot changes.
struct CachedFleet {
    snapshot: InstanceSet,
    fleet: Arc<PrefillFleet>,
}

/// The workers a request would be routed to, without routing it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RouteQuery {
    /// The prefill worker, when disaggregation is active.
    pub prefill: Option<WorkerWithDpRank>,
    /// The decode (or aggregated) worker.
    pub decode: WorkerWithDpRank,
}

impl<R: PhaseRouter + ?Sized> PrefillRouter<R> {
    /// A prefill router over the workers of `instances` (from `Discovery::watch`), routing each
    /// phase with `phases`. It is active exactly while `instances` lists a prefill worker.
    pub fn new(
        phases: Arc<R>,
        instances: watch::Receiver<InstanceSet>,
        config: PrefillRouterConfig,
    ) -> Self {
        let snapshot = instances.borrow().clone();
        let fleet = Arc::new(PrefillFleet::from_instances(&snapshot));
        let rng = ChaCha8Rng::seed_from_u64(config.seed);
        Self {
            inner: Arc::new(Inner {
                config,
                instances,
                cached: Mutex::new(CachedFleet { snapshot, fleet }),
                rng: Mutex::new(rng),
                phases,
            }),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &PrefillRouterConfig {
        &self.inner.config
    }

    /// The phase router that places each phase.
    pub fn phases(&self) -> &Arc<R> {
        &self.inner.phases
    }

    /// The prefill workers of the current discovery snapshot.
    pub fn fleet(&self) -> Arc<PrefillFleet> {
        let snapshot = self.inner.instances.borrow().clone();
        let mut cached = self.inner.cached.lock();
        if !Arc::ptr_eq(&cached.snapshot, &snapshot) {
            let fleet = Arc::new(PrefillFleet::from_instances(&snapshot));
            match (cached.fleet.is_empty(), fleet.is_empty()) {
                (true, false) => tracing::info!(
                    prefill_workers = fleet.len(),
                    "prefill workers appeared: disaggregated serving is active"
                ),
                (false, true) => tracing::info!(
                    mode = ?self.inner.config.mode,
                    "every prefill worker left: disaggregated serving is inactive"
                ),
                _ => {}
            }
            *cached = CachedFleet { snapshot, fleet };
        }
        Arc::clone(&cached.fleet)
    }

    /// Whether disaggregated serving is active (some prefill worker is registered).
    pub fn is_active(&self) -> bool {
        !self.fleet().is_empty()
    }

    /// Waits until disaggregation is `active` (or not); false if discovery closed first.
    pub async fn wait_active(&self, active: bool) -> bool {
        let mut rx = self.inner.instances.clone();
        rx.wait_for(|set| set.values().any(|i| i.role == WorkerRole::Prefill) == active)
            .await
            .is_ok()
    }

    /// Serves `request`: prefill (one token) on a prefill worker, then decode with the prefill's
    /// result or, when the prefill worker offers a bootstrap endpoint, decode at once with the
    /// bootstrap room while prefill runs in the background. Without prefill workers the request
    /// is served aggregated, or refused with [`PrefillError::NotActivated`] when disaggregation
    /// is enforced. A worker that cannot be reached, or a prefill worker whose connection drops
    /// before its prefill ends, is [`PrefillError::WorkerLost`] (when disaggregation is optional
    /// a lost prefill falls back to aggregated serving, like any failed prefill).
    pub async fn generate(
        &self,
        request_id: &str,
        request: PreprocessedRequest,
    ) -> Result<DisaggStream, PrefillError> {
        let fleet = self.fleet();
        if fleet.is_empty() {
            return match self.inner.config.mode {
                DisaggMode::Enforced => Err(PrefillError::NotActivated),
                DisaggMode::Optional | DisaggMode::Conditional => {
                    self.aggregated(request_id, request).await
                }
            };
        }
        if self.placed_locally(&fleet, &request).await? {
            return self.aggregated(request_id, request).await;
        }
        let target = self.resolve_prefill_target(&fleet, &request).await?;
        let bootstrap = target.and_then(|t| {
            let endpoint = fleet.get(t.worker_id)?.bootstrap.as_ref()?;
            Some((t, endpoint))
        });
        let outcome = match bootstrap {
            Some((target, endpoint)) => {
                let info = BootstrapInfo {
                    bootstrap_host: endpoint.host.clone(),
                    bootstrap_port: endpoint.port,
                    bootstrap_room: self.inner.rng.lock().r#gen(),
                };
                self.start_bootstrap_prefill(request_id, &request, target, info)
                    .await
            }
            None => self.run_prefill(request_id, &request, target).await,
        };
        match outcome {
            Ok(prefill) => self.decode(request_id, request, &fleet, prefill).await,
            Err(error) if self.inner.config.mode.falls_back() && error.allows_fallback() => {
                tracing::warn!(
                    request_id,
                    %error,
                    "remote prefill failed; serving the request aggregated"
                );
                self.aggregated(request_id, request).await
            }
            Err(error) => Err(error),
        }
    }

    /// The workers [`Self::generate`] would use now, without routing anything or recording
    /// load (the answer to a query-only request).
    pub async fn query(&self, request: &PreprocessedRequest) -> Result<RouteQuery, PrefillError> {
        let fleet = self.fleet();
        let phases = &self.inner.phases;
        if fleet.is_empty() || self.placed_locally(&fleet, request).await? {
            if fleet.is_empty() && self.inner.config.mode == DisaggMode::Enforced {
                return Err(PrefillError::NotActivated);
            }
            let decode = phases
                .select(request, RequestPhase::Aggregated)
                .await
                .map_err(|e| PrefillError::from_route(RequestPhase::Aggregated, e))?;
            return Ok(RouteQuery {
                prefill: None,
                decode,
            });
        }
        let prefill = match self.pinned_prefill(&fleet, request)? {
            Some(pinned) => pinned,
            None => phases
                .select(&prefill_request(request, None, None), RequestPhase::Prefill)
                .await
                .map_err(|e| PrefillError::from_route(RequestPhase::Prefill, e))?,
        };
        let taints = self.topology_taints(&fleet, prefill.worker_id);
        let decode_req = decode_request(request.clone(), None, as_topology(&taints));
        let decode = phases
            .select(&decode_req, RequestPhase::Decode)
            .await
            .map_err(|e| PrefillError::from_route(RequestPhase::Decode, e))?;
        Ok(RouteQuery {
            prefill: Some(prefill),
            decode,
        })
    }

    /// Whether conditional disaggregation prefills `request` on its decode worker: never in the
    /// other modes, nor for a request that pins its prefill worker. Backpressure from the phase
    /// router is the client's to retry; any other failure to decide leaves the prefill remote,
    /// where routing reports the problem with its own context.
    async fn placed_locally(
        &self,
        fleet: &PrefillFleet,
        request: &PreprocessedRequest,
    ) -> Result<bool, PrefillError> {
        if self.inner.config.mode != DisaggMode::Conditional
            || self.pinned_prefill(fleet, request)?.is_some()
        {
            return Ok(false);
        }
        match self.inner.phases.place(request).await {
            Ok(site) => Ok(site == PrefillSite::Local),
            Err(e) if e.is_resource_exhausted() => {
                Err(PrefillError::from_route(RequestPhase::Aggregated, e))
            }
            Err(_) => Ok(false),
        }
    }

    /// The request's prefill pin, checked against the fleet.
    fn pinned_prefill(
        &self,
        fleet: &PrefillFleet,
        request: &PreprocessedRequest,
    ) -> Result<Option<WorkerWithDpRank>, PrefillError> {
        let Some(routing) = request.routing.as_ref() else {
            return Ok(None);
        };
        let Some(worker_id) = routing.prefill_worker_id else {
            return Ok(None);
        };
        if fleet.get(worker_id).is_none() {
            return Err(PrefillError::UnknownPrefillWorker { worker_id });
        }
        let dp_rank = routing.prefill_dp_rank.unwrap_or(0);
        Ok(Some(WorkerWithDpRank::new(worker_id, dp_rank)))
    }

    /// The prefill worker when it can be known before routing: the pin, or (only when some
    /// prefill worker could use the bootstrap path) the phase router's peek.
    async fn resolve_prefill_target(
        &self,
        fleet: &PrefillFleet,
        request: &PreprocessedRequest,
    ) -> Result<Option<WorkerWithDpRank>, PrefillError> {
        if let Some(pinned) = self.pinned_prefill(fleet, request)? {
            return Ok(Some(pinned));
        }
        if !fleet.any_bootstrap() {
            return Ok(None);
        }
        let peek = prefill_request(request, None, None);
        match self.inner.phases.select(&peek, RequestPhase::Prefill).await {
            Ok(worker) => Ok(Some(worker)),
            Err(e) if e.is_resource_exhausted() => {
                Err(PrefillError::from_route(RequestPhase::Prefill, e))
            }
            // Routing without a target reports the same problem with the stream's context.
            Err(_) => Ok(None),
        }
    }

    /// Sends the prefill with the bootstrap room and drains it in the background; returns once
    /// the prefill worker has accepted it, so that its load is recorded before decode routes.
    async fn start_bootstrap_prefill(
        &self,
        request_id: &str,
        request: &PreprocessedRequest,
        target: WorkerWithDpRank,
        info: BootstrapInfo,
    ) -> Result<Prefilled, PrefillError> {
        let prefill = prefill_request(request, Some(target), Some(info.clone()));
        let routed = self
            .inner
            .phases
            .route(request_id, prefill, RequestPhase::Prefill)
            .await
            .map_err(|e| PrefillError::from_route(RequestPhase::Prefill, e))?;
        let worker = routed.worker;
        let background = BackgroundPrefill {
            request_id: request_id.into(),
            worker,
            details: Arc::default(),
            failed: Arc::default(),
        };
        let details = Arc::clone(&background.details);
        let failed = Arc::clone(&background.failed);
        let task = tokio::spawn(background.drain(routed.stream));
        Ok(Prefilled {
            worker,
            handoff: Handoff::Bootstrap(info.clone()),
            served: Served::Bootstrap {
                prefill: worker,
                info,
            },
            link: PrefillLink {
                details,
                task: Some(task),
                failed,
            },
        })
    }

    /// Runs the prefill to completion and collects its result.
    async fn run_prefill(
        &self,
        request_id: &str,
        request: &PreprocessedRequest,
        target: Option<WorkerWithDpRank>,
    ) -> Result<Prefilled, PrefillError> {
        let prefill = prefill_request(request, target, None);
        let Routed { worker, mut stream } = self
            .inner
            .phases
            .route(request_id, prefill, RequestPhase::Prefill)
            .await
            .map_err(|e| PrefillError::from_route(RequestPhase::Prefill, e))?;
        let mut collector = PrefillCollector::new(worker.worker_id);
        while let Some(item) = stream.next().await {
            match item {
                Ok(item) => collector.push(item),
                // The prefilled KV lives on the worker: once it is gone, so is the result.
                Err(error) if error.is_worker_unavailable() => {
                    return Err(PrefillError::WorkerLost {
                        phase: RequestPhase::Prefill,
                        worker_id: worker.worker_id,
                        message: error.to_string(),
                    });
                }
                Err(error) => collector.push(Annotated::from_error(error.to_string())),
            }
        }
        let result = collector.finish()?;
        Ok(Prefilled {
            worker,
            link: PrefillLink::finished(result.prompt_tokens_details),
            handoff: Handoff::Result(result),
            served: Served::PrefillResult { prefill: worker },
        })
    }

    async fn decode(
        &self,
        request_id: &str,
        request: PreprocessedRequest,
        fleet: &PrefillFleet,
        prefill: Prefilled,
    ) -> Result<DisaggStream, PrefillError> {
        let Prefilled {
            worker,
            handoff,
            served,
            link,
        } = prefill;
        let taints = self.topology_taints(fleet, worker.worker_id);
        let decode = decode_request(request, Some(handoff), as_topology(&taints));
        match self
            .inner
            .phases
            .route(request_id, decode, RequestPhase::Decode)
            .await
        {
            Ok(routed) => Ok(DisaggStream::new(
                served,
                routed.worker,
                routed.stream,
                link,
            )),
            Err(e) => {
                // Nobody will fetch the KV of a background prefill now.
                if let Some(task) = link.task {
                    task.abort();
                }
                Err(PrefillError::from_route(RequestPhase::Decode, e))
            }
        }
    }

    async fn aggregated(
        &self,
        request_id: &str,
        request: PreprocessedRequest,
    ) -> Result<DisaggStream, PrefillError> {
        let Routed { worker, stream } = self
            .inner
            .phases
            .route(request_id, request, RequestPhase::Aggregated)
            .await
            .map_err(|e| PrefillError::from_route(RequestPhase::Aggregated, e))?;
        Ok(DisaggStream::new(
            Served::Aggregated,
            worker,
            stream,
            PrefillLink::default(),
        ))
    }

    /// The topology taints of prefill worker `worker_id` with the configured mode.
    fn topology_taints(
        &self,
        fleet: &PrefillFleet,
        worker_id: WorkerId,
    ) -> Option<(Vec<String>, TopologyMode)> {
        let affinity = self.inner.config.topology.as_ref()?;
        let taints = fleet.get(worker_id)?.topology_taints(affinity);
        Some((taints, affinity.mode))
    }
}

/// A prefill that is done (or, on the bootstrap path, under way).
struct Prefilled {
    worker: WorkerWithDpRank,
    handoff: Handoff,
    served: Served,
    link: PrefillLink,
}

fn as_topology(taints: &Option<(Vec<String>, TopologyMode)>) -> Option<(&[String], TopologyMode)> {
    taints.as_ref().map(|(t, m)| (t.as_slice(), *m))
}

/// A prefill running in the background on the bootstrap path.
struct BackgroundPrefill {
    request_id: Arc<str>,
    worker: WorkerWithDpRank,
    /// Where the prefill worker's prompt token details go, for the decode stream to read.
    details: Arc<OnceLock<PromptTokensDetails>>,
    /// Where a failure goes, for the decode stream to fail with.
    failed: Arc<OnceLock<String>>,
}

impl BackgroundPrefill {
    /// Drains the prefill and hands its prompt token details to the decode stream before the
    /// task ends (the stream waits for this task, up to [`crate::PREFILL_DETAILS_GRACE`] past
    /// the decode output, so it sees them unless the prefill outlives that). A failure is
    /// handed over too: a decode stream that has produced nothing yet fails with it (and
    /// cancels its decode worker's half), since the KV will never arrive.
    async fn drain(self, mut stream: PhaseStream) {
        let Self {
            request_id,
            worker,
            details,
            failed,
        } = self;
        let mut collector = PrefillCollector::new(worker.worker_id);
        while let Some(item) = stream.next().await {
            collector.push(item.unwrap_or_else(|e| Annotated::from_error(e.to_string())));
        }
        match collector.finish() {
            Ok(result) => {
                if let Some(reported) = result.prompt_tokens_details {
                    let _ = details.set(reported);
                }
                tracing::debug!(%request_id, %worker, "background prefill finished");
            }
            // On the bootstrap path the KV goes through the room: an answer without handover
            // parameters (SGLang's) is no failure.
            Err(PrefillError::NoDisaggregatedParams { .. }) => {
                tracing::debug!(%request_id, %worker, "background prefill finished");
            }
            Err(error) => {
                tracing::warn!(%request_id, %worker, %error, "background prefill failed");
                let _ = failed.set(error.to_string());
            }
        }
    }
}
