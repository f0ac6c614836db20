//! The synchronous half of the listener: engine events in, router events out. It owns what the
//! listener must remember between batches: which blocks it republished (per dp rank and tier,
//! with their parent, content hash and cache salt), which KV cache group feeds the index, and
//! which lanes it has written to (so that an engine restart can clear them).
//!
//! Invariant: a block is in the table exactly when the router index learned it from this
//! listener, so a continuation whose parent is not in the table would be rejected by the index
//! anyway, and a removal of a block not in it would name a block the index never had.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use kvroute_protocols::DpRank;
use kvroute_protocols::kv_events::{
    ExternalSequenceBlockHash, KvCacheEventData, KvCacheRemoveData, KvCacheStoreData,
    KvCacheStoredBlockData, StorageTier,
};
use kvroute_protocols::zmq_events::{BlockRemoved, BlockStored, EngineEventBatch, EngineKvEvent};

use super::{BlockHasher, BlockSalt, Counters};

/// Most bytes of distinct cache salts the table keeps; a salted block beyond it is not tracked
/// (and so not republished), which keeps the listener's memory bounded whatever salts clients
/// choose.
pub(super) const MAX_SALT_BYTES: usize = 64 << 20;

/// KV cache group kinds (vLLM's `kv_cache_spec_kind`) whose blocks do not hold a whole prefix:
/// such a group never feeds the index.
const PARTIAL_PREFIX_KINDS: [&str; 6] = [
    "sliding_window",
    "sliding_window_mla",
    "chunked_local_attention",
    "mamba",
    "encoder_only_attention",
    "cross_attention",
];

/// One router event to publish.
pub(super) type Output = (DpRank, StorageTier, KvCacheEventData);

/// Engine events in, router events out, with the memory that takes.
pub(super) struct Translator {
    hasher: BlockHasher,
    block_size: Option<u32>,
    counters: Arc<Counters>,
    table: BlockTable,
    /// The KV cache group whose events feed the index, once known (see [`Translator::feeds_stored`]).
    index_group: Option<u32>,
    /// Every (dp rank, tier) lane an event was published to since the last restart.
    seen: BTreeSet<(DpRank, StorageTier)>,
}

impl Translator {
    pub(super) fn new(
        hasher: BlockHasher,
        block_size: Option<u32>,
        max_tracked_blocks: usize,
        counters: Arc<Counters>,
    ) -> Self {
        Self {
            hasher,
            block_size,
            counters,
            table: BlockTable::new(max_tracked_blocks),
            index_group: None,
            seen: BTreeSet::new(),
        }
    }

    /// The router events for one engine batch, in order.
    pub(super) fn batch(&mut self, batch: EngineEventBatch) -> Vec<Output> {
        for error in batch.errors {
            self.counters.decode_errors.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(%error, "skipping an undecodable engine KV event");
        }
        let dp_rank = batch.dp_rank.unwrap_or(0);
        let mut out = Vec::new();
        for event in batch.events {
            let before = out.len();
            match event {
                EngineKvEvent::BlockStored(stored) => self.stored(dp_rank, &stored, &mut out),
                EngineKvEvent::BlockRemoved(removed) => self.removed(dp_rank, &removed, &mut out),
                EngineKvEvent::AllBlocksCleared => {
                    // The event names no medium: it is the device cache's reset.
                    self.table.clear_lane(dp_rank, StorageTier::Device);
                    out.push((dp_rank, StorageTier::Device, KvCacheEventData::Cleared));
                }
            }
            if out.len() > before {
                self.counters.events.fetch_add(1, Ordering::Relaxed);
            }
        }
        for (dp_rank, tier, _) in &out {
            self.seen.insert((*dp_rank, *tier));
        }
        self.set_gauge();
        out
    }

    /// The engine restarted: everything it held is gone. Returns a `Cleared` for every lane this
    /// listener published to, and forgets all it knew.
    pub(super) fn restart(&mut self) -> Vec<Output> {
        let out = std::mem::take(&mut self.seen)
            .into_iter()
            .map(|(dp_rank, tier)| (dp_rank, tier, KvCacheEventData::Cleared))
            .collect();
        self.table = BlockTable::new(self.table.capacity);
        self.index_group = None;
        self.set_gauge();
        out
    }

    fn set_gauge(&self) {
        self.counters
            .tracked_blocks
            .store(self.table.len as u64, Ordering::Relaxed);
    }

    /// Whether a group's events feed the index. Events without a group (vLLM 0.10, SGLang) do.
    /// Otherwise one group is chosen, at the first store of a group whose kind holds whole
    /// prefixes (anything but sliding window, chunked local, mamba, encoder-only or cross
    /// attention; no kind counts as whole), and kept until the engine restarts: vLLM publishes
    /// the same block hashes in every full-attention group, so one of them says all.
    fn feeds_stored(&mut self, stored: &BlockStored) -> bool {
        let Some(group) = stored.group_idx else {
            return true;
        };
        match self.index_group {
            Some(index_group) => group == index_group,
            None => {
                let kind = stored.kv_cache_spec_kind.as_deref();
                let whole = kind.is_none_or(|k| !PARTIAL_PREFIX_KINDS.contains(&k));
                if whole {
                    self.index_group = Some(group);
                }
                whole
            }
        }
    }

    fn feeds_removed(&self, removed: &BlockRemoved) -> bool {
        removed
            .group_idx
            .is_none_or(|group| Some(group) == self.index_group)
    }

    fn stored(&mut self, dp_rank: DpRank, stored: &BlockStored, out: &mut Vec<Output>) {
        let n = stored.block_hashes.len() as u64;
        if n == 0 {
            return;
        }
        let c = self.counters.clone();
        if stored.token_ids.is_empty() {
            // vLLM's offloading placeholder: a block whose tokens the engine did not record.
            c.unhashable_blocks.fetch_add(n, Ordering::Relaxed);
            return;
        }
        if !self.feeds_stored(stored) {
            c.other_group_events.fetch_add(1, Ordering::Relaxed);
            return;
        }
        if let Some(expected) = self.block_size
            && stored.block_size != expected
        {
            self.block_size_mismatch(expected, stored.block_size);
            return;
        }
        let blocks = stored.token_blocks();
        if blocks.len() as u64 != n {
            c.decode_errors.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                hashes = n,
                full_blocks = blocks.len(),
                block_size = stored.block_size,
                "skipping a BlockStored whose hashes and full token blocks differ in number"
            );
            return;
        }
        if stored.lora_id.is_some() && stored.lora_name.is_none() {
            // vLLM 0.10 names a LoRA by number only: the router cannot hash its blocks.
            c.unhashable_blocks.fetch_add(n, Ordering::Relaxed);
            return;
        }
        let lane = (
            dp_rank,
            tier(stored.medium.as_deref(), stored.locality.as_deref()),
        );
        // A continuation inherits its parent's salt: vLLM names the salt on a request's first
        // block only.
        let mut salt = match stored.parent_block_hash {
            None => None,
            Some(parent) => match self.table.get(lane, parent) {
                Some(block) => block.salt.clone(),
                None => {
                    c.orphan_blocks.fetch_add(n, Ordering::Relaxed);
                    return;
                }
            },
        };
        if let Some(event_salt) = stored.cache_salt.as_deref() {
            salt = Some(same_or_new(salt, event_salt));
        }
        let mut run = Run::new(lane, stored.parent_block_hash);
        for (i, (&hash, tokens)) in stored.block_hashes.iter().zip(blocks).enumerate() {
            let rest = n - i as u64;
            let extra = stored.extra_keys.get(i);
            if extra.is_some_and(|e| e.has_content_keys()) {
                // Media, prompt embeddings or unknown keys: tokens do not identify the block, so
                // neither it nor the rest of its chain can be matched by the router.
                c.unhashable_blocks.fetch_add(rest, Ordering::Relaxed);
                break;
            }
            if let Some(block_salt) = extra.and_then(|e| e.cache_salt.as_deref()) {
                salt = Some(same_or_new(salt, block_salt));
            } else if stored.cache_salt.is_none()
                && let Some(known) = self.table.salt_in_other_tiers(lane, hash)
            {
                // vLLM's offloading tiers publish no extra keys; the engine's hash covers the
                // salt, so the same block in another tier has the same one.
                salt = known;
            }
            if self.table.get(lane, hash).is_some() {
                // Already republished (vLLM re-announces reused prefixes): the chain goes on from
                // it without storing it twice.
                run.flush(out);
                run = Run::new(lane, Some(hash));
                continue;
            }
            let tokens_hash = (self.hasher)(
                tokens,
                BlockSalt {
                    lora_name: stored.lora_name.as_deref(),
                    cache_salt: salt.as_deref(),
                },
            );
            if !self.table.insert(lane, hash, Block { salt: salt.clone() }) {
                c.untracked_blocks.fetch_add(rest, Ordering::Relaxed);
                if !self.table.warned_full {
                    self.table.warned_full = true;
                    tracing::warn!(
                        capacity = self.table.capacity,
                        "the ZMQ listener's block table is full: further blocks are not \
                         republished (raise max_tracked_blocks)"
                    );
                }
                break;
            }
            run.blocks.push(KvCacheStoredBlockData {
                block_hash: hash,
                tokens_hash,
            });
        }
        run.flush(out);
    }

    fn removed(&mut self, dp_rank: DpRank, removed: &BlockRemoved, out: &mut Vec<Output>) {
        if !self.feeds_removed(removed) {
            self.counters
                .other_group_events
                .fetch_add(1, Ordering::Relaxed);
            return;
        }
        let lane = (
            dp_rank,
            tier(removed.medium.as_deref(), removed.locality.as_deref()),
        );
        // Only blocks the index learned from us: the others were never republished.
        let block_hashes: Vec<_> = removed
            .block_hashes
            .iter()
            .copied()
            .filter(|&hash| self.table.remove(lane, hash))
            .collect();
        if !block_hashes.is_empty() {
            out.push((
                lane.0,
                lane.1,
                KvCacheEventData::Removed(KvCacheRemoveData { block_hashes }),
            ));
        }
    }

    fn block_size_mismatch(&self, expected: u32, got: u32) {
        let c = &self.counters;
        let _ = c.first_mismatched_block_size.compare_exchange(
            0,
            u64::from(got) + 1,
            Ordering::Relaxed,
            Ordering::Relaxed,
        );
        let count = c.block_size_mismatches.fetch_add(1, Ordering::Relaxed) + 1;
        // Loud but not flooding: the 1st, 2nd, 4th, 8th... mismatch.
        if count.is_power_of_two() {
            tracing::error!(
                engine_block_size = got,
                worker_block_size = expected,
                mismatches = count,
                "engine KV events use {got} tokens per block but this worker hashes {expected}: \
                 its events are skipped and no prefix cached on it can match. Start the engine \
                 with the worker's block size (vLLM: --block-size {expected}; SGLang: \
                 --page-size {expected}) or configure the worker with block size {got}"
            );
        }
    }
}

/// Reuses the parent's salt allocation when the salt is the same.
fn same_or_new(current: Option<Arc<str>>, salt: &str) -> Arc<str> {
    match current {
        Some(current) if &*current == salt => current,
        _ => Arc::from(salt),
    }
}

/// A run of new blocks continuing one parent, published as one `Stored`.
struct Run {
    lane: (DpRank, StorageTier),
    parent: Option<ExternalSequenceBlockHash>,
    blocks: Vec<KvCacheStoredBlockData>,
}

impl Run {
    fn new(lane: (DpRank, StorageTier), parent: Option<ExternalSequenceBlockHash>) -> Self {
        Self {
            lane,
            parent,
            blocks: Vec::new(),
        }
    }

    fn flush(&mut self, out: &mut Vec<Output>) {
        if self.blocks.is_empty() {
            return;
        }
        out.push((
            self.lane.0,
            self.lane.1,
            KvCacheEventData::Stored(KvCacheStoreData {
                parent_hash: self.parent,
                blocks: std::mem::take(&mut self.blocks),
            }),
        ));
    }
}

/// Maps an engine's medium (and vLLM's locality) to a storage tier. vLLM 0.33: `GPU`, `CPU`,
/// `STORAGE` (file system or object store tiers), locality `LOCAL` / `REMOTE`; SGLang 0.5:
/// `GPU`, `CPU_PINNED`, `DISK`, `EXTERNAL`. A remote tier is external whatever its medium; an
/// unknown medium is taken as external (the slowest tier), not as device memory.
pub(super) fn tier(medium: Option<&str>, locality: Option<&str>) -> StorageTier {
    if locality.is_some_and(|l| l.eq_ignore_ascii_case("REMOTE")) {
        return StorageTier::External;
    }
    match medium.map(str::to_ascii_uppercase).as_deref() {
        None | Some("GPU" | "CUDA" | "DEVICE" | "HBM") => StorageTier::Device,
        Some("CPU" | "CPU_PINNED" | "CPU_TIER" | "HOST" | "PINNED" | "DRAM") => {
            StorageTier::HostPinned
        }
        Some("DISK" | "LOCAL_DISK" | "SSD" | "NVME" | "STORAGE") => StorageTier::Disk,
        Some(_) => StorageTier::External,
    }
}

/// One republished block: what a continuation of it needs.
#[derive(Debug, Clone)]
struct Block {
    /// Shared by every block of a salted chain.
    salt: Option<Arc<str>>,
}

/// The republished blocks per (dp rank, tier) lane, bounded in blocks and in salt bytes.
struct BlockTable {
    lanes: BTreeMap<(DpRank, StorageTier), HashMap<u64, Block>>,
    len: usize,
    capacity: usize,
    /// Distinct salts and how many blocks use each, to bound their bytes.
    salts: HashMap<Arc<str>, usize>,
    salt_bytes: usize,
    warned_full: bool,
}

impl BlockTable {
    fn new(capacity: usize) -> Self {
        Self {
            lanes: BTreeMap::new(),
            len: 0,
            capacity,
            salts: HashMap::new(),
            salt_bytes: 0,
            warned_full: false,
        }
    }

    fn get(&self, lane: (DpRank, StorageTier), hash: ExternalSequenceBlockHash) -> Option<&Block> {
        self.lanes.get(&lane)?.get(&hash.0)
    }

    /// The salt of the same block in another tier of the same dp rank, if one holds it.
    fn salt_in_other_tiers(
        &self,
        (dp_rank, tier): (DpRank, StorageTier),
        hash: ExternalSequenceBlockHash,
    ) -> Option<Option<Arc<str>>> {
        StorageTier::ALL
            .into_iter()
            .filter(|&other| other != tier)
            .find_map(|other| self.get((dp_rank, other), hash))
            .map(|block| block.salt.clone())
    }

    /// Adds a block that is not in the lane; false (nothing added) when the table is full.
    fn insert(
        &mut self,
        lane: (DpRank, StorageTier),
        hash: ExternalSequenceBlockHash,
        mut block: Block,
    ) -> bool {
        if self.len >= self.capacity {
            return false;
        }
        if let Some(salt) = block.salt.take() {
            match self.salts.get_key_value(&salt) {
                Some((interned, _)) => block.salt = Some(interned.clone()),
                None if self.salt_bytes + salt.len() > MAX_SALT_BYTES => return false,
                None => {
                    self.salt_bytes += salt.len();
                    block.salt = Some(salt);
                }
            }
            if let Some(salt) = &block.salt {
                *self.salts.entry(salt.clone()).or_insert(0) += 1;
            }
        }
        self.lanes.entry(lane).or_default().insert(hash.0, block);
        self.len += 1;
        true
    }

    /// Removes a block; false when the lane does not hold it.
    fn remove(&mut self, lane: (DpRank, StorageTier), hash: ExternalSequenceBlockHash) -> bool {
        let Some(block) = self.lanes.get_mut(&lane).and_then(|l| l.remove(&hash.0)) else {
            return false;
        };
        self.len -= 1;
        self.release_salt(block.salt);
        true
    }

    fn clear_lane(&mut self, dp_rank: DpRank, tier: StorageTier) {
        let Some(blocks) = self.lanes.remove(&(dp_rank, tier)) else {
            return;
        };
        self.len -= blocks.len();
        for block in blocks.into_values() {
            self.release_salt(block.salt);
        }
    }

    fn release_salt(&mut self, salt: Option<Arc<str>>) {
        let Some(salt) = salt else { return };
        if let Some(users) = self.salts.get_mut(&salt) {
            *users -= 1;
            if *users == 0 {
                self.salts.remove(&salt);
                self.salt_bytes -= salt.len();
            }
        }
    }
}
