//! Tokenizing a prompt a chunk at a time, with a cache of chunks already seen.
//!
//! A router tokenizes every prompt to hash its KV blocks, and most of a prompt is a prefix some
//! earlier prompt had: the conversation so far, the document, the agent's context. Tokenizing it
//! again was a third of `kvroute serve`'s CPU on the peers bench. [`ChunkCache`] cuts a long text
//! into chunks at fixed byte offsets from its start (each cut moved forward to the next *safe
//! cut*, below), tokenizes each chunk on its own and keeps the ids of chunks it has seen, keyed
//! by a 128-bit hash of the chunk's text. Two prompts sharing a prefix cut it at the same places,
//! so a new turn costs its last chunks only.
//!
//! **Exactness.** Tokenizing chunk by chunk gives the whole text's ids when no token can span a
//! cut and each chunk tokenizes alone as it does in place. A safe cut is just before a single
//! ASCII space that follows a character other than whitespace and precedes an ASCII letter
//! (`"...word| next..."`). Every pre-tokenizer admitted here (whitespace splitting, byte-level
//! with its word regex, Metaspace splitting, a `Split` pattern, digits and punctuation) ends a
//! piece at such a space and starts the next with it or after it, and the model tokenizes each
//! piece alone. What could break it is refused up front ([`ChunkCache::supports`]): a normalizer
//! (one may prepend to the text or join across the cut), no pre-tokenizer or an unknown one,
//! Metaspace without splitting, and added tokens that hold whitespace or strip it around
//! themselves. As a guard against a tokenizer that still tokenizes across such a space, the
//! first chunked encodings and one in [`VERIFY_EVERY`] after them are checked against the whole
//! text's; a difference turns chunking off for good (with a warning) and returns the whole text's
//! ids. The first checks stop after [`VERIFY_FIRST`] encodings or once they covered
//! [`VERIFY_CUTS`] cuts, whichever comes first: a cut is where chunking could go wrong, so a few
//! long prompts prove as much as many short ones, and checking long prompts whole is what costs.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use quick_cache::Weighter;
use quick_cache::sync::Cache;
use serde_json::Value;
use xxhash_rust::xxh3::xxh3_128;

/// Bytes of text between cuts (before moving each to a safe cut).
pub(crate) const CHUNK_BYTES: usize = 1024;
/// Texts shorter than this are tokenized whole: one chunk saves nothing.
const MIN_CHUNKED_BYTES: usize = 2 * CHUNK_BYTES;
/// Token ids the cache holds at most (4 bytes each: 16 MiB).
pub(crate) const CAPACITY_IDS: u64 = 4 << 20;
/// Chunked encodings checked against the whole text's before trusting the tokenizer, at most.
pub(crate) const VERIFY_FIRST: u64 = 32;
/// Cuts the first checks cover before trusting the tokenizer (fewer encodings than
/// [`VERIFY_FIRST`] when prompts are long).
pub(crate) const VERIFY_CUTS: u64 = 128;
/// After the first ones, one chunked encoding in this many is checked.
pub(crate) const VERIFY_EVERY: u64 = 512;

/// Weighs a cached chunk by its ids (at least 1, so that an empty chunk is evictable too).
#[derive(Debug, Clone, Copy)]
struct IdsWeighter;

impl Weighter<u128, Arc<[u32]>> for IdsWeighter {
    fn weight(&self, _key: &u128, ids: &Arc<[u32]>) -> u64 {
        ids.len().max(1) as u64
    }
}

/// The chunk cache of one tokenizer (see the module documentation).
pub(crate) struct ChunkCache {
    chunks: Cache<u128, Arc<[u32]>, IdsWeighter>,
    encodings: AtomicU64,
    /// Cuts covered by the checks so far.
    verified_cuts: AtomicU64,
    disabled: AtomicBool,
}

impl std::fmt::Debug for ChunkCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChunkCache")
            .field("chunks", &self.chunks.len())
            .field("disabled", &self.disabled.load(Ordering::Relaxed))
            .finish()
    }
}

impl ChunkCache {
    /// A cache holding up to `capacity_ids` token ids.
    pub(crate) fn new(capacity_ids: u64) -> Self {
        let estimated_chunks = (capacity_ids / 256).max(16) as usize;
        Self {
            chunks: Cache::with_weighter(estimated_chunks, capacity_ids, IdsWeighter),
            encodings: AtomicU64::new(0),
            verified_cuts: AtomicU64::new(0),
            disabled: AtomicBool::new(false),
        }
    }

    /// Whether a tokenizer, as serialized in its `tokenizer.json` form, tokenizes chunks cut at
    /// safe cuts as it tokenizes them in place; `Err` names what rules it out.
    pub(crate) fn supports(tokenizer: &Value) -> Result<(), String> {
        if !tokenizer.get("normalizer").is_none_or(Value::is_null) {
            return Err("it has a normalizer".to_owned());
        }
        match tokenizer.get("pre_tokenizer") {
            None | Some(Value::Null) => return Err("it has no pre-tokenizer".to_owned()),
            Some(p) => pre_tokenizer_splits_at_spaces(p)?,
        }
        let added = tokenizer
            .get("added_tokens")
            .and_then(Value::as_array)
            .map_or(&[][..], Vec::as_slice);
        for token in added {
            let flag = |name: &str| token.get(name).and_then(Value::as_bool).unwrap_or(false);
            let content = token.get("content").and_then(Value::as_str).unwrap_or("");
            if flag("lstrip") || flag("rstrip") || content.chars().any(char::is_whitespace) {
                return Err(format!(
                    "its added token {content:?} holds or strips whitespace"
                ));
            }
        }
        Ok(())
    }

    /// Whether chunking was turned off after a chunked encoding differed from the whole one.
    pub(crate) fn disabled(&self) -> bool {
        self.disabled.load(Ordering::Relaxed)
    }

    /// Chunks cached now.
    #[cfg(test)]
    pub(crate) fn cached_chunks(&self) -> usize {
        self.chunks.len()
    }

    /// The ids of `text`, with `encode` tokenizing a piece of text alone (the tokenizer's own
    /// encoding, no special tokens added). Short texts, and every text once chunking is off,
    /// are tokenized whole.
    pub(crate) fn encode<E>(&self, text: &str, encode: E) -> Result<Vec<u32>, String>
    where
        E: Fn(&str) -> Result<Vec<u32>, String>,
    {
        if text.len() < MIN_CHUNKED_BYTES || self.disabled() {
            return encode(text);
        }
        let mut ids = Vec::new();
        let mut start = 0;
        let mut cuts = 0u64;
        for end in safe_cuts(text).chain(std::iter::once(text.len())) {
            cuts += u64::from(start > 0);
            let chunk = &text[start..end];
            start = end;
            let key = xxh3_128(chunk.as_bytes());
            if let Some(cached) = self.chunks.get(&key) {
                ids.extend_from_slice(&cached);
                continue;
            }
            let fresh = encode(chunk)?;
            ids.extend_from_slice(&fresh);
            self.chunks.insert(key, fresh.into());
        }
        let n = self.encodings.fetch_add(1, Ordering::Relaxed);
        let first = n < VERIFY_FIRST && self.verified_cuts.load(Ordering::Relaxed) < VERIFY_CUTS;
        if first || n.is_multiple_of(VERIFY_EVERY) {
            self.verified_cuts.fetch_add(cuts, Ordering::Relaxed);
            let whole = encode(text)?;
            if whole != ids {
                let at = whole.iter().zip(&ids).take_while(|(a, b)| a == b).count();
                if !self.disabled.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        first_difference = at,
                        whole = whole.len(),
                        chunked = ids.len(),
                        "tokenizing prompts chunk by chunk gave other ids than tokenizing them \
                         whole with this tokenizer: chunking (and its cache) is off from now on"
                    );
                }
                self.chunks.clear();
                return Ok(whole);
            }
        }
        Ok(ids)
    }
}

/// The safe cuts of `text` (see the module documentation), at most one per [`CHUNK_BYTES`]: the
/// first safe cut at or after each multiple of it, each after the one before.
fn safe_cuts(text: &str) -> impl Iterator<Item = usize> + '_ {
    let len = text.len();
    let mut next_target = CHUNK_BYTES;
    std::iter::from_fn(move || {
        if next_target >= len {
            return None;
        }
        let found = (next_target.max(1)..len.saturating_sub(1)).find(|&p| is_safe_cut(text, p));
        match found {
            Some(p) => {
                next_target = (p / CHUNK_BYTES + 1) * CHUNK_BYTES;
                Some(p)
            }
            None => {
                next_target = len;
                None
            }
        }
    })
}

/// A single ASCII space at byte `p` (`0 < p < text.len() - 1`), after a character that is not
/// whitespace (Unicode's, which whitespace-splitting pre-tokenizers use) and before an ASCII
/// letter.
#[inline]
fn is_safe_cut(text: &str, p: usize) -> bool {
    let bytes = text.as_bytes();
    bytes[p] == b' '
        && bytes[p + 1].is_ascii_alphabetic()
        // `p` holds an ASCII byte, so it is a character boundary.
        && text[..p].chars().next_back().is_some_and(|c| !c.is_whitespace())
}

/// Whether a pre-tokenizer (or each of a sequence's) is one that ends its pieces at a space.
fn pre_tokenizer_splits_at_spaces(p: &Value) -> Result<(), String> {
    let kind = p.get("type").and_then(Value::as_str).unwrap_or("");
    match kind {
        "Sequence" => p
            .get("pretokenizers")
            .and_then(Value::as_array)
            .ok_or_else(|| "its pre-tokenizer sequence lists nothing".to_owned())?
            .iter()
            .try_for_each(pre_tokenizer_splits_at_spaces),
        "Metaspace" if p.get("split").and_then(Value::as_bool) == Some(false) => {
            Err("its Metaspace pre-tokenizer does not split".to_owned())
        }
        "WhitespaceSplit" | "Whitespace" | "ByteLevel" | "Metaspace" | "Split" | "Digits"
        | "Punctuation" => Ok(()),
        other => Err(format!(
            "its pre-tokenizer {other:?} is not one known to split at spaces"
        )),
    }
}

#[cfg(test)]
mod tests;
