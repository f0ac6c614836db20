//! Unit tests: queue ordering, the pickers' edge cases, config validation.

use std::time::Duration;

use kvroute_protocols::WorkerWithDpRank;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use crate::select::{pick_min, pick_softmax};
use crate::{
    AdmissionQueue, CacheHitWeights, CandidateCost, QueueMeta, QueuePolicy, SchedulerConfig,
};

/// Pushes `(name, arrival secs, priority, work tokens)` and checks the release order.
fn check(policy: QueuePolicy, input: &[(&'static str, u64, f64, u64)], expect: &[&str]) {
    let mut q = AdmissionQueue::new(policy, input.len());
    for &(name, arrival, priority, work_tokens) in input {
        let meta = QueueMeta {
            arrival: Duration::from_secs(arrival),
            priority,
            work_tokens,
        };
        q.try_push(name, meta).expect("capacity fits the input");
    }
    let got: Vec<&str> = std::iter::from_fn(|| q.pop()).collect();
    assert_eq!(got, expect);
}

#[test]
fn fcfs_orders_by_arrival_and_priority_jumps_ahead() {
    check(
        QueuePolicy::Fcfs,
        &[("a", 0, 0.0, 1), ("b", 1, 0.0, 1), ("c", 2, 0.0, 1)],
        &["a", "b", "c"],
    );
    // "c" arrived 2 s after "a" but jumps 5 s.
    check(
        QueuePolicy::Fcfs,
        &[("a", 0, 0.0, 1), ("b", 1, 0.0, 1), ("c", 2, 5.0, 1)],
        &["c", "a", "b"],
    );
    // Equal keys keep insertion order; negative priorities count as zero.
    check(
        QueuePolicy::Fcfs,
        &[("a", 3, 0.0, 1), ("b", 3, -4.0, 1)],
        &["a", "b"],
    );
}

#[test]
fn shortest_work_first_weighs_work_by_priority() {
    check(
        QueuePolicy::ShortestWorkFirst,
        &[
            ("long", 0, 0.0, 1000),
            ("short", 5, 0.0, 10),
            ("mid", 1, 0.0, 100),
        ],
        &["short", "mid", "long"],
    );
    // (1 + 19) / 1000 = 0.02 beats (1 + 0) / 100 = 0.01.
    check(
        QueuePolicy::ShortestWorkFirst,
        &[("mid", 0, 0.0, 100), ("urgent-long", 0, 19.0, 1000)],
        &["urgent-long", "mid"],
    );
}

#[test]
fn zero_capacity_refuses_and_hands_back() {
    let mut q = AdmissionQueue::new(QueuePolicy::Fcfs, 0);
    let err = q.try_push(7, QueueMeta::default()).expect_err("no room");
    assert_eq!(
        err.to_string(),
        "admission queue is full (0 waiting requests); retry later or shed load"
    );
    assert_eq!(err.into_inner(), 7);
}

fn costs(values: &[f64]) -> Vec<CandidateCost> {
    values
        .iter()
        .enumerate()
        .map(|(i, &cost)| CandidateCost {
            worker: WorkerWithDpRank::from_worker_id(i as u64),
            overlap_blocks: 0,
            unkept_blocks: 0,
            host_blocks: 0,
            disk_blocks: 0,
            weighted_overlap_blocks: 0.0,
            credit: 1.0,
            prefill_blocks: 0.0,
            credited_prefill_blocks: 0.0,
            decode_blocks: cost,
            weighted_decode_blocks: cost,
            evicted_blocks: 0,
            churn_evicted_blocks: 0,
            churn_share: 0.0,
            new_blocks: 0,
            occupancy_share: 0.0,
            taint_multiplier: 1.0,
            cost,
        })
        .collect()
}

#[test]
fn pick_min_takes_the_unique_minimum() {
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    for _ in 0..100 {
        assert_eq!(pick_min(&costs(&[3.0, 1.0, 2.0]), &mut rng), 1);
    }
}

#[test]
fn softmax_with_equal_costs_is_uniform_and_never_out_of_range() {
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    let mut seen = [0u32; 3];
    let mut weights = Vec::new();
    for _ in 0..3000 {
        seen[pick_softmax(&costs(&[5.0, 5.0, 5.0]), 0.5, &mut weights, &mut rng)] += 1;
    }
    assert!(seen.iter().all(|&n| (850..1150).contains(&n)), "{seen:?}");
}

#[test]
fn softmax_at_low_temperature_concentrates_on_the_minimum() {
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let mut weights = Vec::new();
    // Weight of the max is exp(-1 / 0.01) ~ 4e-44: never drawn in practice.
    for _ in 0..1000 {
        assert_eq!(
            pick_softmax(&costs(&[0.0, 100.0]), 0.01, &mut weights, &mut rng),
            0
        );
    }
}

#[test]
fn config_validation_names_the_field() {
    let mut c = SchedulerConfig::new(0);
    assert_eq!(
        c.validate().map_err(|e| e.to_string()),
        Err("block_size must be at least 1, got 0".into())
    );
    c.block_size = 16;
    c.cost.overlap_credit = f64::NAN;
    assert_eq!(
        c.validate().map_err(|e| e.to_string()),
        Err("overlap_score_credit must be a finite number >= 0, got NaN".into())
    );
}

/// Sets the cache-hit weights and returns the validation error, if any.
fn check_cache_hit_weights(host: f64, disk: f64, expect: Result<(), &str>) {
    let mut c = SchedulerConfig::new(16);
    c.cache_hit_weights = CacheHitWeights { host, disk };
    assert_eq!(
        c.validate().map_err(|e| e.to_string()),
        expect.map_err(str::to_owned),
        "host {host}, disk {disk}"
    );
}

#[test]
fn cache_hit_weight_validation_names_the_key_and_the_range() {
    assert_eq!(
        SchedulerConfig::new(16).cache_hit_weights,
        CacheHitWeights {
            host: 0.75,
            disk: 0.25
        }
    );
    check_cache_hit_weights(0.0, 0.0, Ok(()));
    check_cache_hit_weights(1.0, 1.0, Ok(()));
    check_cache_hit_weights(
        1.5,
        0.25,
        Err("host_cache_hit_weight must be a number in 0..=1, got 1.5"),
    );
    check_cache_hit_weights(
        0.75,
        -0.1,
        Err("disk_cache_hit_weight must be a number in 0..=1, got -0.1"),
    );
    check_cache_hit_weights(
        f64::NAN,
        0.25,
        Err("host_cache_hit_weight must be a number in 0..=1, got NaN"),
    );
    check_cache_hit_weights(
        0.75,
        f64::INFINITY,
        Err("disk_cache_hit_weight must be a number in 0..=1, got inf"),
    );
}

#[test]
fn candidate_display_shows_the_weighted_overlap_only_with_lower_tiers() {
    let mut c = costs(&[2.0])[0];
    c.overlap_blocks = 2;
    assert_eq!(
        c.to_string(),
        "0/dp0 cost=2.000 prefill=0.000->0.000 (overlap 2 x credit 1.000) decode=2.000->2.000 x1.000"
    );
    c.host_blocks = 1;
    c.disk_blocks = 2;
    c.weighted_overlap_blocks = 3.25;
    assert_eq!(
        c.to_string(),
        "0/dp0 cost=2.000 prefill=0.000->0.000 (overlap 2 x credit 1.000 + host 1 + disk 2, \
         weighted 3.250) decode=2.000->2.000 x1.000"
    );
    assert_eq!(c.cached_tokens(16), 52);
}
