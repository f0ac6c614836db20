use std::cell::Cell;

use proptest::prelude::*;

use super::*;
use crate::tokenizer::fixtures::{SPECIALS, WORD_LEVEL, byte_level_bpe, sentencepiece_bpe, text};
use crate::tokenizer::{HfTokenizer, Tokenizer};

/// `text` with the chat markers between some of its pieces, and unknown characters.
fn chat_text(pieces: &[(u8, u16)]) -> String {
    let mut out = String::new();
    for (i, chunk) in pieces.chunks(7).enumerate() {
        out.push_str(&text(chunk));
        match (chunk[0].0 % 4, i % 3) {
            (0, _) => out.push_str(SPECIALS[i % SPECIALS.len()]),
            (1, 0) => out.push_str("<|im_"),
            (1, _) => out.push_str("\u{1f642}~"),
            _ => {}
        }
    }
    out
}

#[test]
fn bpe_tokenizers_are_encoded_with_fastokens_and_others_are_not() {
    assert!(byte_level_bpe().encodes_with_fastokens());
    assert!(sentencepiece_bpe().encodes_with_fastokens());
    let word_level = HfTokenizer::from_bytes(WORD_LEVEL.as_bytes()).expect("loads");
    assert!(
        !word_level.encodes_with_fastokens(),
        "fastokens has no word-level model"
    );
    assert_eq!(word_level.encode("hello world!").unwrap(), vec![1, 2, 3]);
    assert_eq!(word_level.encoder(), "tokenizers");
    assert_eq!(byte_level_bpe().encoder(), "fastokens");
    assert!(
        !byte_level_bpe()
            .with_fastokens(false)
            .encodes_with_fastokens()
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn fastokens_gives_the_tokenizers_crates_ids(
        pieces in prop::collection::vec((any::<u8>(), any::<u16>()), 1..400),
    ) {
        let input = chat_text(&pieces);
        for (fast, reference) in [
            (byte_level_bpe(), byte_level_bpe().with_fastokens(false)),
            (sentencepiece_bpe(), sentencepiece_bpe().with_fastokens(false)),
        ] {
            // Past the first checks too: the unchecked encodings must agree as well.
            for _ in 0..VERIFY_FIRST + 2 {
                prop_assert_eq!(fast.encode(&input).unwrap(), reference.encode(&input).unwrap());
            }
            prop_assert!(fast.encodes_with_fastokens(), "no check found a difference");
        }
    }
}

/// A `reference` encoder giving `ids`, counting its calls in `calls`.
fn counting<'a>(
    calls: &'a Cell<u64>,
    ids: &'a [u32],
) -> impl Fn(&str) -> Result<Vec<u32>, String> + Copy + 'a {
    move |_| {
        calls.set(calls.get() + 1);
        Ok(ids.to_vec())
    }
}

fn byte_level_encoder() -> FastEncoder {
    let t = byte_level_bpe();
    let json = serde_json::to_value(&t.inner).expect("serializable");
    FastEncoder::load(json).expect("fastokens loads a byte-level BPE")
}

#[test]
fn checks_run_first_and_then_now_and_then() {
    let fast = byte_level_encoder();
    let good = fast.inner.encode("the token and the word").unwrap();
    let calls = Cell::new(0);
    for _ in 0..VERIFY_FIRST + 2 * VERIFY_EVERY {
        let ids = fast
            .encode("the token and the word", counting(&calls, &good))
            .unwrap();
        assert_eq!(ids, good);
    }
    assert!(!fast.disabled());
    // The first VERIFY_FIRST, then encodings VERIFY_EVERY and 2 * VERIFY_EVERY.
    assert_eq!(calls.get(), VERIFY_FIRST + 2);
}

#[test]
fn a_difference_turns_fastokens_off_and_answers_with_the_reference() {
    let fast = byte_level_encoder();
    let calls = Cell::new(0);
    let other = [7, 7, 7];
    assert_eq!(
        fast.encode("the token", counting(&calls, &other)).unwrap(),
        other
    );
    assert!(fast.disabled());
    // From now on the reference answers every text, checked or not.
    for _ in 0..VERIFY_EVERY {
        assert_eq!(fast.encode("in", counting(&calls, &other)).unwrap(), other);
    }
    assert_eq!(calls.get(), 1 + VERIFY_EVERY);
}

#[test]
fn a_differing_check_turns_fastokens_off_for_the_tokenizer() {
    // The same through `HfTokenizer`: a fastokens that disagrees is noticed on the first check.
    let t = byte_level_bpe();
    let fast = t.fast.as_ref().expect("fastokens loaded");
    let ids = fast.encode("the token", |_| Ok(vec![1])).unwrap();
    assert_eq!(ids, vec![1]);
    assert!(!t.encodes_with_fastokens());
    assert_eq!(t.encoder(), "tokenizers", "what /metrics shows");
    // Now encoded by the tokenizers crate.
    let reference = byte_level_bpe().with_fastokens(false);
    assert_eq!(
        t.encode("the token and").unwrap(),
        reference.encode("the token and").unwrap()
    );
}

#[test]
fn a_reference_error_is_returned_on_a_check() {
    let fast = byte_level_encoder();
    let err = fast
        .encode("the", |_| Err("tokenizers failed".to_owned()))
        .unwrap_err();
    assert_eq!(err, "tokenizers failed");
    assert!(!fast.disabled(), "an error is not a difference");
}

#[test]
fn a_tokenizer_loaded_without_fastokens_never_loads_it() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let path = dir.path().join("tokenizer.json");
    let json = serde_json::to_string(&byte_level_bpe().inner).expect("serializable");
    std::fs::write(&path, json).expect("written");
    let with = HfTokenizer::from_file_with(&path, true).expect("loads");
    assert!(with.encodes_with_fastokens());
    let without = HfTokenizer::from_file_with(&path, false).expect("loads");
    assert!(without.fast.is_none(), "fastokens was not loaded");
    assert_eq!(without.encoder(), "tokenizers");
    assert_eq!(
        without.encode("the token and").unwrap(),
        with.encode("the token and").unwrap()
    );
}

#[test]
fn the_warm_up_at_load_leaves_every_first_check_to_the_prompts() {
    // Loading encoded the warm-up text with both encoders, but not as one of the checked
    // encodings: the first VERIFY_FIRST prompts are all still compared.
    let t = byte_level_bpe();
    let fast = t.fast.as_ref().expect("fastokens loaded");
    assert_eq!(fast.encodings.load(Ordering::Relaxed), 0);
    let good = fast.inner.encode("the token").unwrap();
    let calls = Cell::new(0);
    for _ in 0..VERIFY_FIRST {
        fast.encode("the token", counting(&calls, &good)).unwrap();
    }
    assert_eq!(calls.get(), VERIFY_FIRST);
    // And the warm-up text itself encodes as the tokenizers crate encodes it.
    let reference = byte_level_bpe().with_fastokens(false);
    assert_eq!(
        t.encode(super::super::WARM_UP_TEXT).unwrap(),
        reference.encode(super::super::WARM_UP_TEXT).unwrap()
    );
}
