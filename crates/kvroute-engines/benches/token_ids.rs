//! Writing a prompt's token ids into an engine request's JSON body: `write_token_ids` against
//! serde_json's serializer, for an `agentic` prompt's length (13,371 ids, the peers bench's mean)
//! drawn from a 150,000-token vocabulary.
//!
//! `cargo bench -p kvroute-engines --bench token_ids`

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvroute_engines::write_token_ids;

fn bench_token_ids(c: &mut Criterion) {
    let ids: Vec<u32> = (0..13_371u32)
        .map(|i| i.wrapping_mul(2_654_435_761) % 150_000)
        .collect();
    let mut group = c.benchmark_group("token_ids");
    group.throughput(Throughput::Elements(ids.len() as u64));
    group.bench_function("write_token_ids", |b| {
        b.iter(|| {
            let mut out = Vec::with_capacity(ids.len() * 7 + 2);
            out.push(b'[');
            write_token_ids(&mut out, black_box(&ids));
            out.push(b']');
            out
        })
    });
    group.bench_function("serde_json", |b| {
        b.iter(|| {
            let mut out = Vec::with_capacity(ids.len() * 7 + 2);
            serde_json::to_writer(&mut out, black_box(&ids)).expect("ids serialize");
            out
        })
    });
    group.finish();
}

criterion_group!(benches, bench_token_ids);
criterion_main!(benches);
