//! Tokenizing the prompts of a multi-turn conversation: each turn's prompt is the previous one
//! plus a new exchange, as a router sees them. `whole` tokenizes every prompt from scratch;
//! `chunked` is the default, which cuts long prompts into chunks and reuses the ids of chunks
//! seen before (`HfTokenizer`'s chunk cache). A word-level tokenizer of 2,000 words (the peers
//! bench's) and a prompt growing by about 1,000 words a turn over 16 turns.

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
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

/// The conversation's prompts, turn by turn (a deterministic word sequence).
fn prompts() -> Vec<String> {
    let mut text = String::new();
    let mut out = Vec::new();
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
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
    let prompts = prompts();
    let mut group = c.benchmark_group("tokenize_conversation_16_turns");
    group.sample_size(20);
    for (name, chunked) in [("whole", false), ("chunked", true)] {
        group.bench_function(name, |b| {
            b.iter_with_setup(
                || {
                    HfTokenizer::from_bytes(json.as_bytes())
                        .expect("valid tokenizer")
                        .with_chunk_cache(chunked)
                },
                |t| {
                    for p in &prompts {
                        black_box(t.encode(p).expect("encodes").len());
                    }
                },
            );
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
