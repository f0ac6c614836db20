//! Hash vectors checked against xxh3 computed directly on hand-built byte arrays.

use kvroute_indexer::hash::{
    HashSalt, SequenceHash, XXH3_SEED, compute_block_hash, compute_block_hashes,
    compute_block_hashes_with_mm, compute_seq_hashes, next_seq_hash,
};
use kvroute_protocols::kv_events::LocalBlockHash;
use xxhash_rust::xxh3::xxh3_64_with_seed;

fn le_bytes(tokens: &[u32]) -> Vec<u8> {
    let mut out = Vec::new();
    for t in tokens {
        out.extend_from_slice(&t.to_le_bytes());
    }
    out
}

#[test]
fn default_salt_is_plain_seed_1337() {
    assert_eq!(HashSalt::default().seed(), 1337);
    assert_eq!(XXH3_SEED, 1337);
    let tokens = [1u32, 2, 3, 4];
    // Bytes written out by hand: 1, 2, 3, 4 as little-endian u32.
    let bytes = [1u8, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0, 4, 0, 0, 0];
    assert_eq!(
        compute_block_hash(&tokens, &HashSalt::default()),
        LocalBlockHash(xxh3_64_with_seed(&bytes, 1337))
    );
}

#[test]
fn block_hashes_skip_partial_trailing_block() {
    let tokens: Vec<u32> = (0..37).map(|i| i * 0x0101_0101 + 7).collect();
    let got = compute_block_hashes(&tokens, 16, &HashSalt::default());
    assert_eq!(got.len(), 2);
    for (i, h) in got.iter().enumerate() {
        let expect = xxh3_64_with_seed(&le_bytes(&tokens[i * 16..(i + 1) * 16]), 1337);
        assert_eq!(h.0, expect, "block {i}");
    }
    assert!(compute_block_hashes(&tokens, 0, &HashSalt::default()).is_empty());
    assert!(compute_block_hashes(&tokens[..15], 16, &HashSalt::default()).is_empty());
}

#[test]
fn seq_hash_chain_matches_16_byte_layout() {
    let local = [
        LocalBlockHash(0x1122_3344_5566_7788),
        LocalBlockHash(42),
        LocalBlockHash(7),
    ];
    let seq = compute_seq_hashes(&local);
    assert_eq!(seq[0], SequenceHash(local[0].0));
    let mut bytes = Vec::new();
    bytes.extend_from_slice(&seq[0].0.to_le_bytes());
    bytes.extend_from_slice(&42u64.to_le_bytes());
    assert_eq!(seq[1].0, xxh3_64_with_seed(&bytes, 1337));
    let mut bytes = Vec::new();
    bytes.extend_from_slice(&seq[1].0.to_le_bytes());
    bytes.extend_from_slice(&7u64.to_le_bytes());
    assert_eq!(seq[2].0, xxh3_64_with_seed(&bytes, 1337));
    assert_eq!(next_seq_hash(Some(seq[1]), local[2]), seq[2]);
    assert_eq!(next_seq_hash(None, local[0]), seq[0]);
    assert!(compute_seq_hashes(&[]).is_empty());
}

#[test]
fn salts_separate_adapters_and_namespaces() {
    let tokens = [9u32; 16];
    let plain = compute_block_hash(&tokens, &HashSalt::default());
    let a = compute_block_hash(&tokens, &HashSalt::lora("adapter-a"));
    let b = compute_block_hash(&tokens, &HashSalt::lora("adapter-b"));
    let ns = compute_block_hash(&tokens, &HashSalt::namespace("adapter-a"));
    assert_ne!(plain, a);
    assert_ne!(a, b);
    assert_ne!(
        a, ns,
        "an adapter and a namespace with the same name must differ"
    );
    // Empty strings mean absent, as in the reference.
    assert_eq!(HashSalt::lora(""), HashSalt::default());
    assert_eq!(HashSalt::new(Some(""), Some("")), HashSalt::default());
    let seed = 1337u64.wrapping_add(xxh3_64_with_seed(b"adapter-a", 0));
    assert_eq!(a.0, xxh3_64_with_seed(&le_bytes(&tokens), seed));
    let both = HashSalt::new(Some("l"), Some("n")).seed();
    assert_eq!(
        both,
        1337u64
            .wrapping_add(xxh3_64_with_seed(b"l", 0))
            .wrapping_add(xxh3_64_with_seed(b"n", 1))
    );
}

#[test]
fn multimodal_hashes_fold_into_their_block_only() {
    let tokens: Vec<u32> = (0..32).collect();
    let mm: Vec<Vec<u64>> = vec![vec![], vec![30, 10]];
    let got = compute_block_hashes_with_mm(&tokens, 16, &HashSalt::default(), &mm);
    let plain = compute_block_hashes(&tokens, 16, &HashSalt::default());
    assert_eq!(got[0], plain[0]);
    let mut bytes = le_bytes(&tokens[16..]);
    bytes.extend_from_slice(&10u64.to_le_bytes());
    bytes.extend_from_slice(&30u64.to_le_bytes());
    assert_eq!(got[1].0, xxh3_64_with_seed(&bytes, 1337));
    // Order of media within a block does not matter.
    let swapped: Vec<Vec<u64>> = vec![vec![], vec![10, 30]];
    assert_eq!(
        compute_block_hashes_with_mm(&tokens, 16, &HashSalt::default(), &swapped),
        got
    );
}

#[test]
fn single_block_hash_agrees_with_the_sequence_version_at_every_size() {
    for len in [1usize, 15, 16, 64, 65, 200] {
        let tokens: Vec<u32> = (0..len as u32)
            .map(|i| i.wrapping_mul(0x0100_0193))
            .collect();
        let salt = HashSalt::lora("x");
        assert_eq!(
            compute_block_hash(&tokens, &salt),
            compute_block_hashes(&tokens, len, &salt)[0],
            "len {len}"
        );
        assert_eq!(
            compute_block_hash(&tokens, &salt).0,
            xxh3_64_with_seed(&le_bytes(&tokens), salt.seed())
        );
    }
}
