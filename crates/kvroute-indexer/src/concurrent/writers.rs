//! Writer threads applying events in the background, shared by every shard.

// Plain std atomics and threads even under loom: the writers are threads of their own, which
// the loom models do not run (the queues they take from are modelled, see `loom_tests`).
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::{JoinHandle, Thread};
use std::time::Duration;

use kvroute_protocols::WorkerId;
use kvroute_protocols::kv_events::RouterEvent;

use super::{ConcurrentIndex, Drained, Op, Shard};

/// Writer threads for the shards of a [`ConcurrentIndex`]: [`IndexWriters::send`] queues an
/// event on its shard and returns at once, so a single source of events (a router's event
/// subscription) keeps every core busy, as the reference's thread-pool indexer does.
///
/// Each thread owns some shards and applies one batch of events from each of its own in turn, so
/// a shard's tables stay in one core's cache. A thread with nothing of its own queued takes over
/// a loaded shard whose owner is applying another one (or asleep), so the load evens out between
/// the threads however unevenly the workers split between shards. With more shards than threads
/// (say two a thread), a shard holding a few busy workers no longer bounds the rest; every shard
/// costs every query a walk, though (see [`ConcurrentIndex::with_shards`]).
///
/// Events of one worker are applied in the order they were sent, also when mixed with
/// [`ConcurrentIndex::submit`] for the same worker (both queue on the worker's shard). Dropping
/// the writers applies what was sent, then stops the threads.
#[derive(Debug)]
pub struct IndexWriters {
    pool: Arc<Pool>,
    threads: Vec<JoinHandle<()>>,
}

/// What the writer threads and the senders share.
#[derive(Debug)]
struct Pool {
    index: Arc<ConcurrentIndex>,
    /// Each shard's writer: the one that applies it, until another writer with nothing of its
    /// own to do takes it over (so a shard stays on one core, in its cache, while the load
    /// allows).
    owner: Box<[AtomicUsize]>,
    /// Each writer's thread (to wake it), whether it is asleep or about to be, and the shard it
    /// is applying ([`NOT_APPLYING`] if none).
    writers: Mutex<Vec<Thread>>,
    parked: Box<[AtomicBool]>,
    applying: Box<[AtomicUsize]>,
    /// Writers that have stopped.
    gone: Box<[AtomicBool]>,
    /// Shards taken over from another writer.
    steals: AtomicUsize,
    /// Flushes waiting (changes under `gate`).
    flushers: AtomicUsize,
    /// Writer threads still running (a writer that panicked no longer applies anything).
    alive: AtomicUsize,
    stop: AtomicBool,
    gate: Mutex<()>,
    /// Wakes a flush: a batch was applied.
    progress: Condvar,
}

/// What a writer's `applying` says when it applies no shard.
const NOT_APPLYING: usize = usize::MAX;

/// Longest a flush sleeps between looks at the shards (events applied by submitters, rather
/// than the writers, do not wake it).
const FLUSH_RECHECK: Duration = Duration::from_millis(1);

impl IndexWriters {
    /// Starts one writer thread per shard of `index`, no more than the cores the process may
    /// use (named `kv-index-writer-N`).
    ///
    /// # Errors
    ///
    /// When the operating system refuses a thread; the threads already started are stopped.
    pub fn spawn(index: Arc<ConcurrentIndex>) -> std::io::Result<Self> {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let threads = index.shards().min(cores);
        Self::with_threads(index, threads)
    }

    /// Starts `threads` writer threads (at least one) for the shards of `index`.
    ///
    /// # Errors
    ///
    /// When the operating system refuses a thread; the threads already started are stopped.
    pub fn with_threads(index: Arc<ConcurrentIndex>, threads: usize) -> std::io::Result<Self> {
        let threads = threads.max(1);
        let shards = index.shards();
        let pool = Arc::new(Pool {
            owner: (0..shards).map(|s| AtomicUsize::new(s % threads)).collect(),
            writers: Mutex::new(Vec::with_capacity(threads)),
            parked: (0..threads).map(|_| AtomicBool::new(false)).collect(),
            gone: (0..threads).map(|_| AtomicBool::new(false)).collect(),
            applying: (0..threads)
                .map(|_| AtomicUsize::new(NOT_APPLYING))
                .collect(),
            index,
            steals: AtomicUsize::new(0),
            flushers: AtomicUsize::new(0),
            alive: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
            gate: Mutex::new(()),
            progress: Condvar::new(),
        });
        let mut writers = Self {
            pool: Arc::clone(&pool),
            threads: Vec::with_capacity(threads),
        };
        // The threads wait for the whole list of threads (to wake each other) before starting.
        let mut list = pool.threads();
        for n in 0..threads {
            let pool = Arc::clone(&pool);
            pool.alive.fetch_add(1, Ordering::SeqCst);
            let started = std::thread::Builder::new()
                .name(format!("kv-index-writer-{n}"))
                .spawn(move || pool.run(n));
            match started {
                Ok(thread) => {
                    list.push(thread.thread().clone());
                    writers.threads.push(thread);
                }
                Err(e) => {
                    writers.pool.alive.fetch_sub(1, Ordering::SeqCst);
                    drop(list);
                    return Err(e);
                }
            }
        }
        drop(list);
        Ok(writers)
    }

    /// The index the writers apply to.
    pub fn index(&self) -> &Arc<ConcurrentIndex> {
        &self.pool.index
    }

    /// Writer threads started.
    pub fn threads(&self) -> usize {
        self.threads.len()
    }

    /// Queues `event` on its shard for the writers; returns without waiting for it to be
    /// applied.
    ///
    /// The queues are unbounded, as the engines' event streams cannot be slowed down without
    /// losing events: a source that outruns the writers grows them, which [`Self::queued`]
    /// shows (export it as a gauge).
    pub fn send(&self, event: RouterEvent) {
        self.send_op(Op::Event(event));
    }

    /// Queues the removal of every rank of `worker_id`, ordered with the worker's events sent
    /// around it.
    pub fn remove_worker(&self, worker_id: WorkerId) {
        self.send_op(Op::RemoveWorker(worker_id));
    }

    fn send_op(&self, op: Op) {
        let pool = &*self.pool;
        let shard = pool.index.shard_of(op.worker_id());
        pool.index.shards[shard].ops.push(op);
        if pool.alive.load(Ordering::SeqCst) == 0 {
            // Every writer is gone (one can only have panicked): apply here rather than lose it.
            pool.index.drain(shard);
            return;
        }
        // A writer going to sleep says so before its last look at the queues, so either it sees
        // this change or this sees it asleep (see `Pool::sleep`).
        let owner = pool.owner[shard].load(Ordering::Relaxed);
        if pool.parked[owner].load(Ordering::SeqCst) {
            pool.wake(owner);
        }
    }

    /// Changes queued and not yet applied, over all shards (a gauge for back-pressure): those
    /// sent, and those submitted or queued on the index directly.
    pub fn queued(&self) -> usize {
        // Counted from each queue's own totals, so it stays exact whichever thread applies a
        // change (a submitter may apply sent ones, a writer submitted ones). `applied` is read
        // first: it never passes what was pushed by then.
        self.pool
            .index
            .shards
            .iter()
            .map(|s| {
                let applied = s.ops.applied();
                s.ops.pushed().saturating_sub(applied) as usize
            })
            .sum()
    }

    /// How many times a writer with nothing of its own queued took over a shard from a writer
    /// busy with another one (a counter: steady growth says the workers split unevenly between
    /// the shards, or there are too few shards for the threads).
    pub fn steals(&self) -> usize {
        self.pool.steals.load(Ordering::Relaxed)
    }

    /// Returns once every change queued before this call (sent, submitted to the index, or
    /// queued on it with [`ConcurrentIndex::enqueue_untracked`]) is applied and visible to
    /// queries.
    pub fn flush(&self) {
        let pool = &*self.pool;
        let shards = &pool.index.shards;
        let target: Vec<u64> = shards.iter().map(|s| s.ops.pushed()).collect();
        let done = || {
            shards
                .iter()
                .zip(&target)
                .all(|(s, &t)| s.ops.applied() >= t)
        };
        let mut gate = pool.gate();
        while !done() {
            if pool.alive.load(Ordering::SeqCst) == 0 {
                // No writer left to apply it (one can only have panicked): apply here.
                drop(gate);
                pool.index.apply_queued();
                gate = pool.gate();
                continue;
            }
            // Changes queued on the index directly (`ConcurrentIndex::enqueue_untracked`) wake
            // no writer: wake the owner of each shard still behind.
            for (s, (shard, &t)) in shards.iter().zip(&target).enumerate() {
                if shard.ops.applied() < t {
                    let owner = pool.owner[s].load(Ordering::Relaxed);
                    if pool.parked[owner].load(Ordering::SeqCst) {
                        pool.wake(owner);
                    }
                }
            }
            pool.flushers.fetch_add(1, Ordering::SeqCst);
            gate = pool
                .progress
                .wait_timeout(gate, FLUSH_RECHECK)
                .unwrap_or_else(|e| e.into_inner())
                .0;
            pool.flushers.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

impl Drop for IndexWriters {
    fn drop(&mut self) {
        // Each writer stops once nothing is queued: what was sent is applied first.
        self.pool.stop.store(true, Ordering::SeqCst);
        for n in 0..self.threads.len() {
            self.pool.wake(n);
        }
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

impl Pool {
    fn gate(&self) -> MutexGuard<'_, ()> {
        self.gate.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn threads(&self) -> MutexGuard<'_, Vec<Thread>> {
        self.writers.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Wakes writer `n` (or makes its next sleep return at once).
    fn wake(&self, n: usize) {
        if let Some(thread) = self.threads().get(n) {
            thread.unpark();
        }
    }

    /// A writer thread: applies one batch at a time from each shard it owns, in turn; with
    /// nothing of its own queued, takes over a shard another writer cannot get to (see
    /// [`Self::steal`]); sleeps when there is neither, until told to stop with nothing left.
    fn run(&self, me: usize) {
        /// Counts the thread out however it ends (a panic applying a batch included), leaving
        /// its shards to a writer still running.
        struct Gone<'a>(&'a Pool, usize);
        impl Drop for Gone<'_> {
            fn drop(&mut self) {
                let (pool, me) = (self.0, self.1);
                pool.applying[me].store(NOT_APPLYING, Ordering::SeqCst);
                pool.gone[me].store(true, Ordering::SeqCst);
                pool.alive.fetch_sub(1, Ordering::SeqCst);
                if let Some(heir) = pool.gone.iter().position(|g| !g.load(Ordering::SeqCst)) {
                    for owner in &*pool.owner {
                        let _ =
                            owner.compare_exchange(me, heir, Ordering::SeqCst, Ordering::SeqCst);
                    }
                }
                for n in 0..pool.parked.len() {
                    pool.wake(n);
                }
            }
        }
        // Wait for the list of threads, so this one can wake the others.
        drop(self.threads());
        let _gone = Gone(self, me);
        let mut batch = Vec::new();
        loop {
            let mut applied = false;
            for (s, shard) in self.owned(me) {
                self.applying[me].store(s, Ordering::Relaxed);
                let drained = shard.ops.drain_once(&mut batch, |ops| {
                    self.index.apply(&shard.index, ops);
                });
                self.applying[me].store(NOT_APPLYING, Ordering::Relaxed);
                if drained == Drained::Applied {
                    applied = true;
                    self.after_batch(me);
                }
            }
            if applied || self.steal(me) {
                continue;
            }
            if !self.sleep(me) {
                return;
            }
        }
    }

    /// After a batch of writer `me`: wakes a flush waiting for it, and a sleeping writer if `me`
    /// has more queued than it can apply at once (two of its shards with changes queued).
    fn after_batch(&self, me: usize) {
        if self.flushers.load(Ordering::SeqCst) > 0 {
            let _gate = self.gate();
            self.progress.notify_all();
        }
        let asleep = self.parked.iter().position(|p| p.load(Ordering::Relaxed));
        if let Some(other) = asleep
            && self.loaded_shards(me) > 1
        {
            self.wake(other);
        }
    }

    /// Shards of writer `me` with changes queued.
    fn loaded_shards(&self, me: usize) -> usize {
        self.owned(me).filter(|(_, s)| !s.ops.is_empty()).count()
    }

    /// The shards writer `me` owns now, with their numbers.
    fn owned(&self, me: usize) -> impl Iterator<Item = (usize, &Shard)> {
        self.index
            .shards
            .iter()
            .enumerate()
            .filter(move |&(s, _)| self.owner[s].load(Ordering::Relaxed) == me)
    }

    /// Takes over, for writer `me`, a shard with changes queued that its owner is not getting
    /// to: nobody is applying it, and its owner is applying another shard or asleep (about to
    /// wake up for it) or gone. A shard its owner is between two batches of is left alone, so
    /// shards do not bounce between cores. Says whether it took one.
    fn steal(&self, me: usize) -> bool {
        for (s, shard) in self.index.shards.iter().enumerate() {
            let owner = self.owner[s].load(Ordering::Relaxed);
            if owner == me || shard.ops.is_busy() || shard.ops.is_empty() {
                continue;
            }
            let elsewhere = self.applying[owner].load(Ordering::Relaxed);
            let away = self.parked[owner].load(Ordering::SeqCst)
                || self.gone[owner].load(Ordering::SeqCst);
            if away || (elsewhere != NOT_APPLYING && elsewhere != s) {
                self.owner[s].store(me, Ordering::Relaxed);
                self.steals.fetch_add(1, Ordering::Relaxed);
                return true;
            }
        }
        false
    }

    /// Whether a shard of writer `me` has changes queued that nobody is applying.
    fn own_work(&self, me: usize) -> bool {
        self.owned(me)
            .any(|(_, s)| !s.ops.is_busy() && !s.ops.is_empty())
    }

    /// Sleeps until there may be work; `false` when the writer should stop instead.
    ///
    /// A shard being applied by another thread is not work for this one: every applier looks
    /// at its queue again after letting go (the writers come round again, a submitter's drain
    /// re-checks), so nothing queued there is stranded.
    fn sleep(&self, me: usize) -> bool {
        // Said before the last look: a sender that queues after that look sees it and wakes
        // this writer, whose park then returns at once if it has not begun.
        self.parked[me].store(true, Ordering::SeqCst);
        let go_on = if self.own_work(me) || self.steal(me) {
            true
        } else if self.stop.load(Ordering::SeqCst) {
            // Stopping with nothing left: anything still queued on its shards is being
            // applied by another thread, which finishes it.
            false
        } else {
            std::thread::park();
            true
        };
        self.parked[me].store(false, Ordering::SeqCst);
        go_on
    }
}
