//! A fast hasher for keys that are already hashes or small integers.
//!
//! Sequence hashes are xxh3 outputs and need no mixing, but engines' block ids may be small
//! sequential integers, so one folded 64x64->128 multiply spreads every key over all bits. It is
//! several times cheaper than SipHash and needs no third-party crate. Not DoS-resistant: the keys
//! come from our own workers, not from clients.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};

/// Multiplier from the golden ratio; odd, with well-spread bits.
const K: u64 = 0x9E37_79B9_7F4A_7C15;

/// A hash map keyed by hashes or small integers, using [`FastHasher`].
pub type FastMap<K, V> = HashMap<K, V, FastBuildHasher>;

/// Builds [`FastHasher`]s; stateless, so every map hashes the same way (deterministic).
#[derive(Debug, Clone, Copy, Default)]
pub struct FastBuildHasher;

impl BuildHasher for FastBuildHasher {
    type Hasher = FastHasher;

    #[inline]
    fn build_hasher(&self) -> FastHasher {
        FastHasher(0)
    }
}

/// A folded-multiply hasher for integer keys.
#[derive(Debug, Clone, Copy)]
pub struct FastHasher(u64);

#[inline]
pub(crate) fn fold_mul(a: u64, b: u64) -> u64 {
    let full = u128::from(a) * u128::from(b);
    (full as u64) ^ ((full >> 64) as u64)
}

impl Hasher for FastHasher {
    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }

    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        // Only reached for non-integer keys; correctness matters here, not speed.
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(word));
        }
    }

    #[inline]
    fn write_u64(&mut self, i: u64) {
        self.0 = fold_mul(self.0 ^ i, K);
    }

    #[inline]
    fn write_u32(&mut self, i: u32) {
        self.write_u64(u64::from(i));
    }

    #[inline]
    fn write_usize(&mut self, i: usize) {
        self.write_u64(i as u64);
    }
}
