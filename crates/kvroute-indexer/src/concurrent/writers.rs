//! A thread per shard, applying events in the background.

// Plain std atomics and channels even under loom: the writers are threads of their own, which
// the loom models do not run.
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, mpsc};
use std::thread::JoinHandle;

use kvroute_protocols::WorkerId;
use kvroute_protocols::kv_events::RouterEvent;

use super::{ConcurrentIndex, MAX_BATCH, Op};

/// What a writer thread is handed.
enum Msg {
    Op(Op),
    /// Answered once every change sent before it is applied.
    Flush(mpsc::SyncSender<()>),
}

/// One writer thread per shard of a [`ConcurrentIndex`]: [`IndexWriters::send`] hands an event
/// to its shard's thread and returns at once, so a single source of events (a router's event
/// subscription) keeps every shard's core busy, as the reference's thread-pool indexer does.
///
/// Events of one worker are applied in the order they were sent. Mixing `send` with
/// [`ConcurrentIndex::submit`] for the same worker leaves their relative order open; use one
/// path per worker. Dropping the writers applies what was sent, then stops the threads.
#[derive(Debug)]
pub struct IndexWriters {
    index: Arc<ConcurrentIndex>,
    senders: Vec<mpsc::Sender<Msg>>,
    threads: Vec<JoinHandle<()>>,
    queued: Arc<AtomicUsize>,
}

impl IndexWriters {
    /// Starts one writer thread per shard of `index` (named `kv-index-writer-N`).
    ///
    /// # Errors
    ///
    /// When the operating system refuses a thread; the threads already started are stopped.
    pub fn spawn(index: Arc<ConcurrentIndex>) -> std::io::Result<Self> {
        let queued = Arc::new(AtomicUsize::new(0));
        let mut writers = Self {
            index: Arc::clone(&index),
            senders: Vec::with_capacity(index.shards()),
            threads: Vec::with_capacity(index.shards()),
            queued: Arc::clone(&queued),
        };
        for shard in 0..index.shards() {
            let (tx, rx) = mpsc::channel();
            let (index, queued) = (Arc::clone(&index), Arc::clone(&queued));
            let thread = std::thread::Builder::new()
                .name(format!("kv-index-writer-{shard}"))
                .spawn(move || run(&index, shard, &rx, &queued))?;
            writers.senders.push(tx);
            writers.threads.push(thread);
        }
        Ok(writers)
    }

    /// The index the writers apply to.
    pub fn index(&self) -> &Arc<ConcurrentIndex> {
        &self.index
    }

    /// Hands `event` to its shard's writer; returns without waiting for it to be applied.
    ///
    /// The queues are unbounded, as the engines' event streams cannot be slowed down without
    /// losing events: a source that outruns the writers grows them, which [`Self::queued`]
    /// shows (export it as a gauge).
    pub fn send(&self, event: RouterEvent) {
        self.send_op(Op::Event(event));
    }

    /// Hands the removal of every rank of `worker_id` to its shard's writer, ordered with the
    /// worker's events sent around it.
    pub fn remove_worker(&self, worker_id: WorkerId) {
        self.send_op(Op::RemoveWorker(worker_id));
    }

    fn send_op(&self, op: Op) {
        let shard = self.index.shard_of(op.worker_id());
        self.queued.fetch_add(1, Ordering::Relaxed);
        if let Err(mpsc::SendError(Msg::Op(op))) = self.senders[shard].send(Msg::Op(op)) {
            // The writer is gone (it can only have panicked): apply here rather than lose it.
            self.queued.fetch_sub(1, Ordering::Relaxed);
            self.index.submit_op(op);
        }
    }

    /// Changes sent and not yet applied, over all shards (a gauge for back-pressure).
    pub fn queued(&self) -> usize {
        self.queued.load(Ordering::Relaxed)
    }

    /// Returns once every change sent before this call is applied and visible to queries.
    pub fn flush(&self) {
        let acks: Vec<_> = self
            .senders
            .iter()
            .filter_map(|tx| {
                let (ack, done) = mpsc::sync_channel(1);
                tx.send(Msg::Flush(ack)).ok().map(|()| done)
            })
            .collect();
        for done in acks {
            // An error means the writer is gone; what it had not applied was lost with it.
            let _ = done.recv();
        }
    }
}

impl Drop for IndexWriters {
    fn drop(&mut self) {
        // Closing the channels ends each writer once it has applied what was sent.
        self.senders.clear();
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

/// A writer thread: applies its shard's changes in batches of up to [`MAX_BATCH`] until every
/// sender is gone.
fn run(index: &ConcurrentIndex, shard: usize, rx: &mpsc::Receiver<Msg>, queued: &AtomicUsize) {
    let mut ops = Vec::with_capacity(MAX_BATCH);
    let mut acks = Vec::new();
    while let Ok(first) = rx.recv() {
        let mut next = Some(first);
        while let Some(msg) = next {
            match msg {
                Msg::Op(op) => ops.push(op),
                Msg::Flush(ack) => acks.push(ack),
            }
            if ops.len() >= MAX_BATCH {
                break;
            }
            next = rx.try_recv().ok();
        }
        let n = ops.len();
        index.apply(&index.shards[shard].index, ops.drain(..));
        queued.fetch_sub(n, Ordering::Relaxed);
        for ack in acks.drain(..) {
            let _ = ack.send(());
        }
    }
}
