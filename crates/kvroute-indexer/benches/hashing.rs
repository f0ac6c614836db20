//! Hashing throughput: local block hashes over token bytes (goal: at least 2 GB/s on one core)
//! and the sequence-hash chain.

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvroute_indexer::hash::{HashSalt, compute_block_hashes, compute_seq_hashes};

fn bench_hashing(c: &mut Criterion) {
    let tokens: Vec<u32> = (0..16_384u32)
        .map(|i| i.wrapping_mul(2_654_435_761))
        .collect();
    let salt = HashSalt::default();
    let mut group = c.benchmark_group("hashing");
    for block_size in [16usize, 64] {
        group.throughput(Throughput::Bytes((tokens.len() * 4) as u64));
        group.bench_function(format!("block_hashes/bs{block_size}"), |b| {
            b.iter(|| compute_block_hashes(black_box(&tokens), block_size, &salt))
        });
    }
    let local = compute_block_hashes(&tokens, 16, &salt);
    group.throughput(Throughput::Elements(local.len() as u64));
    group.bench_function("seq_hashes", |b| {
        b.iter(|| compute_seq_hashes(black_box(&local)))
    });
    group.finish();
}

criterion_group!(benches, bench_hashing);
criterion_main!(benches);
