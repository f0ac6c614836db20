use super::*;
use kvroute_indexer::hash::next_seq_hash;

fn full(blocks: &[BlockId], first_local: u64) -> Vec<FullBlock> {
    let mut prev = None;
    blocks
        .iter()
        .enumerate()
        .map(|(i, &block)| {
            let local = LocalBlockHash(first_local + i as u64);
            let seq = next_seq_hash(prev, local);
            let fb = FullBlock {
                block,
                parent: prev,
                seq,
                local,
            };
            prev = Some(seq);
            fb
        })
        .collect()
}

fn events(pool: &mut BlockPool) -> Vec<KvCacheEvent> {
    let mut out = Vec::new();
    pool.drain_events(&mut out);
    out
}

#[test]
fn allocation_is_all_or_nothing() {
    let mut pool = BlockPool::new(4, 0);
    let mut got = Vec::new();
    assert!(!pool.allocate(5, &mut got));
    assert!(got.is_empty());
    assert!(pool.allocate(3, &mut got));
    assert_eq!((pool.used(), pool.free()), (3, 1));
    pool.release(&got);
    assert_eq!((pool.used(), pool.free()), (0, 4));
}

#[test]
fn stored_chain_then_lru_eviction_emits_removed_tail_first() {
    let mut pool = BlockPool::new(3, 2);
    let mut blocks = Vec::new();
    assert!(pool.allocate(3, &mut blocks));
    let chain = full(&blocks, 100);
    pool.register(&chain);
    let stored = events(&mut pool);
    assert_eq!(stored.len(), 1);
    assert_eq!(stored[0].event_id, 0);
    assert_eq!(stored[0].dp_rank, 2);
    let KvCacheEventData::Stored(data) = &stored[0].data else {
        panic!("expected Stored, got {:?}", stored[0].data);
    };
    assert_eq!(data.parent_hash, None);
    let hashes: Vec<u64> = data.blocks.iter().map(|b| b.block_hash.0).collect();
    assert_eq!(hashes, chain.iter().map(|f| f.seq.0).collect::<Vec<_>>());

    pool.release(&blocks);
    assert_eq!((pool.used(), pool.free(), pool.cached_len()), (0, 3, 3));
    // The sequence's last block was freed first, so it is evicted first.
    let mut fresh = Vec::new();
    assert!(pool.allocate(1, &mut fresh));
    assert_eq!(fresh, vec![blocks[2]]);
    let removed = events(&mut pool);
    assert_eq!(removed.len(), 1);
    assert_eq!(removed[0].event_id, 1);
    assert_eq!(
        removed[0].data,
        KvCacheEventData::Removed(KvCacheRemoveData {
            block_hashes: vec![ExternalSequenceBlockHash(chain[2].seq.0)]
        })
    );
    assert_eq!(pool.lookup(chain[2].seq), None);
    assert_eq!(pool.lookup(chain[0].seq), Some(blocks[0]));
}

#[test]
fn uncached_free_blocks_are_used_before_evicting() {
    let mut pool = BlockPool::new(3, 0);
    let mut a = Vec::new();
    assert!(pool.allocate(1, &mut a));
    pool.register(&full(&a, 7));
    pool.release(&a);
    let _ = events(&mut pool);
    let mut b = Vec::new();
    assert!(pool.allocate(2, &mut b));
    assert!(
        events(&mut pool).is_empty(),
        "no eviction while uncached blocks are free"
    );
    assert_eq!(pool.cached_len(), 1);
}

#[test]
fn acquiring_a_free_cached_block_takes_it_out_of_the_free_pool() {
    let mut pool = BlockPool::new(2, 0);
    let mut a = Vec::new();
    assert!(pool.allocate(1, &mut a));
    let chain = full(&a, 1);
    pool.register(&chain);
    pool.release(&a);
    let hit = pool.lookup(chain[0].seq).expect("cached");
    assert!(pool.is_free(hit));
    pool.acquire(hit);
    assert_eq!((pool.used(), pool.free()), (1, 1));
    let mut b = Vec::new();
    assert!(
        !pool.allocate(2, &mut b),
        "the acquired block must not be evicted"
    );
    pool.release(&[hit]);
    assert_eq!((pool.used(), pool.free()), (0, 2));
}

#[test]
fn duplicate_content_is_not_registered_twice_and_splits_the_chain() {
    let mut pool = BlockPool::new(6, 0);
    let mut a = Vec::new();
    assert!(pool.allocate(3, &mut a));
    let chain_a = full(&a, 50);
    pool.register(&chain_a[1..2]);
    let _ = events(&mut pool);
    // A second sequence computes the same three blocks; the middle one is already cached.
    let mut b = Vec::new();
    assert!(pool.allocate(3, &mut b));
    let mut chain_b = full(&b, 50);
    for (fb, block) in chain_b.iter_mut().zip(&b) {
        fb.block = *block;
    }
    pool.register(&chain_b);
    let stored = events(&mut pool);
    let parents: Vec<Option<u64>> = stored
        .iter()
        .map(|e| match &e.data {
            KvCacheEventData::Stored(s) => s.parent_hash.map(|p| p.0),
            other => panic!("expected Stored, got {other:?}"),
        })
        .collect();
    assert_eq!(parents, vec![None, Some(chain_a[1].seq.0)]);
    assert_eq!(pool.cached_len(), 3);
    assert_eq!(pool.lookup(chain_a[1].seq), Some(a[1]));
}
