//! Tokenizers and texts shared by the tokenizer's unit tests.

use tokenizers::models::bpe::BPE;
use tokenizers::normalizers::replace::Replace;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior};

use crate::tokenizer::HfTokenizer;

/// A word-level tokenizer of three words (which `fastokens` does not implement).
pub(crate) const WORD_LEVEL: &str = r#"{
  "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
  "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
  "decoder": null,
  "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "hello": 1, "world": 2, "!": 3},
            "unk_token": "[UNK]"}
}"#;

/// Llama 3's pre-tokenizer pattern: a space joins the word after it, digits go in threes.
const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// A byte-level BPE tokenizer pre-tokenized as Llama 3's, with merges that join a space to the
/// word after it (so a token spanning a bad cut would show).
pub(crate) fn byte_level_bpe() -> HfTokenizer {
    let mut vocab: Vec<String> = ByteLevel::alphabet()
        .into_iter()
        .map(String::from)
        .collect();
    vocab.sort();
    let (vocab, merges) = with_merges(
        vocab,
        &[
            ("Ġ", "t"),
            ("h", "e"),
            ("Ġt", "he"),
            ("Ġ", "a"),
            ("Ġa", "n"),
            ("Ġan", "d"),
            ("i", "n"),
            ("Ġ", "in"),
            ("Ċ", "Ċ"),
            ("Ġ", "Ġ"),
            ("1", "2"),
        ],
    );
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .expect("a valid BPE");
    let mut t = tokenizers::Tokenizer::new(bpe);
    let split = Split::new(
        SplitPattern::Regex(LLAMA3_PATTERN.to_owned()),
        SplitDelimiterBehavior::Isolated,
        false,
    )
    .expect("a valid pattern");
    t.with_pre_tokenizer(Some(PreTokenizerWrapper::Sequence(Sequence::new(vec![
        split.into(),
        ByteLevel::new(false, true, false).into(),
    ]))));
    let json = t.to_string(false).expect("serializable");
    HfTokenizer::from_bytes(json.as_bytes()).expect("loads")
}

/// Text of words, digits, punctuation, newlines, runs of spaces and non-ASCII characters.
pub(crate) fn text(pieces: &[(u8, u16)]) -> String {
    const WORDS: [&str; 8] = ["the", "and", "in", "token", "Word", "été", "日本", "x"];
    const GAPS: [&str; 8] = [" ", " ", " ", "  ", "\n", "\n\n ", ", ", "\u{3000}"];
    let mut out = String::new();
    for &(kind, n) in pieces {
        out.push_str(WORDS[usize::from(kind % 8)]);
        if kind % 5 == 0 {
            out.push_str(&n.to_string());
        }
        out.push_str(GAPS[usize::from(n % 8)]);
    }
    out
}

/// The chat markers the SentencePiece-style tokenizer holds as special added tokens.
pub(crate) const SPECIALS: [&str; 3] = ["<s>", "<|im_start|>", "<|im_end|>"];

/// A SentencePiece-style BPE tokenizer as the llama.cpp test model's `tokenizer.json` is made
/// (`tests/python/llamacpp/make_model.py`): spaces replaced by the visible space, no
/// pre-tokenizer (the whole text is one piece), byte fallback for characters outside the
/// vocabulary, and chat markers as special added tokens.
pub(crate) fn sentencepiece_bpe() -> HfTokenizer {
    let mut vocab: Vec<String> = vec!["<unk>".to_owned()];
    vocab.extend((0..=255u8).map(|b| format!("<0x{b:02X}>")));
    vocab.extend(
        "\u{2581}abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,;!?'\n"
            .chars()
            .map(String::from),
    );
    let (vocab, merges) = with_merges(
        vocab,
        &[
            ("\u{2581}", "t"),
            ("h", "e"),
            ("\u{2581}t", "he"),
            ("\u{2581}", "a"),
            ("\u{2581}a", "n"),
            ("\u{2581}an", "d"),
            ("i", "n"),
            ("\u{2581}", "in"),
            ("o", "k"),
            ("t", "ok"),
            ("e", "n"),
            ("tok", "en"),
            ("\u{2581}", "token"),
            ("\u{2581}", "\u{2581}"),
            ("1", "2"),
        ],
    );
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .unk_token("<unk>".to_owned())
        .fuse_unk(true)
        .byte_fallback(true)
        .build()
        .expect("a valid BPE");
    let mut t = tokenizers::Tokenizer::new(bpe);
    t.with_normalizer(Some(
        Replace::new(" ", "\u{2581}").expect("a valid pattern"),
    ))
    .expect("a normalizer");
    t.add_special_tokens(SPECIALS.map(|s| AddedToken::from(s, true)))
        .expect("special tokens");
    let json = t.to_string(false).expect("serializable");
    HfTokenizer::from_bytes(json.as_bytes()).expect("loads")
}

/// `vocab` and `merges` as a BPE model takes them: each merge's product appended to the
/// vocabulary, ids in order.
fn with_merges(
    mut vocab: Vec<String>,
    merges: &[(&str, &str)],
) -> (tokenizers::models::bpe::Vocab, Vec<(String, String)>) {
    let merges: Vec<(String, String)> = merges
        .iter()
        .map(|(a, b)| ((*a).to_owned(), (*b).to_owned()))
        .collect();
    for (a, b) in &merges {
        vocab.push(format!("{a}{b}"));
    }
    let vocab = vocab
        .into_iter()
        .enumerate()
        .map(|(i, t)| (t, i as u32))
        .collect();
    (vocab, merges)
}
