//! Routing-core overhead: one `route` + `on_finished` on a fleet of 64 workers with a warm index.

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use kvroute_indexer::hash::{HashSalt, compute_block_hashes};
use kvroute_protocols::kv_events::{
    ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheStoreData,
    KvCacheStoredBlockData, RouterEvent, StorageTier,
};
use kvroute_router::{
    KvMode, KvRouterCore, Policy, RequestId, RouteRequest, RouterConfig, WorkerSpec,
};
use rand::SeedableRng;
use rand::rngs::StdRng;

const WORKERS: u64 = 64;
const BLOCK: u32 = 16;

fn prompt(prefix: u32, len: u32) -> Vec<u32> {
    (0..len)
        .map(|i| if i < 512 { prefix * 100_000 + i } else { i })
        .collect()
}

fn warm_core(policy: Policy) -> KvRouterCore {
    let mut core = KvRouterCore::new(RouterConfig::new(BLOCK).with_policy(policy)).unwrap();
    for w in 0..WORKERS {
        core.add_worker(&WorkerSpec::new(w), KvMode::Events)
            .unwrap();
        // Each worker holds a 1024-token prompt of its own family.
        let local = compute_block_hashes(
            &prompt(w as u32 % 16, 1024),
            BLOCK as usize,
            &HashSalt::default(),
        );
        let blocks = local
            .iter()
            .enumerate()
            .map(|(i, &h)| KvCacheStoredBlockData {
                block_hash: ExternalSequenceBlockHash(w * 10_000 + i as u64),
                tokens_hash: h,
            })
            .collect();
        core.apply_event(&RouterEvent {
            worker_id: w,
            storage_tier: StorageTier::Device,
            event: KvCacheEvent {
                event_id: 0,
                dp_rank: 0,
                data: KvCacheEventData::Stored(KvCacheStoreData {
                    parent_hash: None,
                    blocks,
                }),
            },
        });
    }
    core
}

fn bench(c: &mut Criterion) {
    for policy in [Policy::Kv, Policy::RoundRobin] {
        let mut core = warm_core(policy);
        let mut rng = StdRng::seed_from_u64(1);
        let prompts: Vec<Vec<u32>> = (0..16).map(|p| prompt(p, 1024)).collect();
        let mut id = 0u64;
        c.bench_function(&format!("route_finish_64w_1024tok_{policy}"), |b| {
            b.iter(|| {
                id += 1;
                let p = &prompts[(id % 16) as usize];
                let r = core
                    .route(
                        &RouteRequest::new(RequestId(id), p),
                        Duration::from_millis(id),
                        &mut rng,
                    )
                    .unwrap();
                black_box(core.on_finished(RequestId(id)));
                black_box(r.worker)
            })
        });
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
