//! Encoding with `fastokens`, checked against the `tokenizers` crate.
//!
//! A router tokenizes every prompt only for its ids (to hash its KV blocks), and the
//! `tokenizers` crate builds a whole `Encoding` for each text on the way: a normalized string
//! per word with its byte alignments, every token's string, offsets, masks. On the peers bench
//! that was the largest part of `kvroute serve`'s CPU above SMG's, which tokenizes nothing.
//! `fastokens` (the encoder NVIDIA Dynamo's frontend uses too) encodes a BPE `tokenizer.json`
//! straight to ids: byte-level models (Llama 3, Qwen, DeepSeek), and SentencePiece-style ones
//! with byte fallback. It refuses what it does not implement (word-level and unigram models,
//! some normalizers and pre-tokenizers), and those tokenizers stay with the `tokenizers` crate.
//!
//! **Exactness.** The `tokenizers` crate stays the authority. The first [`VERIFY_FIRST`]
//! encodings, and one in [`VERIFY_EVERY`] after them, are also encoded by it and compared; a
//! difference turns `fastokens` off for good (with a warning) and returns the `tokenizers`
//! crate's ids. A text `fastokens` fails on is encoded by the `tokenizers` crate alone.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use serde_json::Value;

/// Encodings checked against the `tokenizers` crate before trusting `fastokens`.
pub(crate) const VERIFY_FIRST: u64 = 16;
/// After the first ones, one encoding in this many is checked.
pub(crate) const VERIFY_EVERY: u64 = 256;

/// `fastokens` for one tokenizer (see the module documentation).
pub(crate) struct FastEncoder {
    inner: fastokens::Tokenizer,
    encodings: AtomicU64,
    disabled: AtomicBool,
}

impl std::fmt::Debug for FastEncoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FastEncoder")
            .field("encodings", &self.encodings.load(Ordering::Relaxed))
            .field("disabled", &self.disabled())
            .finish()
    }
}

impl FastEncoder {
    /// `fastokens` loaded from a `tokenizer.json` document; `Err` says why it cannot encode it.
    pub(crate) fn load(config: Value) -> Result<Self, String> {
        let inner = fastokens::Tokenizer::from_json(config).map_err(|e| e.to_string())?;
        Ok(Self {
            inner,
            encodings: AtomicU64::new(0),
            disabled: AtomicBool::new(false),
        })
    }

    /// Whether `fastokens` was turned off after its ids differed from the `tokenizers` crate's.
    pub(crate) fn disabled(&self) -> bool {
        self.disabled.load(Ordering::Relaxed)
    }

    /// Encodes `text` and forgets the ids: builds what `fastokens` makes on first use, without
    /// counting as an encoding (the first ones are the checked ones).
    pub(crate) fn warm_up(&self, text: &str) {
        let _ = self.inner.encode(text);
    }

    /// The ids of `text` (no special tokens added), with `reference` encoding it with the
    /// `tokenizers` crate when this encoding is checked, when `fastokens` fails on it and once
    /// `fastokens` is off.
    pub(crate) fn encode<R>(&self, text: &str, reference: R) -> Result<Vec<u32>, String>
    where
        R: FnOnce(&str) -> Result<Vec<u32>, String>,
    {
        if self.disabled() {
            return reference(text);
        }
        let Ok(ids) = self.inner.encode(text) else {
            return reference(text);
        };
        let n = self.encodings.fetch_add(1, Ordering::Relaxed);
        if n < VERIFY_FIRST || n.is_multiple_of(VERIFY_EVERY) {
            let expected = reference(text)?;
            if expected != ids {
                let at = expected
                    .iter()
                    .zip(&ids)
                    .take_while(|(a, b)| a == b)
                    .count();
                if !self.disabled.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        first_difference = at,
                        expected = expected.len(),
                        fastokens = ids.len(),
                        "fastokens gave other ids than the tokenizers crate for this tokenizer: \
                         prompts are tokenized with the tokenizers crate from now on"
                    );
                }
                return Ok(expected);
            }
        }
        Ok(ids)
    }
}

#[cfg(test)]
mod tests;
