//! The core's KV event intake: live events (applied, or queued on the shared index), events
//! fetched to fill a gap, and a worker's dump.

use kvroute_indexer::EventGap;
use kvroute_indexer::EventOrder;
use kvroute_protocols::WorkerId;
use kvroute_protocols::WorkerWithDpRank;
use kvroute_protocols::kv_events::RouterEvent;
use kvroute_sessions::AffinityStore;

use super::KvRouterCore;
use crate::config::KvMode;

impl<S: AffinityStore> KvRouterCore<S> {
    /// Applies one live KV event. Returns the ids lost before it, if any, which the caller
    /// should fetch from the worker (`kv_events_range`) and pass to [`Self::apply_recovered`].
    ///
    /// Late events (an id at or below one already seen) are skipped: they were recovered or
    /// dumped already. Events of workers in approximate mode are skipped, and so are events of
    /// workers not registered (yet): when one joins, its blocks come from a dump or, on a plane
    /// that keeps history, from its events since [`Self::expect_events_from`]'s base (the ones
    /// skipped before it joined come back as a gap to repair).
    pub fn apply_event(&mut self, event: &RouterEvent) -> Option<EventGap> {
        let (admitted, gap) = self.admit(event);
        if admitted {
            // Bad events are counted by the index; it stays consistent.
            self.index_mut(|index| {
                let _ = index.apply_event_untracked(event);
            });
        }
        gap
    }

    /// [`Self::apply_event`] without the write: an admitted event is queued on the shared index,
    /// in order with every other change the core makes to it, and applied by the next
    /// [`ConcurrentIndex::apply_queued`](kvroute_indexer::ConcurrentIndex::apply_queued) (which
    /// the caller runs after letting go of whatever lock guards this core), or by any change or
    /// consistent read of the index made first.
    pub fn queue_event(&mut self, event: RouterEvent) -> Option<EventGap> {
        let (admitted, gap) = self.admit(&event);
        if admitted {
            self.index.enqueue_untracked(event);
        }
        gap
    }

    /// Whether a live event is to be applied (its worker is registered in events mode and the
    /// id is not late), and the gap before it; counts it.
    fn admit(&mut self, event: &RouterEvent) -> (bool, Option<EventGap>) {
        match self.modes.get(&event.worker_id) {
            Some(KvMode::Events) => {}
            Some(KvMode::Approximate) => {
                self.stats.events_ignored += 1;
                return (false, None);
            }
            None => {
                self.stats.events_unregistered += 1;
                return (false, None);
            }
        }
        let key = WorkerWithDpRank::from_worker_id(event.worker_id);
        let first = self.gaps.expected(key).is_none();
        let gap = match self.gaps.observe(key, event.event.event_id) {
            EventOrder::InOrder => {
                if first {
                    self.origin.insert(event.worker_id, event.event.event_id);
                }
                None
            }
            EventOrder::Gap(gap) => {
                self.stats.gaps_detected += 1;
                tracing::warn!(worker = event.worker_id, missing = ?gap.missing, "KV event gap");
                Some(gap)
            }
            EventOrder::Late => {
                self.stats.events_late += 1;
                return (false, None);
            }
        };
        self.stats.events_applied += 1;
        (true, gap)
    }

    /// Applies an event fetched to fill a gap (its id is not tracked).
    pub fn apply_recovered(&mut self, event: &RouterEvent) {
        if self.modes.get(&event.worker_id) == Some(&KvMode::Approximate) {
            self.stats.events_ignored += 1;
            return;
        }
        self.index_mut(|index| {
            let _ = index.apply_event_untracked(event);
        });
        self.stats.events_recovered += 1;
    }

    /// Replaces everything known about `worker_id`'s cache with a dump of it (a worker that
    /// joined, or one whose gap could not be filled): `events` are its blocks as `Stored` events
    /// and `last_event_id` the newest event they reflect, after which live events resume.
    pub fn apply_dump(
        &mut self,
        worker_id: WorkerId,
        last_event_id: Option<u64>,
        events: &[RouterEvent],
    ) {
        let applied = self.index_mut(|index| {
            index.remove_worker(worker_id);
            let mut applied = 0;
            for event in events.iter().filter(|e| e.worker_id == worker_id) {
                let _ = index.apply_event_untracked(event);
                applied += 1;
            }
            applied
        });
        self.gaps.forget_worker(worker_id);
        self.origin.insert(worker_id, 0);
        self.stats.events_recovered += applied;
        if let Some(last) = last_event_id {
            self.gaps
                .observe(WorkerWithDpRank::from_worker_id(worker_id), last);
        }
    }
}
