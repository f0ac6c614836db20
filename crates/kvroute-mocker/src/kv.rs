//! The paged KV cache: a fixed pool of blocks with reference counts, a prefix cache keyed by
//! sequence hash, LRU eviction of cached blocks nobody uses, and the KV events a vLLM engine
//! would publish for them.
//!
//! A block is *used* while some sequence or session holds a reference, otherwise *free*. A free
//! block is either uncached (no content worth keeping) or cached (its sequence hash is in the
//! prefix cache, and it sits in the LRU list). Allocation takes uncached free blocks first and
//! then evicts the least recently freed cached block, emitting `Removed`; vLLM takes both from one
//! queue, which evicts cached content sooner than needed, and this pool deliberately does not.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use kvroute_indexer::hash::SequenceHash;
use kvroute_protocols::kv_events::{
    ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheRemoveData, KvCacheStoreData,
    KvCacheStoredBlockData, LocalBlockHash,
};

/// The index of a physical block in the pool.
pub(crate) type BlockId = u32;

const NIL: BlockId = BlockId::MAX;

/// Sequence hashes are already uniformly distributed, so hashing them again only costs time.
#[derive(Default)]
pub(crate) struct IdentityHasher(u64);

impl Hasher for IdentityHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8) | u64::from(b);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

pub(crate) type IdMap<V> = HashMap<u64, V, BuildHasherDefault<IdentityHasher>>;

#[derive(Debug, Clone, Copy)]
struct Block {
    refs: u32,
    /// The sequence hash this block is registered under in the prefix cache.
    cached: Option<SequenceHash>,
    prev: BlockId,
    next: BlockId,
}

/// One block that just became full, to be registered in the prefix cache.
#[derive(Debug, Clone, Copy)]
pub(crate) struct FullBlock {
    pub(crate) block: BlockId,
    pub(crate) parent: Option<SequenceHash>,
    pub(crate) seq: SequenceHash,
    pub(crate) local: LocalBlockHash,
}

/// The block pool plus the event log of everything cached and evicted.
#[derive(Debug)]
pub(crate) struct BlockPool {
    blocks: Vec<Block>,
    uncached_free: Vec<BlockId>,
    lru_head: BlockId,
    lru_tail: BlockId,
    lru_len: usize,
    used: usize,
    cache: IdMap<BlockId>,
    dp_rank: u32,
    next_event_id: u64,
    events: Vec<KvCacheEvent>,
    evicted: Vec<ExternalSequenceBlockHash>,
}

impl BlockPool {
    pub(crate) fn new(num_blocks: u32, dp_rank: u32) -> Self {
        let blocks = vec![
            Block {
                refs: 0,
                cached: None,
                prev: NIL,
                next: NIL,
            };
            num_blocks as usize
        ];
        // Reversed so that allocation pops block 0 first, which keeps traces readable.
        let uncached_free = (0..num_blocks).rev().collect();
        Self {
            blocks,
            uncached_free,
            lru_head: NIL,
            lru_tail: NIL,
            lru_len: 0,
            used: 0,
            cache: IdMap::default(),
            dp_rank,
            next_event_id: 0,
            events: Vec::new(),
            evicted: Vec::new(),
        }
    }

    pub(crate) fn capacity(&self) -> usize {
        self.blocks.len()
    }

    /// Blocks referenced by a sequence or a session.
    pub(crate) fn used(&self) -> usize {
        self.used
    }

    /// Blocks nobody references: uncached ones plus evictable cached ones.
    pub(crate) fn free(&self) -> usize {
        self.uncached_free.len() + self.lru_len
    }

    /// Blocks registered in the prefix cache, used or free.
    pub(crate) fn cached_len(&self) -> usize {
        self.cache.len()
    }

    /// Every sequence hash in the prefix cache, sorted (for tests and dumps).
    pub(crate) fn cached_hashes(&self) -> Vec<u64> {
        let mut out: Vec<u64> = self.cache.keys().copied().collect();
        out.sort_unstable();
        out
    }

    /// The cached block holding `seq`, if any.
    pub(crate) fn lookup(&self, seq: SequenceHash) -> Option<BlockId> {
        self.cache.get(&seq.0).copied()
    }

    /// Whether `block` is referenced by nobody (a prefix hit on it takes it out of the free pool).
    pub(crate) fn is_free(&self, block: BlockId) -> bool {
        self.blocks[block as usize].refs == 0
    }

    /// Takes a reference on a cached block found by [`Self::lookup`].
    pub(crate) fn acquire(&mut self, block: BlockId) {
        if self.blocks[block as usize].refs == 0 {
            self.lru_unlink(block);
            self.used += 1;
        }
        self.blocks[block as usize].refs += 1;
    }

    /// Appends `n` fresh blocks to `out`, evicting cached ones as needed; all or nothing.
    pub(crate) fn allocate(&mut self, n: usize, out: &mut Vec<BlockId>) -> bool {
        if n > self.free() {
            return false;
        }
        for _ in 0..n {
            let block = match self.uncached_free.pop() {
                Some(b) => b,
                None => {
                    let b = self.lru_head;
                    self.lru_unlink(b);
                    if let Some(seq) = self.blocks[b as usize].cached.take() {
                        self.cache.remove(&seq.0);
                        self.evicted.push(ExternalSequenceBlockHash(seq.0));
                    }
                    b
                }
            };
            self.blocks[block as usize].refs = 1;
            self.used += 1;
            out.push(block);
        }
        if !self.evicted.is_empty() {
            let block_hashes = std::mem::take(&mut self.evicted);
            self.emit(KvCacheEventData::Removed(KvCacheRemoveData {
                block_hashes,
            }));
        }
        true
    }

    /// Drops one reference on each block, last block first so that a sequence's tail is evicted
    /// before its (more shareable) head, as vLLM does.
    pub(crate) fn release(&mut self, blocks: &[BlockId]) {
        for &b in blocks.iter().rev() {
            let block = &mut self.blocks[b as usize];
            debug_assert!(block.refs > 0, "released a free block");
            block.refs -= 1;
            if block.refs == 0 {
                self.used -= 1;
                if block.cached.is_some() {
                    self.lru_push_back(b);
                } else {
                    self.uncached_free.push(b);
                }
            }
        }
    }

    /// Registers newly full blocks of one sequence, in order, and emits `Stored` for them.
    ///
    /// A block whose hash another block already holds (two sequences computed the same content
    /// at once) stays uncached: one hash names one block, so a later `Removed` is unambiguous.
    pub(crate) fn register(&mut self, full: &[FullBlock]) {
        let mut parent: Option<SequenceHash> = None;
        let mut chain: Vec<KvCacheStoredBlockData> = Vec::new();
        for fb in full {
            if self.cache.contains_key(&fb.seq.0) {
                self.flush_chain(parent, &mut chain);
                continue;
            }
            if chain.is_empty() {
                parent = fb.parent;
            }
            self.cache.insert(fb.seq.0, fb.block);
            self.blocks[fb.block as usize].cached = Some(fb.seq);
            chain.push(KvCacheStoredBlockData {
                block_hash: ExternalSequenceBlockHash(fb.seq.0),
                tokens_hash: fb.local,
            });
        }
        self.flush_chain(parent, &mut chain);
    }

    /// Moves the pending events out.
    pub(crate) fn drain_events(&mut self, out: &mut Vec<KvCacheEvent>) {
        out.append(&mut self.events);
    }

    fn flush_chain(
        &mut self,
        parent: Option<SequenceHash>,
        chain: &mut Vec<KvCacheStoredBlockData>,
    ) {
        if chain.is_empty() {
            return;
        }
        let blocks = std::mem::take(chain);
        self.emit(KvCacheEventData::Stored(KvCacheStoreData {
            parent_hash: parent.map(|p| ExternalSequenceBlockHash(p.0)),
            blocks,
        }));
    }

    fn emit(&mut self, data: KvCacheEventData) {
        self.events.push(KvCacheEvent {
            event_id: self.next_event_id,
            data,
            dp_rank: self.dp_rank,
        });
        self.next_event_id += 1;
    }

    fn lru_unlink(&mut self, b: BlockId) {
        let Block { prev, next, .. } = self.blocks[b as usize];
        if prev == NIL {
            self.lru_head = next;
        } else {
            self.blocks[prev as usize].next = next;
        }
        if next == NIL {
            self.lru_tail = prev;
        } else {
            self.blocks[next as usize].prev = prev;
        }
        let block = &mut self.blocks[b as usize];
        block.prev = NIL;
        block.next = NIL;
        self.lru_len -= 1;
    }

    fn lru_push_back(&mut self, b: BlockId) {
        let tail = self.lru_tail;
        {
            let block = &mut self.blocks[b as usize];
            block.prev = tail;
            block.next = NIL;
        }
        if tail == NIL {
            self.lru_head = b;
        } else {
            self.blocks[tail as usize].next = b;
        }
        self.lru_tail = b;
        self.lru_len += 1;
    }
}

#[cfg(test)]
mod tests;
