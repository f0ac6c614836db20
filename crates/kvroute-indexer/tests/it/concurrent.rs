//! Many threads submitting and querying end where one thread applying everything ends.

use std::sync::Arc;
use std::thread;

use kvroute_indexer::{ConcurrentIndex, KvIndex};
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
    shared.read(|index| {
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
    shared.read(|index| {
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
