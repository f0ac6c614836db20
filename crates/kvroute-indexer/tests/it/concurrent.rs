//! Many threads submitting and querying end where one thread applying everything ends.

use std::sync::Arc;
use std::thread;

use kvroute_indexer::{ConcurrentIndex, IndexWriters, KvIndex};
use kvroute_protocols::kv_events::{
    ExternalSequenceBlockHash as Ext, KvCacheEvent, KvCacheEventData, KvCacheRemoveData,
    KvCacheStoreData, KvCacheStoredBlockData, LocalBlockHash, RouterEvent, StorageTier,
};

/// Worker `w`'s i-th event: store a 4-block chain, remove its last block every third time.
fn events_of(w: u64) -> Vec<RouterEvent> {
    let mut out = Vec::new();
    for i in 0..200u64 {
        let data = if i % 3 == 2 {
            KvCacheEventData::Removed(KvCacheRemoveData {
                block_hashes: vec![Ext((i - 1) * 4 + 3)],
            })
        } else {
            KvCacheEventData::Stored(KvCacheStoreData {
                parent_hash: None,
                blocks: (0..4)
                    .map(|k| KvCacheStoredBlockData {
                        block_hash: Ext(i * 4 + k),
                        tokens_hash: LocalBlockHash(i % 7 + k),
                    })
                    .collect(),
            })
        };
        out.push(RouterEvent {
            worker_id: w,
            storage_tier: StorageTier::Device,
            event: KvCacheEvent {
                event_id: i,
                data,
                dp_rank: 0,
            },
        });
    }
    out
}

#[test]
fn concurrent_submitters_and_readers_reach_the_sequential_state() {
    let shared = Arc::new(ConcurrentIndex::new());
    let mut handles = Vec::new();
    for w in 0..3u64 {
        let shared = Arc::clone(&shared);
        handles.push(thread::spawn(move || {
            for ev in events_of(w) {
                shared.submit(ev);
            }
        }));
    }
    let reader = {
        let shared = Arc::clone(&shared);
        thread::spawn(move || {
            let q: Vec<LocalBlockHash> = (0..4).map(LocalBlockHash).collect();
            for _ in 0..500 {
                let scores = shared.find_matches(&q);
                assert!(scores.scores.values().all(|&s| s <= 4));
            }
        })
    };
    for h in handles {
        h.join().expect("submitter panicked");
    }
    reader.join().expect("reader panicked");
    let mut sequential = KvIndex::new();
    for w in 0..3u64 {
        for ev in events_of(w) {
            let _ = sequential.apply_event(&ev);
        }
    }
    shared.read_shard(0, |index| {
        assert!(index.same_content(&sequential));
        assert_eq!(index.check_consistency(), Ok(()));
    });
    assert!(shared.take_gaps().is_empty());
}

#[test]
fn long_events_applied_in_pieces_match_whole_application() {
    let store = |w: u64, id: u64, parent: Option<u64>, range: std::ops::Range<u64>| RouterEvent {
        worker_id: w,
        storage_tier: StorageTier::Device,
        event: KvCacheEvent {
            event_id: id,
            data: KvCacheEventData::Stored(KvCacheStoreData {
                parent_hash: parent.map(Ext),
                blocks: range
                    .map(|b| KvCacheStoredBlockData {
                        block_hash: Ext(b),
                        tokens_hash: LocalBlockHash(b % 13),
                    })
                    .collect(),
            }),
            dp_rank: 0,
        },
    };
    let events = vec![
        store(1, 0, None, 0..1000),
        store(1, 1, Some(999), 1000..1600),
        // Duplicates inside a long chain and an unknown parent are counted, not fatal.
        store(1, 2, Some(5), 500..1200),
        store(1, 3, Some(123_456), 2000..2100),
        RouterEvent {
            worker_id: 1,
            storage_tier: StorageTier::Device,
            event: KvCacheEvent {
                event_id: 5,
                data: KvCacheEventData::Removed(KvCacheRemoveData {
                    block_hashes: (300..900).rev().map(Ext).collect(),
                }),
                dp_rank: 0,
            },
        },
    ];
    let shared = ConcurrentIndex::new();
    let mut sequential = KvIndex::new();
    for ev in events {
        let _ = sequential.apply_event(&ev);
        shared.submit(ev);
    }
    shared.read_shard(0, |index| {
        assert!(index.same_content(&sequential));
        assert_eq!(index.error_counts(), sequential.error_counts());
        assert_eq!(index.check_consistency(), Ok(()));
    });
    let gaps = shared.take_gaps();
    assert_eq!(gaps.len(), 1);
    assert_eq!(gaps[0].missing, 4..5);
    let q: Vec<LocalBlockHash> = (0..1600).map(|b| LocalBlockHash(b % 13)).collect();
    assert_eq!(shared.find_matches(&q), sequential.find_matches(&q));
}

/// A sequential index of the events of the workers in `shard` of `shared`.
fn sequential_shard(shared: &ConcurrentIndex, shard: usize, workers: &[u64]) -> KvIndex {
    let mut index = KvIndex::new();
    for &w in workers.iter().filter(|&&w| shared.shard_of(w) == shard) {
        for ev in events_of(w) {
            let _ = index.apply_event(&ev);
        }
    }
    index
}

#[test]
fn shards_applied_by_many_submitters_hold_their_workers_and_answer_as_one_index() {
    let workers = [0u64, 1, 2, 3, 4];
    let shared = Arc::new(ConcurrentIndex::with_shards(2));
    assert_eq!(shared.shards(), 2);
    let handles: Vec<_> = workers
        .iter()
        .map(|&w| {
            let shared = Arc::clone(&shared);
            thread::spawn(move || {
                for ev in events_of(w) {
                    shared.submit(ev);
                }
            })
        })
        .collect();
    for h in handles {
        h.join().expect("submitter panicked");
    }
    let mut whole = KvIndex::new();
    for &w in &workers {
        for ev in events_of(w) {
            let _ = whole.apply_event(&ev);
        }
    }
    for shard in 0..2 {
        let expected = sequential_shard(&shared, shard, &workers);
        shared.read_shard(shard, |index| {
            assert!(index.same_content(&expected), "shard {shard}");
            assert_eq!(index.check_consistency(), Ok(()));
        });
    }
    assert_eq!(
        shared.memory().indexed_blocks,
        whole.memory().indexed_blocks
    );
    assert_eq!(shared.memory().workers, workers.len());
    for start in 0..7u64 {
        let q: Vec<LocalBlockHash> = (start..start + 4).map(LocalBlockHash).collect();
        assert_eq!(
            shared.find_matches(&q),
            whole.find_matches(&q),
            "query {start}"
        );
    }
    assert!(shared.take_gaps().is_empty());
}

#[test]
fn writers_apply_one_source_of_events_in_order_on_a_thread_per_shard() {
    let workers = [10u64, 11, 12, 13];
    let shared = Arc::new(ConcurrentIndex::with_shards(2));
    let writers = IndexWriters::spawn(Arc::clone(&shared)).expect("threads start");
    // Interleave the workers' events, as one subscription delivers them.
    let streams: Vec<Vec<RouterEvent>> = workers.iter().map(|&w| events_of(w)).collect();
    for i in 0..streams[0].len() {
        for stream in &streams {
            writers.send(stream[i].clone());
        }
    }
    writers.flush();
    assert_eq!(writers.queued(), 0);
    for shard in 0..2 {
        let expected = sequential_shard(&shared, shard, &workers);
        shared.read_shard(shard, |index| assert!(index.same_content(&expected)));
    }
    // Out of order events are still reported as gaps, and a removal is ordered with events.
    let mut late = events_of(12).pop().expect("events");
    late.event.event_id = 500;
    writers.send(late);
    writers.remove_worker(13);
    writers.flush();
    let gaps = shared.take_gaps();
    assert_eq!(gaps.len(), 1);
    assert_eq!(gaps[0].missing, 200..500);
    assert_eq!(shared.memory().workers, 3);
    // Dropping the writers applies what was sent.
    for ev in events_of(13) {
        writers.send(ev);
    }
    drop(writers);
    let expected = sequential_shard(&shared, shared.shard_of(13), &[13]);
    let q: Vec<LocalBlockHash> = (0..4).map(LocalBlockHash).collect();
    assert_eq!(
        shared
            .find_matches(&q)
            .score(kvroute_protocols::WorkerWithDpRank::new(13, 0)),
        expected
            .find_matches(&q)
            .score(kvroute_protocols::WorkerWithDpRank::new(13, 0)),
    );
    assert_eq!(shared.memory().workers, 4);
}

#[test]
fn fewer_writers_than_shards_apply_every_shard_in_order() {
    let workers: Vec<u64> = (20..27).collect();
    let shared = Arc::new(ConcurrentIndex::with_shards(4));
    let writers = IndexWriters::with_threads(Arc::clone(&shared), 2).expect("threads start");
    assert_eq!(writers.threads(), 2);
    let streams: Vec<Vec<RouterEvent>> = workers.iter().map(|&w| events_of(w)).collect();
    for i in 0..streams[0].len() {
        for stream in &streams {
            writers.send(stream[i].clone());
        }
        // A flush midway waits for what was sent so far, and the writers go on after it.
        if i == 100 {
            writers.flush();
        }
    }
    writers.flush();
    assert_eq!(writers.queued(), 0);
    for shard in 0..4 {
        let expected = sequential_shard(&shared, shard, &workers);
        shared.read_shard(shard, |index| {
            assert!(index.same_content(&expected), "shard {shard}");
            assert_eq!(index.check_consistency(), Ok(()));
        });
    }
    assert!(shared.take_gaps().is_empty());
    assert_eq!(shared.memory().workers, workers.len());
}

#[test]
fn sends_and_submits_for_one_worker_keep_their_order() {
    let shared = Arc::new(ConcurrentIndex::with_shards(2));
    let writers = IndexWriters::with_threads(Arc::clone(&shared), 1).expect("threads start");
    let events = events_of(31);
    for (i, ev) in events.iter().enumerate() {
        // Alternate the two ways in: both queue on the worker's shard, in call order.
        if i % 2 == 0 {
            writers.send(ev.clone());
        } else {
            shared.submit(ev.clone());
        }
    }
    writers.flush();
    let expected = sequential_shard(&shared, shared.shard_of(31), &[31]);
    shared.read_shard(shared.shard_of(31), |index| {
        assert!(index.same_content(&expected));
    });
    assert!(shared.take_gaps().is_empty(), "events applied out of order");
}

#[test]
fn an_idle_writer_takes_over_a_shard_its_busy_owner_cannot_get_to() {
    // Workers 40 and 42 sit on shards 0 and 2 of four, both first owned by writer 0 of two;
    // writer 1 owns only the idle shards 1 and 3. Everything is queued before the writers start,
    // and this thread holds shard 0 while they run: writer 0 starts on shard 0 and cannot get on,
    // so writer 1, woken by changes on its own shard 1, takes shard 2 over. (Without the held
    // shard the steal depends on writer 1 being scheduled while writer 0 applies: not so on a
    // busy machine.)
    let shared = Arc::new(ConcurrentIndex::with_shards(4));
    let workers = [40u64, 42];
    assert_eq!(shared.shard_of(40), 0);
    assert_eq!(shared.shard_of(41), 1);
    assert_eq!(shared.shard_of(42), 2);
    for _ in 0..20 {
        for &w in &workers {
            for ev in events_of(w) {
                shared.enqueue_untracked(ev);
            }
        }
    }
    let writers = shared.read_shard(0, |_| {
        let writers = IndexWriters::with_threads(Arc::clone(&shared), 2).expect("threads start");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while writers.steals() == 0 && std::time::Instant::now() < deadline {
            // A change on shard 1 (removing a worker nobody has) wakes writer 1 if it sleeps.
            writers.remove_worker(41);
            thread::sleep(std::time::Duration::from_millis(1));
        }
        writers
    });
    writers.flush();
    assert!(writers.steals() > 0, "writer 1 never took over a shard");
    // Every copy of a stored block after the first is a duplicate store, counted and dropped;
    // the shards hold what one pass of each worker's events leaves.
    for &w in &workers {
        let shard = shared.shard_of(w);
        let mut expected = KvIndex::new();
        for _ in 0..20 {
            for ev in events_of(w) {
                let _ = expected.apply_event_untracked(&ev);
            }
        }
        shared.read_shard(shard, |index| assert!(index.same_content(&expected)));
    }
    drop(writers);
}

/// Queued events wait for `apply_queued`, apply in queue order, and an exclusive section sees
/// every event queued before it (a router queues under its own lock and applies after it).
#[test]
fn queued_events_apply_in_order_and_before_an_exclusive_section() {
    let shared = ConcurrentIndex::new();
    let events = events_of(5);
    let mut sequential = KvIndex::new();
    for ev in &events[..30] {
        let _ = sequential.apply_event(ev);
        shared.enqueue_untracked(ev.clone());
    }
    // Nothing is applied until asked.
    assert_eq!(shared.memory().indexed_blocks, 0);
    shared.apply_queued();
    assert!(shared.read_shard(0, |idx| idx.same_content(&sequential)));

    for ev in &events[30..60] {
        let _ = sequential.apply_event(ev);
        shared.enqueue_untracked(ev.clone());
    }
    // The section runs after everything queued, and its own change lands between those and
    // what is queued after it.
    let blocks = shared.with_shard_mut(0, |idx| {
        let held = idx.block_count(
            kvroute_protocols::WorkerWithDpRank::from_worker_id(5),
            StorageTier::Device,
        );
        idx.remove_worker(5);
        held
    });
    assert_eq!(
        blocks,
        sequential.block_count(
            kvroute_protocols::WorkerWithDpRank::from_worker_id(5),
            StorageTier::Device,
        )
    );
    assert!(blocks > 0);
    assert_eq!(shared.memory().indexed_blocks, 0);
    shared.enqueue_untracked(events[0].clone());
    shared.with_shard_mut(0, |_| ());
    assert_eq!(shared.memory().indexed_blocks, 4);
}

/// Runs `f` on a thread of its own and fails the test if it has not returned within `secs`
/// seconds (a flush that waits on writers nobody woke would otherwise hang the test run).
fn within<R: Send + 'static>(secs: u64, what: &str, f: impl FnOnce() -> R + Send + 'static) -> R {
    let (tx, rx) = std::sync::mpsc::channel();
    thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(std::time::Duration::from_secs(secs))
        .unwrap_or_else(|_| panic!("{what} did not return within {secs} s"))
}

#[test]
fn flush_applies_events_queued_on_the_index_while_the_writers_sleep() {
    let shared = Arc::new(ConcurrentIndex::with_shards(2));
    let writers =
        Arc::new(IndexWriters::with_threads(Arc::clone(&shared), 2).expect("threads start"));
    // Let the writers find nothing to do and go to sleep.
    writers.flush();
    thread::sleep(std::time::Duration::from_millis(20));
    // A router orders events under its own lock with `enqueue_untracked`, which wakes nobody.
    for w in [50u64, 51] {
        for ev in events_of(w) {
            shared.enqueue_untracked(ev);
        }
    }
    let flushing = Arc::clone(&writers);
    within(10, "flush", move || flushing.flush());
    for w in [50u64, 51] {
        let expected = sequential_shard(&shared, shared.shard_of(w), &[w]);
        shared.read_shard(shared.shard_of(w), |index| {
            assert!(index.same_content(&expected));
        });
    }
    assert_eq!(writers.queued(), 0);
}

#[test]
fn the_queued_gauge_counts_sends_and_submits_alike() {
    // One shard: a writer applying sent events meets a thread submitting to the same shard, so
    // each applies some of the other's changes. The gauge must end at zero either way (it must
    // neither wrap below zero nor keep changes another thread applied).
    let shared = Arc::new(ConcurrentIndex::new());
    let writers =
        Arc::new(IndexWriters::with_threads(Arc::clone(&shared), 1).expect("threads start"));
    // Sent and submitted alike: the most that can be queued at once.
    let total = 2 * 20 * events_of(0).len();
    let sender = {
        let writers = Arc::clone(&writers);
        thread::spawn(move || {
            for _ in 0..20 {
                for ev in events_of(60) {
                    writers.send(ev);
                    assert!(writers.queued() <= total, "the gauge wrapped below zero");
                }
            }
        })
    };
    for _ in 0..20 {
        for ev in events_of(61) {
            shared.submit(ev);
        }
    }
    sender.join().expect("the sender ran");
    let flushing = Arc::clone(&writers);
    within(10, "flush", move || flushing.flush());
    assert_eq!(writers.queued(), 0);
}

/// A frozen index holds the state of the freeze while changes queue behind it and queries go
/// on; letting go applies them in order (a router's snapshot cut, taken off its routing lock).
#[test]
fn a_frozen_index_reads_as_of_the_freeze_and_applies_what_queued_behind_it_after() {
    let shared = Arc::new(ConcurrentIndex::with_shards(2));
    let (before, after) = (events_of(70), events_of(71));
    let mut at_freeze = KvIndex::new();
    for ev in &before[..100] {
        shared.enqueue_untracked(ev.clone());
        let _ = at_freeze.apply_event_untracked(ev);
    }
    // Queued, not yet applied: the freeze applies it first.
    let frozen = shared.freeze();
    for ev in &before[100..] {
        shared.enqueue_untracked(ev.clone());
    }
    shared.apply_queued();
    // A submitter neither waits for the freeze nor gets ahead of it.
    {
        let shared = Arc::clone(&shared);
        within(10, "submits while frozen", move || {
            for ev in after {
                shared.submit(ev);
            }
        });
    }
    frozen.read_shard(shared.shard_of(70), |index| {
        assert!(
            index.same_content(&at_freeze),
            "changes got past the freeze"
        );
    });
    frozen.read_shard(shared.shard_of(71), |index| {
        assert_eq!(
            index.memory().indexed_blocks,
            0,
            "a submit got past the freeze"
        );
    });
    // Queries go on while it is held.
    let reader = Arc::clone(&shared);
    let probe: Vec<LocalBlockHash> = (0..4).map(LocalBlockHash).collect();
    within(10, "a query while frozen", move || {
        reader.find_matches(&probe)
    });
    drop(frozen);
    for w in [70u64, 71] {
        let expected = sequential_shard(&shared, shared.shard_of(w), &[w]);
        shared.read_shard(shared.shard_of(w), |index| {
            assert!(index.same_content(&expected), "worker {w} after the freeze");
        });
    }
}

/// Lanes dumped and restored keep the index's layout: long chains shared by several workers
/// come back along segments, in about the memory they took, and answer alike.
#[test]
fn restored_lanes_keep_the_layout_of_long_shared_chains() {
    let mut index = KvIndex::new();
    for w in 0..4u64 {
        for c in 0..10u64 {
            // 150 blocks every chain shares, then 150 of its own.
            let blocks = (0..300u64)
                .map(|k| KvCacheStoredBlockData {
                    block_hash: Ext(c * 1_000 + k),
                    tokens_hash: LocalBlockHash(if k < 150 { k } else { c * 100_000 + k }),
                })
                .collect();
            let ev = RouterEvent {
                worker_id: w,
                storage_tier: StorageTier::Device,
                event: KvCacheEvent {
                    event_id: c,
                    dp_rank: 0,
                    data: KvCacheEventData::Stored(KvCacheStoreData {
                        parent_hash: None,
                        blocks,
                    }),
                },
            };
            index.apply_event_untracked(&ev).expect("a valid chain");
        }
        // Evict the middle of one chain: its tail lives on after a dead stretch.
        let evict = KvCacheEventData::Removed(KvCacheRemoveData {
            block_hashes: (200..220u64).map(|k| Ext(3_000 + k)).collect(),
        });
        let ev = RouterEvent {
            worker_id: w,
            storage_tier: StorageTier::Device,
            event: KvCacheEvent {
                event_id: 10,
                dp_rank: 0,
                data: evict,
            },
        };
        index.apply_event_untracked(&ev).expect("held blocks");
    }
    let lanes: Vec<kvroute_indexer::LaneDump> = index.dump_lanes().collect();
    let mut restored = KvIndex::new();
    let blocks = restored.restore_lanes(lanes.iter().map(|l| (l.worker, l.tier, &l.blocks[..])));
    assert_eq!(blocks, index.memory().indexed_blocks);
    assert!(index.same_content(&restored));
    restored
        .check_consistency()
        .unwrap_or_else(|e| panic!("{e}"));
    let (before, after) = (index.memory().table_bytes, restored.memory().table_bytes);
    // The tables may sit anywhere in their 1/3 to 2/3 load band, so allow half again. Rebuilt
    // from one-block events (`KvIndex::dump`), every block is a segment of its own and the
    // index takes about three times the bytes.
    let flat = KvIndex::from_events(index.dump()).memory().table_bytes;
    assert!(
        after * 2 <= before * 3 && flat * 2 > before * 3,
        "restored index takes {after} bytes, the original {before}, one rebuilt from events {flat}"
    );
    for c in [0u64, 3, 9] {
        let prompt: Vec<LocalBlockHash> = (0..300u64)
            .map(|k| LocalBlockHash(if k < 150 { k } else { c * 100_000 + k }))
            .collect();
        assert_eq!(index.find_matches(&prompt), restored.find_matches(&prompt));
    }
}
