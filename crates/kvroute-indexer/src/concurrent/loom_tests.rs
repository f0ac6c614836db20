//! Loom models of the flat-combining handoff: no queued item may be stranded.
//!
//! Run with `RUSTFLAGS="--cfg loom" cargo test -p kvroute-indexer --release --lib loom`.

use loom::sync::Arc;
use loom::sync::atomic::AtomicUsize;
use loom::thread;

use super::Combiner;
use crate::sync::{AtomicBool, Mutex, Ordering, lock};

/// A submitter thread: pushes `item`, then drains, counting what it applies into `applied`.
fn submitter(
    combiner: &Arc<Combiner<u32>>,
    applied: &Arc<AtomicUsize>,
    item: u32,
) -> thread::JoinHandle<()> {
    let (combiner, applied) = (Arc::clone(combiner), Arc::clone(applied));
    thread::spawn(move || {
        combiner.push(item);
        combiner.drain(|batch| {
            applied.fetch_add(batch.count(), Ordering::Relaxed);
        });
    })
}

/// Two submitters push and drain; once both return, everything pushed has been applied.
#[test]
fn loom_combiner_never_strands_an_item() {
    loom::model(|| {
        let combiner = Arc::new(Combiner::<u32>::new());
        let applied = Arc::new(AtomicUsize::new(0));
        let handles: Vec<_> = (0..2).map(|i| submitter(&combiner, &applied, i)).collect();
        for h in handles {
            h.join().expect("submitter panicked");
        }
        assert_eq!(combiner.pending(), 0);
        assert_eq!(applied.load(Ordering::Relaxed), 2);
    });
}

/// A submitter races an exclusive section: the section sees the pusher's item either applied
/// (queued before it) or not yet, never half; once both return, nothing is stranded.
#[test]
fn loom_exclusive_applies_what_was_queued_first() {
    loom::model(|| {
        let combiner = Arc::new(Combiner::<u32>::new());
        let applied = Arc::new(AtomicUsize::new(0));
        combiner.push(0);
        let submitter = submitter(&combiner, &applied, 1);
        let seen = combiner.exclusive(
            |batch| {
                applied.fetch_add(batch.count(), Ordering::Relaxed);
            },
            || applied.load(Ordering::Relaxed),
        );
        // The item queued before the section is always applied first; the racing one may be.
        assert!(
            seen == 1 || seen == 2,
            "the section ran before queued items: {seen}"
        );
        submitter.join().expect("submitter panicked");
        assert_eq!(combiner.pending(), 0, "an item was stranded");
        assert_eq!(applied.load(Ordering::Relaxed), 2);
    });
}

/// A writer serving the queue a batch at a time (`drain_once`, as `IndexWriters` do) races a
/// submitter: the writer goes on until it finds the queue idle or busy (the busy applier looks
/// again after letting go); once both return, nothing is stranded.
#[test]
fn loom_batch_at_a_time_writer_never_strands_an_item() {
    use super::Drained;
    loom::model(|| {
        let combiner = Arc::new(Combiner::<u32>::new());
        let applied = Arc::new(AtomicUsize::new(0));
        combiner.push(0);
        let submitter = submitter(&combiner, &applied, 1);
        let mut batch = Vec::new();
        while combiner.drain_once(&mut batch, |b| {
            applied.fetch_add(b.count(), Ordering::Relaxed);
        }) == Drained::Applied
        {}
        submitter.join().expect("submitter panicked");
        assert_eq!(combiner.pending(), 0, "an item was stranded");
        assert_eq!(applied.load(Ordering::Relaxed), 2);
        assert_eq!(combiner.applied(), 2);
        assert_eq!(combiner.pushed(), 2);
    });
}

/// The same handoff without the re-check after letting go of the applier flag: loom must find
/// the interleaving that strands an item (negative control for the model above).
#[test]
#[should_panic(expected = "an item was stranded")]
fn loom_combiner_without_recheck_strands_an_item() {
    struct Broken {
        pending: Mutex<Vec<u32>>,
        applying: AtomicBool,
    }
    impl Broken {
        fn drain(&self, applied: &AtomicUsize) {
            if self
                .applying
                .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
                .is_err()
            {
                return;
            }
            loop {
                let batch: Vec<u32> = lock(&self.pending).drain(..).collect();
                if batch.is_empty() {
                    break;
                }
                applied.fetch_add(batch.len(), Ordering::Relaxed);
            }
            self.applying.store(false, Ordering::Release);
        }
    }
    loom::model(|| {
        let broken = Arc::new(Broken {
            pending: Mutex::new(Vec::new()),
            applying: AtomicBool::new(false),
        });
        let applied = Arc::new(AtomicUsize::new(0));
        let handles: Vec<_> = (0..2)
            .map(|i| {
                let broken = Arc::clone(&broken);
                let applied = Arc::clone(&applied);
                thread::spawn(move || {
                    lock(&broken.pending).push(i);
                    broken.drain(&applied);
                })
            })
            .collect();
        for h in handles {
            h.join().expect("submitter panicked");
        }
        assert_eq!(applied.load(Ordering::Relaxed), 2, "an item was stranded");
    });
}

/// A query racing a submit sees the index either before or after the event, never torn, and the
/// event is applied once the submitter returns.
#[test]
fn loom_query_races_submit() {
    use kvroute_protocols::kv_events::{
        ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheStoreData,
        KvCacheStoredBlockData, LocalBlockHash, RouterEvent, StorageTier,
    };
    loom::model(|| {
        let shared = Arc::new(super::ConcurrentIndex::new());
        let q = [LocalBlockHash(1), LocalBlockHash(2)];
        let writer = {
            let shared = Arc::clone(&shared);
            thread::spawn(move || {
                shared.submit(RouterEvent {
                    worker_id: 1,
                    storage_tier: StorageTier::Device,
                    event: KvCacheEvent {
                        event_id: 0,
                        data: KvCacheEventData::Stored(KvCacheStoreData {
                            parent_hash: None,
                            blocks: (1..=2)
                                .map(|b| KvCacheStoredBlockData {
                                    block_hash: ExternalSequenceBlockHash(b),
                                    tokens_hash: LocalBlockHash(b),
                                })
                                .collect(),
                        }),
                        dp_rank: 0,
                    },
                });
            })
        };
        let seen = shared.find_matches(&q).max_score();
        assert!(seen == 0 || seen == 2, "torn read: {seen}");
        writer.join().expect("writer panicked");
        assert_eq!(shared.find_matches(&q).max_score(), 2);
    });
}
