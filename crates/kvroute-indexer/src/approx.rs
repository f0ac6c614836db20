//! Approximate mode: for workers that publish no KV events, routing decisions stand in for them.
//!
//! When the router sends a request to a worker it records the request's blocks as *predicted*
//! held there for a TTL. Predictions expire, and a size cap prunes the oldest down to a target
//! ratio of the cap, both driven by the caller's clock (a `Duration` since any fixed origin).

use std::collections::VecDeque;
use std::time::Duration;

use kvroute_protocols::WorkerWithDpRank;
use kvroute_protocols::kv_events::{
    ExternalSequenceBlockHash, KvCacheRemoveData, KvCacheStoreData, KvCacheStoredBlockData,
    LocalBlockHash, StorageTier,
};

use crate::fasthash::FastMap;
use crate::hash::{SequenceHash, next_seq_hash};
use crate::index::{KvIndex, MemoryStats};
use crate::scores::OverlapScores;

/// Settings of approximate mode.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ApproxConfig {
    /// How long a prediction lives unless refreshed by another decision.
    pub ttl: Duration,
    /// The most predicted blocks kept over all workers; beyond it the oldest are pruned.
    pub max_blocks: usize,
    /// Pruning stops at `max_blocks * prune_target_ratio` (0..=1), leaving headroom.
    pub prune_target_ratio: f64,
}

impl Default for ApproxConfig {
    fn default() -> Self {
        Self {
            ttl: Duration::from_secs(120),
            max_blocks: 1 << 20,
            prune_target_ratio: 0.8,
        }
    }
}

/// An index fed by routing decisions instead of events.
///
/// Predicted blocks are stored under their sequence hash as engine block id, so a prefix's parent
/// is always the previous block's sequence hash.
#[derive(Debug)]
pub struct ApproxIndex {
    index: KvIndex,
    config: ApproxConfig,
    /// (worker, sequence hash) -> deadline in nanoseconds of the caller's clock.
    deadlines: FastMap<(WorkerWithDpRank, u64), u64>,
    /// Deadlines in the order they were set; stale entries are skipped when popped. Because the
    /// TTL is fixed this is also deadline order, so expiry and pruning pop from the front.
    queue: VecDeque<(u64, WorkerWithDpRank, u64)>,
    store_scratch: KvCacheStoreData,
    remove_scratch: KvCacheRemoveData,
}

impl ApproxIndex {
    /// An empty approximate index.
    pub fn new(config: ApproxConfig) -> Self {
        Self {
            index: KvIndex::new(),
            config,
            deadlines: FastMap::default(),
            queue: VecDeque::new(),
            store_scratch: KvCacheStoreData {
                parent_hash: None,
                blocks: Vec::with_capacity(1),
            },
            remove_scratch: KvCacheRemoveData {
                block_hashes: Vec::with_capacity(1),
            },
        }
    }

    /// Records that the request with blocks `local` was sent to `worker` at `now`: its blocks are
    /// predicted held there until `now + ttl`. Expires and prunes as needed first.
    pub fn record(&mut self, worker: WorkerWithDpRank, local: &[LocalBlockHash], now: Duration) {
        self.expire(now);
        let deadline = nanos(now.saturating_add(self.config.ttl));
        let mut prev: Option<SequenceHash> = None;
        for &block in local {
            let seq = next_seq_hash(prev, block);
            let fresh = self.deadlines.insert((worker, seq.0), deadline).is_none();
            if fresh {
                self.store_scratch.parent_hash = prev.map(|p| ExternalSequenceBlockHash(p.0));
                self.store_scratch.blocks.clear();
                self.store_scratch.blocks.push(KvCacheStoredBlockData {
                    block_hash: ExternalSequenceBlockHash(seq.0),
                    tokens_hash: block,
                });
                // The parent was stored or refreshed one step earlier, so this cannot fail.
                let _ = self
                    .index
                    .store(worker, StorageTier::Device, &self.store_scratch);
            }
            self.queue.push_back((deadline, worker, seq.0));
            prev = Some(seq);
        }
        if self.deadlines.len() > self.config.max_blocks {
            let target = (self.config.max_blocks as f64 * self.config.prune_target_ratio) as usize;
            self.pop_while(|_, live| live > target);
        }
    }

    /// Drops every prediction whose deadline is at or before `now`.
    pub fn expire(&mut self, now: Duration) {
        let now = nanos(now);
        self.pop_while(|deadline, _| deadline <= now);
    }

    /// Forgets every prediction for every rank of a worker.
    pub fn remove_worker(&mut self, worker_id: u64) {
        self.index.remove_worker(worker_id);
        self.deadlines.retain(|(w, _), _| w.worker_id != worker_id);
        self.queue.retain(|(_, w, _)| w.worker_id != worker_id);
    }

    /// Forgets every prediction for `worker` except the blocks whose sequence hashes are in
    /// `keep` (an engine evidently lost what was predicted: it restarted or evicted it, and
    /// holds only the prompt it just served). Returns how many predictions were dropped.
    pub fn retain_worker(&mut self, worker: WorkerWithDpRank, keep: &[u64]) -> usize {
        let drop: Vec<u64> = self
            .deadlines
            .keys()
            .filter(|(w, seq)| *w == worker && !keep.contains(seq))
            .map(|&(_, seq)| seq)
            .collect();
        for &seq in &drop {
            self.deadlines.remove(&(worker, seq));
            self.remove_scratch.block_hashes.clear();
            self.remove_scratch
                .block_hashes
                .push(ExternalSequenceBlockHash(seq));
            let _ = self
                .index
                .remove(worker, StorageTier::Device, &self.remove_scratch);
        }
        // Their queue entries are stale now and are skipped when popped.
        drop.len()
    }

    /// Overlap of `local` with the predictions (see [`KvIndex::find_matches`]).
    pub fn find_matches(&self, local: &[LocalBlockHash]) -> OverlapScores {
        self.index.find_matches(local)
    }

    /// Predicted blocks currently live, over all workers.
    pub fn live_blocks(&self) -> usize {
        self.deadlines.len()
    }

    /// The underlying index's accounting plus this mode's own tables.
    pub fn memory(&self) -> MemoryStats {
        let mut stats = self.index.memory();
        stats.table_bytes += self.deadlines.capacity() * 33 + self.queue.capacity() * 24;
        stats
    }

    /// Pops queue entries while `more(deadline, live)` holds, removing live predictions.
    fn pop_while(&mut self, more: impl Fn(u64, usize) -> bool) {
        while let Some(&(deadline, worker, seq)) = self.queue.front() {
            if !more(deadline, self.deadlines.len()) {
                break;
            }
            self.queue.pop_front();
            if self.deadlines.get(&(worker, seq)) != Some(&deadline) {
                continue; // Refreshed later; a newer queue entry stands for it.
            }
            self.deadlines.remove(&(worker, seq));
            self.remove_scratch.block_hashes.clear();
            self.remove_scratch
                .block_hashes
                .push(ExternalSequenceBlockHash(seq));
            let _ = self
                .index
                .remove(worker, StorageTier::Device, &self.remove_scratch);
        }
        if self.queue.capacity() > 4096 && self.queue.len() * 4 < self.queue.capacity() {
            self.queue.shrink_to(self.queue.len() * 2);
        }
    }
}

/// Nanoseconds of a clock value, saturating (u64 nanoseconds last 584 years).
fn nanos(t: Duration) -> u64 {
    u64::try_from(t.as_nanos()).unwrap_or(u64::MAX)
}
