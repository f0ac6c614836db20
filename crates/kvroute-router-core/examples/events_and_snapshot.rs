//! The routing core fed by KV events, then saved and restored: a worker that reports a prompt's
//! blocks cached gets the requests that repeat that prompt, and a core restored from an index
//! snapshot (as a restarted router replica would be) finds the same cached blocks at once.
//! No I/O anywhere: the events are built in memory, time is a `Duration` and the RNG is seeded.
//!
//! Run with `cargo run -p kvroute-router-core --example events_and_snapshot`.

use std::time::Duration;

use kvroute_indexer::hash::{HashSalt, compute_block_hashes};
use kvroute_protocols::kv_events::{
    ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheStoreData,
    KvCacheStoredBlockData, RouterEvent, StorageTier,
};
use kvroute_router_core::{IndexSnapshot, KvMode, KvRouterCore, RouteRequest, RouterConfig};
use kvroute_scheduler::{RequestId, WorkerSpec};
use rand::SeedableRng;
use rand::rngs::StdRng;

const BLOCK_SIZE: u32 = 4;

/// The KV event an engine publishes when it has cached every full block of `tokens`.
fn stored(worker: u64, event_id: u64, tokens: &[u32]) -> RouterEvent {
    let local = compute_block_hashes(tokens, BLOCK_SIZE as usize, &HashSalt::default());
    RouterEvent {
        worker_id: worker,
        storage_tier: StorageTier::Device,
        event: KvCacheEvent {
            event_id,
            dp_rank: 0,
            data: KvCacheEventData::Stored(KvCacheStoreData {
                parent_hash: None,
                blocks: local
                    .iter()
                    .enumerate()
                    .map(|(i, &h)| KvCacheStoredBlockData {
                        block_hash: ExternalSequenceBlockHash(1_000 + i as u64),
                        tokens_hash: h,
                    })
                    .collect(),
            }),
        },
    }
}

fn core_with_workers() -> KvRouterCore {
    let mut core = KvRouterCore::new(RouterConfig::new(BLOCK_SIZE)).expect("valid config");
    for id in [1, 2, 3] {
        core.add_worker(&WorkerSpec::new(id), KvMode::Events)
            .expect("new worker");
    }
    core
}

fn main() {
    let mut core = core_with_workers();
    let mut rng = StdRng::seed_from_u64(7);
    let now = Duration::ZERO;
    let prompt: Vec<u32> = (0..32).collect();

    // Worker 3 reports the prompt's 8 blocks cached (its first KV event, id 0).
    assert!(core.apply_event(&stored(3, 0, &prompt)).is_none(), "no gap");
    let routed = core
        .route(&RouteRequest::new(RequestId(1), &prompt), now, &mut rng)
        .expect("routed");
    println!(
        "live core: request 1 -> {} with {} of 8 blocks cached",
        routed.worker, routed.overlap_blocks
    );
    assert_eq!((routed.worker.worker_id, routed.overlap_blocks), (3, 8));
    core.on_first_token(RequestId(1)).expect("active");
    assert!(core.on_finished(RequestId(1)).is_empty());

    // Save the index as of event-plane position 1, and restore it into a fresh core.
    let bytes = core.snapshot(1).encode();
    let snapshot = IndexSnapshot::decode(&bytes).expect("a snapshot this core wrote");
    let mut restored = core_with_workers();
    let blocks = restored.restore(&snapshot).expect("same block size");
    let again = restored
        .query(&RouteRequest::new(RequestId(2), &prompt), now, &mut rng)
        .expect("routed");
    println!(
        "restored core ({blocks} blocks, {} bytes): request 2 -> {} with {} blocks cached",
        bytes.len(),
        again.worker,
        again.overlap_blocks
    );
    assert_eq!((again.worker.worker_id, again.overlap_blocks), (3, 8));
    assert_eq!(restored.active_requests(), 0, "a query records nothing");
}
