//! [`KvPushRouter`]: the KV router served over kvroute-runtime.
//!
//! Three background tasks keep the [`KvRouterCore`] current: one applies KV events from the event
//! plane (filling gaps from the worker with `kv_events_range`, or a `kv_dump` when the worker no
//! longer holds them), one follows discovery (a worker that joins is added and dumped, one that
//! leaves is removed), one expires forgotten requests, predictions and sessions. Requests are
//! routed by the core under a mutex held only for the decision, then sent with
//! [`RouteMode::Direct`] to the chosen worker; a [`RequestGuard`] rides the response stream.
//!
//! The rooms around it: the state every part shares is `shared::Inner` (the routing state
//! itself, the core and its RNG under one lock, is `state::State`); the background loops are in
//! `background`, the index snapshot's save and restore in `snapshots`, load sharing between
//! replicas in `load_sync`, the configuration in `push_config` and the errors in `error`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use kvroute_protocols::{PreprocessedRequest, RequestPhase, WorkerWithDpRank};
use kvroute_runtime::{
    EventPlane, InstanceSet, KV_EVENT_SUBJECT, LOAD_REPORT_SUBJECT, LlmPushRouter, RouteMode,
    SnapshotStore, diff_instances,
};
use kvroute_scheduler::RequestId;
use kvroute_sessions::InMemoryAffinityStore;
use parking_lot::Mutex;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::background::{discovery_loop, event_loop, expire_loop, report_loop, snapshot_loop};
use crate::error::{KvRouterError, StartError};
use crate::guard::{KvRoutedStream, RequestGuard};
use crate::health::PassiveHealth;
use crate::load_sync::{self, LoadSync, Local};
use crate::metrics::RouterMetrics;
use crate::push_config::KvPushRouterConfig;
use crate::shared::{Inner, SnapshotCounters};
use crate::snapshots::restore;
use crate::state::{SharedAffinityStore, State};
use kvroute_router_core::KvRouterCore;
use kvroute_router_core::{RouteRequest, Routed};

/// The annotation that turns a request into a routing query (`query_instance_id`, optionally
/// with a `:value` suffix, as the reference).
pub const QUERY_INSTANCE_ID: &str = "query_instance_id";

/// See [`KvPushRouter::load_sync_stats`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoadSyncStats {
    /// Other replicas' requests counted in this router's load now.
    pub remote_requests: usize,
    /// Other replicas' requests freed because their replica fell silent or stopped listing
    /// them.
    pub remote_freed: u64,
    /// Load messages dropped as undecodable.
    pub undecodable: u64,
    /// Other replicas' approximate-mode predictions recorded here.
    pub remote_predictions: u64,
}

/// See [`KvPushRouter::snapshot_stats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SnapshotStats {
    /// Blocks restored from the snapshot loaded at start (0 when there was none).
    pub restored_blocks: u64,
    /// The stream position the router resumed after (that snapshot's), if it restored one.
    pub resumed_after: Option<u64>,
    /// Snapshots this router saved.
    pub saved: u64,
    /// Turns skipped because another replica's snapshot was fresh.
    pub skipped_fresh: u64,
    /// Turns skipped because a gap repair or dump was in flight (a cut then would miss it).
    pub skipped_recovering: u64,
    /// Loads or saves that failed.
    pub failures: u64,
    /// Size of the last snapshot saved, in bytes.
    pub last_bytes: u64,
}

/// The answer to a query-only request: where it would go, and its tokens.
#[derive(Debug, Clone, PartialEq)]
pub struct QueryAnswer {
    /// The worker the router would choose.
    pub worker: WorkerWithDpRank,
    /// The request's tokens (what the router matched).
    pub token_ids: Vec<u32>,
    /// The decision with its cost breakdown.
    pub decision: Routed,
}

/// What [`KvPushRouter::generate`] returns.
#[derive(Debug)]
pub enum KvResponse {
    /// The request was routed and sent; its responses stream back.
    Stream(KvRoutedStream),
    /// The request was a query (`query_instance_id`): nothing was sent or recorded.
    Query(QueryAnswer),
}

/// What [`KvPushRouter::route_recorded`] decided.
pub(crate) enum Recorded {
    /// A query: the decision only, nothing recorded.
    Query(Routed),
    /// Routed and recorded; the guard frees it.
    Routed(Routed, RequestGuard),
}

/// The KV router over kvroute-runtime. Cheap to clone; background tasks stop when the last
/// clone is dropped.
#[derive(Clone)]
pub struct KvPushRouter {
    pub(crate) inner: Arc<Inner>,
    _tasks: Arc<Tasks>,
}

struct Tasks(Vec<JoinHandle<()>>);

impl Drop for Tasks {
    fn drop(&mut self) {
        for task in &self.0 {
            task.abort();
        }
    }
}

impl std::fmt::Debug for KvPushRouter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvPushRouter")
            .field("policy", &self.inner.config.core.policy)
            .finish_non_exhaustive()
    }
}

impl KvPushRouter {
    /// Starts a router over the instances of `instances` (a discovery watch) and the KV events
    /// of `events`. Must be called inside a tokio runtime. Workers already listed are added (and
    /// their dumps requested) before this returns.
    pub async fn start(
        config: KvPushRouterConfig,
        instances: watch::Receiver<InstanceSet>,
        events: Arc<dyn EventPlane>,
    ) -> Result<Self, StartError> {
        let store = Arc::new(InMemoryAffinityStore::new(config.core.max_sessions));
        Self::start_with_store(config, instances, events, store).await
    }

    /// [`Self::start`] with the sticky-session bindings in `store` (for example one shared with
    /// other router replicas) instead of an in-memory store of this router's own.
    pub async fn start_with_store(
        config: KvPushRouterConfig,
        instances: watch::Receiver<InstanceSet>,
        events: Arc<dyn EventPlane>,
        store: SharedAffinityStore,
    ) -> Result<Self, StartError> {
        Self::start_shared(config, instances, events, store, None).await
    }

    /// [`Self::start_with_store`] with an index snapshot shared by the router replicas of a
    /// fleet. When the event plane keeps history ([`EventPlane::keeps_history`]), the router
    /// first restores the stored snapshot (if any, and of its block size) and reads only the
    /// KV events after it; then it saves its own every [`KvPushRouterConfig::snapshot_interval`]
    /// unless another replica's is fresh. A snapshot that cannot be loaded or decoded is logged
    /// and ignored: the router replays the whole retained stream instead.
    pub async fn start_shared(
        config: KvPushRouterConfig,
        instances: watch::Receiver<InstanceSet>,
        events: Arc<dyn EventPlane>,
        store: SharedAffinityStore,
        snapshots: Option<Arc<dyn SnapshotStore>>,
    ) -> Result<Self, StartError> {
        let mut core = KvRouterCore::with_store(config.core.clone(), store)?;
        let history = events.keeps_history();
        let snapshots = snapshots.filter(|_| history);
        let counters = SnapshotCounters::default();
        let mut resume_after = None;
        if let Some(snapshots) = &snapshots {
            resume_after = restore(&mut core, snapshots.as_ref(), &counters).await;
        }
        // Subscribe before the first dumps so that no event falls between a dump and the feed.
        let subscription = match resume_after {
            Some(sequence) => events.subscribe_after(KV_EVENT_SUBJECT, sequence).await?,
            None => events.subscribe(KV_EVENT_SUBJECT).await?,
        };
        let report_subscription = events.subscribe(LOAD_REPORT_SUBJECT).await?;
        let load_subscription = match &config.load_sync {
            Some(sync) => Some(events.subscribe(&sync.subscription()).await?),
            None => None,
        };
        let preparer = core.preparer();
        let index = Arc::clone(core.shared_index());
        let state = Arc::new(Mutex::new(State {
            core,
            rng: ChaCha8Rng::seed_from_u64(config.seed),
        }));
        let epoch = Instant::now();
        let load_sync = config
            .load_sync
            .map(|sync| Arc::new(LoadSync::new(sync, Arc::clone(&state), epoch)));
        let inner = Arc::new(Inner {
            preparer,
            index,
            state,
            push: LlmPushRouter::new(instances.clone(), config.push.clone()),
            metrics: RouterMetrics::new(),
            epoch,
            next_id: AtomicU64::new(1),
            health: Mutex::new(PassiveHealth::new(config.health)),
            load_sync,
            config,
            history,
            snapshots,
            snapshot_counters: counters,
            recovering: AtomicUsize::new(0),
            applied_sequence: AtomicU64::new(resume_after.unwrap_or(0)),
        });
        let mut instances = instances;
        let initial = instances.borrow_and_update().clone();
        for event in diff_instances(&Default::default(), &initial) {
            inner.on_discovery(event).await;
        }
        if resume_after.is_some() {
            let gone = inner.state.lock().core.forget_unregistered();
            if gone > 0 {
                tracing::info!(
                    workers = gone,
                    "dropped snapshot workers that are no longer registered"
                );
            }
        }
        let mut tasks = vec![
            tokio::spawn(event_loop(inner.clone(), subscription)),
            tokio::spawn(discovery_loop(inner.clone(), instances, initial)),
            tokio::spawn(expire_loop(inner.clone())),
            tokio::spawn(report_loop(inner.clone(), report_subscription)),
        ];
        if inner.snapshots.is_some() {
            tasks.push(tokio::spawn(snapshot_loop(inner.clone())));
        }
        if let (Some(subscription), Some(sync)) = (load_subscription, &inner.load_sync) {
            tasks.push(tokio::spawn(load_sync::publish_loop(
                sync.clone(),
                events.clone(),
            )));
            tasks.push(tokio::spawn(load_sync::receive_loop(
                sync.clone(),
                subscription,
            )));
        }
        Ok(Self {
            inner,
            _tasks: Arc::new(Tasks(tasks)),
        })
    }

    /// Routes and sends an aggregated request (see [`Self::generate_phase`]).
    pub async fn generate(
        &self,
        request: PreprocessedRequest,
    ) -> Result<KvResponse, KvRouterError> {
        self.generate_phase(request, RequestPhase::Aggregated).await
    }

    /// Routes `request` for `phase` and sends it to the chosen worker.
    ///
    /// A request annotated `query_instance_id` is only answered ([`KvResponse::Query`]): no
    /// load, session or prediction is recorded and nothing is sent. Otherwise the session's
    /// `open` runs on the worker before sending, and the returned stream's guard frees the
    /// request's load however the stream ends (and runs the deferred session `close`).
    pub async fn generate_phase(
        &self,
        mut request: PreprocessedRequest,
        phase: RequestPhase,
    ) -> Result<KvResponse, KvRouterError> {
        let inner = &self.inner;
        let (routed, guard) = match self.route_recorded(&request, phase).await? {
            Recorded::Query(decision) => {
                return Ok(KvResponse::Query(QueryAnswer {
                    worker: decision.worker,
                    token_ids: request.token_ids,
                    decision,
                }));
            }
            Recorded::Routed(routed, guard) => (routed, guard),
        };
        let worker = routed.worker;
        if worker.dp_rank != 0 {
            request.routing_mut().dp_rank = Some(worker.dp_rank);
        }
        let request_id = format!("kvr-{}", guard.id().0);
        let stream = match inner
            .push
            .generate(&request_id, &request, RouteMode::Direct(worker.worker_id))
            .await
        {
            Ok(stream) => stream,
            Err(source) => {
                inner.metrics.on_route_error();
                if let kvroute_runtime::RouteError::Request { source, .. } = &source {
                    inner.on_worker_failure(worker.worker_id, source);
                }
                // The worker failed the request (not the client, who is still waiting):
                // `outcome="error"`, not the `cancelled` a dropped guard would count.
                guard.fail();
                return Err(KvRouterError::Send { worker, source });
            }
        };
        let mut stream = KvRoutedStream::new(stream, guard, routed);
        if phase == RequestPhase::Decode {
            // Decode routing predicts no reuse by design (the prompt's cache is the prefill
            // worker's), and decode workers repeat the prefill's report: nothing to compare.
            stream.skip_cache_report();
        }
        Ok(KvResponse::Stream(stream))
    }

    /// Routes `request` for `phase` and records it in the core (load, prediction, session,
    /// shared with the other replicas), running the session's `open` on the worker; returns
    /// the decision and the guard that frees it, or only the decision for a query. Nothing is
    /// sent: [`Self::generate_phase`] sends, [`Self::pick`] lets the caller's proxy send.
    pub(crate) async fn route_recorded(
        &self,
        request: &PreprocessedRequest,
        phase: RequestPhase,
    ) -> Result<Recorded, KvRouterError> {
        let inner = &self.inner;
        let id = RequestId(inner.next_id.fetch_add(1, Ordering::Relaxed));
        let now = inner.now();
        let avoided = inner.health.lock().ejected(now);
        let route_req = RouteRequest::from_preprocessed(id, request)
            .with_phase(phase)
            .with_avoided(&avoided);
        // Hashing the prompt and matching it against the index take no lock: the state lock
        // covers the decision only.
        let prepared = inner.preparer.prepare(&route_req);
        if is_query(request) {
            let decision = {
                let mut state = inner.state.lock();
                let State { core, rng } = &mut *state;
                core.query_prepared(&route_req, prepared, now, rng)
            }
            .inspect_err(|_| inner.metrics.on_route_error())?;
            inner.metrics.on_query();
            return Ok(Recorded::Query(decision));
        }
        let (routed, shared_load) = {
            let mut state = inner.state.lock();
            let State { core, rng } = &mut *state;
            let routed = core.route_prepared(&route_req, prepared, now, rng);
            // Other replicas count this request's load and, for a worker in approximate
            // mode, record the same prediction.
            let shared_load = match (&routed, &inner.load_sync) {
                (Ok(_), Some(_)) => core.request_load(id).map(|load| {
                    let predicted = core
                        .predicted_blocks(id)
                        .map(|blocks| blocks.iter().map(|b| b.0).collect());
                    (load, predicted)
                }),
                _ => None,
            };
            (routed, shared_load)
        };
        let routed = routed.inspect_err(|_| inner.metrics.on_route_error())?;
        if let (Some(sync), Some((load, predicted))) = (&inner.load_sync, shared_load) {
            sync.local(Local::Added(id, load, predicted));
        }
        inner
            .metrics
            .on_routed(&routed, inner.config.core.block_size());
        if tracing::enabled!(tracing::Level::DEBUG) {
            // The best cached candidate's terms beside the chosen one's: why the cache lost.
            let best = routed
                .candidates
                .iter()
                .max_by_key(|c| c.overlap_blocks)
                .filter(|c| c.overlap_blocks > routed.overlap_blocks);
            tracing::debug!(
                id = id.0,
                worker = %routed.worker,
                isl_tokens = routed.isl_tokens,
                overlap_blocks = routed.overlap_blocks,
                forgone_cached_tokens = routed.forgone_cached_tokens(inner.config.core.block_size()),
                prefill_blocks = routed.cost.prefill_blocks,
                decode_blocks = routed.cost.decode_blocks,
                cost = routed.cost.cost,
                best_cached_worker = best.map(|c| c.worker.to_string()),
                best_cached_overlap_blocks = best.map(|c| c.overlap_blocks),
                best_cached_prefill_blocks = best.map(|c| c.prefill_blocks),
                best_cached_decode_blocks = best.map(|c| c.decode_blocks),
                best_cached_cost = best.map(|c| c.cost),
                candidates = routed.candidates.len(),
                "routed"
            );
        }
        // From here on the guard frees the request on every path, including early returns.
        let guard = RequestGuard::new(inner.clone(), id, routed.worker);
        if let Some(open) = &routed.session_open {
            let accepted = inner.run_session_command(open).await;
            let _ = inner
                .state
                .lock()
                .core
                .session_opened(id, accepted, inner.now());
        }
        Ok(Recorded::Routed(routed, guard))
    }

    /// Runs `f` on the routing core under its lock (inspection, tests, the replay of live
    /// state). Keep it short: every routing decision waits on this lock.
    pub fn with_core<R>(&self, f: impl FnOnce(&mut KvRouterCore<SharedAffinityStore>) -> R) -> R {
        f(&mut self.inner.state.lock().core)
    }

    /// The metrics, with the per-worker gauges refreshed, as Prometheus text.
    pub fn metrics_text(&self) -> String {
        self.inner.refresh_worker_gauges();
        self.inner.metrics.encode_text()
    }

    /// [`Self::metrics_text`] with `router="<router>"` on every sample (serving disaggregated:
    /// which phase's router this is; see [`RouterMetrics::encode_text_labelled`]).
    pub fn metrics_text_labelled(&self, router: &str) -> String {
        self.inner.refresh_worker_gauges();
        self.inner.metrics.encode_text_labelled(router)
    }

    /// The metrics registry (for counters read directly).
    pub fn metrics(&self) -> &RouterMetrics {
        &self.inner.metrics
    }

    /// Load shared with other replicas ([`KvPushRouterConfig::load_sync`]): the other
    /// replicas' requests held now, those freed because their replica fell silent or stopped
    /// listing them, and load messages dropped as undecodable. `None` without load sync.
    pub fn load_sync_stats(&self) -> Option<LoadSyncStats> {
        self.inner.load_sync.as_ref().map(|s| LoadSyncStats {
            remote_requests: s.remote_requests(),
            remote_freed: s.remote_freed(),
            undecodable: s.undecodable(),
            remote_predictions: s.remote_predictions(),
        })
    }

    /// The index snapshot's counters; `None` without a snapshot store (or when the event plane
    /// keeps no history, which makes snapshots useless).
    pub fn snapshot_stats(&self) -> Option<SnapshotStats> {
        self.inner.snapshots.as_ref().map(|_| {
            let c = &self.inner.snapshot_counters;
            SnapshotStats {
                restored_blocks: c.restored_blocks.load(Ordering::Relaxed),
                resumed_after: *c.resumed_after.lock(),
                saved: c.saved.load(Ordering::Relaxed),
                skipped_fresh: c.skipped_fresh.load(Ordering::Relaxed),
                skipped_recovering: c.skipped_recovering.load(Ordering::Relaxed),
                failures: c.failures.load(Ordering::Relaxed),
                last_bytes: c.last_bytes.load(Ordering::Relaxed),
            }
        })
    }

    /// Saves an index snapshot now (if the router has a snapshot store and no gap repair is in
    /// flight), whether or not another replica's is fresh; says whether it did. The periodic
    /// task does this by itself; this is for tests, benches and a graceful stop.
    pub async fn save_snapshot(&self) -> bool {
        self.inner.save_snapshot().await
    }

    /// OpenMetrics text of what this router shares with other replicas: load sync (other
    /// replicas' requests counted here, those freed because their replica went silent, load
    /// messages dropped) and the index snapshot. Empty for a router that uses neither.
    pub fn replica_metrics_text(&self) -> String {
        let mut out = String::new();
        let mut family = |name: &str, kind: &str, help: &str, value: u64| {
            let sample = if kind == "counter" {
                format!("{name}_total")
            } else {
                name.to_owned()
            };
            out.push_str(&format!(
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{sample} {value}\n"
            ));
        };
        let p = crate::metrics::METRIC_PREFIX;
        if let Some(s) = self.load_sync_stats() {
            family(
                &format!("{p}_replica_remote_requests"),
                "gauge",
                "Other router replicas' requests counted in this router's worker load.",
                s.remote_requests as u64,
            );
            family(
                &format!("{p}_replica_remote_freed"),
                "counter",
                "Other replicas' requests freed because their replica went silent or stopped listing them.",
                s.remote_freed,
            );
            family(
                &format!("{p}_replica_undecodable"),
                "counter",
                "Load messages from other replicas dropped as undecodable.",
                s.undecodable,
            );
            family(
                &format!("{p}_replica_remote_predictions"),
                "counter",
                "Other replicas' approximate-mode cache predictions recorded in this router's index.",
                s.remote_predictions,
            );
        }
        if let Some(s) = self.snapshot_stats() {
            family(
                &format!("{p}_snapshot_restored_blocks"),
                "gauge",
                "Blocks restored from the index snapshot at start.",
                s.restored_blocks,
            );
            family(
                &format!("{p}_snapshots_saved"),
                "counter",
                "Index snapshots this router saved.",
                s.saved,
            );
            family(
                &format!("{p}_snapshot_failures"),
                "counter",
                "Index snapshot loads or saves that failed.",
                s.failures,
            );
            family(
                &format!("{p}_snapshot_bytes"),
                "gauge",
                "Size of the last index snapshot this router saved.",
                s.last_bytes,
            );
        }
        out
    }

    /// Time since the router started: the `now` the core sees.
    pub fn now(&self) -> Duration {
        self.inner.now()
    }
}

pub(crate) fn is_query(request: &PreprocessedRequest) -> bool {
    request.annotations.iter().any(|a| {
        a == QUERY_INSTANCE_ID
            || a.strip_prefix(QUERY_INSTANCE_ID)
                .is_some_and(|rest| rest.starts_with(':'))
    })
}
