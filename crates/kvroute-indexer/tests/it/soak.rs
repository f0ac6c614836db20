//! A small churn soak: many events over a bounded live set end with the steady-state footprint.

use kvroute_indexer::KvIndex;
use kvroute_protocols::kv_events::{
    ExternalSequenceBlockHash as Ext, KvCacheEvent, KvCacheEventData, KvCacheRemoveData,
    KvCacheStoreData, KvCacheStoredBlockData, LocalBlockHash, RouterEvent, StorageTier,
};

fn ev(worker: u64, data: KvCacheEventData) -> RouterEvent {
    RouterEvent {
        worker_id: worker,
        storage_tier: StorageTier::Device,
        event: KvCacheEvent {
            event_id: 0,
            data,
            dp_rank: 0,
        },
    }
}

#[test]
fn churn_over_a_bounded_live_set_keeps_the_footprint() {
    const WORKERS: u64 = 4;
    const LIVE: u64 = 64; // chains of 8 blocks live per worker
    let mut index = KvIndex::new();
    let mut steady = None;
    for round in 0..4000u64 {
        let w = round % WORKERS;
        let chain = round / WORKERS;
        let store = KvCacheStoreData {
            parent_hash: None,
            blocks: (0..8)
                .map(|k| KvCacheStoredBlockData {
                    block_hash: Ext(chain * 8 + k),
                    tokens_hash: LocalBlockHash(chain % 97 + k),
                })
                .collect(),
        };
        assert!(
            index
                .apply_event_untracked(&ev(w, KvCacheEventData::Stored(store)))
                .is_ok()
        );
        if chain >= LIVE {
            let old = chain - LIVE;
            let remove = KvCacheRemoveData {
                block_hashes: (0..8).rev().map(|k| Ext(old * 8 + k)).collect(),
            };
            assert!(
                index
                    .apply_event_untracked(&ev(w, KvCacheEventData::Removed(remove)))
                    .is_ok()
            );
        }
        // After the last worker's turn every worker holds the same 64 chains, as at the end; in
        // between, the union spans 65 chains and the nodes (now sized per node) differ.
        if round == 1003 {
            steady = Some(index.memory());
        }
    }
    let end = index.memory();
    let steady = steady.expect("steady state recorded");
    assert_eq!(end.indexed_blocks, steady.indexed_blocks);
    assert_eq!(end.indexed_blocks, (WORKERS * LIVE * 8) as usize);
    assert_eq!(end.table_bytes, steady.table_bytes);
    assert_eq!(index.check_consistency(), Ok(()));
}
