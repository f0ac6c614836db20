use std::cell::Cell;

use proptest::prelude::*;

use super::*;
use crate::tokenizer::Tokenizer;
use crate::tokenizer::fixtures::{byte_level_bpe, text};

#[test]
fn a_byte_level_tokenizer_is_chunked() {
    let t = byte_level_bpe();
    assert!(t.tokenizes_in_chunks());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn chunked_ids_are_the_whole_texts_and_shared_prefixes_hit_the_cache(
        pieces in prop::collection::vec((any::<u8>(), any::<u16>()), 300..1200),
        extra in prop::collection::vec((any::<u8>(), any::<u16>()), 1..200),
    ) {
        let t = byte_level_bpe();
        let cache = t.chunks.as_ref().expect("chunked");
        let first = text(&pieces);
        let whole = t.encode_whole(&first).unwrap();
        prop_assert_eq!(&t.encode(&first).unwrap(), &whole);
        let cached = cache.cached_chunks();
        prop_assert!(cached >= first.len() / CHUNK_BYTES - 1, "{} chunks for {} bytes", cached, first.len());
        // The same prefix, longer: its chunks come from the cache and the ids stay exact.
        let mut second = first.clone();
        second.push_str(&text(&extra));
        let ids = t.encode(&second).unwrap();
        prop_assert_eq!(&ids, &t.encode_whole(&second).unwrap());
        prop_assert!(t.tokenizes_in_chunks(), "no check found a difference");
    }
}

#[test]
fn safe_cuts_sit_before_a_single_space_and_a_letter() {
    let t = text(&(0..2000u16).map(|i| ((i * 7) as u8, i)).collect::<Vec<_>>());
    let cuts: Vec<usize> = safe_cuts(&t).collect();
    assert!(cuts.len() > 3, "{} cuts in {} bytes", cuts.len(), t.len());
    let mut last = 0;
    for &p in &cuts {
        assert!(p > last && t.is_char_boundary(p));
        assert_eq!(&t[p..p + 1], " ");
        assert!(t[p + 1..].starts_with(|c: char| c.is_ascii_alphabetic()));
        assert!(
            !t[..p].ends_with(char::is_whitespace),
            "{:?}",
            &t[p - 4..p + 2]
        );
        last = p;
    }
    // No space, or only spaces after whitespace, gives no cut.
    assert_eq!(safe_cuts(&"a".repeat(5000)).count(), 0);
    assert_eq!(safe_cuts(&"\u{3000} word".repeat(500)).count(), 0);
    assert_eq!(safe_cuts(&"\n word".repeat(800)).count(), 0);
}

#[test]
fn a_tokenizer_that_differs_in_chunks_turns_chunking_off_and_is_answered_whole() {
    let cache = ChunkCache::new(1 << 16);
    let text = "word ".repeat(1000);
    // A context-sensitive "tokenizer": one id, the text's length.
    let calls = Cell::new(0);
    let by_length = |s: &str| {
        calls.set(calls.get() + 1);
        Ok(vec![s.len() as u32])
    };
    assert_eq!(cache.encode(&text, by_length).unwrap(), vec![5000]);
    assert!(cache.disabled());
    assert_eq!(cache.cached_chunks(), 0, "the cache is dropped");
    let before = calls.get();
    assert_eq!(cache.encode(&text, by_length).unwrap(), vec![5000]);
    assert_eq!(calls.get(), before + 1, "tokenized whole, once");
}

/// An encoder giving each word its length as its id, counting in `wholes` the encodings of
/// whole `len`-byte texts (the checks; chunks are shorter).
fn counting_wholes(
    len: usize,
    wholes: &Cell<u64>,
) -> impl Fn(&str) -> Result<Vec<u32>, String> + Copy + '_ {
    move |s: &str| {
        if s.len() == len {
            wholes.set(wholes.get() + 1);
        }
        Ok(s.split_whitespace().map(|w| w.len() as u32).collect())
    }
}

#[test]
fn checks_run_first_and_then_now_and_then() {
    let cache = ChunkCache::new(1 << 16);
    let text = "word ".repeat(1000);
    let wholes = Cell::new(0u64);
    let per_word = counting_wholes(text.len(), &wholes);
    let n = VERIFY_FIRST + 2 * VERIFY_EVERY;
    for _ in 0..n {
        assert_eq!(cache.encode(&text, per_word).unwrap().len(), 1000);
    }
    assert!(!cache.disabled());
    // Each text has 4 cuts, so the first VERIFY_FIRST cover VERIFY_CUTS between them; then
    // every VERIFY_EVERY-th (512 and 1024).
    assert_eq!(4 * VERIFY_FIRST, VERIFY_CUTS);
    assert_eq!(wholes.get(), VERIFY_FIRST + 2);
}

#[test]
fn long_prompts_end_the_first_checks_sooner() {
    let cache = ChunkCache::new(1 << 20);
    // About 100 cuts a text: two texts cover VERIFY_CUTS.
    let text = "word ".repeat(20_000);
    let wholes = Cell::new(0u64);
    let per_word = counting_wholes(text.len(), &wholes);
    for _ in 0..VERIFY_EVERY + 1 {
        assert_eq!(cache.encode(&text, per_word).unwrap().len(), 20_000);
    }
    assert!(!cache.disabled());
    // The first two, then the VERIFY_EVERY-th.
    assert_eq!(wholes.get(), 3);
}

#[test]
fn a_difference_in_a_long_prompt_is_still_caught_first() {
    // A tokenizer that joins across the first cut: the very first check sees it.
    let cache = ChunkCache::new(1 << 20);
    let text = "word ".repeat(20_000);
    let glued = |s: &str| -> Result<Vec<u32>, String> {
        if s.len() == text.len() {
            Ok(vec![0])
        } else {
            Ok(vec![s.len() as u32])
        }
    };
    assert_eq!(cache.encode(&text, glued).unwrap(), vec![0]);
    assert!(cache.disabled());
}

#[test]
fn tokenizers_that_could_tokenize_across_a_cut_are_refused() {
    let ok = serde_json::json!({
        "normalizer": null,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split"}, {"type": "ByteLevel"}]},
        "added_tokens": [{"content": "<|eot_id|>", "lstrip": false, "rstrip": false}],
    });
    assert_eq!(ChunkCache::supports(&ok), Ok(()));
    let refused = |patch: serde_json::Value, why: &str| {
        let mut t = ok.clone();
        for (k, v) in patch.as_object().expect("an object") {
            t[k] = v.clone();
        }
        let err = ChunkCache::supports(&t).expect_err("refused");
        assert!(err.contains(why), "{err}");
    };
    refused(
        serde_json::json!({"normalizer": {"type": "NFC"}}),
        "normalizer",
    );
    refused(
        serde_json::json!({"pre_tokenizer": null}),
        "no pre-tokenizer",
    );
    refused(
        serde_json::json!({"pre_tokenizer": {"type": "Metaspace", "split": false}}),
        "does not split",
    );
    refused(
        serde_json::json!({"pre_tokenizer": {"type": "UnicodeScripts"}}),
        "UnicodeScripts",
    );
    refused(
        serde_json::json!({"added_tokens": [{"content": "<x>", "rstrip": true}]}),
        "strips whitespace",
    );
    refused(
        serde_json::json!({"added_tokens": [{"content": "<think> "}]}),
        "holds or strips",
    );
}
