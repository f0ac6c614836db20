//! The live router's background loops: KV events, discovery, worker load reports, expiry and
//! the index snapshot's turns ([`KvPushRouter::start_shared`](crate::KvPushRouter::start_shared)
//! spawns them), with what they do to the shared state: adding and removing workers, dumps and
//! gap repairs.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use futures::StreamExt;
use kvroute_indexer::EventGap;
use kvroute_protocols::WorkerId;
use kvroute_runtime::{
    DiscoveryEvent, InstanceInfo, InstanceSet, KV_EVENT_BASE_METADATA, Subscription, diff_instances,
};
use kvroute_scheduler::WorkerSpec;
use tokio::sync::watch;

use crate::push_config::KV_EVENTS_METADATA_KEY;
use crate::shared::Inner;
use kvroute_router_core::KvMode;

/// Saves the index snapshot every `snapshot_interval`, unless another replica's is fresh.
pub(crate) async fn snapshot_loop(inner: Arc<Inner>) {
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

/// Applies the KV events of the event plane, repairing the gaps it finds.
pub(crate) async fn event_loop(inner: Arc<Inner>, mut subscription: Subscription) {
    while let Some(message) = subscription.next().await {
        let event = match message.router_event() {
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

/// Follows discovery: adds (and dumps or catches up) the workers that join, removes those that
/// leave.
pub(crate) async fn discovery_loop(
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

/// Holds the tracked load against the workers' own reports
/// ([`LOAD_REPORT_SUBJECT`](kvroute_runtime::LOAD_REPORT_SUBJECT)): each report is recorded (for
/// `/metrics`) and frees other replicas' requests the worker no longer holds
/// ([`KvRouterCore::on_load_report`](crate::KvRouterCore::on_load_report)). An undecodable or
/// invalid report is counted and dropped.
pub(crate) async fn report_loop(inner: Arc<Inner>, mut subscription: Subscription) {
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

/// Expires forgotten requests, predictions and sessions, and silent replicas' load.
pub(crate) async fn expire_loop(inner: Arc<Inner>) {
    let mut tick = tokio::time::interval(inner.config.expire_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if let Some(sync) = &inner.load_sync {
            sync.expire_silent();
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

impl Inner {
    pub(crate) async fn on_discovery(self: &Arc<Self>, event: DiscoveryEvent) {
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
