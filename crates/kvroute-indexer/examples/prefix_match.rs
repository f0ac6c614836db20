//! Two workers report what they cached as KV events; the index answers, for a new prompt, how many
//! of its leading blocks each worker already holds, follows an eviction, and notices a lost event.
//!
//! Run with `cargo run -p kvroute-indexer --example prefix_match`.

use kvroute_indexer::KvIndex;
use kvroute_indexer::hash::{HashSalt, compute_block_hashes};
use kvroute_protocols::WorkerWithDpRank;
use kvroute_protocols::kv_events::{
    ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheRemoveData, KvCacheStoreData,
    KvCacheStoredBlockData, LocalBlockHash, RouterEvent, StorageTier,
};

const BLOCK_SIZE: usize = 16;

fn main() {
    let salt = HashSalt::default();
    // A shared 2-block system prompt followed by two different conversations.
    let system: Vec<u32> = (0..32).collect();
    let chat_a: Vec<u32> = system.iter().copied().chain(100..132).collect();
    let chat_b: Vec<u32> = system.iter().copied().chain(200..232).collect();

    // Worker 1 cached all 4 blocks of conversation A, worker 2 all 4 blocks of conversation B.
    let mut index = KvIndex::new();
    let a = compute_block_hashes(&chat_a, BLOCK_SIZE, &salt);
    let b = compute_block_hashes(&chat_b, BLOCK_SIZE, &salt);
    assert!(index.apply_event(&stored(1, 1, &a, 1000)).result.is_ok());
    assert!(index.apply_event(&stored(2, 1, &b, 2000)).result.is_ok());

    // A new turn of conversation A (its 4 blocks plus a partial one, which is never hashed).
    let next_turn: Vec<u32> = chat_a.iter().copied().chain(300..310).collect();
    let query = compute_block_hashes(&next_turn, BLOCK_SIZE, &salt);
    let scores = index.find_matches(&query);
    let (w1, w2) = (
        WorkerWithDpRank::from_worker_id(1),
        WorkerWithDpRank::from_worker_id(2),
    );
    println!(
        "prompt of {} blocks: worker 1 holds {}, worker 2 holds {}",
        query.len(),
        scores.score(w1),
        scores.score(w2)
    );
    assert_eq!((query.len(), scores.score(w1), scores.score(w2)), (4, 4, 2));

    // Worker 1 evicts its third block: the match stops where the chain breaks.
    let evict = event(1, 2, removed(&[1002]));
    assert!(index.apply_event(&evict).result.is_ok());
    let scores = index.find_matches(&query);
    println!(
        "after worker 1 evicts block 3: worker 1 holds {}",
        scores.score(w1)
    );
    assert_eq!(scores.score(w1), 2);

    // Worker 2's events 2 and 3 never arrived: event 4 (a clear) is applied, and the gap is
    // reported so the caller can ask the worker to replay what was lost.
    let outcome = index.apply_event(&event(2, 4, KvCacheEventData::Cleared));
    let gap = outcome.gap.expect("events 2 and 3 are missing");
    println!(
        "worker 2: {gap:?}; blocks left on worker 2: {}",
        index.block_count(w2, StorageTier::Device)
    );
    assert_eq!((gap.missing, index.gaps_detected()), (2..4, 1));
    assert_eq!(index.block_count(w2, StorageTier::Device), 0);
}

/// A `Stored` event for a chain starting a sequence; the engine names its blocks `first_id..`.
fn stored(worker: u64, event_id: u64, hashes: &[LocalBlockHash], first_id: u64) -> RouterEvent {
    let blocks = hashes
        .iter()
        .zip(first_id..)
        .map(|(&tokens_hash, id)| KvCacheStoredBlockData {
            block_hash: ExternalSequenceBlockHash(id),
            tokens_hash,
        })
        .collect();
    let data = KvCacheStoreData {
        parent_hash: None,
        blocks,
    };
    event(worker, event_id, KvCacheEventData::Stored(data))
}

fn removed(ids: &[u64]) -> KvCacheEventData {
    KvCacheEventData::Removed(KvCacheRemoveData {
        block_hashes: ids.iter().copied().map(ExternalSequenceBlockHash).collect(),
    })
}

fn event(worker: u64, event_id: u64, data: KvCacheEventData) -> RouterEvent {
    RouterEvent {
        worker_id: worker,
        storage_tier: StorageTier::Device,
        event: KvCacheEvent {
            event_id,
            data,
            dp_rank: 0,
        },
    }
}
