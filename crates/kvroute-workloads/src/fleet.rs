//! A simulated fleet that turns requests into one recorded stream of KV events and index queries,
//! with the expected answer of every query, so a benchmark can replay the stream against an index
//! and check each answer.
//!
//! Each trace block id expands deterministically into engine blocks of synthetic tokens. The fleet
//! routes each request to the worker with the lowest cost (blocks to prefill plus a decaying load,
//! as the reference's default), stores the new blocks there and evicts that worker's least
//! recently used leaves beyond its cache size; the blocks each worker holds before a query are the
//! query's expected answer. `crates/kvroute-workloads/benches/trace_replay.rs` (`cargo xtask bench
//! indexer`) and `benches/indexer-compare` both replay what [`Recorded::simulate`] records.

use std::cmp::Reverse;
use std::collections::BTreeSet;

use kvroute_indexer::FastMap;
use kvroute_indexer::hash::{HashSalt, compute_block_hash, compute_seq_hashes};
use kvroute_protocols::kv_events::{
    ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheRemoveData, KvCacheStoreData,
    KvCacheStoredBlockData, LocalBlockHash, RouterEvent, StorageTier,
};

/// The simulated fleet.
#[derive(Debug, Clone)]
pub struct Fleet {
    /// Workers (1 to 64).
    pub workers: usize,
    /// Tokens per engine block.
    pub block_size: usize,
    /// Blocks each worker caches before it evicts.
    pub cache_blocks: usize,
}

/// A fleet that cannot be simulated.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FleetError {
    /// The engine block size does not divide the trace's block size.
    #[error(
        "the trace block size ({trace_block}) must be a positive multiple of the engine block size ({block_size})"
    )]
    BlockSize {
        /// Tokens per trace block id.
        trace_block: usize,
        /// Tokens per engine block.
        block_size: usize,
    },
    /// The number of workers is out of range.
    #[error("a simulated fleet has 1..=64 workers, got {0}")]
    Workers(usize),
}

/// One step of the replay.
#[derive(Debug, Clone, Copy)]
pub enum Op {
    /// Query request `r`.
    Query(usize),
    /// Apply event `i` of [`Recorded::events`].
    Event(usize),
}

/// The recorded stream: queries, their expected answers, and the events between them.
#[derive(Debug)]
pub struct Recorded {
    /// Events and queries in order.
    pub ops: Vec<Op>,
    /// Every event, in order.
    pub events: Vec<RouterEvent>,
    /// Local hashes of every request, concatenated; request `r` is `offsets[r]..offsets[r + 1]`.
    pub local: Vec<LocalBlockHash>,
    /// Bounds of each request in `local`.
    pub offsets: Vec<usize>,
    /// Expected device score of worker `w` for request `r` at `r * workers + w`.
    pub expected: Vec<u32>,
    /// Trace ids of each request, to rebuild its tokens.
    pub ids: Vec<Vec<u64>>,
    /// Workers in the fleet.
    pub workers: usize,
    /// Tokens per engine block.
    pub block_size: usize,
    /// Engine blocks per trace id.
    pub per_id: usize,
    /// Blocks stored by all events.
    pub stored_blocks: u64,
    /// Blocks removed by all events.
    pub removed_blocks: u64,
    /// Leading blocks the chosen worker already held, summed over requests.
    pub matched_blocks: u64,
    /// Blocks held at the end, summed over workers.
    pub final_blocks: u64,
    /// Prompt lengths in tokens.
    pub prompt_tokens: Vec<usize>,
}

impl Recorded {
    /// Simulates `fleet` over `requests` (each `(input_length, hash_ids)`, every id standing for
    /// `trace_block` tokens), recording events and expected answers.
    pub fn simulate(
        requests: &[(usize, Vec<u64>)],
        fleet: &Fleet,
        trace_block: usize,
    ) -> Result<Self, FleetError> {
        if fleet.block_size == 0 || !trace_block.is_multiple_of(fleet.block_size) {
            return Err(FleetError::BlockSize {
                trace_block,
                block_size: fleet.block_size,
            });
        }
        if !(1..=64).contains(&fleet.workers) {
            return Err(FleetError::Workers(fleet.workers));
        }
        Ok(simulate(requests, fleet, trace_block / fleet.block_size))
    }

    /// Request `r`'s local hashes.
    pub fn query(&self, r: usize) -> &[LocalBlockHash] {
        &self.local[self.offsets[r]..self.offsets[r + 1]]
    }

    /// Number of requests.
    pub fn requests(&self) -> usize {
        self.offsets.len() - 1
    }

    /// Request `r`'s prompt: the full engine blocks its local hashes stand for.
    pub fn tokens(&self, r: usize, out: &mut Vec<u32>) {
        out.clear();
        let blocks = self.offsets[r + 1] - self.offsets[r];
        let mut block = vec![0u32; self.block_size];
        'ids: for &id in &self.ids[r] {
            for j in 0..self.per_id {
                if out.len() / self.block_size == blocks {
                    break 'ids;
                }
                block_tokens(id, j, &mut block);
                out.extend_from_slice(&block);
            }
        }
    }
}

/// The tokens of engine block `j` of trace id `id` (any block size).
fn block_tokens(id: u64, j: usize, tokens: &mut [u32]) {
    for (t, tok) in tokens.iter_mut().enumerate() {
        let x = (id << 24) ^ ((j as u64) << 12) ^ t as u64;
        *tok = (x.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40) as u32;
    }
}

/// The engine blocks' local hashes of one trace block.
fn expand(id: u64, per_id: usize, block_size: usize) -> Vec<LocalBlockHash> {
    let salt = HashSalt::default();
    let mut tokens = vec![0u32; block_size];
    (0..per_id)
        .map(|j| {
            block_tokens(id, j, &mut tokens);
            compute_block_hash(&tokens, &salt)
        })
        .collect()
}

/// Per-request decay of a simulated worker's load.
const LOAD_DECAY: f64 = 0.9;

/// What one simulated worker holds: blocks by sequence hash with their LRU stamp and depth.
#[derive(Default)]
struct SimWorker {
    held: FastMap<u64, (u64, u32)>,
    lru: BTreeSet<(u64, Reverse<u32>, u64)>,
    /// Blocks prefilled here recently, decaying by [`LOAD_DECAY`] per request in the fleet.
    load: f64,
    next_event_id: u64,
}

impl SimWorker {
    fn touch(&mut self, seq: u64, depth: u32, stamp: u64) {
        if let Some((old, _)) = self.held.insert(seq, (stamp, depth)) {
            self.lru.remove(&(old, Reverse(depth), seq));
        }
        self.lru.insert((stamp, Reverse(depth), seq));
    }

    fn event(&mut self, worker: usize, data: KvCacheEventData) -> RouterEvent {
        let event_id = self.next_event_id;
        self.next_event_id += 1;
        RouterEvent {
            worker_id: worker as u64,
            storage_tier: StorageTier::Device,
            event: KvCacheEvent {
                event_id,
                data,
                dp_rank: 0,
            },
        }
    }
}

/// Engine block ids are opaque to the index; derive them from the sequence hash like vLLM does.
fn ext_of(seq: u64) -> ExternalSequenceBlockHash {
    ExternalSequenceBlockHash(seq ^ 0x5bd1_e995_5bd1_e995)
}

fn simulate(requests: &[(usize, Vec<u64>)], fleet: &Fleet, per_id: usize) -> Recorded {
    let trace_block = per_id * fleet.block_size;
    let mut by_id: FastMap<u64, Vec<LocalBlockHash>> = FastMap::default();
    let mut sims: Vec<SimWorker> = (0..fleet.workers).map(|_| SimWorker::default()).collect();
    let mut w = Recorded {
        ops: Vec::new(),
        events: Vec::new(),
        local: Vec::new(),
        offsets: vec![0],
        expected: Vec::new(),
        ids: Vec::with_capacity(requests.len()),
        workers: fleet.workers,
        block_size: fleet.block_size,
        per_id,
        stored_blocks: 0,
        removed_blocks: 0,
        matched_blocks: 0,
        final_blocks: 0,
        prompt_tokens: Vec::with_capacity(requests.len()),
    };
    let mut scores = vec![0u32; fleet.workers];
    for (r, (input, ids)) in requests.iter().enumerate() {
        let start = w.local.len();
        for (k, &id) in ids.iter().enumerate() {
            let covered = input.saturating_sub(k * trace_block) / fleet.block_size;
            let blocks = by_id
                .entry(id)
                .or_insert_with(|| expand(id, per_id, fleet.block_size));
            w.local.extend_from_slice(&blocks[..covered.min(per_id)]);
        }
        w.offsets.push(w.local.len());
        w.ids.push(ids.clone());
        w.prompt_tokens.push(*input);
        let local = &w.local[start..];
        let chain = compute_seq_hashes(local);
        for (s, sim) in scores.iter_mut().zip(&sims) {
            *s = chain
                .iter()
                .take_while(|h| sim.held.contains_key(&h.0))
                .count() as u32;
        }
        w.expected.extend_from_slice(&scores);
        w.ops.push(Op::Query(r));
        // Cost as in the reference's default: blocks to prefill plus the worker's load (blocks
        // routed to it recently, decaying), lower is better; ties to the lower load, then id.
        let n = chain.len() as f64;
        let best = (0..fleet.workers)
            .min_by(|&a, &b| {
                let cost = |i: usize| n - f64::from(scores[i]) + sims[i].load;
                cost(a)
                    .total_cmp(&cost(b))
                    .then(sims[a].load.total_cmp(&sims[b].load))
            })
            .unwrap_or(0);
        for sim in &mut sims {
            sim.load *= LOAD_DECAY;
        }
        let matched = scores[best] as usize;
        w.matched_blocks += matched as u64;
        let stamp = r as u64 + 1;
        let sim = &mut sims[best];
        sim.load += n - matched as f64;
        for (depth, seq) in chain.iter().enumerate() {
            sim.touch(seq.0, depth as u32, stamp);
        }
        if matched < chain.len() {
            let blocks: Vec<KvCacheStoredBlockData> = (matched..chain.len())
                .map(|i| KvCacheStoredBlockData {
                    block_hash: ext_of(chain[i].0),
                    tokens_hash: local[i],
                })
                .collect();
            w.stored_blocks += blocks.len() as u64;
            let data = KvCacheEventData::Stored(KvCacheStoreData {
                parent_hash: matched.checked_sub(1).map(|i| ext_of(chain[i].0)),
                blocks,
            });
            w.ops.push(Op::Event(w.events.len()));
            w.events.push(sim.event(best, data));
        }
        let mut evicted = Vec::new();
        while sim.held.len() > fleet.cache_blocks {
            let Some((_, _, seq)) = sim.lru.pop_first() else {
                break;
            };
            sim.held.remove(&seq);
            evicted.push(ext_of(seq));
        }
        if !evicted.is_empty() {
            w.removed_blocks += evicted.len() as u64;
            let data = KvCacheEventData::Removed(KvCacheRemoveData {
                block_hashes: evicted,
            });
            w.ops.push(Op::Event(w.events.len()));
            w.events.push(sim.event(best, data));
        }
    }
    w.final_blocks = sims.iter().map(|s| s.held.len() as u64).sum();
    w
}

#[cfg(test)]
mod tests;
