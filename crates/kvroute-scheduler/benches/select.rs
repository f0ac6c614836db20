//! Selection latency over 8 / 64 / 512 / 4096 workers, and load-tracking cycles per second.
//!
//! The fleet looks like the Mooncake trace: every prompt starts with the same block, so every
//! worker reports some overlap (1..=8 blocks) and one worker in sixteen a deep one (up to 48);
//! each worker carries four active requests of 32 blocks from a handful of prefix families, so
//! the "already active" count walks real holder lists.

use std::hint::black_box;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kvroute_protocols::WorkerWithDpRank;
use kvroute_scheduler::{
    NewRequest, RequestId, Scheduler, SchedulerConfig, SelectRequest, WorkerSpec,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const BS: u32 = 16;
const PROMPT_BLOCKS: u64 = 64;

fn prompt(family: u64, unique: u64, blocks: u64) -> Vec<u64> {
    // Shared first block, then a family prefix of 16 blocks, then request-specific blocks.
    std::iter::once(0)
        .chain((1..16).map(|p| family * 1_000 + p))
        .chain((16..blocks).map(|p| unique * 1_000_000 + p))
        .collect()
}

fn fleet(workers: u64, rng: &mut ChaCha8Rng) -> Scheduler {
    let mut config = SchedulerConfig::new(BS);
    // Half the fleet's requests are generating: measure output-block growth too.
    config.track_output_blocks = true;
    let mut s = Scheduler::new(config).expect("valid config");
    let mut id = 0;
    for wid in 0..workers {
        s.add_worker(&WorkerSpec::new(wid).with_kv_capacity(100_000))
            .expect("fresh");
        for _ in 0..4 {
            let p = prompt(rng.gen_range(0..8), 1 + id, 32);
            s.add_request(
                &NewRequest {
                    id: RequestId(id),
                    worker: WorkerWithDpRank::from_worker_id(wid),
                    isl_tokens: 32 * u64::from(BS),
                    block_hashes: &p,
                    overlap_blocks: 0,
                    expected_output_tokens: Some(256),
                },
                Duration::ZERO,
            )
            .expect("added");
            if id % 2 == 0 {
                s.add_output_tokens(RequestId(id), 40).expect("active");
            }
            id += 1;
        }
    }
    s
}

fn overlaps(workers: u64, rng: &mut ChaCha8Rng) -> Vec<(WorkerWithDpRank, u32)> {
    (0..workers)
        .map(|wid| {
            let depth = if wid % 16 == 0 {
                rng.gen_range(16..=48)
            } else {
                rng.gen_range(1..=8)
            };
            (WorkerWithDpRank::from_worker_id(wid), depth)
        })
        .collect()
}

fn bench_select(c: &mut Criterion) {
    let mut group = c.benchmark_group("select");
    for workers in [8u64, 64, 512, 4096] {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let mut s = fleet(workers, &mut rng);
        let o = overlaps(workers, &mut rng);
        let p = prompt(3, 999_999, PROMPT_BLOCKS);
        let req = SelectRequest::new(PROMPT_BLOCKS * u64::from(BS), &p, &o);
        group.throughput(Throughput::Elements(1));
        group.bench_with_input(BenchmarkId::from_parameter(workers), &workers, |b, _| {
            b.iter(|| {
                black_box(
                    s.select(black_box(&req), &mut rng)
                        .expect("ok")
                        .chosen
                        .worker,
                )
            });
        });
    }
    group.finish();
}

fn bench_cycle(c: &mut Criterion) {
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    let mut s = fleet(64, &mut rng);
    let prompts: Vec<Vec<u64>> = (0..64)
        .map(|i| prompt(i % 8, 10_000 + i, PROMPT_BLOCKS))
        .collect();
    let mut next = 1_000_000u64;
    let mut group = c.benchmark_group("load");
    group.throughput(Throughput::Elements(1));
    group.bench_function("add_prefill_output_free_64_blocks", |b| {
        b.iter(|| {
            let id = RequestId(next);
            next += 1;
            let p = &prompts[(next % 64) as usize];
            s.add_request(
                &NewRequest {
                    id,
                    worker: WorkerWithDpRank::from_worker_id(next % 64),
                    isl_tokens: PROMPT_BLOCKS * u64::from(BS),
                    block_hashes: p,
                    overlap_blocks: 16,
                    expected_output_tokens: Some(128),
                },
                Duration::ZERO,
            )
            .expect("added");
            s.mark_prefill_completed(id).expect("active");
            s.add_output_tokens(id, 64).expect("active");
            s.free(id).expect("active");
        });
    });
    group.finish();
}

criterion_group!(benches, bench_select, bench_cycle);
criterion_main!(benches);
