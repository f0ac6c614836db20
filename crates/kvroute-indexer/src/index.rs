//! The index from cached blocks to the workers that hold them.
//!
//! Layout: the shared table of each storage tier maps a block's *sequence hash* (which names the
//! whole prefix ending at that block, so its position is implied) to the set of worker slots
//! holding it, an inline `u64` bitset for slots 0..64 plus a spill table for larger fleets. Each
//! worker lane (worker, dp rank, tier) maps the engine's opaque block ids to where their nodes sit
//! (a live node never moves), which resolves parents of new chains and the blocks named by
//! removals without a lookup by sequence hash. A query computes the request's
//! sequence-hash chain and walks it, intersecting worker sets until none is left; with blocks in
//! slower tiers, a worker leaving the device tier's walk goes on in the host tier, then the disk
//! and external ones, so each tier is credited the blocks that continue the faster tiers' prefix.
//!
//! The nodes of a tier sit in segments along the chains they were stored in (see [`nodes`]): a
//! query follows a long prompt along a segment comparing local hashes, and hashes and looks up
//! only where the prompt leaves a segment.
//!
//! This module applies events; the query walks are in [`query`], dumps and self-checks in
//! [`audit`].
//!
//! Events are applied in pieces of [`BATCH`] blocks: a piece's table slots are peeked at (a
//! prefetch) before they are used, so its cache misses overlap instead of queueing one after
//! another; a stored chain that follows live nodes along a segment (a second worker storing a
//! shared prefix) needs neither hashing nor a lookup, and the new nodes of a piece that go on at
//! the end of a device segment are appended as one run (one capacity check, each array extended
//! once, one probe a block to check the node is not live elsewhere); a removal's run of blocks
//! that end a segment in reverse order (engines evict a chain's deepest blocks first), held by
//! no other worker, is cut off the segment at once.
//!
//! Per indexed block this costs one 16-byte lane entry plus, shared by every worker holding the
//! block, 24 bytes and a bit of segment; the tables sit at 1/3 to 2/3 load (see
//! [`crate::table`]). Only the device nodes a walk or a store cannot reach from their parent
//! (segment starts, nodes after a dead position) have a 16-byte location entry, so about 70
//! bytes a block when workers share little.

use kvroute_protocols::kv_events::{
    ExternalSequenceBlockHash, KvCacheEventData, KvCacheRemoveData, KvCacheStoreData,
    KvCacheStoredBlockData, RouterEvent, StorageTier,
};
use kvroute_protocols::{WorkerId, WorkerWithDpRank};

use crate::error::{ErrorCounts, IndexError};
use crate::fasthash::FastMap;
use crate::gap::{EventGap, EventOrder, GapTracker};
use crate::hash::{SequenceHash, next_seq_hash};
use crate::table::U64Map;

mod audit;
pub use audit::LaneDump;
mod nodes;
mod query;
pub(crate) use query::Gathered;
#[cfg(test)]
mod tests;

use nodes::{INLINE_SLOTS, Loc, Parent, TierNodes};

const TIERS: usize = StorageTier::ALL.len();

/// Blocks of an event handled as one piece: their table accesses are issued together so the
/// cache misses overlap (a piece's scratch lives on the stack).
const BATCH: usize = 32;

/// The KV cache index: apply events, answer overlap queries.
///
/// Single-writer: mutation takes `&mut self`, queries `&self`; wrap it in
/// [`crate::ConcurrentIndex`] to query from many threads while events arrive.
#[derive(Debug)]
pub struct KvIndex {
    tiers: [TierNodes; TIERS],
    slots: Vec<SlotState>,
    slot_of: FastMap<WorkerWithDpRank, u32>,
    free_slots: Vec<u32>,
    gaps: GapTracker,
    errors: ErrorCounts,
    late_events: u64,
    gaps_seen: u64,
}

impl Default for KvIndex {
    fn default() -> Self {
        Self {
            // The device tier's location table keeps only the nodes a walk or a store cannot
            // reach from their parent (see [`nodes`]); slower tiers', whose chains may continue
            // a parent held in another tier, keep every node.
            tiers: std::array::from_fn(|t| TierNodes::new(t != StorageTier::Device.index())),
            slots: Vec::new(),
            slot_of: FastMap::default(),
            free_slots: Vec::new(),
            gaps: GapTracker::default(),
            errors: ErrorCounts::default(),
            late_events: 0,
            gaps_seen: 0,
        }
    }
}

/// Where a chain being stored goes on from: the node its next block continues.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ChainStart(Parent);

/// What applying one event did besides changing the index.
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use]
pub struct ApplyOutcome {
    /// Events lost before this one, which the caller should ask the worker for.
    pub gap: Option<EventGap>,
    /// The first problem found in the event (all problems are counted).
    pub result: Result<(), IndexError>,
}

/// Size of the index, from its own accounting.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryStats {
    /// Distinct (prefix, tier) nodes held by at least one worker.
    pub live_nodes: usize,
    /// Blocks held, summed over workers, ranks and tiers.
    pub indexed_blocks: usize,
    /// Worker ranks known to the index.
    pub workers: usize,
    /// Bytes reserved by the index's tables (buckets times entry size, control bytes included).
    pub table_bytes: usize,
}

/// One worker rank's lanes, one per tier.
#[derive(Debug, Default)]
struct SlotState {
    worker: Option<WorkerWithDpRank>,
    lanes: [Lane; TIERS],
}

/// What one worker rank holds in one tier.
#[derive(Debug, Default)]
struct Lane {
    /// Engine block id -> where its node sits in the tier (a live node never moves).
    blocks: U64Map,
    /// Node location -> holders beyond the first, for engines that cache one prefix under two
    /// block ids. Empty in practice, so it costs one branch.
    aliases: FastMap<Loc, u32>,
}

impl Lane {
    /// Releases one holding of the node at `loc` by `slot`.
    #[inline]
    fn release(&mut self, nodes: &mut TierNodes, loc: Loc, slot: u32) {
        Self::release_in(&mut self.aliases, nodes, loc, slot);
    }

    /// Drops everything, giving the lane's memory back.
    fn clear(&mut self, nodes: &mut TierNodes, slot: u32) {
        for (_, loc) in self.blocks.iter() {
            Self::release_in(&mut self.aliases, nodes, loc, slot);
        }
        self.blocks = U64Map::default();
        self.aliases = FastMap::default();
    }

    /// [`Lane::release`] with the lane's alias counts borrowed apart from its blocks.
    #[inline]
    fn release_in(aliases: &mut FastMap<Loc, u32>, nodes: &mut TierNodes, loc: Loc, slot: u32) {
        if !aliases.is_empty()
            && let Some(extra) = aliases.get_mut(&loc)
        {
            *extra -= 1;
            if *extra == 0 {
                aliases.remove(&loc);
            }
            return;
        }
        nodes.release(loc, slot);
    }

    /// Every held block as (engine block id, sequence hash).
    fn seqs<'a>(&'a self, nodes: &'a TierNodes) -> impl Iterator<Item = (u64, u64)> + 'a {
        self.blocks
            .iter()
            .map(move |(ext, loc)| (ext, nodes.seq_at(loc)))
    }
}

impl KvIndex {
    /// An empty index.
    pub fn new() -> Self {
        Self::default()
    }

    /// Applies one event, checking its id for lost events first. The event is applied even when
    /// a gap precedes it or it arrives late: the gap is the caller's cue to recover what was lost.
    pub fn apply_event(&mut self, event: &RouterEvent) -> ApplyOutcome {
        let worker = WorkerWithDpRank::new(event.worker_id, event.event.dp_rank);
        ApplyOutcome {
            gap: self.track_event_id(worker, event.event.event_id),
            result: self.apply_event_untracked(event),
        }
    }

    /// Records an event id from `worker`, returning the ids lost before it, if any; late ids are
    /// counted (see [`KvIndex::late_events`]).
    pub fn track_event_id(&mut self, worker: WorkerWithDpRank, event_id: u64) -> Option<EventGap> {
        match self.gaps.observe(worker, event_id) {
            EventOrder::InOrder => None,
            EventOrder::Gap(gap) => {
                self.gaps_seen += 1;
                Some(gap)
            }
            EventOrder::Late => {
                self.late_events += 1;
                None
            }
        }
    }

    /// Applies one event without looking at its id (for dumps, recovery replays and predictions).
    pub fn apply_event_untracked(&mut self, event: &RouterEvent) -> Result<(), IndexError> {
        let worker = WorkerWithDpRank::new(event.worker_id, event.event.dp_rank);
        let tier = event.storage_tier;
        match &event.event.data {
            KvCacheEventData::Stored(data) => self.store(worker, tier, data),
            KvCacheEventData::Removed(data) => self.remove(worker, tier, data),
            KvCacheEventData::Cleared => {
                self.clear(worker, tier);
                Ok(())
            }
        }
    }

    /// Applies a chain of stored blocks for one worker lane.
    pub fn store(
        &mut self,
        worker: WorkerWithDpRank,
        tier: StorageTier,
        data: &KvCacheStoreData,
    ) -> Result<(), IndexError> {
        let prev = self.resolve_parent(worker, tier, data.parent_hash)?;
        self.store_chain(worker, tier, prev, &data.blocks, data.blocks.len())
            .1
    }

    /// The node a chain continuing `parent` starts from (`None` starts a sequence).
    pub(crate) fn resolve_parent(
        &mut self,
        worker: WorkerWithDpRank,
        tier: StorageTier,
        parent: Option<ExternalSequenceBlockHash>,
    ) -> Result<Option<ChainStart>, IndexError> {
        let Some(parent) = parent else {
            return Ok(None);
        };
        let found = self.slot_of.get(&worker).and_then(|&slot| {
            let lanes = &self.slots[slot as usize].lanes;
            if let Some(loc) = lanes[tier.index()].blocks.get(parent.0) {
                return Some(Parent {
                    seq: self.tiers[tier.index()].seq_at(loc),
                    loc: Some(loc),
                });
            }
            if tier == StorageTier::Device {
                return None;
            }
            // A block offloaded to a slower tier continues a prefix whose earlier blocks may
            // live in another tier (on the device, typically): the reference keys lower-tier
            // chains by the parent's engine hash alone, wherever that parent is held.
            StorageTier::ALL
                .iter()
                .filter(|&&t| t != tier)
                .find_map(|t| {
                    let loc = lanes[t.index()].blocks.get(parent.0)?;
                    Some(Parent {
                        seq: self.tiers[t.index()].seq_at(loc),
                        loc: None,
                    })
                })
        });
        match found {
            Some(p) => Ok(Some(ChainStart(p))),
            None => {
                self.errors.parent_not_found += 1;
                Err(IndexError::ParentNotFound {
                    worker,
                    tier,
                    parent,
                })
            }
        }
    }

    /// Stores `blocks` as a chain continuing `prev`; returns where the chain ends, so a long
    /// chain can be applied in pieces (with only reads in between), and the first problem found.
    /// `to_come` counts these blocks and those of the chain still to follow in later pieces, so
    /// the tables and a segment the chain grows make room for the whole chain at once.
    pub(crate) fn store_chain(
        &mut self,
        worker: WorkerWithDpRank,
        tier: StorageTier,
        prev: Option<ChainStart>,
        blocks: &[KvCacheStoredBlockData],
        to_come: usize,
    ) -> (Option<ChainStart>, Result<(), IndexError>) {
        debug_assert!(to_come >= blocks.len());
        let slot = self.slot_for(worker);
        let nodes = &mut self.tiers[tier.index()];
        let lane = &mut self.slots[slot as usize].lanes[tier.index()];
        lane.blocks.reserve(to_come);
        nodes.expect_chain(to_come);
        let mut prev = prev.map(|p| p.0);
        let mut first_err = Ok(());
        for piece in blocks.chunks(BATCH) {
            // First plan the piece: while the chain follows live nodes along a segment, each
            // block's node is known without hashing or a lookup; past that, hash the blocks and
            // peek at their location entries. Peek at every block's lane entry too, so the
            // cache misses of the piece overlap instead of queueing one after another.
            let mut plan = [(0u64, None::<Loc>); BATCH];
            let mut at = prev;
            let mut warm = 0u64;
            for (step, block) in plan.iter_mut().zip(piece) {
                let local = block.tokens_hash.0;
                let known = at
                    .and_then(|p| p.loc)
                    .and_then(|loc| nodes.next_live(loc, local));
                let seq = match known {
                    Some(loc) => nodes.seq_at(loc),
                    None => {
                        let seq =
                            next_seq_hash(at.map(|p| SequenceHash(p.seq)), block.tokens_hash).0;
                        warm ^= nodes.peek(seq);
                        seq
                    }
                };
                warm ^= lane.blocks.peek(block.block_hash.0);
                *step = (seq, known);
                at = Some(Parent { seq, loc: known });
            }
            std::hint::black_box(warm);
            let mut i = 0;
            while i < piece.len() {
                let ((seq, known), block) = (plan[i], &piece[i]);
                i += 1;
                let (entry, fresh) = lane.blocks.get_or_insert(block.block_hash.0, 0);
                if !fresh {
                    self.errors.duplicate_store += 1;
                    if first_err.is_ok() {
                        first_err = Err(IndexError::DuplicateStore {
                            worker,
                            tier,
                            block: block.block_hash,
                        });
                    }
                    // The chain goes on from this block's node, wherever it is live (the block
                    // id may have named another prefix): found from the previous block's node.
                    let at = prev.and_then(|p| p.loc);
                    prev = Some(Parent {
                        seq,
                        loc: nodes.follow(at, seq, block.tokens_hash.0),
                    });
                    continue;
                }
                let (loc, had) = match known {
                    Some(loc) => (loc, nodes.hold(loc, slot)),
                    None => nodes.add(prev, seq, block.tokens_hash.0, slot),
                };
                *entry = loc;
                if had {
                    *lane.aliases.entry(loc).or_insert(0) += 1;
                }
                prev = Some(Parent {
                    seq,
                    loc: Some(loc),
                });
                // When this node ends its segment and the plan found no node after it along one
                // (then it found none for the rest of the piece either), the new nodes that follow
                // are appended as one run.
                let rest = &plan[i..piece.len()];
                if slot < INLINE_SLOTS
                    && rest.first().is_some_and(|&(_, k)| k.is_none())
                    && nodes.ends_segment(loc)
                {
                    let blocks = &mut lane.blocks;
                    let n = nodes.append_run(
                        loc,
                        rest,
                        |k| piece[i + k].tokens_hash.0,
                        slot,
                        |k, at| {
                            let (entry, fresh) = blocks.get_or_insert(piece[i + k].block_hash.0, 0);
                            if fresh {
                                *entry = at;
                            }
                            fresh
                        },
                    );
                    if n > 0 {
                        // The run's last node, `n` positions after this one in its segment.
                        prev = Some(Parent {
                            seq: rest[n - 1].0,
                            loc: Some(loc + n as u64),
                        });
                        i += n;
                    }
                }
            }
        }
        (prev.map(ChainStart), first_err)
    }

    /// Applies evictions for one worker lane.
    pub fn remove(
        &mut self,
        worker: WorkerWithDpRank,
        tier: StorageTier,
        data: &KvCacheRemoveData,
    ) -> Result<(), IndexError> {
        self.remove_blocks(worker, tier, &data.block_hashes)
    }

    /// Removes `blocks` from one worker lane, counting those it does not hold.
    pub(crate) fn remove_blocks(
        &mut self,
        worker: WorkerWithDpRank,
        tier: StorageTier,
        blocks: &[ExternalSequenceBlockHash],
    ) -> Result<(), IndexError> {
        let Some(&slot) = self.slot_of.get(&worker) else {
            self.errors.block_not_found += blocks.len() as u64;
            return match blocks.first() {
                Some(&block) => Err(IndexError::BlockNotFound {
                    worker,
                    tier,
                    block,
                }),
                None => Ok(()),
            };
        };
        let nodes = &mut self.tiers[tier.index()];
        let lane = &mut self.slots[slot as usize].lanes[tier.index()];
        let mut first_err = Ok(());
        for piece in blocks.chunks(BATCH) {
            // In stages, each peeking at what the next one reads, so the cache misses of a piece
            // overlap: the lane entries, then the nodes, then the location entries of the nodes
            // that will die.
            let mut warm = 0u64;
            for block in piece {
                warm ^= lane.blocks.peek(block.0);
            }
            std::hint::black_box(warm);
            let mut locs = [None; BATCH];
            for (loc, block) in locs.iter_mut().zip(piece) {
                *loc = lane.blocks.remove(block.0);
                warm ^= loc.map_or(0, |l| nodes.peek_at(l));
            }
            std::hint::black_box(warm);
            for loc in locs.iter().flatten() {
                warm ^= nodes.peek_death(*loc, slot);
            }
            std::hint::black_box(warm);
            let mut k = 0;
            while k < piece.len() {
                let (loc, block) = (locs[k], piece[k]);
                k += 1;
                match loc {
                    Some(top) => {
                        // The blocks that follow at the positions before this one in its segment
                        // (a chain evicted deepest first) die together if nobody else holds them.
                        let run = locs[k..piece.len()]
                            .iter()
                            .zip(1..=nodes::position(top))
                            .take_while(|&(l, back)| *l == Some(top - back as u64))
                            .count();
                        if run > 0
                            && lane.aliases.is_empty()
                            && nodes.release_tail(top, run + 1, slot)
                        {
                            k += run;
                        } else {
                            lane.release(nodes, top, slot);
                        }
                    }
                    None => {
                        self.errors.block_not_found += 1;
                        if first_err.is_ok() {
                            first_err = Err(IndexError::BlockNotFound {
                                worker,
                                tier,
                                block,
                            });
                        }
                    }
                }
            }
        }
        lane.blocks.maybe_shrink();
        nodes.maybe_shrink();
        first_err
    }

    /// Drops every block of one worker lane (the engine cleared its cache in that tier).
    pub fn clear(&mut self, worker: WorkerWithDpRank, tier: StorageTier) {
        if let Some(&slot) = self.slot_of.get(&worker) {
            let nodes = &mut self.tiers[tier.index()];
            self.slots[slot as usize].lanes[tier.index()].clear(nodes, slot);
        }
    }

    /// Removes every rank of a worker, in every tier, and forgets its event ids.
    pub fn remove_worker(&mut self, worker_id: WorkerId) {
        let ranks: Vec<WorkerWithDpRank> = self
            .slot_of
            .keys()
            .filter(|w| w.worker_id == worker_id)
            .copied()
            .collect();
        for rank in ranks {
            self.remove_worker_rank(rank);
        }
        self.gaps.forget_worker(worker_id);
    }

    /// Removes one rank of a worker, in every tier, and forgets its event ids.
    pub fn remove_worker_rank(&mut self, worker: WorkerWithDpRank) {
        self.gaps.forget(worker);
        let Some(slot) = self.slot_of.remove(&worker) else {
            return;
        };
        let state = &mut self.slots[slot as usize];
        for (lane, nodes) in state.lanes.iter_mut().zip(self.tiers.iter_mut()) {
            lane.clear(nodes, slot);
        }
        state.worker = None;
        self.free_slots.push(slot);
    }

    /// Blocks held by `worker` in `tier`.
    pub fn block_count(&self, worker: WorkerWithDpRank, tier: StorageTier) -> usize {
        self.slot_of.get(&worker).map_or(0, |&slot| {
            self.slots[slot as usize].lanes[tier.index()].blocks.len()
        })
    }

    /// Every worker rank known to the index with the blocks it holds in `tier`, appended to
    /// `out` (one pass over the ranks, no lookup).
    pub fn block_counts(&self, tier: StorageTier, out: &mut Vec<(WorkerWithDpRank, u64)>) {
        out.extend(self.slots.iter().filter_map(|s| {
            s.worker
                .map(|w| (w, s.lanes[tier.index()].blocks.len() as u64))
        }));
    }

    /// Every worker rank known to the index (it sent an event and was not removed).
    pub fn workers(&self) -> impl Iterator<Item = WorkerWithDpRank> + '_ {
        self.slots.iter().filter_map(|s| s.worker)
    }

    /// Errors seen so far, by kind.
    pub fn error_counts(&self) -> ErrorCounts {
        self.errors
    }

    /// Events that arrived after a later id from the same worker rank.
    pub fn late_events(&self) -> u64 {
        self.late_events
    }

    /// Gaps in event ids detected so far.
    pub fn gaps_detected(&self) -> u64 {
        self.gaps_seen
    }

    /// The event-id tracker (what id each worker rank is expected to send next).
    pub fn gap_tracker(&self) -> &GapTracker {
        &self.gaps
    }

    /// Size of the index from its own accounting.
    pub fn memory(&self) -> MemoryStats {
        let mut stats = MemoryStats {
            workers: self.slot_of.len(),
            ..MemoryStats::default()
        };
        for nodes in &self.tiers {
            stats.live_nodes += nodes.len();
            stats.table_bytes += nodes.bytes();
        }
        for slot in &self.slots {
            for lane in &slot.lanes {
                stats.indexed_blocks += lane.blocks.len();
                stats.table_bytes += lane.blocks.bytes() + table_bytes(&lane.aliases);
            }
        }
        stats.table_bytes +=
            table_bytes(&self.slot_of) + self.slots.capacity() * std::mem::size_of::<SlotState>();
        stats
    }

    /// The slot of `worker`, assigning a free one on first sight.
    fn slot_for(&mut self, worker: WorkerWithDpRank) -> u32 {
        if let Some(&slot) = self.slot_of.get(&worker) {
            return slot;
        }
        // Reuse the lowest free slot so small fleets stay in the inline bitset.
        let slot = match self.free_slots.iter().enumerate().min_by_key(|(_, s)| **s) {
            Some((i, _)) => self.free_slots.swap_remove(i),
            None => {
                self.slots.push(SlotState::default());
                (self.slots.len() - 1) as u32
            }
        };
        self.slots[slot as usize].worker = Some(worker);
        self.slot_of.insert(worker, slot);
        slot
    }
}

/// Bytes reserved by a hashbrown table of `map`'s capacity: buckets times (entry + control byte).
fn table_bytes<K, V>(map: &FastMap<K, V>) -> usize {
    let cap = map.capacity();
    if cap == 0 {
        return 0;
    }
    let buckets = if cap < 8 {
        (cap + 1).next_power_of_two()
    } else {
        (cap * 8 / 7).next_power_of_two()
    };
    buckets * (std::mem::size_of::<(K, V)>() + 1)
}
