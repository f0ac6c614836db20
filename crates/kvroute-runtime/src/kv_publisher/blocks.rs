//! The blocks a worker holds, rebuilt from its own published events: the dump of an engine that
//! cannot list its cache itself (a real engine behind an adapter only streams events).

use std::collections::HashMap;

use kvroute_protocols::DpRank;
use kvroute_protocols::kv_events::{
    ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheStoreData,
    KvCacheStoredBlockData, LocalBlockHash, StorageTier,
};

/// One held block: when it was stored (dumps list parents before children), what it continues,
/// and the router's content hash.
#[derive(Debug, Clone, Copy)]
struct Held {
    order: u64,
    parent: Option<ExternalSequenceBlockHash>,
    tokens_hash: LocalBlockHash,
}

/// Held blocks per (dp rank, tier), by the engine's block hash. Memory follows the engine's
/// live set: a removed block is forgotten, a cleared lane dropped.
#[derive(Debug, Default)]
pub(super) struct BlockState {
    lanes: HashMap<(DpRank, StorageTier), HashMap<ExternalSequenceBlockHash, Held>>,
    next_order: u64,
}

impl BlockState {
    /// Applies one published event.
    pub(super) fn apply(&mut self, tier: StorageTier, event: &KvCacheEvent) {
        let key = (event.dp_rank, tier);
        match &event.data {
            KvCacheEventData::Stored(store) => {
                let lane = self.lanes.entry(key).or_default();
                let mut parent = store.parent_hash;
                for block in &store.blocks {
                    lane.insert(
                        block.block_hash,
                        Held {
                            order: self.next_order,
                            parent,
                            tokens_hash: block.tokens_hash,
                        },
                    );
                    self.next_order += 1;
                    parent = Some(block.block_hash);
                }
            }
            KvCacheEventData::Removed(removed) => {
                if let Some(lane) = self.lanes.get_mut(&key) {
                    for hash in &removed.block_hashes {
                        lane.remove(hash);
                    }
                    if lane.is_empty() {
                        self.lanes.remove(&key);
                    }
                }
            }
            KvCacheEventData::Cleared => {
                self.lanes.remove(&key);
            }
        }
    }

    /// Every held block as a one-block `Stored` event naming its parent, parents first (in the
    /// order they were stored), with its tier; event ids are left at 0.
    pub(super) fn dump(&self) -> Vec<(StorageTier, KvCacheEvent)> {
        let mut blocks: Vec<_> = self
            .lanes
            .iter()
            .flat_map(|(&(dp_rank, tier), lane)| {
                lane.iter()
                    .map(move |(&hash, held)| (held.order, dp_rank, tier, hash, *held))
            })
            .collect();
        blocks.sort_unstable_by_key(|b| b.0);
        blocks
            .into_iter()
            .map(|(_, dp_rank, tier, block_hash, held)| {
                let data = KvCacheEventData::Stored(KvCacheStoreData {
                    parent_hash: held.parent,
                    blocks: vec![KvCacheStoredBlockData {
                        block_hash,
                        tokens_hash: held.tokens_hash,
                    }],
                });
                (
                    tier,
                    KvCacheEvent {
                        event_id: 0,
                        data,
                        dp_rank,
                    },
                )
            })
            .collect()
    }

    /// How many blocks are held, over every lane.
    pub(super) fn len(&self) -> usize {
        self.lanes.values().map(HashMap::len).sum()
    }
}
