//! Tokenizing the prompts of a multi-turn conversation: each turn's prompt is the previous one
//! plus a new exchange, as a router sees them, over 16 turns of about 1,000 words each. Every
//! iteration is a new conversation (nothing carries over but the chunk cache's other entries),
//! on a tokenizer past its first checks, as a running router's is.
//!
//! Two tokenizers. `word_level`: the peers bench's (2,000 words, one token a word), which only
//! the `tokenizers` crate encodes: `whole` tokenizes every prompt from scratch, `chunked` (the
//! default) cuts long prompts into chunks and reuses the ids of chunks seen before
//! (`HfTokenizer`'s chunk cache). `byte_level_bpe`: a Llama 3-style byte-level BPE of 8,000
//! tokens trained here on English-like text, with the same two ways through the `tokenizers`
//! crate (`tokenizers_*`) and through `fastokens` (`fastokens_*`; `fastokens_chunked` is the
//! default).

use std::hint::black_box;

use criterion::{BatchSize, Criterion, criterion_group, criterion_main};
use kvroute_router::tokenizer::{HfTokenizer, Tokenizer};
use tokenizers::models::bpe::{BPE, BpeTrainerBuilder};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{
    DecoderWrapper, NormalizerWrapper, PostProcessorWrapper, PreTokenizerWrapper,
    SplitDelimiterBehavior, TokenizerBuilder,
};

const WORDS: u32 = 2000;
const TURNS: usize = 16;
const WORDS_PER_TURN: usize = 1000;
/// Llama 3's pre-tokenizer pattern.
const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

fn word_level_json() -> String {
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

/// xorshift64: a fixed sequence per seed, no dependency.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Self(0x9E37_79B9_7F4A_7C15 ^ seed.wrapping_mul(0xA24B_AED4_963E_E407))
    }

    fn next(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// Word `i` of the English-like vocabulary: one to four consonant-vowel syllables.
fn pseudo_word(i: u64) -> String {
    const C: &[u8] = b"bcdfghklmnprstvwz";
    const V: &[u8] = b"aeiouy";
    let mut rng = Rng::new(i);
    let syllables = 1 + rng.next(4);
    let mut w = String::new();
    for _ in 0..syllables {
        w.push(char::from(C[rng.next(C.len() as u64) as usize]));
        w.push(char::from(V[rng.next(V.len() as u64) as usize]));
    }
    w
}

/// `words` words of English-like text: frequent words more often, capitals, digits, commas,
/// sentences and paragraphs.
fn english_like(rng: &mut Rng, words: usize) -> String {
    let mut text = String::new();
    for k in 0..words {
        // Roughly Zipf: the product of two uniforms favours small indices.
        let i = rng.next(WORDS.into()) * rng.next(WORDS.into()) / u64::from(WORDS);
        let w = pseudo_word(i);
        if k % 9 == 0 {
            let mut c = w.chars();
            text.extend(c.next().map(|c| c.to_ascii_uppercase()));
            text.push_str(c.as_str());
        } else {
            text.push_str(&w);
        }
        match rng.next(40) {
            0 => text.push_str(", "),
            1 => text.push_str(&format!(" {} ", rng.next(2000))),
            2 => text.push_str(".\n\n"),
            3 | 4 => text.push_str(". "),
            _ => text.push(' '),
        }
    }
    text
}

/// A Llama 3-style byte-level BPE of 8,000 tokens, trained on English-like text.
fn byte_level_bpe_json() -> String {
    let split = Split::new(
        SplitPattern::Regex(LLAMA3_PATTERN.to_owned()),
        SplitDelimiterBehavior::Isolated,
        false,
    )
    .expect("a valid pattern");
    let pre = Sequence::new(vec![
        split.into(),
        ByteLevel::new(false, true, false).into(),
    ]);
    let mut t = TokenizerBuilder::<
        BPE,
        NormalizerWrapper,
        PreTokenizerWrapper,
        PostProcessorWrapper,
        DecoderWrapper,
    >::new()
    .with_model(BPE::default())
    .with_pre_tokenizer(Some(PreTokenizerWrapper::Sequence(pre)))
    .with_decoder(Some(DecoderWrapper::ByteLevel(ByteLevel::default())))
    .build()
    .expect("a tokenizer");
    let mut trainer = BpeTrainerBuilder::new()
        .vocab_size(8000)
        .min_frequency(2)
        .show_progress(false)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build();
    let mut rng = Rng::new(1);
    let corpus: Vec<String> = (0..2000).map(|_| english_like(&mut rng, 200)).collect();
    t.train(&mut trainer, corpus.into_iter()).expect("trains");
    let t: tokenizers::Tokenizer = t.into();
    t.to_string(false).expect("serializable")
}

/// Conversation `seed`'s prompts, turn by turn, with `turn` making each turn's new text.
fn prompts(seed: u64, turn: fn(&mut Rng) -> String) -> Vec<String> {
    let mut rng = Rng::new(seed);
    let mut text = String::new();
    let mut out = Vec::new();
    for _ in 0..TURNS {
        text.push_str(&turn(&mut rng));
        out.push(text.clone());
    }
    out
}

fn word_level_turn(rng: &mut Rng) -> String {
    let mut text = String::new();
    for _ in 0..WORDS_PER_TURN {
        text.push_str(&format!("w{} ", rng.next(WORDS.into())));
    }
    text
}

fn english_turn(rng: &mut Rng) -> String {
    english_like(rng, WORDS_PER_TURN)
}

fn bench_group(
    c: &mut Criterion,
    group: &str,
    turn: fn(&mut Rng) -> String,
    configs: Vec<(&str, HfTokenizer)>,
) {
    let mut group = c.benchmark_group(group);
    group.sample_size(20);
    for (name, t) in configs {
        // Past the first checks of fastokens and of chunked encodings against whole ones.
        for p in (1..=3).flat_map(|k| prompts(u64::MAX - k, turn)) {
            black_box(t.encode(&p).expect("encodes"));
        }
        let mut seed = 0;
        group.bench_function(name, |b| {
            b.iter_batched(
                || {
                    seed += 1;
                    prompts(seed, turn)
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

fn bench(c: &mut Criterion) {
    let load = |json: &str| HfTokenizer::from_bytes(json.as_bytes()).expect("valid tokenizer");
    let word_level = word_level_json();
    bench_group(
        c,
        "tokenize_conversation_16_turns",
        word_level_turn,
        vec![
            ("whole", load(&word_level).with_chunk_cache(false)),
            ("chunked", load(&word_level)),
        ],
    );
    let bpe = byte_level_bpe_json();
    assert!(load(&bpe).encodes_with_fastokens(), "fastokens loads it");
    bench_group(
        c,
        "tokenize_conversation_16_turns_byte_level_bpe",
        english_turn,
        vec![
            (
                "tokenizers_whole",
                load(&bpe).with_fastokens(false).with_chunk_cache(false),
            ),
            ("tokenizers_chunked", load(&bpe).with_fastokens(false)),
            ("fastokens_whole", load(&bpe).with_chunk_cache(false)),
            ("fastokens_chunked", load(&bpe)),
        ],
    );
}

criterion_group!(benches, bench);
criterion_main!(benches);
