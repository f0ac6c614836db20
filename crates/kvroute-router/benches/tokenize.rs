//! Tokenizing the prompts of a multi-turn conversation: each turn's prompt is the previous one
//! plus a new exchange, as a router sees them. `whole` tokenizes every prompt from scratch;
//! `chunked` is the default, which cuts long prompts into chunks and reuses the ids of chunks
//! seen before (`HfTokenizer`'s chunk cache). A word-level tokenizer of 2,000 words (the peers
//! bench's) and a prompt growing by about 1,000 words a turn over 16 turns; every iteration is a
//! new conversation (nothing carries over but the cache's other entries), on a tokenizer past
//! the chunk cache's first checks against whole encodings, as a running router's is.

use std::hint::black_box;

use criterion::{BatchSize, Criterion, criterion_group, criterion_main};
use kvroute_router::tokenizer::{HfTokenizer, Tokenizer};

const WORDS: u32 = 2000;
const TURNS: usize = 16;
const WORDS_PER_TURN: usize = 1000;

fn tokenizer_json() -> String {
    let vocab: serde_json::Map<String, serde_json::Value> =
        std::iter::once(("<unk>".to_owned(), 0.into()))
            .chain((0..WORDS).map(|i| (format!("w{i}"), (i + 1).into())))
            .collect();
    serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}
    })
    .to_string()
}

/// Conversation `seed`'s prompts, turn by turn (a deterministic word sequence).
fn prompts(seed: u64) -> Vec<String> {
    let mut text = String::new();
    let mut out = Vec::new();
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15 ^ seed.wrapping_mul(0xA24B_AED4_963E_E407);
    for _ in 0..TURNS {
        for _ in 0..WORDS_PER_TURN {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            text.push_str(&format!("w{} ", x % u64::from(WORDS)));
        }
        out.push(text.clone());
    }
    out
}

fn bench(c: &mut Criterion) {
    let json = tokenizer_json();
    let mut group = c.benchmark_group("tokenize_conversation_16_turns");
    group.sample_size(20);
    for (name, chunked) in [("whole", false), ("chunked", true)] {
        let t = HfTokenizer::from_bytes(json.as_bytes())
            .expect("valid tokenizer")
            .with_chunk_cache(chunked);
        // Past the first checks of chunked encodings against whole ones.
        for p in prompts(u64::MAX)
            .iter()
            .chain(&prompts(u64::MAX - 1))
            .chain(&prompts(u64::MAX - 2))
        {
            black_box(t.encode(p).expect("encodes"));
        }
        let mut seed = 0;
        group.bench_function(name, |b| {
            b.iter_batched(
                || {
                    seed += 1;
                    prompts(seed)
                },
                |prompts| {
                    for p in &prompts {
                        black_box(t.encode(p).expect("encodes").len());
                    }
                },
                BatchSize::LargeInput,
            );
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
