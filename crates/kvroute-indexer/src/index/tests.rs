use kvroute_protocols::WorkerWithDpRank;
use kvroute_protocols::kv_events::{
    ExternalSequenceBlockHash as Ext, KvCacheEvent, KvCacheEventData, KvCacheRemoveData,
    KvCacheStoreData, KvCacheStoredBlockData, LocalBlockHash, RouterEvent, StorageTier,
};

use super::KvIndex;
use crate::error::IndexError;

/// A compact script: `s W P B..` stores blocks B (ext id = local hash = B) on worker W after
/// parent P (0 = none) in the device tier (`h`, `d`, `e`: in the host, disk, external tier),
/// `r W B..` removes, `c W` clears, `x W` removes the worker (all on the device tier).
fn run(script: &str) -> (KvIndex, Vec<Result<(), IndexError>>) {
    let mut index = KvIndex::new();
    let mut results = Vec::new();
    for (id, line) in script
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .enumerate()
    {
        let mut words = line.split_whitespace();
        let op = words.next().unwrap_or_default();
        let nums: Vec<u64> = words.map(|w| w.parse().unwrap_or(0)).collect();
        let worker = nums[0];
        let tier = match op {
            "h" => StorageTier::HostPinned,
            "d" => StorageTier::Disk,
            "e" => StorageTier::External,
            _ => StorageTier::Device,
        };
        let data = match op {
            "s" | "h" | "d" | "e" => KvCacheEventData::Stored(KvCacheStoreData {
                parent_hash: (nums[1] != 0).then_some(Ext(nums[1])),
                blocks: nums[2..]
                    .iter()
                    .map(|&b| KvCacheStoredBlockData {
                        block_hash: Ext(b),
                        tokens_hash: LocalBlockHash(b),
                    })
                    .collect(),
            }),
            "r" => KvCacheEventData::Removed(KvCacheRemoveData {
                block_hashes: nums[1..].iter().map(|&b| Ext(b)).collect(),
            }),
            "c" => KvCacheEventData::Cleared,
            _ => {
                index.remove_worker(worker);
                continue;
            }
        };
        let event = RouterEvent {
            worker_id: worker,
            storage_tier: tier,
            event: KvCacheEvent {
                event_id: id as u64,
                data,
                dp_rank: 0,
            },
        };
        results.push(index.apply_event_untracked(&event));
    }
    (index, results)
}

/// Runs `script`, queries `query` (local hashes) and compares "worker:score" pairs, device
/// scores as `1:3` and slower tiers' runs as `1:h2` (host), `1:d1` (disk), `1:e1` (external).
fn check(script: &str, query: &[u64], expect: &str) {
    let (index, _) = run(script);
    index
        .check_consistency()
        .unwrap_or_else(|e| panic!("inconsistent: {e}"));
    let q: Vec<LocalBlockHash> = query.iter().map(|&h| LocalBlockHash(h)).collect();
    let scores = index.find_matches(&q);
    let mut got: Vec<(u64, usize, u32)> = scores
        .scores
        .iter()
        .map(|(w, s)| (w.worker_id, 0, *s))
        .chain(
            scores
                .lower_tiers
                .iter()
                .map(|t| (t.worker.worker_id, t.tier.index(), t.blocks)),
        )
        .collect();
    got.sort_unstable();
    let got: Vec<String> = got
        .iter()
        .map(|&(w, tier, s)| format!("{w}:{}{s}", ["", "h", "d", "e"][tier]))
        .collect();
    assert_eq!(got.join(" "), expect, "script:\n{script}");
}

#[test]
fn prefix_matches_per_worker() {
    check("s 1 0 10 11 12\ns 2 0 10 11", &[10, 11, 12, 13], "1:3 2:2");
    check("s 1 0 10 11 12\ns 2 0 10 11", &[11, 12], "");
    check("s 1 0 10\ns 1 10 11 12", &[10, 11, 12], "1:3");
}

#[test]
fn removal_in_the_middle_cuts_the_match() {
    check("s 1 0 10 11 12\nr 1 11", &[10, 11, 12], "1:1");
    check("s 1 0 10 11 12\nr 1 10 11 12", &[10], "");
}

#[test]
fn clear_and_remove_worker_free_everything() {
    check("s 1 0 10 11\ns 2 0 10\nc 1", &[10, 11], "2:1");
    check("s 1 0 10 11\ns 2 0 10\nx 2", &[10, 11], "1:2");
    let (index, _) = run("s 1 0 10 11\ns 2 0 10 11\nx 1\nx 2");
    assert_eq!(index.memory().live_nodes, 0);
    assert_eq!(index.memory().indexed_blocks, 0);
}

#[test]
fn same_content_at_another_position_does_not_match() {
    // Block 11 after 10 is a different prefix than block 11 first.
    check("s 1 0 10 11", &[11], "");
    check("s 1 0 11\ns 2 0 10 11", &[11], "1:1");
}

#[test]
fn errors_are_counted_and_harmless() {
    let (index, results) = run("s 1 99 10\ns 1 0 10\ns 1 0 10\nr 1 77\nr 5 1");
    assert!(matches!(results[0], Err(IndexError::ParentNotFound { .. })));
    assert!(results[1].is_ok());
    assert!(matches!(results[2], Err(IndexError::DuplicateStore { .. })));
    assert!(matches!(results[3], Err(IndexError::BlockNotFound { .. })));
    assert!(matches!(results[4], Err(IndexError::BlockNotFound { .. })));
    let counts = index.error_counts();
    assert_eq!(
        (
            counts.parent_not_found,
            counts.duplicate_store,
            counts.block_not_found
        ),
        (1, 1, 2)
    );
    index.check_consistency().unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn aliased_blocks_are_reference_counted() {
    // Two engine ids for the same prefix: the worker holds it until both are gone.
    check("s 1 0 10\ns 1 0 20", &[10], "1:1");
    let script = "s 1 0 10\ns 1 0 20\nr 1 10";
    let (index, _) = run(script);
    // Block 20 has local hash 20, so the alias here is by content: store 10 twice under ids.
    drop(index);
    let mut index = KvIndex::new();
    let w = WorkerWithDpRank::from_worker_id(1);
    let store = |ext: u64| KvCacheStoreData {
        parent_hash: None,
        blocks: vec![KvCacheStoredBlockData {
            block_hash: Ext(ext),
            tokens_hash: LocalBlockHash(10),
        }],
    };
    let remove = |ext: u64| KvCacheRemoveData {
        block_hashes: vec![Ext(ext)],
    };
    assert!(index.store(w, StorageTier::Device, &store(1)).is_ok());
    assert!(index.store(w, StorageTier::Device, &store(2)).is_ok());
    assert!(index.remove(w, StorageTier::Device, &remove(1)).is_ok());
    assert_eq!(index.find_matches(&[LocalBlockHash(10)]).score(w), 1);
    index.check_consistency().unwrap_or_else(|e| panic!("{e}"));
    assert!(index.remove(w, StorageTier::Device, &remove(2)).is_ok());
    assert_eq!(index.find_matches(&[LocalBlockHash(10)]).score(w), 0);
    assert_eq!(index.memory().live_nodes, 0);
}

#[test]
fn tiers_are_scored_separately() {
    let mut index = KvIndex::new();
    let w = WorkerWithDpRank::new(3, 1);
    let data = KvCacheStoreData {
        parent_hash: None,
        blocks: vec![KvCacheStoredBlockData {
            block_hash: Ext(1),
            tokens_hash: LocalBlockHash(5),
        }],
    };
    assert!(index.store(w, StorageTier::HostPinned, &data).is_ok());
    let scores = index.find_matches(&[LocalBlockHash(5)]);
    assert_eq!(scores.score(w), 0);
    assert_eq!(scores.tier_score(w, StorageTier::HostPinned), 1);
}

#[test]
fn wide_fleets_spill_past_64_slots() {
    let mut script = String::new();
    for w in 1..=150 {
        script.push_str(&format!("s {w} 0 10 11\n"));
    }
    script.push_str("r 140 11\nx 3\n");
    let (index, _) = run(&script);
    index.check_consistency().unwrap_or_else(|e| panic!("{e}"));
    let scores = index.find_matches(&[LocalBlockHash(10), LocalBlockHash(11)]);
    assert_eq!(scores.scores.len(), 149);
    assert_eq!(scores.score(WorkerWithDpRank::from_worker_id(140)), 1);
    assert_eq!(scores.score(WorkerWithDpRank::from_worker_id(150)), 2);
    assert_eq!(scores.score(WorkerWithDpRank::from_worker_id(3)), 0);
}

#[test]
fn dump_round_trips() {
    let (index, _) = run("s 1 0 10 11 12\ns 2 0 10 11\ns 2 11 13\nr 1 12\ns 1 0 20");
    let rebuilt = KvIndex::from_events(index.dump());
    assert!(index.same_content(&rebuilt));
    rebuilt
        .check_consistency()
        .unwrap_or_else(|e| panic!("{e}"));
    let q: Vec<LocalBlockHash> = [10, 11, 13].map(LocalBlockHash).to_vec();
    assert_eq!(index.find_matches(&q), rebuilt.find_matches(&q));
}

#[test]
fn lower_tiers_continue_the_device_prefix() {
    // Device 10 11, then host 12 13 (its chain continues the device block 11), then disk 14.
    check(
        "s 1 0 10 11\nh 1 11 12 13\nd 1 13 14",
        &[10, 11, 12, 13, 14, 15],
        "1:2 1:h2 1:d1",
    );
    // External comes after disk, and counts alone too.
    check("s 1 0 10\ne 1 10 11", &[10, 11], "1:1 1:e1");
    // The chain may end inside a lower tier.
    check("s 1 0 10\nh 1 10 11 12", &[10, 11], "1:1 1:h1");
}

#[test]
fn a_worker_without_device_blocks_starts_in_a_lower_tier() {
    check("h 2 0 10 11\nd 2 11 12", &[10, 11, 12, 13], "2:h2 2:d1");
    check("d 3 0 10", &[10, 11], "3:d1");
    check("h 2 0 10 11\ns 1 0 10", &[10, 11], "1:1 2:h2");
}

#[test]
fn lower_tiers_count_only_blocks_after_the_device_prefix() {
    // The host copy of the device blocks earns nothing; its block 12 continues the prefix.
    check("s 1 0 10 11\nh 1 0 10 11 12", &[10, 11, 12], "1:2 1:h1");
    // Host holding the whole prefix the device holds adds nothing.
    check("s 1 0 10 11\nh 1 0 10 11", &[10, 11, 12], "1:2");
}

#[test]
fn a_tier_left_behind_does_not_count_again() {
    // After device 10 the host holds nothing at 11, disk does: host's 12 comes after the disk
    // run started and is not counted (the walk goes device, host, disk, external, once).
    check("s 1 0 10\nd 1 10 11\nh 1 11 12", &[10, 11, 12], "1:1 1:d1");
    // A gap in every tier ends the walk: nothing after it counts.
    check("s 1 0 10\nh 1 10 11\nr 1 10", &[10, 11], "");
}

#[test]
fn lower_tier_chains_resolve_parents_in_other_tiers_device_chains_do_not() {
    let (index, results) = run("s 1 0 10\nh 1 10 11\nd 1 11 12\nh 2 0 20\ns 2 20 21");
    assert!(results[1].is_ok() && results[2].is_ok());
    assert!(matches!(
        results[4],
        Err(IndexError::ParentNotFound {
            tier: StorageTier::Device,
            ..
        })
    ));
    index.check_consistency().unwrap_or_else(|e| panic!("{e}"));
    let rebuilt = KvIndex::from_events(index.dump());
    assert!(index.same_content(&rebuilt));
    let q: Vec<LocalBlockHash> = [10, 11, 12].map(LocalBlockHash).to_vec();
    assert_eq!(index.find_matches(&q), rebuilt.find_matches(&q));
}

#[test]
fn wide_fleets_walk_lower_tiers_past_64_slots() {
    let mut script = String::new();
    for w in 1..=130 {
        script.push_str(&format!("s {w} 0 10\n"));
    }
    script.push_str("h 70 10 11\nh 129 10 11 12\nd 3 10 11\nh 100 0 10 11 12 13\nx 5\n");
    let (index, _) = run(&script);
    index.check_consistency().unwrap_or_else(|e| panic!("{e}"));
    let q: Vec<LocalBlockHash> = [10, 11, 12].map(LocalBlockHash).to_vec();
    let scores = index.find_matches(&q);
    assert_eq!(scores.scores.len(), 129);
    let tier = |w: u64, t| scores.tier_score(WorkerWithDpRank::from_worker_id(w), t);
    assert_eq!(tier(70, StorageTier::HostPinned), 1);
    assert_eq!(tier(129, StorageTier::HostPinned), 2);
    assert_eq!(tier(3, StorageTier::Disk), 1);
    assert_eq!(tier(100, StorageTier::Device), 1);
    assert_eq!(tier(100, StorageTier::HostPinned), 2);
    assert_eq!(tier(5, StorageTier::Device), 0);
    assert_eq!(scores.lower_tiers.len(), 4);
}

/// One step of [`tail_evictions_match_block_by_block`]: `Store` continues (or, for `None` or a
/// chain the worker no longer holds, starts) a chain of the worker's in a tier; `Evict` removes
/// `n` blocks the worker holds of one of its chains, the last ones but `skip` (so a chain can
/// lose blocks in the middle), deepest first or, `upward`, in chain order.
#[derive(Debug, Clone)]
enum TailOp {
    Store {
        worker: u64,
        host: bool,
        after: Option<usize>,
        locals: Vec<u64>,
    },
    Evict {
        worker: u64,
        host: bool,
        chain: usize,
        n: usize,
        skip: usize,
        upward: bool,
    },
}

fn tail_op() -> impl proptest::strategy::Strategy<Value = TailOp> {
    use proptest::prelude::*;
    // Chains of few distinct local hashes share prefixes between workers (and alias within
    // one, which takes the block-by-block path for the rest of the run); the others rarely do.
    let locals = prop_oneof![
        1 => proptest::collection::vec(1u64..4, 1..10),
        3 => proptest::collection::vec(1u64..1000, 1..10),
    ];
    let store = (
        1u64..3,
        proptest::bool::weighted(0.2),
        proptest::option::of(0usize..8),
        locals,
    )
        .prop_map(|(worker, host, after, locals)| TailOp::Store {
            worker,
            host,
            after,
            locals,
        });
    let evict = (
        1u64..4,
        proptest::bool::weighted(0.2),
        0usize..8,
        1usize..8,
        prop_oneof![3 => Just(0usize), 1 => 1usize..4],
        proptest::bool::weighted(0.2),
    )
        .prop_map(|(worker, host, chain, n, skip, upward)| TailOp::Evict {
            worker,
            host,
            chain,
            n,
            skip,
            upward,
        });
    prop_oneof![3 => store, 2 => evict]
}

/// A chain a worker holds: the engine ids it still holds, and the local hashes from the root.
type HeldChain = (Vec<u64>, Vec<u64>);

proptest::proptest! {
    /// Removing a chain's tail in one event (cut back at once when only its worker holds it)
    /// leaves the index exactly as removing the same blocks one event each does.
    #[test]
    fn tail_evictions_match_block_by_block(
        ops in proptest::collection::vec(tail_op(), 1..80)
    ) {
        let (mut batched, mut single) = (KvIndex::new(), KvIndex::new());
        // Per (worker, host tier or not): the chains held.
        let mut chains: std::collections::HashMap<(u64, bool), Vec<HeldChain>> =
            Default::default();
        let mut next_id = 1u64;
        for op in ops {
            match op {
                TailOp::Store { worker, host, after, locals } => {
                    let held = chains.entry((worker, host)).or_default();
                    let parent = after.and_then(|c| held.get(c)).filter(|c| !c.0.is_empty());
                    let (parent_hash, mut path) = match parent {
                        Some((ids, path)) => (ids.last().map(|&id| Ext(id)), path[..ids.len()].to_vec()),
                        None => (None, Vec::new()),
                    };
                    let mut ids = parent.map_or_else(Vec::new, |p| p.0.clone());
                    let blocks: Vec<_> = locals
                        .iter()
                        .map(|&local| {
                            next_id += 1;
                            ids.push(next_id);
                            path.push(local);
                            KvCacheStoredBlockData {
                                block_hash: Ext(next_id),
                                tokens_hash: LocalBlockHash(local),
                            }
                        })
                        .collect();
                    let tier = if host { StorageTier::HostPinned } else { StorageTier::Device };
                    let data = KvCacheStoreData { parent_hash, blocks };
                    let w = WorkerWithDpRank::from_worker_id(worker);
                    let a = batched.store(w, tier, &data);
                    let b = single.store(w, tier, &data);
                    proptest::prop_assert_eq!(a, b);
                    held.push((ids, path));
                }
                TailOp::Evict { worker, host, chain, n, skip, upward } => {
                    let Some(held) = chains.get_mut(&(worker, host)) else { continue };
                    let Some((ids, _)) = held.get_mut(chain) else { continue };
                    let end = ids.len().saturating_sub(skip);
                    let mut gone: Vec<u64> = ids.drain(end.saturating_sub(n)..end).collect();
                    if !upward {
                        gone.reverse();
                    }
                    // Blocks shared with the worker's other chains go once, from every chain.
                    for (other, _) in held.iter_mut() {
                        other.retain(|id| !gone.contains(id));
                    }
                    let tier = if host { StorageTier::HostPinned } else { StorageTier::Device };
                    let w = WorkerWithDpRank::from_worker_id(worker);
                    let all = KvCacheRemoveData {
                        block_hashes: gone.iter().map(|&id| Ext(id)).collect(),
                    };
                    proptest::prop_assert!(batched.remove(w, tier, &all).is_ok());
                    for &id in &gone {
                        let one = KvCacheRemoveData { block_hashes: vec![Ext(id)] };
                        proptest::prop_assert!(single.remove(w, tier, &one).is_ok());
                    }
                }
            }
            batched
                .check_consistency()
                .map_err(|e| proptest::test_runner::TestCaseError::fail(format!("batched: {e}")))?;
            proptest::prop_assert_eq!(batched.memory().live_nodes, single.memory().live_nodes);
            proptest::prop_assert_eq!(
                batched.memory().indexed_blocks,
                single.memory().indexed_blocks
            );
            for (_, path) in chains.values().flatten() {
                let q: Vec<LocalBlockHash> = path.iter().map(|&h| LocalBlockHash(h)).collect();
                proptest::prop_assert_eq!(batched.find_matches(&q), single.find_matches(&q));
            }
        }
    }
}
