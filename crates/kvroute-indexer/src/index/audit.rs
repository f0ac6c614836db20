//! Snapshots and self-checks of the index: dump, rebuild, content equality, consistency.

use kvroute_protocols::WorkerWithDpRank;
use kvroute_protocols::kv_events::{
    ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheStoreData,
    KvCacheStoredBlockData, LocalBlockHash, RouterEvent, StorageTier,
};

use super::{INLINE_SLOTS, KvIndex, TIERS};
use crate::fasthash::FastMap;
use crate::table::U64Map;

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
