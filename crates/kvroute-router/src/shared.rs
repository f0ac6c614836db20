//! [`Inner`]: the state a live router shares with its request guards and background tasks
//! (the routing state, the transport, metrics, load sync, passive health, snapshot counters),
//! and what they all do with it: the clock, worker health, per-worker gauges, session commands.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize};
use std::time::{Duration, Instant};

use kvroute_indexer::ConcurrentIndex;
use kvroute_protocols::{SessionAction, SessionControl, WorkerId};
use kvroute_runtime::{LlmPushRouter, SnapshotStore};
use kvroute_sessions::SessionCommand;
use parking_lot::Mutex;

use crate::health::{HealthFailure, PassiveHealth, Verdict};
use crate::load_sync::LoadSync;
use crate::metrics::RouterMetrics;
use crate::push_config::KvPushRouterConfig;
use crate::state::State;
use kvroute_router_core::RoutePreparer;

/// What a [`KvPushRouter`](crate::KvPushRouter), its guards and its background tasks share.
pub(crate) struct Inner {
    /// The core and its RNG (shared with load sync, which updates the core too).
    pub(crate) state: Arc<Mutex<State>>,
    /// Hashes and matches prompts against the core's exact index without its lock.
    pub(crate) preparer: RoutePreparer,
    /// The core's exact index, where the event loop applies the events it queued under the
    /// lock once it has let go of it.
    pub(crate) index: Arc<ConcurrentIndex>,
    pub(crate) push: LlmPushRouter,
    pub(crate) metrics: RouterMetrics,
    pub(crate) epoch: Instant,
    pub(crate) next_id: AtomicU64,
    pub(crate) config: KvPushRouterConfig,
    pub(crate) load_sync: Option<Arc<LoadSync>>,
    /// The event plane replays retained KV events to new subscribers: a worker that states its
    /// first event id is caught up from the stream rather than dumped.
    pub(crate) history: bool,
    pub(crate) snapshots: Option<Arc<dyn SnapshotStore>>,
    pub(crate) snapshot_counters: SnapshotCounters,
    /// Gap repairs and dumps in flight.
    pub(crate) recovering: AtomicUsize,
    /// The event-plane position of the last KV event applied (0: none with a position).
    pub(crate) applied_sequence: AtomicU64,
    /// Workers whose requests keep failing, routed around for a while.
    pub(crate) health: Mutex<PassiveHealth>,
}

/// The index snapshot's counters (see [`SnapshotStats`](crate::SnapshotStats)).
#[derive(Debug, Default)]
pub(crate) struct SnapshotCounters {
    pub(crate) restored_blocks: AtomicU64,
    pub(crate) resumed_after: Mutex<Option<u64>>,
    pub(crate) saved: AtomicU64,
    pub(crate) skipped_fresh: AtomicU64,
    pub(crate) skipped_recovering: AtomicU64,
    pub(crate) failures: AtomicU64,
    pub(crate) last_bytes: AtomicU64,
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Inner").finish_non_exhaustive()
    }
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
        self.on_health_failure(worker, failure, error);
    }

    /// A request failed on `worker` in a way that says the worker is unhealthy (`failure`;
    /// `detail` says what happened, for the log): counted, and passive health may eject it.
    pub(crate) fn on_health_failure(
        &self,
        worker: WorkerId,
        failure: HealthFailure,
        detail: &dyn std::fmt::Display,
    ) {
        self.metrics.on_worker_failure(worker, failure.label());
        let verdict = self.health.lock().on_failure(worker, failure, self.now());
        match verdict {
            Verdict::Ejected { after, .. } => {
                tracing::warn!(
                    worker,
                    reason = %failure,
                    ?after,
                    error = %detail,
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

    pub(crate) fn refresh_worker_gauges(&self) {
        let (loads, reports, capacities, reconciled, stats): (Vec<_>, Vec<_>, Vec<_>, _, _) = {
            let state = self.state.lock();
            let core = &state.core;
            (
                core.workers()
                    .filter_map(|w| core.worker_load(w).map(|l| (w, l)))
                    .collect(),
                core.workers()
                    .filter_map(|w| core.reported_load(w).map(|r| (w, *r)))
                    .collect(),
                core.workers()
                    .filter_map(|w| core.approx_index().retention(w).map(|r| (w, r)))
                    .collect(),
                core.scheduler().metrics().snapshot().requests_reconciled,
                core.stats(),
            )
        };
        self.metrics
            .set_load_reports(stats.load_reports_applied, stats.load_reports_unregistered);
        self.metrics.set_worker_loads(loads);
        self.metrics.set_approx_capacities(capacities);
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
}
