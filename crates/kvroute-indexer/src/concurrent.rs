//! Querying from many threads while events arrive.
//!
//! Queries share a read lock on one [`KvIndex`]. Events never wait for the index: a submitter
//! queues its event and, if no other thread is applying, becomes the applier and drains the queue
//! under the write lock (flat combining), letting go of it after every few hundred blocks, so a
//! query waits for at most one such piece however large the events, and a burst of events from
//! many threads costs one lock handoff per piece instead of one per event.

use std::collections::VecDeque;

use kvroute_protocols::kv_events::{KvCacheEventData, LocalBlockHash, RouterEvent};
use kvroute_protocols::{WorkerId, WorkerWithDpRank};

use crate::gap::EventGap;
use crate::index::KvIndex;
use crate::scores::OverlapScores;
use crate::sync::{AtomicBool, Mutex, Ordering, RwLock, RwLockWriteGuard, lock};

#[cfg(all(test, loom))]
mod loom_tests;

/// Events taken from the queue at a time.
const MAX_BATCH: usize = 64;

/// Blocks stored or removed per write-lock hold: bounds how long a query can wait.
const MAX_BLOCKS_PER_HOLD: usize = 256;

/// One queued change to the index.
#[derive(Debug)]
enum Op {
    Event(RouterEvent),
    RemoveWorker(WorkerId),
}

/// A [`KvIndex`] shared by query threads and event submitters.
#[derive(Debug)]
pub struct ConcurrentIndex {
    index: RwLock<KvIndex>,
    ops: Combiner<Op>,
    gaps: Mutex<Vec<EventGap>>,
}

impl ConcurrentIndex {
    /// An empty shared index.
    pub fn new() -> Self {
        Self::from_index(KvIndex::new())
    }

    /// Shares an existing index (for instance one rebuilt from a dump).
    pub fn from_index(index: KvIndex) -> Self {
        Self {
            index: RwLock::new(index),
            ops: Combiner::new(),
            gaps: Mutex::new(Vec::new()),
        }
    }

    /// Queues an event; it is applied before this returns unless another thread is applying,
    /// in which case that thread applies it.
    pub fn submit(&self, event: RouterEvent) {
        self.ops.push(Op::Event(event));
        self.drain();
    }

    /// Queues the removal of every rank of a worker, ordered with the events around it.
    pub fn remove_worker(&self, worker_id: WorkerId) {
        self.ops.push(Op::RemoveWorker(worker_id));
        self.drain();
    }

    /// Overlap of `local` with what every worker holds (see [`KvIndex::find_matches`]).
    pub fn find_matches(&self, local: &[LocalBlockHash]) -> OverlapScores {
        self.read(|index| index.find_matches(local))
    }

    /// Runs `f` with shared access to the index.
    pub fn read<R>(&self, f: impl FnOnce(&KvIndex) -> R) -> R {
        let guard = self.index.read().unwrap_or_else(|e| e.into_inner());
        f(&guard)
    }

    /// Event-id gaps detected since the last call, for the caller to recover.
    pub fn take_gaps(&self) -> Vec<EventGap> {
        std::mem::take(&mut *lock(&self.gaps))
    }

    fn drain(&self) {
        self.ops.drain(|batch| {
            let mut gaps = Vec::new();
            let mut held = HeldWrite {
                lock: &self.index,
                guard: None,
                budget: 0,
            };
            for op in batch {
                match op {
                    Op::Event(event) => apply_in_pieces(&mut held, &event, &mut gaps),
                    Op::RemoveWorker(worker_id) => held.get(1).remove_worker(worker_id),
                }
            }
            drop(held);
            if !gaps.is_empty() {
                lock(&self.gaps).extend(gaps);
            }
        });
    }
}

impl Default for ConcurrentIndex {
    fn default() -> Self {
        Self::new()
    }
}

/// The write lock, re-taken whenever a block budget runs out so queries can slip in between.
struct HeldWrite<'a> {
    lock: &'a RwLock<KvIndex>,
    guard: Option<RwLockWriteGuard<'a, KvIndex>>,
    budget: usize,
}

impl HeldWrite<'_> {
    /// The index, for work on `blocks` blocks; lets readers in first if the budget is spent.
    fn get(&mut self, blocks: usize) -> &mut KvIndex {
        if self.budget < blocks {
            self.guard = None;
            self.budget = MAX_BLOCKS_PER_HOLD;
        }
        self.budget = self.budget.saturating_sub(blocks);
        self.guard
            .get_or_insert_with(|| self.lock.write().unwrap_or_else(|e| e.into_inner()))
    }
}

/// Applies one event, splitting long chains and removals into pieces of at most
/// [`MAX_BLOCKS_PER_HOLD`] blocks so a query waits for one piece, never a whole huge event.
/// Between pieces a reader sees a prefix of the chain stored, a state the engine could have
/// reported with two events.
fn apply_in_pieces(held: &mut HeldWrite<'_>, event: &RouterEvent, gaps: &mut Vec<EventGap>) {
    let worker = WorkerWithDpRank::new(event.worker_id, event.event.dp_rank);
    let tier = event.storage_tier;
    let index = held.get(1);
    if let Some(gap) = index.track_event_id(worker, event.event.event_id) {
        gaps.push(gap);
    }
    // Errors are counted by the index; the caller reads them from its counters.
    match &event.event.data {
        KvCacheEventData::Stored(data) => {
            let Ok(mut prev) = index.resolve_parent(worker, tier, data.parent_hash) else {
                return;
            };
            let mut to_come = data.blocks.len();
            for piece in data.blocks.chunks(MAX_BLOCKS_PER_HOLD) {
                prev = held
                    .get(piece.len())
                    .store_chain(worker, tier, prev, piece, to_come)
                    .0;
                to_come -= piece.len();
            }
        }
        KvCacheEventData::Removed(data) => {
            for piece in data.block_hashes.chunks(MAX_BLOCKS_PER_HOLD) {
                let _ = held.get(piece.len()).remove_blocks(worker, tier, piece);
            }
        }
        KvCacheEventData::Cleared => index.clear(worker, tier),
    }
}

/// A queue whose items are applied by whichever pusher finds nobody else applying.
#[derive(Debug)]
pub(crate) struct Combiner<T> {
    pending: Mutex<VecDeque<T>>,
    applying: AtomicBool,
}

impl<T> Combiner<T> {
    /// An empty queue with nobody applying.
    pub(crate) fn new() -> Self {
        Self {
            pending: Mutex::new(VecDeque::new()),
            applying: AtomicBool::new(false),
        }
    }

    /// Queues one item (applied by the next `drain`).
    pub(crate) fn push(&self, item: T) {
        lock(&self.pending).push_back(item);
    }

    /// Applies queued items in batches of at most [`MAX_BATCH`] unless another thread already
    /// is; every item queued before this call is applied by the time some drain returns.
    pub(crate) fn drain(&self, mut apply: impl FnMut(std::vec::Drain<'_, T>)) {
        let mut batch = Vec::new();
        loop {
            if self
                .applying
                .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
                .is_err()
            {
                // The applier will see our item: it re-checks the queue after letting go.
                return;
            }
            loop {
                {
                    let mut pending = lock(&self.pending);
                    let n = pending.len().min(MAX_BATCH);
                    batch.extend(pending.drain(..n));
                }
                if batch.is_empty() {
                    break;
                }
                apply(batch.drain(..));
            }
            self.applying.store(false, Ordering::Release);
            // An item pushed after our last look, whose pusher saw us applying, would otherwise
            // be stranded until the next submit.
            if lock(&self.pending).is_empty() {
                return;
            }
        }
    }

    /// Items queued and not yet applied.
    #[cfg(loom)]
    pub(crate) fn pending(&self) -> usize {
        lock(&self.pending).len()
    }
}
