//! [`KvPushRouter`]: the KV router served over kvroute-runtime.
//!
//! Three background tasks keep the [`KvRouterCore`] current: one applies KV events from the event
//! plane (filling gaps from the worker with `kv_events_range`, or a `kv_dump` when the worker no
//! longer holds them), one follows discovery (a worker that joins is added and dumped, one that
//! leaves is removed), one expires forgotten requests, predictions and sessions. Requests are
//! routed by the core under a mutex held only for the decision, then sent with
//! [`RouteMode::Direct`] to the chosen worker; a [`RequestGuard`] rides the response stream.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use futures::StreamExt;
use kvroute_indexer::{ConcurrentIndex, EventGap};
use kvroute_protocols::{
    PreprocessedRequest, RequestPhase, SessionAction, SessionControl, WorkerId, WorkerWithDpRank,
};
use kvroute_runtime::{
    DiscoveryEvent, EventPlane, EventPlaneError, InstanceInfo, InstanceSet, KV_EVENT_BASE_METADATA,
    KV_EVENT_SUBJECT, LOAD_REPORT_SUBJECT, LlmPushRouter, PushRouterConfig, RouteMode,
    SnapshotStore, Subscription, decode_router_event, diff_instances,
};
use kvroute_scheduler::{ConfigError, RequestId, WorkerSpec};
use kvroute_sessions::{AffinityStore, InMemoryAffinityStore, SessionCommand};
use parking_lot::Mutex;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::config::{KvMode, RouterConfig};
use crate::core::{IndexSnapshot, KvRouterCore};
use crate::error::RouteError;
use crate::guard::{KvRoutedStream, RequestGuard};
use crate::health::{HealthConfig, HealthFailure, PassiveHealth, Verdict};
use crate::load_sync::{self, LoadSync, LoadSyncConfig, Local};
use crate::metrics::RouterMetrics;
use crate::request::{RoutePreparer, RouteRequest, Routed};

/// A router's sticky-session store: any [`AffinityStore`], shared.
pub type SharedAffinityStore = Arc<dyn AffinityStore>;

/// The instance metadata key a worker sets to `"false"` when it publishes no KV events (the
/// router then predicts its cache from routing decisions).
pub const KV_EVENTS_METADATA_KEY: &str = "kv_events";

/// The annotation that turns a request into a routing query (`query_instance_id`, optionally
/// with a `:value` suffix, as the reference).
pub const QUERY_INSTANCE_ID: &str = "query_instance_id";

/// How a [`KvPushRouter`] behaves.
#[derive(Debug, Clone)]
pub struct KvPushRouterConfig {
    /// The routing core (block size, policy, cost, sessions).
    pub core: RouterConfig,
    /// The transport (connections, role filter, backoff).
    pub push: PushRouterConfig,
    /// The KV mode of workers that do not say (see [`KV_EVENTS_METADATA_KEY`]).
    pub default_kv_mode: KvMode,
    /// Seed of the routing RNG (tie-breaking, temperature, the random policy).
    pub seed: u64,
    /// How often requests, predictions and sessions are expired.
    pub expire_interval: Duration,
    /// Share active load with other router replicas over the event plane (see
    /// [`LoadSyncConfig`]); `None` for a router that serves its fleet alone.
    pub load_sync: Option<LoadSyncConfig>,
    /// How often the index snapshot is saved, when the router has a [`SnapshotStore`] (see
    /// [`KvPushRouter::start_shared`]); a replica skips its turn while another's snapshot is
    /// younger than 80% of this.
    pub snapshot_interval: Duration,
    /// When a worker whose requests keep failing is routed around (see [`crate::health`]).
    pub health: HealthConfig,
}

impl KvPushRouterConfig {
    /// Defaults for engines with `block_size` tokens per KV block.
    pub fn new(block_size: u32) -> Self {
        Self {
            core: RouterConfig::new(block_size),
            push: PushRouterConfig::default(),
            default_kv_mode: KvMode::Events,
            seed: 0x6b76_726f_7574_6572,
            expire_interval: Duration::from_secs(1),
            load_sync: None,
            snapshot_interval: Duration::from_secs(30),
            health: HealthConfig::default(),
        }
    }
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

#[derive(Debug, Default)]
struct SnapshotCounters {
    restored_blocks: AtomicU64,
    resumed_after: Mutex<Option<u64>>,
    saved: AtomicU64,
    skipped_fresh: AtomicU64,
    skipped_recovering: AtomicU64,
    failures: AtomicU64,
    last_bytes: AtomicU64,
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

/// The KV router over kvroute-runtime. Cheap to clone; background tasks stop when the last
/// clone is dropped.
#[derive(Clone)]
pub struct KvPushRouter {
    pub(crate) inner: Arc<Inner>,
    _tasks: Arc<Tasks>,
}

pub(crate) struct Inner {
    pub(crate) state: Mutex<State>,
    /// Hashes and matches prompts against the core's exact index without its lock.
    preparer: RoutePreparer,
    /// The core's exact index, where the event loop applies the events it queued under the
    /// lock once it has let go of it.
    index: Arc<ConcurrentIndex>,
    pub(crate) push: LlmPushRouter,
    pub(crate) metrics: RouterMetrics,
    epoch: Instant,
    next_id: AtomicU64,
    pub(crate) config: KvPushRouterConfig,
    pub(crate) load_sync: Option<LoadSync>,
    /// The event plane replays retained KV events to new subscribers: a worker that states its
    /// first event id is caught up from the stream rather than dumped.
    history: bool,
    snapshots: Option<Arc<dyn SnapshotStore>>,
    snapshot_counters: SnapshotCounters,
    /// Gap repairs and dumps in flight.
    recovering: AtomicUsize,
    /// The event-plane position of the last KV event applied (0: none with a position).
    applied_sequence: AtomicU64,
    /// Workers whose requests keep failing, routed around for a while.
    health: Mutex<PassiveHealth>,
}

pub(crate) struct State {
    pub(crate) core: KvRouterCore<SharedAffinityStore>,
    rng: ChaCha8Rng,
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
        let inner = Arc::new(Inner {
            preparer,
            index,
            state: Mutex::new(State {
                core,
                rng: ChaCha8Rng::seed_from_u64(config.seed),
            }),
            push: LlmPushRouter::new(instances.clone(), config.push.clone()),
            metrics: RouterMetrics::new(),
            epoch: Instant::now(),
            next_id: AtomicU64::new(1),
            health: Mutex::new(PassiveHealth::new(config.health)),
            load_sync: config.load_sync.map(LoadSync::new),
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
        if let Some(subscription) = load_subscription {
            tasks.push(tokio::spawn(load_sync::publish_loop(
                inner.clone(),
                events.clone(),
            )));
            tasks.push(tokio::spawn(load_sync::receive_loop(
                inner.clone(),
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
        let id = RequestId(inner.next_id.fetch_add(1, Ordering::Relaxed));
        let now = inner.now();
        let avoided = inner.health.lock().ejected(now);
        let route_req = RouteRequest::from_preprocessed(id, &request)
            .with_phase(phase)
            .with_avoided(&avoided);
        // Hashing the prompt and matching it against the index take no lock: the state lock
        // covers the decision only.
        let prepared = inner.preparer.prepare(&route_req);
        if is_query(&request) {
            let decision = {
                let mut state = inner.state.lock();
                let State { core, rng } = &mut *state;
                core.query_prepared(&route_req, prepared, now, rng)
            }
            .inspect_err(|_| inner.metrics.on_route_error())?;
            inner.metrics.on_query();
            return Ok(KvResponse::Query(QueryAnswer {
                worker: decision.worker,
                token_ids: request.token_ids,
                decision,
            }));
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
        inner.metrics.on_routed(
            routed.isl_tokens,
            routed.predicted_cached_tokens(inner.config.core.block_size()),
            &routed.timings,
        );
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
        let worker = routed.worker;
        if worker.dp_rank != 0 {
            request.routing_mut().dp_rank = Some(worker.dp_rank);
        }
        let request_id = format!("kvr-{}", id.0);
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

impl Inner {
    pub(crate) fn now(&self) -> Duration {
        self.epoch.elapsed()
    }

    /// A request failed on `worker` with `error`: counted, and passive health may eject the
    /// worker. Errors that say nothing of the worker's health (an engine refusal) are ignored.
    pub(crate) fn on_worker_failure(
        &self,
        worker: WorkerId,
        error: &kvroute_runtime::RequestError,
    ) {
        let failure = if error.is_unreachable() {
            HealthFailure::Unreachable
        } else if error.is_timeout() {
            HealthFailure::Timeout
        } else if error.is_worker_unavailable() {
            HealthFailure::Lost
        } else {
            return;
        };
        self.metrics.on_worker_failure(worker, failure.label());
        let verdict = self.health.lock().on_failure(worker, failure, self.now());
        match verdict {
            Verdict::Ejected { after, .. } => {
                tracing::warn!(
                    worker,
                    reason = %failure,
                    ?after,
                    %error,
                    "worker ejected: new requests go to other workers until it is probed again"
                );
                self.metrics.on_worker_ejected(worker, failure.label());
            }
            Verdict::Counted { in_a_row } => {
                tracing::debug!(worker, reason = %failure, in_a_row, "worker failure counted");
            }
            Verdict::AlreadyEjected => {}
        }
    }

    /// A request on `worker` ran to its end: passive health clears the worker's record.
    pub(crate) fn on_worker_success(&self, worker: WorkerId) {
        if self.health.lock().on_success(worker) {
            tracing::info!(worker, "worker back in: its probe request succeeded");
        }
    }

    fn refresh_worker_gauges(&self) {
        let (loads, reports, reconciled, stats): (Vec<_>, Vec<_>, _, _) = {
            let state = self.state.lock();
            let core = &state.core;
            (
                core.workers()
                    .filter_map(|w| core.worker_load(w).map(|l| (w, l)))
                    .collect(),
                core.workers()
                    .filter_map(|w| core.reported_load(w).map(|r| (w, *r)))
                    .collect(),
                core.scheduler().metrics().snapshot().requests_reconciled,
                core.stats(),
            )
        };
        self.metrics
            .set_load_reports(stats.load_reports_applied, stats.load_reports_unregistered);
        self.metrics.set_worker_loads(loads);
        self.metrics
            .set_worker_reports(reports.iter().map(|(w, r)| (*w, r)));
        self.metrics.set_requests_reconciled(reconciled);
        let ejected = self.health.lock().ejected(self.now());
        self.metrics.set_ejected(&ejected);
    }

    /// Runs one session command on its worker; says whether it succeeded.
    pub(crate) async fn run_session_command(&self, command: &SessionCommand) -> bool {
        let (worker, control) = match command {
            SessionCommand::Open {
                session_id,
                worker,
                timeout,
            } => (
                *worker,
                SessionControl::new(session_id.clone())
                    .with_action(SessionAction::Open)
                    .with_timeout(timeout.as_secs()),
            ),
            SessionCommand::Close { session_id, worker } => (
                *worker,
                SessionControl::new(session_id.clone()).with_action(SessionAction::Close),
            ),
        };
        let result = match self.push.client(worker.worker_id).await {
            Ok(client) => client
                .session_control(&control)
                .await
                .map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        match result {
            Ok(()) => true,
            Err(error) => {
                tracing::warn!(%worker, session = %control.session_id, ?control.action, %error, "session_control failed");
                false
            }
        }
    }

    /// Runs session commands in the background (deferred closes must not hold up the caller,
    /// and may be issued from a `Drop`).
    pub(crate) fn spawn_session_commands(self: &Arc<Self>, commands: Vec<SessionCommand>) {
        if commands.is_empty() {
            return;
        }
        let Ok(handle) = tokio::runtime::Handle::try_current() else {
            tracing::warn!(
                count = commands.len(),
                "no tokio runtime; dropping session commands"
            );
            return;
        };
        let inner = self.clone();
        handle.spawn(async move {
            for command in &commands {
                inner.run_session_command(command).await;
            }
        });
    }

    async fn on_discovery(self: &Arc<Self>, event: DiscoveryEvent) {
        match event {
            DiscoveryEvent::Removed(id) => {
                let dropped = self.state.lock().core.remove_worker(id);
                self.health.lock().remove(id);
                tracing::info!(worker = id, dropped = dropped.len(), "worker left");
            }
            DiscoveryEvent::Added(info) => {
                let Some(mode) = self.accept(&info) else {
                    return;
                };
                let spec = WorkerSpec::new(info.id).with_dp_ranks(0, info.dp_size);
                {
                    let mut state = self.state.lock();
                    // A re-registration with new details replaces the old worker.
                    if state.core.has_worker(info.id) {
                        state.core.remove_worker(info.id);
                    }
                    if let Err(error) = state.core.add_worker(&spec, mode) {
                        tracing::warn!(worker = info.id, %error, "cannot add worker");
                        return;
                    }
                }
                if mode == KvMode::Events {
                    match self.event_base(&info) {
                        Some(base) => {
                            let gap = self.state.lock().core.expect_events_from(info.id, base);
                            if let Some(gap) = gap {
                                self.recover(gap).await;
                            }
                        }
                        None => self.dump(info.id).await,
                    }
                }
            }
        }
    }

    /// Where the worker's current life numbers its KV events from, when the event plane replays
    /// them (so the router catches up from the stream instead of asking for a dump).
    fn event_base(&self, info: &InstanceInfo) -> Option<u64> {
        if !self.history {
            return None;
        }
        let value = info.metadata.get(KV_EVENT_BASE_METADATA)?;
        match value.parse() {
            Ok(base) => Some(base),
            Err(_) => {
                tracing::warn!(worker = info.id, %value, "ignoring an unparsable {KV_EVENT_BASE_METADATA}; dumping the worker instead");
                None
            }
        }
    }

    /// Saves a snapshot of the index as of the last applied event's position; see
    /// [`KvPushRouter::save_snapshot`].
    async fn save_snapshot(&self) -> bool {
        let Some(store) = &self.snapshots else {
            return false;
        };
        let c = &self.snapshot_counters;
        if self.recovering.load(Ordering::Acquire) > 0 {
            c.skipped_recovering.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        // Read the position before the cut: the cut then reflects at least the events up to it
        // (later ones it may also hold are skipped by id when replayed after a restore).
        let sequence = self.applied_sequence.load(Ordering::Acquire);
        // Only the cut holds the routing lock; the blocks are read and encoded off it, and off
        // the runtime's threads, while routes go on and events queue behind the cut.
        let cut = self.state.lock().core.snapshot_cut(sequence);
        let encoded = tokio::task::spawn_blocking(move || {
            let snapshot = cut.finish();
            (snapshot.blocks(), snapshot.encode())
        })
        .await;
        let (blocks, bytes) = match encoded {
            Ok((blocks, bytes)) => (blocks, bytes::Bytes::from(bytes)),
            Err(error) => {
                c.failures.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(%error, "index snapshot not taken");
                return false;
            }
        };
        let size = bytes.len() as u64;
        match store.save(bytes).await {
            Ok(()) => {
                c.saved.fetch_add(1, Ordering::Relaxed);
                c.last_bytes.store(size, Ordering::Relaxed);
                tracing::debug!(sequence, blocks, bytes = size, "index snapshot saved");
                true
            }
            Err(error) => {
                c.failures.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(%error, "index snapshot not saved");
                false
            }
        }
    }

    /// The worker's KV mode if this router serves it (role and block size match).
    fn accept(&self, info: &InstanceInfo) -> Option<KvMode> {
        if let Some(role) = self.config.push.role
            && info.role != role
        {
            return None;
        }
        let block_size = self.config.core.block_size();
        if info.kv_block_size != block_size {
            tracing::warn!(
                worker = info.id,
                worker_block_size = info.kv_block_size,
                router_block_size = block_size,
                "ignoring worker: its KV block size differs from the router's"
            );
            return None;
        }
        Some(
            match info
                .metadata
                .get(KV_EVENTS_METADATA_KEY)
                .map(String::as_str)
            {
                Some("false") => KvMode::Approximate,
                Some("true") => KvMode::Events,
                _ => self.config.default_kv_mode,
            },
        )
    }

    /// Rebuilds one worker's blocks from its dump.
    async fn dump(&self, worker: WorkerId) {
        let _recovering = Recovering::new(&self.recovering);
        let dump = match self.push.client(worker).await {
            Ok(client) => client.kv_dump().await.map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        match dump {
            Ok(dump) => {
                let mut state = self.state.lock();
                if state.core.kv_mode(worker) == Some(KvMode::Events) {
                    state
                        .core
                        .apply_dump(worker, dump.last_event_id, &dump.events);
                }
            }
            Err(error) => tracing::warn!(worker, %error, "KV dump failed"),
        }
    }

    /// Fills a gap from the worker's event ring, or rebuilds from a dump when it no longer holds
    /// the missing events.
    async fn recover(&self, gap: EventGap) {
        let _recovering = Recovering::new(&self.recovering);
        let worker = gap.worker.worker_id;
        let (from, to) = (gap.missing.start, gap.missing.end.saturating_sub(1));
        let fetched = match self.push.client(worker).await {
            Ok(client) => client
                .kv_events_range(from, to)
                .await
                .map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        match fetched {
            Ok(events) if events.first().map(|e| e.event.event_id) == Some(from) => {
                let mut state = self.state.lock();
                for event in &events {
                    state.core.apply_recovered(event);
                }
                tracing::info!(worker, recovered = events.len(), "KV event gap filled");
            }
            other => {
                tracing::warn!(
                    worker,
                    ?other,
                    "KV event gap not fillable from the ring; dumping"
                );
                self.dump(worker).await;
            }
        }
    }
}

/// Counts a gap repair or dump in flight while it lives.
struct Recovering<'a>(&'a AtomicUsize);

impl<'a> Recovering<'a> {
    fn new(count: &'a AtomicUsize) -> Self {
        count.fetch_add(1, Ordering::AcqRel);
        Self(count)
    }
}

impl Drop for Recovering<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Loads and restores the stored snapshot; returns the position to resume after.
async fn restore(
    core: &mut KvRouterCore<SharedAffinityStore>,
    store: &dyn SnapshotStore,
    counters: &SnapshotCounters,
) -> Option<u64> {
    let started = Instant::now();
    let bytes = match store.load().await {
        Ok(Some(bytes)) => bytes,
        Ok(None) => {
            tracing::info!("no index snapshot yet; replaying the retained KV event stream");
            return None;
        }
        Err(error) => {
            counters.failures.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(%error, "cannot load the index snapshot; replaying the retained KV event stream");
            return None;
        }
    };
    let restored = IndexSnapshot::decode(&bytes).and_then(|snapshot| {
        core.restore(&snapshot)
            .map(|blocks| (blocks, snapshot.sequence))
    });
    match restored {
        Ok((blocks, sequence)) => {
            counters
                .restored_blocks
                .store(blocks as u64, Ordering::Relaxed);
            *counters.resumed_after.lock() = Some(sequence);
            tracing::info!(
                blocks,
                after = sequence,
                bytes = bytes.len(),
                took = ?started.elapsed(),
                "index snapshot restored; reading the KV events after it"
            );
            Some(sequence)
        }
        Err(error) => {
            counters.failures.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(%error, "ignoring the index snapshot; replaying the retained KV event stream");
            None
        }
    }
}

async fn snapshot_loop(inner: Arc<Inner>) {
    let every = inner
        .config
        .snapshot_interval
        .max(Duration::from_millis(100));
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(store) = &inner.snapshots else {
            return;
        };
        match store.age().await {
            Ok(Some(age)) if age < every.mul_f64(0.8) => {
                inner
                    .snapshot_counters
                    .skipped_fresh
                    .fetch_add(1, Ordering::Relaxed);
                continue;
            }
            Ok(_) => {}
            Err(error) => {
                inner
                    .snapshot_counters
                    .failures
                    .fetch_add(1, Ordering::Relaxed);
                tracing::warn!(%error, "cannot read the index snapshot's age; skipping this turn");
                continue;
            }
        }
        inner.save_snapshot().await;
    }
}

async fn event_loop(inner: Arc<Inner>, mut subscription: Subscription) {
    while let Some(message) = subscription.next().await {
        let event = match decode_router_event(&message.payload) {
            Ok(event) => event,
            Err(error) => {
                tracing::warn!(%error, "undecodable KV event");
                continue;
            }
        };
        // Ordered and counted under the lock, applied after it: routing never waits for an
        // event to be written (a long prompt's chain can take a millisecond).
        let gap = inner.state.lock().core.queue_event(event);
        inner.index.apply_queued();
        if let Some(sequence) = message.sequence {
            inner.applied_sequence.store(sequence, Ordering::Release);
        }
        if let Some(gap) = gap {
            let inner = inner.clone();
            tokio::spawn(async move { inner.recover(gap).await });
        }
    }
}

async fn discovery_loop(
    inner: Arc<Inner>,
    mut instances: watch::Receiver<InstanceSet>,
    mut known: InstanceSet,
) {
    while instances.changed().await.is_ok() {
        let current = instances.borrow_and_update().clone();
        for event in diff_instances(&known, &current) {
            inner.on_discovery(event).await;
        }
        known = current;
    }
}

/// Holds the tracked load against the workers' own reports ([`LOAD_REPORT_SUBJECT`]): each
/// report is recorded (for `/metrics`) and frees other replicas' requests the worker no longer
/// holds ([`KvRouterCore::on_load_report`]). An undecodable or invalid report is counted and
/// dropped.
async fn report_loop(inner: Arc<Inner>, mut subscription: Subscription) {
    while let Some(message) = subscription.next().await {
        let freed = kvroute_protocols::WorkerLoadReport::from_json(&message.payload)
            .and_then(|report| inner.state.lock().core.on_load_report(&report, inner.now()));
        match freed {
            Ok(freed) => {
                if let Some(sync) = &inner.load_sync {
                    sync.forget(&freed);
                }
            }
            Err(error) => {
                inner.metrics.on_invalid_load_report();
                tracing::warn!(%error, "dropping an invalid worker load report");
            }
        }
    }
}

async fn expire_loop(inner: Arc<Inner>) {
    let mut tick = tokio::time::interval(inner.config.expire_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if let Some(sync) = &inner.load_sync {
            sync.expire_silent(&inner);
        }
        let expired = inner.state.lock().core.expire(inner.now());
        if !expired.requests.is_empty() {
            tracing::warn!(
                count = expired.requests.len(),
                "expired requests nobody freed"
            );
        }
        inner.spawn_session_commands(expired.session_closes);
    }
}
