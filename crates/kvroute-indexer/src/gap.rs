//! Per-worker event-id tracking: detects lost events so the caller can ask the worker again.

use std::ops::Range;

use kvroute_protocols::WorkerWithDpRank;

use crate::fasthash::FastMap;

/// A run of event ids that never arrived from one worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventGap {
    /// The worker and rank whose events are missing.
    pub worker: WorkerWithDpRank,
    /// The missing ids, `start` inclusive, `end` exclusive.
    pub missing: Range<u64>,
}

/// What the tracker concluded about one event id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EventOrder {
    /// The first event seen from the worker, or the one expected next.
    InOrder,
    /// Events were skipped before this one.
    Gap(EventGap),
    /// An id at or below one already seen (a recovered or duplicated event).
    Late,
}

/// Remembers, per worker and rank, the next event id expected.
#[derive(Debug, Default, Clone)]
pub struct GapTracker {
    next: FastMap<WorkerWithDpRank, u64>,
}

impl GapTracker {
    /// An empty tracker.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records `event_id` from `worker` and says whether events were lost before it.
    pub fn observe(&mut self, worker: WorkerWithDpRank, event_id: u64) -> EventOrder {
        let following = event_id.saturating_add(1);
        match self.next.get_mut(&worker) {
            None => {
                self.next.insert(worker, following);
                EventOrder::InOrder
            }
            Some(next) if event_id == *next => {
                *next = following;
                EventOrder::InOrder
            }
            Some(next) if event_id > *next => {
                let missing = *next..event_id;
                *next = following;
                EventOrder::Gap(EventGap { worker, missing })
            }
            Some(_) => EventOrder::Late,
        }
    }

    /// The next id expected from `worker`, if any event was seen.
    pub fn expected(&self, worker: WorkerWithDpRank) -> Option<u64> {
        self.next.get(&worker).copied()
    }

    /// Sets the next id expected from `worker` (a restored snapshot, or a worker's new life
    /// whose first id it announced): `next` is then in order, lower ids are late.
    pub fn expect(&mut self, worker: WorkerWithDpRank, next: u64) {
        self.next.insert(worker, next);
    }

    /// Forgets one worker rank (it left, or restarted and will count from scratch).
    pub fn forget(&mut self, worker: WorkerWithDpRank) {
        self.next.remove(&worker);
    }

    /// Forgets every rank of a worker.
    pub fn forget_worker(&mut self, worker_id: u64) {
        self.next.retain(|w, _| w.worker_id != worker_id);
    }
}
