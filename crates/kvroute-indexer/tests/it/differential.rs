//! Differential test: random event streams applied to the index and to a naive model agree on
//! every query. Streams include duplicate stores, unknown parents, unknown blocks, clears and
//! worker removals, in every storage tier (a slower tier's chain may continue a parent held in
//! another tier, and a query credits each slower tier with the run continuing the faster
//! tiers' match); proptest shrinks a failure to a minimal stream.

use std::collections::BTreeMap;

use kvroute_indexer::hash::{SequenceHash, next_seq_hash};
use kvroute_indexer::{ConcurrentIndex, KvIndex, LaneDump, OverlapScores};
use kvroute_protocols::WorkerWithDpRank;
use kvroute_protocols::kv_events::{
    ExternalSequenceBlockHash as Ext, KvCacheEvent, KvCacheEventData, KvCacheRemoveData,
    KvCacheStoreData, KvCacheStoredBlockData, LocalBlockHash, RouterEvent, StorageTier,
};
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    Event(RouterEvent),
    RemoveWorker(u64),
    Query(Vec<u64>),
}

/// The naive model: per lane, a map from engine id to sequence hash.
#[derive(Default)]
struct Model {
    lanes: BTreeMap<(WorkerWithDpRank, StorageTier), BTreeMap<u64, u64>>,
}

impl Model {
    fn apply(&mut self, ev: &RouterEvent) {
        let key = (
            WorkerWithDpRank::new(ev.worker_id, ev.event.dp_rank),
            ev.storage_tier,
        );
        // A slower tier's chain may continue a parent held in any tier of the worker rank: its
        // own first, then in tier order; a device chain only on the device.
        let parent = |p: u64| {
            let mut tiers = vec![key.1];
            if key.1 != StorageTier::Device {
                tiers.extend(StorageTier::ALL.into_iter().filter(|&t| t != key.1));
            }
            tiers
                .into_iter()
                .find_map(|t| self.lanes.get(&(key.0, t)).and_then(|l| l.get(&p)).copied())
        };
        let parent = match &ev.event.data {
            KvCacheEventData::Stored(data) => data.parent_hash.map(|p| parent(p.0)),
            _ => None,
        };
        let lane = self.lanes.entry(key).or_default();
        match &ev.event.data {
            KvCacheEventData::Stored(data) => {
                let mut prev = match parent {
                    None => None,
                    Some(Some(s)) => Some(SequenceHash(s)),
                    Some(None) => return,
                };
                for b in &data.blocks {
                    let seq = next_seq_hash(prev, b.tokens_hash);
                    prev = Some(seq);
                    lane.entry(b.block_hash.0).or_insert(seq.0);
                }
            }
            KvCacheEventData::Removed(data) => {
                for h in &data.block_hashes {
                    lane.remove(&h.0);
                }
            }
            KvCacheEventData::Cleared => lane.clear(),
        }
    }

    fn remove_worker(&mut self, id: u64) {
        self.lanes.retain(|(w, _), _| w.worker_id != id);
    }

    /// (worker, tier) -> blocks credited, non-zero only: the leading device blocks, then per
    /// slower tier in order the run of blocks held there from where the previous tiers' ended.
    fn query(&self, local: &[u64]) -> BTreeMap<(WorkerWithDpRank, StorageTier), u32> {
        let mut chain = Vec::new();
        let mut prev = None;
        for &l in local {
            let s = next_seq_hash(prev, LocalBlockHash(l));
            chain.push(s.0);
            prev = Some(s);
        }
        let mut out = BTreeMap::new();
        let workers: std::collections::BTreeSet<WorkerWithDpRank> =
            self.lanes.keys().map(|(w, _)| *w).collect();
        for worker in workers {
            let mut at = 0;
            for tier in StorageTier::ALL {
                let Some(lane) = self.lanes.get(&(worker, tier)) else {
                    continue;
                };
                let run = chain[at..]
                    .iter()
                    .take_while(|s| lane.values().any(|v| v == *s))
                    .count();
                if run > 0 {
                    out.insert((worker, tier), run as u32);
                }
                at += run;
            }
        }
        out
    }
}

fn event(worker: u64, dp: u32, tier: StorageTier, id: u64, data: KvCacheEventData) -> RouterEvent {
    RouterEvent {
        worker_id: worker,
        storage_tier: tier,
        event: KvCacheEvent {
            event_id: id,
            data,
            dp_rank: dp,
        },
    }
}

fn op_strategy() -> impl Strategy<Value = Op> {
    let who = (
        1u64..4,
        0u32..2,
        prop_oneof![
            4 => Just(StorageTier::Device),
            2 => Just(StorageTier::HostPinned),
            1 => Just(StorageTier::Disk),
            1 => Just(StorageTier::External),
        ],
    );
    let store = (
        who.clone(),
        proptest::option::weighted(0.6, 1u64..10),
        proptest::collection::vec((1u64..10, 1u64..4), 1..5),
    )
        .prop_map(|((w, dp, tier), parent, blocks)| {
            Op::Event(event(
                w,
                dp,
                tier,
                0,
                KvCacheEventData::Stored(KvCacheStoreData {
                    parent_hash: parent.map(Ext),
                    blocks: blocks
                        .into_iter()
                        .map(|(e, l)| KvCacheStoredBlockData {
                            block_hash: Ext(e),
                            tokens_hash: LocalBlockHash(l),
                        })
                        .collect(),
                }),
            ))
        });
    let remove = (who.clone(), proptest::collection::vec(1u64..10, 1..4)).prop_map(
        |((w, dp, tier), blocks)| {
            Op::Event(event(
                w,
                dp,
                tier,
                0,
                KvCacheEventData::Removed(KvCacheRemoveData {
                    block_hashes: blocks.into_iter().map(Ext).collect(),
                }),
            ))
        },
    );
    let clear =
        who.prop_map(|(w, dp, tier)| Op::Event(event(w, dp, tier, 0, KvCacheEventData::Cleared)));
    prop_oneof![
        6 => store,
        3 => remove,
        1 => clear,
        1 => (1u64..4).prop_map(Op::RemoveWorker),
        4 => proptest::collection::vec(1u64..4, 0..6).prop_map(Op::Query),
    ]
}

fn index_query(index: &KvIndex, local: &[u64]) -> BTreeMap<(WorkerWithDpRank, StorageTier), u32> {
    let q: Vec<LocalBlockHash> = local.iter().map(|&l| LocalBlockHash(l)).collect();
    answer_map(&index.find_matches(&q))
}

/// An answer as the model gives it: blocks per (worker, tier).
fn answer_map(scores: &OverlapScores) -> BTreeMap<(WorkerWithDpRank, StorageTier), u32> {
    let mut out = BTreeMap::new();
    for (w, s) in &scores.scores {
        out.insert((*w, StorageTier::Device), *s);
    }
    for t in &scores.lower_tiers {
        out.insert((t.worker, t.tier), t.blocks);
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn index_agrees_with_naive_model(ops in proptest::collection::vec(op_strategy(), 1..60)) {
        let mut index = KvIndex::new();
        let mut model = Model::default();
        for op in &ops {
            match op {
                Op::Event(ev) => {
                    let _ = index.apply_event_untracked(ev);
                    model.apply(ev);
                }
                Op::RemoveWorker(id) => {
                    index.remove_worker(*id);
                    model.remove_worker(*id);
                }
                Op::Query(q) => prop_assert_eq!(index_query(&index, q), model.query(q)),
            }
        }
        prop_assert_eq!(index.check_consistency(), Ok(()));
        let held: usize = model.lanes.values().map(BTreeMap::len).sum();
        prop_assert_eq!(index.memory().indexed_blocks, held);
        let rebuilt = KvIndex::from_events(index.dump());
        prop_assert!(index.same_content(&rebuilt));
        for q in [vec![1, 2, 3], vec![2, 1], vec![3, 3, 3, 1]] {
            prop_assert_eq!(index_query(&rebuilt, &q), model.query(&q));
        }
        check_restored(&index, &model, &ops)?;
    }
}

/// Device-only streams with long chains over a few local hashes: what the segment walk sees
/// (chains continuing a segment's end or branching off its middle, removals in the middle of a
/// segment, prefixes stored again after they died elsewhere).
fn device_op_strategy() -> impl Strategy<Value = Op> {
    let store = (
        1u64..4,
        proptest::option::weighted(0.7, 1u64..40),
        1u64..40,
        proptest::collection::vec(1u64..3, 1..12),
    )
        .prop_map(|(w, parent, first, locals)| {
            Op::Event(event(
                w,
                0,
                StorageTier::Device,
                0,
                KvCacheEventData::Stored(KvCacheStoreData {
                    parent_hash: parent.map(Ext),
                    blocks: locals
                        .into_iter()
                        .enumerate()
                        .map(|(k, l)| KvCacheStoredBlockData {
                            block_hash: Ext(first + k as u64),
                            tokens_hash: LocalBlockHash(l),
                        })
                        .collect(),
                }),
            ))
        });
    let remove = (1u64..4, proptest::collection::vec(1u64..40, 1..6)).prop_map(|(w, blocks)| {
        Op::Event(event(
            w,
            0,
            StorageTier::Device,
            0,
            KvCacheEventData::Removed(KvCacheRemoveData {
                block_hashes: blocks.into_iter().map(Ext).collect(),
            }),
        ))
    });
    prop_oneof![
        6 => store,
        4 => remove,
        1 => (1u64..4).prop_map(Op::RemoveWorker),
        5 => proptest::collection::vec(1u64..3, 0..16).prop_map(Op::Query),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn device_walk_agrees_with_naive_model(ops in proptest::collection::vec(device_op_strategy(), 1..80)) {
        let mut index = KvIndex::new();
        let mut model = Model::default();
        for op in &ops {
            match op {
                Op::Event(ev) => {
                    let _ = index.apply_event_untracked(ev);
                    model.apply(ev);
                }
                Op::RemoveWorker(id) => {
                    index.remove_worker(*id);
                    model.remove_worker(*id);
                }
                Op::Query(q) => prop_assert_eq!(index_query(&index, q), model.query(q)),
            }
            prop_assert_eq!(index.check_consistency(), Ok(()));
        }
        check_restored(&index, &model, &ops)?;
    }
}

/// A local hash that is almost always 1: long chains and prompts then follow one another for
/// hundreds of blocks, across the walk's 8-block chunks and 64-block windows.
fn mostly_ones() -> impl Strategy<Value = u64> {
    prop_oneof![60 => Just(1u64), 1 => Just(2u64)]
}

/// Streams of long chains over nearly one local hash from the workers `who` names (by index),
/// in the tiers `tiers` names, whose holdings differ block by block (removals in the middle of
/// long runs), so the walk's stretches run long and meet bit changes at every offset of a window.
fn long_op_strategy(
    who: &'static [u64],
    tiers: &'static [StorageTier],
) -> impl Strategy<Value = Op> {
    let lane = (0..who.len(), 0..tiers.len()).prop_map(move |(w, t)| (who[w], tiers[t]));
    let store = (
        lane.clone(),
        proptest::option::weighted(0.6, 1u64..600),
        1u64..600,
        proptest::collection::vec(mostly_ones(), 1..200),
    )
        .prop_map(|((w, tier), parent, first, locals)| {
            Op::Event(event(
                w,
                0,
                tier,
                0,
                KvCacheEventData::Stored(KvCacheStoreData {
                    parent_hash: parent.map(Ext),
                    blocks: locals
                        .into_iter()
                        .enumerate()
                        .map(|(k, l)| KvCacheStoredBlockData {
                            block_hash: Ext(first + k as u64),
                            tokens_hash: LocalBlockHash(l),
                        })
                        .collect(),
                }),
            ))
        });
    let remove = (lane, 1u64..600, 1u64..40).prop_map(|((w, tier), from, n)| {
        Op::Event(event(
            w,
            0,
            tier,
            0,
            KvCacheEventData::Removed(KvCacheRemoveData {
                block_hashes: (from..from + n).map(Ext).collect(),
            }),
        ))
    });
    prop_oneof![
        6 => store,
        3 => remove,
        1 => (0..who.len()).prop_map(move |w| Op::RemoveWorker(who[w])),
        4 => proptest::collection::vec(mostly_ones(), 0..300).prop_map(Op::Query),
    ]
}

/// Applies `ops` to the index and the model, comparing every query and, at the end, the audit.
fn run_against_model(
    index: &mut KvIndex,
    model: &mut Model,
    ops: &[Op],
) -> Result<(), TestCaseError> {
    for op in ops {
        match op {
            Op::Event(ev) => {
                let _ = index.apply_event_untracked(ev);
                model.apply(ev);
            }
            Op::RemoveWorker(id) => {
                index.remove_worker(*id);
                model.remove_worker(*id);
            }
            Op::Query(q) => prop_assert_eq!(index_query(index, q), model.query(q)),
        }
    }
    prop_assert_eq!(index.check_consistency(), Ok(()));
    check_restored(index, model, ops)
}

/// An index restored from `index`'s lanes holds the same blocks, passes the audit and answers
/// every query of `ops` as the model does.
fn check_restored(index: &KvIndex, model: &Model, ops: &[Op]) -> Result<(), TestCaseError> {
    let lanes: Vec<LaneDump> = index.dump_lanes().collect();
    let mut restored = KvIndex::new();
    let blocks = restored.restore_lanes(lanes.iter().map(|l| (l.worker, l.tier, &l.blocks[..])));
    prop_assert_eq!(blocks, index.memory().indexed_blocks);
    prop_assert!(index.same_content(&restored));
    prop_assert_eq!(restored.check_consistency(), Ok(()));
    for op in ops {
        if let Op::Query(q) = op {
            prop_assert_eq!(index_query(&restored, q), model.query(q));
        }
    }
    Ok(())
}

/// Workers 1..=`n` each storing one block, so that the index knows them all (with more than 64,
/// slots past the inline bits).
fn known_workers(n: u64) -> Vec<Op> {
    (1..=n)
        .map(|w| {
            Op::Event(event(
                w,
                0,
                StorageTier::Device,
                0,
                KvCacheEventData::Stored(KvCacheStoreData {
                    parent_hash: None,
                    blocks: vec![KvCacheStoredBlockData {
                        block_hash: Ext(10_000),
                        tokens_hash: LocalBlockHash(7),
                    }],
                }),
            ))
        })
        .collect()
}

const FEW: &[u64] = &[1, 2, 3, 4, 5];
const DEVICE: &[StorageTier] = &[StorageTier::Device];
/// Workers 65 and up get slots past the inline bits (see `wide_walks_agree_with_naive_model`).
const WIDE: &[u64] = &[1, 2, 65, 66, 70];
const TWO_TIERS: &[StorageTier] = &[StorageTier::Device, StorageTier::HostPinned];

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn long_walks_agree_with_naive_model(ops in proptest::collection::vec(long_op_strategy(FEW, DEVICE), 1..60)) {
        run_against_model(&mut KvIndex::new(), &mut Model::default(), &ops)?;
    }

    /// The same with 70 workers known (slots past 64, whose bits spill), in two tiers.
    #[test]
    fn wide_walks_agree_with_naive_model(ops in proptest::collection::vec(long_op_strategy(WIDE, TWO_TIERS), 1..40)) {
        let (mut index, mut model) = (KvIndex::new(), Model::default());
        let prelude = known_workers(70);
        run_against_model(&mut index, &mut model, &prelude)?;
        run_against_model(&mut index, &mut model, &ops)?;
    }
}

/// [`index_query`] for a shared index, whose answer is gathered from its shards.
fn shared_query(
    index: &ConcurrentIndex,
    local: &[u64],
) -> Result<BTreeMap<(WorkerWithDpRank, StorageTier), u32>, TestCaseError> {
    let q: Vec<LocalBlockHash> = local.iter().map(|&l| LocalBlockHash(l)).collect();
    let scores = index.find_matches(&q);
    // Each worker once, in worker order, whichever shard answered.
    prop_assert!(scores.scores.keys().is_sorted());
    prop_assert!(scores.tree_sizes.keys().eq(scores.scores.keys()));
    Ok(answer_map(&scores))
}

/// Applies `ops` to a sharded shared index and the model, comparing every query, then checks
/// each shard holds exactly its own workers and passes the audit.
fn run_sharded_against_model(
    index: &ConcurrentIndex,
    model: &mut Model,
    ops: &[Op],
) -> Result<(), TestCaseError> {
    for op in ops {
        match op {
            Op::Event(ev) => {
                index.submit(ev.clone());
                model.apply(ev);
            }
            Op::RemoveWorker(id) => {
                index.remove_worker(*id);
                model.remove_worker(*id);
            }
            Op::Query(q) => prop_assert_eq!(shared_query(index, q)?, model.query(q)),
        }
    }
    for shard in 0..index.shards() {
        index.read_shard(shard, |s| {
            prop_assert_eq!(s.check_consistency(), Ok(()));
            for worker in s.workers() {
                prop_assert_eq!(index.shard_of(worker.worker_id), shard);
            }
            Ok(())
        })?;
    }
    let held: usize = model.lanes.values().map(BTreeMap::len).sum();
    prop_assert_eq!(index.memory().indexed_blocks, held);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    /// Workers split between 2 or 3 shards answer as one index does, in every tier.
    #[test]
    fn sharded_index_agrees_with_naive_model(
        shards in 2usize..4,
        ops in proptest::collection::vec(op_strategy(), 1..60),
    ) {
        run_sharded_against_model(&ConcurrentIndex::with_shards(shards), &mut Model::default(), &ops)?;
    }

    /// Long walks through two shards of 70 workers each (slots past the inline bits), two tiers.
    #[test]
    fn sharded_wide_walks_agree_with_naive_model(
        ops in proptest::collection::vec(long_op_strategy(WIDE, TWO_TIERS), 1..40),
    ) {
        let (index, mut model) = (ConcurrentIndex::with_shards(2), Model::default());
        let prelude = known_workers(140);
        run_sharded_against_model(&index, &mut model, &prelude)?;
        run_sharded_against_model(&index, &mut model, &ops)?;
    }

    /// Long device walks through three shards.
    #[test]
    fn sharded_long_walks_agree_with_naive_model(
        ops in proptest::collection::vec(long_op_strategy(FEW, DEVICE), 1..60),
    ) {
        run_sharded_against_model(&ConcurrentIndex::with_shards(3), &mut Model::default(), &ops)?;
    }
}
