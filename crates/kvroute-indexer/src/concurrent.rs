//! Querying from many threads while events arrive, and applying events on several at once.
//!
//! Queries share a read lock on each [`KvIndex`] shard. Events never wait for the index: a
//! submitter queues its event and, if no other thread is applying to that shard, becomes the
//! applier and drains the shard's queue under its write lock (flat combining), letting go of it
//! after every few hundred blocks, so a query waits for at most one such piece however large the
//! events, and a burst of events from many threads costs one lock handoff per piece instead of
//! one per event.
//!
//! With more than one shard ([`ConcurrentIndex::with_shards`]) workers are split between shards
//! by id, each shard a whole index of its workers behind its own lock, so events of workers in
//! different shards are applied at the same time (by their submitters, or by [`IndexWriters`]:
//! background threads, each owning some shards and taking over another's when it has nothing of
//! its own queued). A query walks every shard and gathers one answer: the shards share the
//! request's sequence hashes and one answer buffer, but each walks its own copy of a prefix its
//! workers share, so a query costs more than with one shard (see `docs/benchmarks.md`).

use std::collections::VecDeque;
use std::sync::Arc;

use kvroute_protocols::kv_events::{KvCacheEventData, LocalBlockHash, RouterEvent, StorageTier};
use kvroute_protocols::{WorkerId, WorkerWithDpRank};

use crate::error::ErrorCounts;
use crate::gap::EventGap;
use crate::index::{Gathered, KvIndex, MemoryStats};
use crate::scores::OverlapScores;
use crate::sync::{
    AtomicBool, AtomicU64, Mutex, Ordering, RwLock, RwLockWriteGuard, lock, yield_now,
};

#[cfg(all(test, loom))]
mod loom_tests;
mod writers;

pub use writers::IndexWriters;

/// Events taken from the queue at a time.
const MAX_BATCH: usize = 64;

/// Blocks stored or removed per write-lock hold: bounds how long a query can wait.
const MAX_BLOCKS_PER_HOLD: usize = 256;

/// Most shards a [`ConcurrentIndex`] splits its workers into.
pub const MAX_SHARDS: usize = 64;

/// One queued change to the index.
#[derive(Debug)]
enum Op {
    Event(RouterEvent),
    /// An event applied without looking at its id (the caller tracks ids itself).
    Untracked(RouterEvent),
    RemoveWorker(WorkerId),
}

impl Op {
    /// The worker the change is about, which picks its shard.
    fn worker_id(&self) -> WorkerId {
        match self {
            Op::Event(event) | Op::Untracked(event) => event.worker_id,
            Op::RemoveWorker(worker_id) => *worker_id,
        }
    }
}

/// One index of some workers, with its queue of changes.
#[derive(Debug)]
struct Shard {
    index: RwLock<KvIndex>,
    ops: Combiner<Op>,
}

impl Shard {
    fn new(index: KvIndex) -> Self {
        Self {
            index: RwLock::new(index),
            ops: Combiner::new(),
        }
    }

    fn read(&self) -> impl std::ops::Deref<Target = KvIndex> + '_ {
        self.index.read().unwrap_or_else(|e| e.into_inner())
    }
}

/// A [`KvIndex`] (or several, one per shard of the workers) shared by query threads and event
/// submitters.
#[derive(Debug)]
pub struct ConcurrentIndex {
    shards: Box<[Shard]>,
    gaps: Mutex<Vec<EventGap>>,
}

impl ConcurrentIndex {
    /// An empty shared index of one shard: the fastest queries; events are applied one at a
    /// time.
    pub fn new() -> Self {
        Self::from_index(KvIndex::new())
    }

    /// An empty shared index whose workers are split between `shards` indexes (clamped to
    /// `1..=`[`MAX_SHARDS`]), so that events of workers in different shards can be applied at
    /// the same time. Every query walks every shard; use as many shards as cores that apply
    /// events, or up to twice that when the workers' loads are very uneven (the writers even
    /// out the load between shards, see [`IndexWriters`]), no more.
    pub fn with_shards(shards: usize) -> Self {
        let n = shards.clamp(1, MAX_SHARDS);
        Self {
            shards: (0..n).map(|_| Shard::new(KvIndex::new())).collect(),
            gaps: Mutex::new(Vec::new()),
        }
    }

    /// Shares an existing index (for instance one rebuilt from a dump), as one shard.
    pub fn from_index(index: KvIndex) -> Self {
        Self {
            shards: Box::new([Shard::new(index)]),
            gaps: Mutex::new(Vec::new()),
        }
    }

    /// How many shards the workers are split between.
    pub fn shards(&self) -> usize {
        self.shards.len()
    }

    /// The shard that holds every rank of `worker_id`.
    pub fn shard_of(&self, worker_id: WorkerId) -> usize {
        (worker_id % self.shards.len() as u64) as usize
    }

    /// Queues an event; it is applied before this returns unless another thread is applying to
    /// the event's shard, in which case that thread applies it.
    pub fn submit(&self, event: RouterEvent) {
        self.submit_op(Op::Event(event));
    }

    /// Queues the removal of every rank of a worker, ordered with the events around it.
    pub fn remove_worker(&self, worker_id: WorkerId) {
        self.submit_op(Op::RemoveWorker(worker_id));
    }

    fn submit_op(&self, op: Op) {
        let shard = self.shard_of(op.worker_id());
        self.shards[shard].ops.push(op);
        self.drain(shard);
    }

    /// Queues an event without applying it, nor looking at its id (the caller tracks ids, as
    /// [`KvIndex::apply_event_untracked`]): [`Self::apply_queued`], the next submit to its shard
    /// or [`Self::with_shard_mut`] applies it, in queue order; so do [`IndexWriters`] running on
    /// this index, once a send to the shard or [`IndexWriters::flush`] wakes them. A caller that
    /// orders events under a lock of its own (a router's state lock) queues them there and
    /// applies them after letting go of it, so that lock is never held while the index is
    /// written.
    pub fn enqueue_untracked(&self, event: RouterEvent) {
        let shard = self.shard_of(event.worker_id);
        self.shards[shard].ops.push(Op::Untracked(event));
    }

    /// Applies what is queued on every shard, except on a shard another thread is applying to
    /// (that thread applies it before it lets go).
    pub fn apply_queued(&self) {
        for shard in 0..self.shards.len() {
            self.drain(shard);
        }
    }

    /// Runs `f` with exclusive access to the index of shard `shard` (below [`Self::shards`]),
    /// once every change queued for it has been applied, waiting for a thread applying them to
    /// finish; changes queued meanwhile are applied after `f`. For changes that are not events
    /// (a restore, a worker's removal in order with its queued events) and for consistent
    /// reads (a snapshot that must hold every event queued before it).
    ///
    /// # Panics
    ///
    /// If there is no such shard.
    pub fn with_shard_mut<R>(&self, shard: usize, f: impl FnOnce(&mut KvIndex) -> R) -> R {
        let s = &self.shards[shard];
        s.ops.exclusive(
            |batch| self.apply(&s.index, batch),
            || f(&mut s.index.write().unwrap_or_else(|e| e.into_inner())),
        )
    }

    /// Overlap of `local` with what every worker holds (see [`KvIndex::find_matches`]).
    pub fn find_matches(&self, local: &[LocalBlockHash]) -> OverlapScores {
        let mut chain = Vec::new();
        if let [shard] = &*self.shards {
            return shard.read().find_matches_with(local, &mut chain);
        }
        // One answer buffer and one cache of the request's sequence hashes for every shard.
        let mut out = Gathered::default();
        for shard in &*self.shards {
            shard.read().gather(local, &mut chain, &mut out);
        }
        out.finish()
    }

    /// Applies every change queued so far and holds every shard at that point: changes queued
    /// while the returned [`Frozen`] lives wait in their queues (a submit or
    /// [`Self::apply_queued`] leaves them there and returns), and are applied when it is
    /// dropped. Queries go on meanwhile. For a consistent read that takes long (a snapshot's
    /// dump) without holding the lock that orders the events: freeze under that lock, let go of
    /// it, then read.
    ///
    /// While it lives, a [`Self::with_shard_mut`] (or a writer's flush) waits for it: do not
    /// call one on the thread holding it.
    pub fn freeze(self: &Arc<Self>) -> Frozen {
        for shard in &*self.shards {
            shard
                .ops
                .begin_exclusive(&mut |batch| self.apply(&shard.index, batch));
        }
        Frozen {
            index: Arc::clone(self),
        }
    }

    /// Runs `f` with shared access to the index of shard `shard` (below [`Self::shards`]).
    ///
    /// # Panics
    ///
    /// If there is no such shard.
    pub fn read_shard<R>(&self, shard: usize, f: impl FnOnce(&KvIndex) -> R) -> R {
        let guard = self.shards[shard].read();
        f(&guard)
    }

    /// Every worker rank with the blocks it holds in device memory, appended to `out` (see
    /// [`KvIndex::block_counts`]; a rank is on one shard).
    pub fn device_block_counts(&self, out: &mut Vec<(WorkerWithDpRank, u64)>) {
        for shard in &*self.shards {
            shard.read().block_counts(StorageTier::Device, out);
        }
    }

    /// Size of the index, summed over its shards (a prefix that workers of two shards hold is
    /// stored, and counted, in both).
    pub fn memory(&self) -> MemoryStats {
        let mut total = MemoryStats::default();
        for shard in &*self.shards {
            let m = shard.read().memory();
            total.live_nodes += m.live_nodes;
            total.indexed_blocks += m.indexed_blocks;
            total.workers += m.workers;
            total.table_bytes += m.table_bytes;
        }
        total
    }

    /// Bad events seen so far, summed over the shards.
    pub fn error_counts(&self) -> ErrorCounts {
        let mut total = ErrorCounts::default();
        for shard in &*self.shards {
            let e = shard.read().error_counts();
            total.parent_not_found += e.parent_not_found;
            total.block_not_found += e.block_not_found;
            total.duplicate_store += e.duplicate_store;
        }
        total
    }

    /// Event-id gaps detected since the last call, for the caller to recover.
    pub fn take_gaps(&self) -> Vec<EventGap> {
        std::mem::take(&mut *lock(&self.gaps))
    }

    /// Applies the queued changes of `shard` unless another thread already is.
    fn drain(&self, shard: usize) {
        let shard = &self.shards[shard];
        shard.ops.drain(|batch| self.apply(&shard.index, batch));
    }

    /// Applies `ops` to one shard under its write lock, letting readers in between pieces.
    fn apply(&self, index: &RwLock<KvIndex>, ops: impl Iterator<Item = Op>) {
        let mut gaps = Vec::new();
        let mut held = HeldWrite {
            lock: index,
            guard: None,
            budget: 0,
        };
        for op in ops {
            match op {
                Op::Event(event) => apply_in_pieces(&mut held, &event, Some(&mut gaps)),
                Op::Untracked(event) => apply_in_pieces(&mut held, &event, None),
                Op::RemoveWorker(worker_id) => held.get(1).remove_worker(worker_id),
            }
        }
        drop(held);
        if !gaps.is_empty() {
            lock(&self.gaps).extend(gaps);
        }
    }
}

impl Default for ConcurrentIndex {
    fn default() -> Self {
        Self::new()
    }
}

/// Every shard of a [`ConcurrentIndex`] held at one point of its queues (see
/// [`ConcurrentIndex::freeze`]); dropping it applies what was queued meanwhile.
#[derive(Debug)]
#[must_use = "the index is held only while this lives"]
pub struct Frozen {
    index: Arc<ConcurrentIndex>,
}

impl Frozen {
    /// Runs `f` on shard `shard` as of the freeze, with queries going on alongside.
    ///
    /// # Panics
    ///
    /// If there is no such shard.
    pub fn read_shard<R>(&self, shard: usize, f: impl FnOnce(&KvIndex) -> R) -> R {
        self.index.read_shard(shard, f)
    }

    /// How many shards the index has.
    pub fn shards(&self) -> usize {
        self.index.shards()
    }
}

impl Drop for Frozen {
    fn drop(&mut self) {
        let index = &*self.index;
        for shard in &*index.shards {
            shard
                .ops
                .end_exclusive(|batch| index.apply(&shard.index, batch));
        }
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
/// With `gaps`, the event's id is tracked and gaps before it are pushed there.
fn apply_in_pieces(
    held: &mut HeldWrite<'_>,
    event: &RouterEvent,
    gaps: Option<&mut Vec<EventGap>>,
) {
    let worker = WorkerWithDpRank::new(event.worker_id, event.event.dp_rank);
    let tier = event.storage_tier;
    let index = held.get(1);
    if let Some(gaps) = gaps
        && let Some(gap) = index.track_event_id(worker, event.event.event_id)
    {
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
    pending: Mutex<Queue<T>>,
    applying: AtomicBool,
    /// Items applied so far (a writer's flush waits for it to reach what was pushed).
    applied: AtomicU64,
}

/// The items waiting, and how many were ever pushed.
#[derive(Debug)]
struct Queue<T> {
    items: VecDeque<T>,
    pushed: u64,
}

/// What [`Combiner::drain_once`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Drained {
    /// Another thread is applying; it looks at the queue again after letting go.
    Busy,
    /// Nothing is queued (looked at after letting go).
    Idle,
    /// A batch was applied; more may be queued.
    Applied,
}

impl<T> Combiner<T> {
    /// An empty queue with nobody applying.
    pub(crate) fn new() -> Self {
        Self {
            pending: Mutex::new(Queue {
                items: VecDeque::new(),
                pushed: 0,
            }),
            applying: AtomicBool::new(false),
            applied: AtomicU64::new(0),
        }
    }

    /// Queues one item (applied by the next `drain`).
    pub(crate) fn push(&self, item: T) {
        let mut queue = lock(&self.pending);
        queue.items.push_back(item);
        queue.pushed += 1;
    }

    /// Items ever pushed.
    pub(crate) fn pushed(&self) -> u64 {
        lock(&self.pending).pushed
    }

    /// Items applied so far: every item pushed before the `pushed()`-th is applied once this
    /// reaches it (items are applied in push order).
    pub(crate) fn applied(&self) -> u64 {
        self.applied.load(Ordering::Acquire)
    }

    /// Whether nothing is queued.
    pub(crate) fn is_empty(&self) -> bool {
        lock(&self.pending).items.is_empty()
    }

    /// Whether a thread is applying.
    pub(crate) fn is_busy(&self) -> bool {
        self.applying.load(Ordering::Acquire)
    }

    /// Applies queued items in batches of at most [`MAX_BATCH`] unless another thread already
    /// is; every item queued before this call is applied by the time some drain returns.
    pub(crate) fn drain(&self, mut apply: impl FnMut(std::vec::Drain<'_, T>)) {
        let mut batch = Vec::new();
        loop {
            if !self.try_begin() {
                // The applier will see our item: it re-checks the queue after letting go.
                return;
            }
            self.apply_pending(&mut batch, &mut apply);
            self.applying.store(false, Ordering::Release);
            // An item pushed after our last look, whose pusher saw us applying, would otherwise
            // be stranded until the next submit.
            if self.is_empty() {
                return;
            }
        }
    }

    /// Applies one batch of at most [`MAX_BATCH`] queued items unless another thread is
    /// applying. Unlike [`Self::drain`] it lets go after one batch, so a thread serving several
    /// queues moves between them; whoever calls it must call it again after
    /// [`Drained::Applied`] until it finds the queue [`Drained::Idle`] or [`Drained::Busy`] (that
    /// applier looks again after letting go), or an item pushed meanwhile by a submitter that
    /// saw it applying is stranded.
    pub(crate) fn drain_once(
        &self,
        batch: &mut Vec<T>,
        mut apply: impl FnMut(std::vec::Drain<'_, T>),
    ) -> Drained {
        /// Lets go even if `apply` panics, so the queue is not wedged for the threads left.
        struct Release<'a>(&'a AtomicBool);
        impl Drop for Release<'_> {
            fn drop(&mut self) {
                self.0.store(false, Ordering::Release);
            }
        }
        loop {
            if !self.try_begin() {
                return Drained::Busy;
            }
            let release = Release(&self.applying);
            if self.take_batch(batch) {
                let n = batch.len() as u64;
                apply(batch.drain(..));
                self.applied.fetch_add(n, Ordering::Release);
                return Drained::Applied;
            }
            drop(release);
            // An item pushed after our look, whose pusher saw us applying, would otherwise be
            // stranded: the caller takes `Idle` as nothing left to do.
            if self.is_empty() {
                return Drained::Idle;
            }
        }
    }

    /// Becomes the applier (waiting for the current one to let go), applies everything queued,
    /// runs `f` while still the applier (so nothing queued meanwhile goes first), then lets go
    /// and applies what was queued meanwhile.
    pub(crate) fn exclusive<R>(
        &self,
        mut apply: impl FnMut(std::vec::Drain<'_, T>),
        f: impl FnOnce() -> R,
    ) -> R {
        self.begin_exclusive(&mut apply);
        let out = f();
        self.end_exclusive(apply);
        out
    }

    /// The first half of [`Self::exclusive`]: becomes the applier (waiting for the current one
    /// to let go) and applies everything queued. Until [`Self::end_exclusive`], items pushed stay
    /// queued.
    pub(crate) fn begin_exclusive(&self, apply: &mut impl FnMut(std::vec::Drain<'_, T>)) {
        while !self.try_begin() {
            yield_now();
        }
        self.apply_pending(&mut Vec::new(), apply);
    }

    /// The second half of [`Self::exclusive`]: lets go, then applies what was queued meanwhile.
    pub(crate) fn end_exclusive(&self, apply: impl FnMut(std::vec::Drain<'_, T>)) {
        self.applying.store(false, Ordering::Release);
        // Items pushed while we held the flag: their pushers saw us applying.
        if !self.is_empty() {
            self.drain(apply);
        }
    }

    /// Becomes the applier if nobody is.
    fn try_begin(&self) -> bool {
        self.applying
            .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
    }

    /// Moves up to [`MAX_BATCH`] queued items into `batch`; whether there were any.
    fn take_batch(&self, batch: &mut Vec<T>) -> bool {
        let mut pending = lock(&self.pending);
        let n = pending.items.len().min(MAX_BATCH);
        batch.extend(pending.items.drain(..n));
        n > 0
    }

    /// As the applier, applies batches of at most [`MAX_BATCH`] until the queue is empty.
    fn apply_pending(&self, batch: &mut Vec<T>, apply: &mut impl FnMut(std::vec::Drain<'_, T>)) {
        while self.take_batch(batch) {
            let n = batch.len() as u64;
            apply(batch.drain(..));
            self.applied.fetch_add(n, Ordering::Release);
        }
    }

    /// Items queued and not yet applied.
    #[cfg(all(test, loom))]
    pub(crate) fn pending(&self) -> usize {
        lock(&self.pending).items.len()
    }
}
