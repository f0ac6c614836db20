//! Approximate mode: predictions with a TTL and a size cap, on the caller's clock.

use std::time::Duration;

use kvroute_indexer::{ApproxConfig, ApproxIndex};
use kvroute_protocols::WorkerWithDpRank;
use kvroute_protocols::kv_events::LocalBlockHash;

fn blocks(ids: &[u64]) -> Vec<LocalBlockHash> {
    ids.iter().map(|&i| LocalBlockHash(i)).collect()
}

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

#[test]
fn predictions_match_until_they_expire() {
    let w = WorkerWithDpRank::from_worker_id(7);
    let mut approx = ApproxIndex::new(ApproxConfig {
        ttl: secs(10),
        ..ApproxConfig::default()
    });
    approx.record(w, &blocks(&[1, 2, 3]), secs(0));
    assert_eq!(approx.find_matches(&blocks(&[1, 2, 9])).score(w), 2);
    approx.expire(secs(9));
    assert_eq!(approx.live_blocks(), 3);
    approx.expire(secs(10));
    assert_eq!(approx.live_blocks(), 0);
    assert_eq!(approx.find_matches(&blocks(&[1])).score(w), 0);
    assert_eq!(approx.memory().live_nodes, 0);
}

#[test]
fn a_new_decision_refreshes_the_shared_prefix() {
    let w = WorkerWithDpRank::from_worker_id(1);
    let mut approx = ApproxIndex::new(ApproxConfig {
        ttl: secs(10),
        ..ApproxConfig::default()
    });
    approx.record(w, &blocks(&[1, 2]), secs(0));
    approx.record(w, &blocks(&[1, 3]), secs(5));
    approx.expire(secs(12));
    // [1] was refreshed at 5 and lives to 15; [1, 2] expired at 10.
    let scores = approx.find_matches(&blocks(&[1, 3]));
    assert_eq!(scores.score(w), 2);
    assert_eq!(approx.find_matches(&blocks(&[1, 2])).score(w), 1);
    assert_eq!(approx.live_blocks(), 2);
}

#[test]
fn the_size_cap_prunes_oldest_to_the_target_ratio() {
    let mut approx = ApproxIndex::new(ApproxConfig {
        ttl: secs(1000),
        max_blocks: 10,
        prune_target_ratio: 0.5,
    });
    for i in 0..4u64 {
        let w = WorkerWithDpRank::from_worker_id(i);
        approx.record(w, &blocks(&[i * 10, i * 10 + 1, i * 10 + 2]), secs(i));
    }
    // 12 > 10 blocks: the oldest are pruned until 5 remain.
    assert_eq!(approx.live_blocks(), 5);
    let newest = WorkerWithDpRank::from_worker_id(3);
    assert_eq!(approx.find_matches(&blocks(&[30, 31, 32])).score(newest), 3);
    let oldest = WorkerWithDpRank::from_worker_id(0);
    assert_eq!(approx.find_matches(&blocks(&[0])).score(oldest), 0);
}

#[test]
fn removing_a_worker_drops_its_predictions() {
    let mut approx = ApproxIndex::new(ApproxConfig::default());
    approx.record(
        WorkerWithDpRank::from_worker_id(1),
        &blocks(&[1, 2]),
        secs(0),
    );
    approx.record(WorkerWithDpRank::from_worker_id(2), &blocks(&[1]), secs(0));
    approx.remove_worker(1);
    assert_eq!(approx.live_blocks(), 1);
    assert_eq!(approx.find_matches(&blocks(&[1, 2])).scores.len(), 1);
}
