//! Snapshots and self-checks of the index: dump, rebuild, content equality, consistency.

use kvroute_protocols::WorkerWithDpRank;
use kvroute_protocols::kv_events::{
    ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheStoreData,
    KvCacheStoredBlockData, LocalBlockHash, RouterEvent, StorageTier,
};

use super::nodes::{Loc, Parent};
use super::{INLINE_SLOTS, KvIndex, TIERS};
use crate::fasthash::FastMap;
use crate::hash::{SequenceHash, next_seq_hash};
use crate::table::U64Map;

/// One worker rank's blocks in one storage tier, in the index's layout (see
/// [`KvIndex::dump_lanes`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaneDump {
    /// The worker rank.
    pub worker: WorkerWithDpRank,
    /// The tier.
    pub tier: StorageTier,
    /// `(engine block id, sequence hash, local hash)` of each block held, in layout order.
    pub blocks: Vec<(u64, u64, u64)>,
}

impl KvIndex {
    /// The index's content as `Stored` events, one per held block: a snapshot to rebuild from.
    ///
    /// Each event is a one-block chain with no parent whose `tokens_hash` carries the block's
    /// *sequence* hash (the first block of a chain is its own sequence hash), so applying the
    /// events to an empty index reproduces this one exactly, including the engine block ids that
    /// later events name as parents. It is kvroute's snapshot format, not a replay of engine
    /// events. `event_id`s count up from 0 within the dump.
    pub fn dump(&self) -> impl Iterator<Item = RouterEvent> + '_ {
        let mut next_id = 0u64;
        self.slots
            .iter()
            .flat_map(move |slot| {
                let worker = slot.worker;
                StorageTier::ALL.into_iter().flat_map(move |tier| {
                    let lane = &slot.lanes[tier.index()];
                    let nodes = &self.tiers[tier.index()];
                    worker
                        .into_iter()
                        .flat_map(move |w| lane.seqs(nodes).map(move |(ext, seq)| (w, ext, seq)))
                        .map(move |(w, ext, seq)| (w, tier, ext, seq))
                })
            })
            .map(move |(worker, tier, ext, seq)| {
                let event = snapshot_event(worker, tier, next_id, ext, seq);
                next_id += 1;
                event
            })
    }

    /// Every worker lane's blocks in the index's own layout: a snapshot that
    /// [`KvIndex::restore_lanes`] rebuilds with the same layout.
    ///
    /// [`KvIndex::dump`]'s one-block events carry no local hashes, so an index rebuilt from them
    /// holds every block in a segment of its own: the same answers, but a query looks up every
    /// block of a prompt instead of following it along segments (a 2,000-block prompt went
    /// from under a microsecond to hundreds), in about twice the memory. Here each lane lists its
    /// blocks in layout order with their local hashes, so a block that continues the one before
    /// it (its sequence hash chains from that one's) is put right after it again.
    pub fn dump_lanes(&self) -> impl Iterator<Item = LaneDump> + '_ {
        self.slots
            .iter()
            .filter_map(|state| state.worker.map(|worker| (worker, state)))
            .flat_map(move |(worker, state)| {
                StorageTier::ALL.into_iter().filter_map(move |tier| {
                    let lane = &state.lanes[tier.index()];
                    if lane.blocks.is_empty() {
                        return None;
                    }
                    let nodes = &self.tiers[tier.index()];
                    let mut held: Vec<(u64, u64)> =
                        lane.blocks.iter().map(|(ext, loc)| (loc, ext)).collect();
                    held.sort_unstable();
                    let blocks = held
                        .into_iter()
                        .map(|(loc, ext)| (ext, nodes.seq_at(loc), nodes.local_at(loc)))
                        .collect();
                    Some(LaneDump {
                        worker,
                        tier,
                        blocks,
                    })
                })
            })
    }

    /// Adds the blocks of [`KvIndex::dump_lanes`]'s lanes (or any lanes listed that way) to the
    /// index; returns how many were added. A block whose sequence hash chains from the block
    /// before it in its list continues that one; any other starts a run of its own, on the node
    /// of its sequence hash if that is live. A block id listed twice in a lane is counted as a
    /// duplicate store and skipped. Restore a whole snapshot in one call: each call first lists
    /// the nodes already live, once per call.
    pub fn restore_lanes<'a>(
        &mut self,
        lanes: impl IntoIterator<Item = (WorkerWithDpRank, StorageTier, &'a [(u64, u64, u64)])>,
    ) -> usize {
        // Where each live node of a tier whose table maps only entries sits, so a run can start
        // on a node that is live but not an entry (listed when the first run needs it).
        let mut live: [Option<FastMap<u64, Loc>>; TIERS] = Default::default();
        let mut restored = 0;
        for (worker, tier, blocks) in lanes {
            let slot = self.slot_for(worker);
            let t = tier.index();
            let nodes = &mut self.tiers[t];
            let lane = &mut self.slots[slot as usize].lanes[t];
            lane.blocks.reserve(blocks.len());
            // Whether each block's sequence hash chains from the one before it in the list.
            let chains: Vec<bool> = std::iter::once(false)
                .chain(blocks.windows(2).map(|w| {
                    next_seq_hash(Some(SequenceHash(w[0].1)), LocalBlockHash(w[1].2)).0 == w[1].1
                }))
                .collect();
            let mut prev: Option<Parent> = None;
            for (i, &(ext, seq, local)) in blocks.iter().enumerate() {
                if !(chains[i] && prev.is_some()) {
                    // A run starts: let a segment it starts make room for all of it.
                    let run = 1 + chains[i + 1..].iter().take_while(|&&c| c).count();
                    nodes.expect_chain(run);
                    prev = None;
                }
                let (entry, fresh) = lane.blocks.get_or_insert(ext, 0);
                if !fresh {
                    self.errors.duplicate_store += 1;
                    prev = None;
                    continue;
                }
                let (loc, had) = match prev {
                    Some(p) => nodes.add(Some(p), seq, local, slot),
                    None => {
                        // An entry (every live node, in a tier that maps them all), else a
                        // node listed live.
                        let at = nodes.follow(None, seq, local).or_else(|| {
                            if nodes.every_node() {
                                return None;
                            }
                            let map = live[t].get_or_insert_with(|| nodes.live_nodes().collect());
                            map.get(&seq).copied().filter(|&l| nodes.is_live(l))
                        });
                        match at {
                            Some(loc) => (loc, nodes.hold(loc, slot)),
                            None => nodes.add(None, seq, local, slot),
                        }
                    }
                };
                if let Some(map) = &mut live[t] {
                    map.insert(seq, loc);
                }
                *entry = loc;
                if had {
                    *lane.aliases.entry(loc).or_insert(0) += 1;
                }
                restored += 1;
                prev = Some(Parent {
                    seq,
                    loc: Some(loc),
                });
            }
        }
        restored
    }

    /// Rebuilds an index from a [`KvIndex::dump`] (or any stream of events), ignoring event ids.
    pub fn from_events(events: impl IntoIterator<Item = RouterEvent>) -> Self {
        let mut index = Self::new();
        for event in events {
            // A dump never holds invalid events; anything else is counted like any stream.
            let _ = index.apply_event_untracked(&event);
        }
        index
    }

    /// Whether two indexes hold the same blocks for the same workers (slot numbering aside; a
    /// worker known without blocks counts as absent).
    pub fn same_content(&self, other: &KvIndex) -> bool {
        fn holds(index: &KvIndex, worker: &WorkerWithDpRank, tier: usize) -> Option<U64Map> {
            let lane = &index.slots[*index.slot_of.get(worker)? as usize].lanes[tier];
            let mut seqs = U64Map::default();
            for (ext, seq) in lane.seqs(&index.tiers[tier]) {
                seqs.get_or_insert(ext, seq);
            }
            (!seqs.is_empty()).then_some(seqs)
        }
        let covered = |a: &KvIndex, b: &KvIndex| {
            a.slot_of.keys().all(|worker| {
                (0..TIERS).all(
                    |tier| match (holds(a, worker, tier), holds(b, worker, tier)) {
                        (None, None) => true,
                        (Some(x), Some(y)) => x.same_entries(&y),
                        _ => false,
                    },
                )
            })
        };
        covered(self, other) && covered(other, self)
    }

    /// Checks that the shared nodes agree exactly with the lanes: every held block has its slot's
    /// bit, alias counts match duplicates, and no node outlives its last holder. O(size); for
    /// tests and soaks.
    pub fn check_consistency(&self) -> Result<(), String> {
        for tier in StorageTier::ALL {
            let nodes = &self.tiers[tier.index()];
            nodes.check().map_err(|e| format!("tier {tier:?}: {e}"))?;
            let mut expect: FastMap<u64, FastMap<u32, u32>> = FastMap::default();
            // Where each held node sits, as the lanes say.
            let mut place: FastMap<u64, u64> = FastMap::default();
            for (slot, state) in self.slots.iter().enumerate() {
                let lane = &state.lanes[tier.index()];
                if state.worker.is_none() && !lane.blocks.is_empty() {
                    return Err(format!("free slot {slot} still holds blocks"));
                }
                for (ext, loc) in lane.blocks.iter() {
                    let seq = nodes.seq_at(loc);
                    if !nodes.is_live(loc) {
                        return Err(format!(
                            "slot {slot} block {ext:#x} names a dead position of {seq:#x}"
                        ));
                    }
                    if *place.entry(seq).or_insert(loc) != loc {
                        return Err(format!("node {seq:#x} is live in two places"));
                    }
                    *expect
                        .entry(seq)
                        .or_default()
                        .entry(slot as u32)
                        .or_insert(0) += 1;
                }
            }
            for (slot, state) in self.slots.iter().enumerate() {
                for (&loc, &extra) in &state.lanes[tier.index()].aliases {
                    let seq = nodes.seq_at(loc);
                    let held = expect
                        .get(&seq)
                        .is_some_and(|m| m.contains_key(&(slot as u32)));
                    if extra == 0 || !held {
                        return Err(format!("slot {slot} has a stray alias count for {seq:#x}"));
                    }
                }
            }
            if nodes.len() != expect.len() {
                return Err(format!(
                    "tier {tier:?}: {} nodes, expected {}",
                    nodes.len(),
                    expect.len()
                ));
            }
            for (seq, holders) in &expect {
                let mut lo = 0u64;
                let mut hi: Vec<u64> = Vec::new();
                for (&slot, &count) in holders {
                    let lane = &self.slots[slot as usize].lanes[tier.index()];
                    let extra = lane.aliases.get(&place[seq]).copied().unwrap_or(0);
                    if extra + 1 != count {
                        return Err(format!(
                            "slot {slot} holds {seq:#x} {count}x, aliases {extra}"
                        ));
                    }
                    if slot < INLINE_SLOTS {
                        lo |= 1 << slot;
                    } else {
                        let w = (slot / 64 - 1) as usize;
                        if hi.len() <= w {
                            hi.resize(w + 1, 0);
                        }
                        hi[w] |= 1 << (slot % 64);
                    }
                }
                if nodes.bits_at(place[seq]) != lo {
                    return Err(format!("tier {tier:?} node {seq:#x}: wrong inline bits"));
                }
                let got: Vec<u64> = nodes.spill_at(place[seq]).to_vec();
                let trim = |v: &[u64]| {
                    let n = v.iter().rposition(|w| *w != 0).map_or(0, |i| i + 1);
                    v[..n].to_vec()
                };
                if trim(&got) != trim(&hi) || (hi.iter().all(|w| *w == 0) && !got.is_empty()) {
                    return Err(format!("tier {tier:?} node {seq:#x}: wrong spill bits"));
                }
            }
        }
        Ok(())
    }
}

/// One snapshot block as a `Stored` event (see [`KvIndex::dump`]).
fn snapshot_event(
    worker: WorkerWithDpRank,
    tier: StorageTier,
    event_id: u64,
    ext: u64,
    seq: u64,
) -> RouterEvent {
    RouterEvent {
        worker_id: worker.worker_id,
        storage_tier: tier,
        event: KvCacheEvent {
            event_id,
            data: KvCacheEventData::Stored(KvCacheStoreData {
                parent_hash: None,
                blocks: vec![KvCacheStoredBlockData {
                    block_hash: ExternalSequenceBlockHash(ext),
                    tokens_hash: LocalBlockHash(seq),
                }],
            }),
            dp_rank: worker.dp_rank,
        },
    }
}
