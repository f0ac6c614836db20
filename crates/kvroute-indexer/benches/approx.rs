//! Approximate mode's per-request work on a table the size a busy fleet gives it: route a
//! conversation's next turn (`find_matches`) and record it (`record_request`, then the engine's
//! report), on 8 workers whose predictions hold about 200,000 blocks. Each turn's prompt is its
//! conversation's previous one plus new blocks (the agentic and multi-turn workloads' shape), so
//! most of its blocks are looked up in a table far larger than the CPU's caches.
//!
//! `cargo bench -p kvroute-indexer --bench approx`

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvroute_indexer::{ApproxConfig, ApproxIndex};
use kvroute_protocols::WorkerWithDpRank;
use kvroute_protocols::kv_events::LocalBlockHash;

const WORKERS: u64 = 8;
const CONVERSATIONS: u64 = 512;
/// Blocks of the system prompt each family of conversations shares.
const SYSTEM_BLOCKS: u64 = 200;
/// New blocks a turn appends.
const TURN_BLOCKS: u64 = 40;
/// Turns every conversation has had before the measurement.
const WARM_TURNS: u64 = 10;
/// Time between two requests, and how long a prediction lives: every conversation comes back
/// well within it, so its blocks stay predicted, while each request expires about as many
/// queued deadlines (mostly stale: refreshed since) as it adds, the steady state of a router up
/// for longer than its TTL.
const STEP: Duration = Duration::from_millis(1);
const TTL: Duration = Duration::from_secs(2);

/// A conversation's prompt after `turns` turns: its family's system prompt, then its own blocks.
fn prompt(conversation: u64, turns: u64) -> Vec<LocalBlockHash> {
    let family = conversation % 4;
    let system = (0..SYSTEM_BLOCKS).map(|b| (family << 48) | b);
    let own = (0..turns * TURN_BLOCKS).map(|b| (1 << 60) | (conversation << 32) | b);
    system
        .chain(own)
        .map(|h| LocalBlockHash(h.wrapping_mul(0x9E37_79B9_7F4A_7C15)))
        .collect()
}

fn worker(conversation: u64) -> WorkerWithDpRank {
    WorkerWithDpRank {
        worker_id: conversation % WORKERS,
        dp_rank: 0,
    }
}

fn bench_approx(c: &mut Criterion) {
    let mut approx = ApproxIndex::new(ApproxConfig {
        ttl: TTL,
        ..ApproxConfig::default()
    });
    let mut request = 0u64;
    let mut now = Duration::ZERO;
    for turn in 1..=WARM_TURNS {
        for conversation in 0..CONVERSATIONS {
            now += STEP;
            request += 1;
            approx.record_request(
                worker(conversation),
                &prompt(conversation, turn),
                now,
                Some(request),
            );
            approx.forget(request);
        }
    }
    // The next turn of every conversation, taken in turn: each measured request re-records a
    // prompt of 600 blocks (all but the last 40 already predicted on its worker).
    let prompts: Vec<_> = (0..CONVERSATIONS)
        .map(|c| (worker(c), prompt(c, WARM_TURNS)))
        .collect();
    let blocks = prompts[0].1.len() as u64;
    eprintln!(
        "approx bench: {} predicted blocks, {blocks} blocks a prompt, tables {:.1} MB",
        approx.live_blocks(),
        approx.memory().table_bytes as f64 / 1e6
    );
    let mut group = c.benchmark_group("approx");
    group.throughput(Throughput::Elements(blocks));
    let mut next = 0usize;
    group.bench_function("route_and_record_600_blocks", |b| {
        b.iter(|| {
            let (worker, local) = &prompts[next % prompts.len()];
            next += 1;
            now += STEP;
            request += 1;
            black_box(approx.find_matches(local));
            approx.record_request(*worker, local, now, Some(request));
            approx.on_report(request, local.len() as u32 - 1)
        })
    });
    group.bench_function("record_600_blocks", |b| {
        b.iter(|| {
            let (worker, local) = &prompts[next % prompts.len()];
            next += 1;
            now += STEP;
            approx.record_request(*worker, local, now, None)
        })
    });
    group.finish();
}

criterion_group!(benches, bench_approx);
criterion_main!(benches);
