//! Four workers' KV events arrive on one stream; a shared index split into two worker shards
//! applies them on a writer thread per shard while this thread queries, and answers exactly as
//! one index fed the same events does.
//!
//! Run with `cargo run -p kvroute-indexer --example sharded_writers`.

use std::sync::Arc;

use kvroute_indexer::hash::{HashSalt, compute_block_hashes};
use kvroute_indexer::{ConcurrentIndex, IndexWriters, KvIndex};
use kvroute_protocols::WorkerWithDpRank;
use kvroute_protocols::kv_events::{
    ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheStoreData,
    KvCacheStoredBlockData, LocalBlockHash, RouterEvent, StorageTier,
};

const BLOCK_SIZE: usize = 16;
const WORKERS: u64 = 4;
const TURNS: usize = 50;

fn main() -> std::io::Result<()> {
    let salt = HashSalt::default();
    // Every conversation starts with the same 4-block system prompt; each turn adds 2 blocks.
    let system: Vec<u32> = (0..64).collect();

    let index = Arc::new(ConcurrentIndex::with_shards(2));
    let writers = IndexWriters::spawn(Arc::clone(&index))?;
    let mut one = KvIndex::new();
    for w in 0..WORKERS {
        println!("worker {w} is in shard {}", index.shard_of(w));
    }

    // One stream of events, the workers interleaved, as a router's subscription delivers them.
    let mut prompts: Vec<Vec<u32>> = (0..WORKERS).map(|_| system.clone()).collect();
    // Blocks each worker has cached so far (its first turn stores the system prompt too).
    let mut cached = vec![0usize; WORKERS as usize];
    for turn in 0..TURNS {
        for w in 0..WORKERS {
            let fresh = (w as u32 + 1) * 1_000_000 + turn as u32 * 32;
            prompts[w as usize].extend(fresh..fresh + 32);
            let blocks = compute_block_hashes(&prompts[w as usize], BLOCK_SIZE, &salt);
            let event = stored(w, turn as u64, &blocks, cached[w as usize]);
            cached[w as usize] = blocks.len();
            let _ = one.apply_event(&event);
            writers.send(event);
        }
    }
    // Queries may run at any time; flush when every event sent so far must be visible.
    writers.flush();
    println!(
        "{} events applied by {} writer threads, {} still queued",
        TURNS as u64 * WORKERS,
        index.shards(),
        writers.queued()
    );
    assert_eq!(writers.queued(), 0);

    // Worker 2's next turn: it holds the whole prompt, the others the system prompt only.
    let query = compute_block_hashes(&prompts[2], BLOCK_SIZE, &salt);
    let sharded = index.find_matches(&query);
    for w in 0..WORKERS {
        let score = sharded.score(WorkerWithDpRank::from_worker_id(w));
        println!(
            "worker {w} holds {score} of the prompt's {} blocks",
            query.len()
        );
        let expected = if w == 2 { query.len() } else { 4 };
        assert_eq!(score as usize, expected);
    }
    assert_eq!(sharded, one.find_matches(&query));
    assert_eq!(index.memory().indexed_blocks, one.memory().indexed_blocks);
    println!("the sharded index answers as one index fed the same events does");
    Ok(())
}

/// Worker `w`'s event storing `blocks[from..]` (a new turn continuing its cached conversation).
fn stored(w: u64, id: u64, blocks: &[LocalBlockHash], from: usize) -> RouterEvent {
    // Engines name blocks with ids of their own; here, the worker and the position.
    let ext = |i: usize| ExternalSequenceBlockHash(w * 1_000_000 + i as u64);
    RouterEvent {
        worker_id: w,
        storage_tier: StorageTier::Device,
        event: KvCacheEvent {
            event_id: id,
            data: KvCacheEventData::Stored(KvCacheStoreData {
                parent_hash: from.checked_sub(1).map(ext),
                blocks: (from..blocks.len())
                    .map(|i| KvCacheStoredBlockData {
                        block_hash: ext(i),
                        tokens_hash: blocks[i],
                    })
                    .collect(),
            }),
            dp_rank: 0,
        },
    }
}
