//! Decoding engines' ZMQ KV event batches (`decode_event_batch`), as a router reading a fleet's
//! events does for every batch: a vLLM 0.33 batch (map-encoded events) storing a 2,048-token
//! prompt in 16-token blocks and evicting as many blocks, and the same batch array-encoded, as
//! older vLLM and SGLang send it.
//!
//! `cargo bench -p kvroute-protocols --bench zmq_decode`

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvroute_protocols::zmq_events::decode_event_batch;
use rmpv::Value;

const BLOCK: u64 = 16;
const BLOCKS: u64 = 128;

fn pack(v: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, v).expect("writing to a Vec cannot fail");
    out
}

fn ints(items: impl Iterator<Item = u64>) -> Value {
    Value::Array(items.map(Value::from).collect())
}

/// The stored blocks' hashes, parent and tokens: large hashes, as vLLM's 64-bit ones are.
fn parts() -> (Value, Value, Value) {
    let hashes = ints((0..BLOCKS).map(|b| 0x9e37_79b9_7f4a_7c15_u64.wrapping_mul(b + 1)));
    let parent = Value::from(0x1234_5678_9abc_def0_u64);
    let tokens = ints((0..BLOCKS * BLOCK).map(|t| (t * 7919) % 151_000));
    (hashes, parent, tokens)
}

fn map_batch() -> Vec<u8> {
    let (hashes, parent, tokens) = parts();
    let stored = Value::Map(vec![
        ("type".into(), "BlockStored".into()),
        ("block_hashes".into(), hashes.clone()),
        ("parent_block_hash".into(), parent),
        ("token_ids".into(), tokens),
        ("block_size".into(), Value::from(BLOCK)),
        ("lora_id".into(), Value::Nil),
        ("medium".into(), "GPU".into()),
        ("lora_name".into(), Value::Nil),
        ("extra_keys".into(), Value::Nil),
        ("group_idx".into(), Value::from(0)),
        ("kv_cache_spec_kind".into(), "full_attention".into()),
        ("kv_cache_spec_sliding_window".into(), Value::Nil),
        ("locality".into(), Value::Nil),
    ]);
    let removed = Value::Map(vec![
        ("type".into(), "BlockRemoved".into()),
        ("block_hashes".into(), hashes),
        ("medium".into(), "GPU".into()),
    ]);
    pack(&Value::Array(vec![
        Value::F64(1.7e9),
        Value::Array(vec![stored, removed]),
        Value::Nil,
    ]))
}

fn array_batch() -> Vec<u8> {
    let (hashes, parent, tokens) = parts();
    let stored = Value::Array(vec![
        "BlockStored".into(),
        hashes.clone(),
        parent,
        tokens,
        Value::from(BLOCK),
        Value::Nil,
        "GPU".into(),
    ]);
    let removed = Value::Array(vec!["BlockRemoved".into(), hashes, "GPU".into()]);
    pack(&Value::Array(vec![
        Value::F64(1.7e9),
        Value::Array(vec![stored, removed]),
        Value::from(0),
    ]))
}

fn decode(c: &mut Criterion) {
    let mut group = c.benchmark_group("zmq_decode");
    for (name, payload) in [("vllm_map", map_batch()), ("array", array_batch())] {
        let batch = decode_event_batch(&payload).expect("the bench's batch decodes");
        assert_eq!(batch.events.len(), 2, "{name}: both events decode");
        assert!(batch.errors.is_empty(), "{name}: {:?}", batch.errors);
        group.throughput(Throughput::Elements(BLOCKS * BLOCK));
        group.bench_function(name, |b| b.iter(|| decode_event_batch(black_box(&payload))));
    }
    group.finish();
}

criterion_group!(benches, decode);
criterion_main!(benches);
