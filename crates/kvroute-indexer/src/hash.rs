//! Block hashing compatible with the reference router.
//!
//! A block's local hash is xxh3-64 over the little-endian bytes of its full block of `u32`
//! tokens, seeded with [`XXH3_SEED`] (1337) unless a [`HashSalt`] (LoRA adapter, cache namespace)
//! changes the seed. Trailing partial blocks are never hashed. The sequence hash chains the local
//! hashes so that one value names a whole prefix: the first block's sequence hash is its local
//! hash, every later one is `xxh3_64(prev_seq.to_le_bytes() ++ local.to_le_bytes(), 1337)`.

use kvroute_protocols::kv_events::LocalBlockHash;
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// The seed of every xxh3 hash in the reference router.
pub const XXH3_SEED: u64 = 1337;

/// The hash of a whole prefix of blocks, ending at one block: position is implied by the chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SequenceHash(pub u64);

/// What separates caches that must never share blocks: the LoRA adapter and a cache namespace.
///
/// The default salt (no adapter, no namespace) hashes exactly as the reference does, with seed
/// 1337. Each present, non-empty string adds its own xxh3 hash to the seed (the adapter's with
/// inner seed 0, the namespace's with inner seed 1, as the reference derives it), so an adapter
/// named like a namespace still hashes differently.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct HashSalt {
    seed: u64,
}

impl Default for HashSalt {
    fn default() -> Self {
        Self { seed: XXH3_SEED }
    }
}

impl HashSalt {
    /// The salt of requests served by LoRA adapter `lora_name` (empty means no adapter).
    pub fn lora(lora_name: &str) -> Self {
        Self::new(Some(lora_name), None)
    }

    /// The salt of requests in cache namespace `namespace` (empty means none).
    pub fn namespace(namespace: &str) -> Self {
        Self::new(None, Some(namespace))
    }

    /// The salt for an optional adapter and an optional namespace; empty strings count as absent.
    pub fn new(lora_name: Option<&str>, namespace: Option<&str>) -> Self {
        let mut seed = XXH3_SEED;
        if let Some(name) = lora_name.filter(|s| !s.is_empty()) {
            seed = seed.wrapping_add(xxh3_64_with_seed(name.as_bytes(), 0));
        }
        if let Some(ns) = namespace.filter(|s| !s.is_empty()) {
            seed = seed.wrapping_add(xxh3_64_with_seed(ns.as_bytes(), 1));
        }
        Self { seed }
    }

    /// The xxh3 seed used for block hashes under this salt.
    pub const fn seed(&self) -> u64 {
        self.seed
    }
}

/// The local hash of one block of tokens (the caller passes exactly one block).
pub fn compute_block_hash(tokens: &[u32], salt: &HashSalt) -> LocalBlockHash {
    // Engines' blocks are small (16 to 64 tokens): hash them from the stack, no allocation.
    if tokens.len() <= 64 {
        let mut buf = [0u8; 256];
        for (dst, t) in buf.chunks_exact_mut(4).zip(tokens) {
            dst.copy_from_slice(&t.to_le_bytes());
        }
        return LocalBlockHash(xxh3_64_with_seed(&buf[..tokens.len() * 4], salt.seed));
    }
    let mut scratch = Vec::new();
    hash_tokens(tokens, &[], salt.seed, &mut scratch)
}

/// The local hashes of every full block of `tokens`; a trailing partial block is not hashed and a
/// `block_size` of zero yields no blocks.
pub fn compute_block_hashes(
    tokens: &[u32],
    block_size: usize,
    salt: &HashSalt,
) -> Vec<LocalBlockHash> {
    if block_size == 0 {
        return Vec::new();
    }
    let mut scratch = Vec::with_capacity(block_size * 4);
    tokens
        .chunks_exact(block_size)
        .map(|chunk| hash_tokens(chunk, &[], salt.seed, &mut scratch))
        .collect()
}

/// Like [`compute_block_hashes`], folding multimodal media hashes into the blocks they touch.
///
/// `block_mm_hashes[i]` lists the media hashes of block `i` (missing or empty means a text-only
/// block). They are sorted and appended as little-endian `u64`s after the block's token bytes, as
/// the reference does, so blocks with the same placeholder tokens but different images differ.
pub fn compute_block_hashes_with_mm<M: AsRef<[u64]>>(
    tokens: &[u32],
    block_size: usize,
    salt: &HashSalt,
    block_mm_hashes: &[M],
) -> Vec<LocalBlockHash> {
    if block_size == 0 {
        return Vec::new();
    }
    let mut scratch = Vec::with_capacity(block_size * 4);
    let mut sorted = Vec::new();
    tokens
        .chunks_exact(block_size)
        .enumerate()
        .map(|(i, chunk)| {
            sorted.clear();
            if let Some(mm) = block_mm_hashes.get(i) {
                sorted.extend_from_slice(mm.as_ref());
                sorted.sort_unstable();
            }
            hash_tokens(chunk, &sorted, salt.seed, &mut scratch)
        })
        .collect()
}

/// The sequence hash after `local`, continuing the prefix ending at `prev` (`None` at the start).
#[inline]
pub fn next_seq_hash(prev: Option<SequenceHash>, local: LocalBlockHash) -> SequenceHash {
    match prev {
        None => SequenceHash(local.0),
        Some(prev) => {
            let mut bytes = [0u8; 16];
            bytes[..8].copy_from_slice(&prev.0.to_le_bytes());
            bytes[8..].copy_from_slice(&local.0.to_le_bytes());
            SequenceHash(xxh3_64_with_seed(&bytes, XXH3_SEED))
        }
    }
}

/// The sequence hashes of a chain of local hashes starting a sequence.
pub fn compute_seq_hashes(local: &[LocalBlockHash]) -> Vec<SequenceHash> {
    let mut out = Vec::with_capacity(local.len());
    let mut prev = None;
    for &l in local {
        let s = next_seq_hash(prev, l);
        out.push(s);
        prev = Some(s);
    }
    out
}

/// Hashes a block's token bytes followed by already sorted media hashes.
#[inline]
fn hash_tokens(tokens: &[u32], mm: &[u64], seed: u64, scratch: &mut Vec<u8>) -> LocalBlockHash {
    // Text blocks on little-endian machines: the tokens' memory already is the little-endian
    // bytes to hash, so hash it in place (no copy; most prompts are text).
    #[cfg(target_endian = "little")]
    if mm.is_empty() {
        return LocalBlockHash(xxh3_64_with_seed(bytemuck::cast_slice(tokens), seed));
    }
    // Copying into a reusable buffer keeps the crate free of unsafe casts; the copy vectorizes and
    // costs far less than the hash itself.
    scratch.clear();
    scratch.resize(tokens.len() * 4 + mm.len() * 8, 0);
    let (tok_bytes, mm_bytes) = scratch.split_at_mut(tokens.len() * 4);
    for (dst, t) in tok_bytes.chunks_exact_mut(4).zip(tokens) {
        dst.copy_from_slice(&t.to_le_bytes());
    }
    for (dst, h) in mm_bytes.chunks_exact_mut(8).zip(mm) {
        dst.copy_from_slice(&h.to_le_bytes());
    }
    LocalBlockHash(xxh3_64_with_seed(scratch, seed))
}
