//! Helpers shared by the integration tests.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use kvroute_indexer::KvIndex;
use kvroute_indexer::hash::{SequenceHash, next_seq_hash};
use kvroute_mocker::{Engine, MockerConfig, Request, RequestId, StepOutput};
use kvroute_protocols::kv_events::{KvCacheEvent, KvCacheEventData, RouterEvent, StorageTier};

/// A small engine: 4-token blocks so that short prompts span several blocks.
pub(crate) fn small_config(num_blocks: u32, max_num_seqs: u32, max_batched: u32) -> MockerConfig {
    MockerConfig {
        block_size: 4,
        num_blocks,
        max_num_seqs,
        max_num_batched_tokens: max_batched,
        ..MockerConfig::default()
    }
}

pub(crate) fn request(id: RequestId, tokens: Vec<u32>, out: u32, session: Option<&str>) -> Request {
    Request {
        id,
        tokens,
        max_output_tokens: out,
        session: session.map(str::to_owned),
    }
}

/// Runs one wake-up at a time until `until` (or until idle when `None`), calling `each` after
/// every wake-up with what it produced.
pub(crate) fn run(
    engine: &mut Engine,
    until: Option<Duration>,
    mut each: impl FnMut(&Engine, &StepOutput),
) {
    while let Some(t) = engine.next_wakeup() {
        if until.is_some_and(|u| t > u) {
            break;
        }
        let out = engine.advance_to(t);
        each(engine, &out);
    }
    if let Some(u) = until {
        let out = engine.advance_to(u);
        each(engine, &out);
    }
}

/// A naive model of what a router learns from the events: the set of cached blocks, checking that
/// every parent is known, every removal names a cached block and ids count up by one.
#[derive(Debug, Default)]
pub(crate) struct EventModel {
    blocks: HashMap<u64, ()>,
    next_id: u64,
}

impl EventModel {
    pub(crate) fn apply(&mut self, event: &KvCacheEvent) {
        assert_eq!(
            event.event_id, self.next_id,
            "event ids must count up by one"
        );
        self.next_id += 1;
        match &event.data {
            KvCacheEventData::Stored(data) => {
                let mut parent = data.parent_hash.map(|p| {
                    assert!(self.blocks.contains_key(&p.0), "parent {p:?} is not cached");
                    SequenceHash(p.0)
                });
                for block in &data.blocks {
                    // The engine's block hash is the sequence hash of the chain.
                    let seq = next_seq_hash(parent, block.tokens_hash);
                    assert_eq!(block.block_hash.0, seq.0, "block hash is the sequence hash");
                    assert!(
                        self.blocks.insert(seq.0, ()).is_none(),
                        "stored twice: {seq:?}"
                    );
                    parent = Some(seq);
                }
            }
            KvCacheEventData::Removed(data) => {
                for h in &data.block_hashes {
                    assert!(
                        self.blocks.remove(&h.0).is_some(),
                        "removed unknown block {h:?}"
                    );
                }
            }
            KvCacheEventData::Cleared => self.blocks.clear(),
        }
    }

    pub(crate) fn cached(&self) -> Vec<u64> {
        let mut out: Vec<u64> = self.blocks.keys().copied().collect();
        out.sort_unstable();
        out
    }
}

/// Feeds events into a kvroute-indexer index as worker `worker_id`, asserting none is refused.
pub(crate) fn apply_to_index(index: &mut KvIndex, worker_id: u64, events: &[KvCacheEvent]) {
    for event in events {
        let outcome = index.apply_event(&RouterEvent {
            worker_id,
            storage_tier: StorageTier::Device,
            event: event.clone(),
        });
        assert_eq!(outcome.gap, None, "no event may be lost");
        assert_eq!(outcome.result, Ok(()), "the index accepts every event");
    }
}

/// The blocks the index holds for `worker_id`, as sorted external hashes; also checks that the
/// index's own sequence hash of each block equals the engine's block hash.
pub(crate) fn index_blocks(index: &KvIndex, worker_id: u64) -> Vec<u64> {
    let mut seen = HashSet::new();
    for event in index.dump().filter(|e| e.worker_id == worker_id) {
        if let KvCacheEventData::Stored(data) = &event.event.data {
            for block in &data.blocks {
                assert_eq!(
                    block.block_hash.0, block.tokens_hash.0,
                    "index sequence hash"
                );
                seen.insert(block.block_hash.0);
            }
        }
    }
    let mut out: Vec<u64> = seen.into_iter().collect();
    out.sort_unstable();
    out
}
