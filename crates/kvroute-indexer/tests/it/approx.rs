//! Approximate mode: predictions with a TTL and a size cap, on the caller's clock.

use std::time::Duration;

use kvroute_indexer::{ApproxConfig, ApproxIndex, Learnt};
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

/// Three conversations of `len` blocks each recorded on `w` one after another, under ids 1..=3.
fn three_conversations(approx: &mut ApproxIndex, w: WorkerWithDpRank, len: u64) {
    for c in 0..3u64 {
        let ids: Vec<u64> = (c * 100..c * 100 + len).collect();
        approx.record_request(w, &blocks(&ids), secs(c), Some(c + 1));
        approx.forget(c + 1);
    }
}

#[test]
fn a_report_of_fewer_blocks_teaches_the_capacity_and_cuts_older_predictions() {
    let w = WorkerWithDpRank::from_worker_id(1);
    let mut approx = ApproxIndex::new(ApproxConfig::default());
    three_conversations(&mut approx, w, 4);
    // Conversation 0 is 8 blocks old, 1 is 4, 2 is 0: all predicted while nothing is learnt.
    for c in 0..3u64 {
        assert_eq!(approx.find_matches(&blocks(&[c * 100])).score(w), 1);
    }
    assert_eq!(approx.capacity(w), None);

    // Conversation 0 again: predicted 4 blocks, the engine had none (evicted at age 8). The
    // first shortfall cannot tell an eviction from a lost cache: it sets the capacity, whose
    // cut drops the older predictions either way.
    approx.record_request(w, &blocks(&[0, 1, 2, 3, 50]), secs(4), Some(10));
    assert_eq!(approx.on_report(10, 4, 0), Learnt::Lowered(8.0));
    assert_eq!(approx.capacity(w), Some(8.0));
    // A second report of the same request teaches nothing.
    assert_eq!(approx.on_report(10, 4, 0), Learnt::Nothing);

    // Now conversation 0 (with its new block) is age 0, 2 is age 1, 1 is age 5: all under 8.
    assert_eq!(approx.find_matches(&blocks(&[100, 101])).score(w), 2);
    // Conversation 2 again, held: reported as predicted, nothing learnt.
    approx.record_request(w, &blocks(&[200, 201, 202, 203]), secs(5), Some(11));
    assert_eq!(approx.on_report(11, 4, 4), Learnt::Nothing);
    // Conversation 1 (age 5) reported missing: an eviction, the capacity moves halfway to 5.
    approx.record_request(w, &blocks(&[100, 101, 102, 103]), secs(6), Some(12));
    assert_eq!(approx.on_report(12, 4, 0), Learnt::Lowered(6.5));
    assert_eq!(approx.capacity(w), Some(6.5));
}

#[test]
fn matches_stop_at_the_first_block_older_than_the_capacity() {
    let w = WorkerWithDpRank::from_worker_id(1);
    let mut approx = ApproxIndex::new(ApproxConfig::default());
    let long: Vec<u64> = (0..10).collect();
    approx.record(w, &blocks(&long), secs(0));
    approx.record(w, &blocks(&[700, 701, 702, 703, 704]), secs(1));
    approx.record(w, &blocks(&[800, 801, 802, 803, 804]), secs(2));
    // `long` is 10 blocks old, the 700s 5.
    assert_eq!(approx.find_matches(&blocks(&long)).score(w), 10);
    approx.record_request(w, &blocks(&[700, 701, 702, 703, 704]), secs(3), Some(5));
    assert_eq!(approx.on_report(5, 5, 0), Learnt::Lowered(5.0));
    assert_eq!(approx.capacity(w), Some(5.0));
    assert_eq!(approx.find_matches(&blocks(&long)).score(w), 0);
    // The first half of `long` used again (with one new block): young again, the rest old.
    approx.record(w, &blocks(&[0, 1, 2, 3, 4, 77]), secs(4));
    assert_eq!(approx.find_matches(&blocks(&long)).score(w), 5);
    assert_eq!(approx.find_matches(&blocks(&long[..3])).score(w), 3);
}

#[test]
fn a_report_above_the_cut_raises_the_capacity() {
    let w = WorkerWithDpRank::from_worker_id(1);
    let mut approx = ApproxIndex::new(ApproxConfig::default());
    three_conversations(&mut approx, w, 4);
    // Learn a small capacity from a miss of conversation 0 (age 8).
    approx.record_request(w, &blocks(&[0, 1, 2, 3]), secs(4), Some(10));
    assert_eq!(approx.on_report(10, 4, 0), Learnt::Lowered(8.0));
    assert_eq!(approx.capacity(w), Some(8.0));
    // 8 fresh blocks elsewhere: conversation 1 is age 12 now, cut to nothing...
    approx.record_request(w, &blocks(&(300..308).collect::<Vec<_>>()), secs(5), None);
    assert_eq!(
        approx.find_matches(&blocks(&[100, 101, 102, 103])).score(w),
        0
    );
    // ...but the engine had all 4 blocks: the capacity moves halfway past age 12.
    approx.record_request(w, &blocks(&[100, 101, 102, 103]), secs(6), Some(11));
    assert_eq!(approx.on_report(11, 0, 4), Learnt::Raised(10.5));
    // A young block lost (age 0 against a capacity of 10.5): the cache was lost.
    approx.record_request(w, &blocks(&[100, 101, 102, 103]), secs(7), Some(12));
    assert_eq!(approx.on_report(12, 4, 0), Learnt::Lost);
    assert_eq!(approx.capacity(w), Some(10.5));
    // A young block missing while the prompt's first blocks were held: not a restart (LRU
    // loses a prompt's tail first) but an engine short of memory; the capacity moves halfway
    // down.
    approx.record_request(w, &blocks(&[100, 101, 102, 103]), secs(8), Some(13));
    assert_eq!(approx.on_report(13, 4, 2), Learnt::Lowered(5.25));
    assert_eq!(approx.capacity(w), Some(5.25));
    // Removing the worker forgets what was learnt.
    approx.remove_worker(1);
    assert_eq!(approx.capacity(w), None);
}
