//! Hand-computed costs, tie-breaking, the softmax distribution, the shared-first-block trap, and
//! the admission queue re-scoring released requests.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use kvroute_protocols::kv_events::StorageTier;
use kvroute_protocols::{RouterConfigOverride, RoutingConstraints, WorkerWithDpRank};
use kvroute_scheduler::{
    AdmissionQueue, CacheHitWeights, CandidateCost, CostWeights, LoadThresholds, NewRequest,
    QueueMeta, QueuePolicy, RequestId, SchedulerConfig, SelectRequest, TierOverlap, WorkerLoad,
    WorkerSpec,
};

use crate::support::{BS, add, blocks, rng, scheduler, scheduler_with, w};

fn cost_of(candidates: &[CandidateCost], worker: WorkerWithDpRank) -> CandidateCost {
    *candidates
        .iter()
        .find(|c| c.worker == worker)
        .expect("candidate present")
}

#[test]
fn idle_workers_prefer_the_cached_prefix() {
    let mut s = scheduler(2);
    let prompt = blocks(100, 4);
    let overlaps = [(w(1), 2)];
    let d = s
        .select(&SelectRequest::new(64, &prompt, &overlaps), &mut rng())
        .expect("selected");
    // Worker 0: prefill 64/16 = 4 blocks, no credit; decode 0 active + 4 new = 4; total 8.
    let c0 = cost_of(d.candidates, w(0));
    assert_eq!(
        (
            c0.prefill_blocks,
            c0.credited_prefill_blocks,
            c0.decode_blocks,
            c0.cost
        ),
        (4.0, 4.0, 4.0, 8.0)
    );
    // Worker 1: prefill 4 - 1.0 * 2 = 2; decode 4; total 6.
    let c1 = cost_of(d.candidates, w(1));
    assert_eq!(
        (c1.credited_prefill_blocks, c1.decode_blocks, c1.cost),
        (2.0, 4.0, 6.0)
    );
    assert_eq!(d.chosen.worker, w(1));
}

#[test]
fn outstanding_prefill_and_active_blocks_outweigh_a_cache_hit() {
    let mut s = scheduler(2);
    // Worker 1 is busy prefilling an unrelated 8-block (128-token) prompt.
    add(&mut s, 1, w(1), &blocks(500, 8));
    let prompt = blocks(100, 4);
    let overlaps = [(w(1), 4)];
    let d = s
        .select(&SelectRequest::new(64, &prompt, &overlaps), &mut rng())
        .expect("selected");
    // Worker 0: 4 + 4 = 8. Worker 1: prefill (128 + 64) / 16 - 4 = 8, decode 8 + 4 = 12: 20.
    assert_eq!(cost_of(d.candidates, w(0)).cost, 8.0);
    assert_eq!(cost_of(d.candidates, w(1)).cost, 20.0);
    assert_eq!(d.chosen.worker, w(0));

    // Once its prefill completes, worker 1 costs 0 + 12 = 12: still more than 8.
    s.mark_prefill_completed(RequestId(1)).expect("active");
    let d = s
        .select(&SelectRequest::new(64, &prompt, &overlaps), &mut rng())
        .expect("selected");
    assert_eq!(cost_of(d.candidates, w(1)).cost, 12.0);
}

#[test]
fn prompt_blocks_active_on_a_worker_are_not_counted_twice() {
    let mut s = scheduler(2);
    add(&mut s, 1, w(1), &blocks(100, 6));
    s.mark_prefill_completed(RequestId(1)).expect("active");
    // The new prompt shares its first 4 blocks with the active request on worker 1.
    let prompt = [100, 101, 102, 103, 900, 901];
    let d = s
        .select(&SelectRequest::new(96, &prompt, &[(w(1), 4)]), &mut rng())
        .expect("ok");
    // Worker 1: decode = 6 active + 2 new = 8; prefill 6 - 4 = 2; total 10.
    let c1 = cost_of(d.candidates, w(1));
    assert_eq!((c1.decode_blocks, c1.cost), (8.0, 10.0));
    // Worker 0: 6 + 6 = 12.
    assert_eq!(cost_of(d.candidates, w(0)).cost, 12.0);
    assert_eq!(d.chosen.worker, w(1));
}

#[test]
fn overrides_change_the_weights_per_request() {
    let mut s = scheduler(2);
    let prompt = blocks(100, 4);
    let overlaps = [(w(1), 4)];
    let o = RouterConfigOverride {
        overlap_score_credit: Some(0.0),
        prefill_load_scale: Some(2.0),
        ..RouterConfigOverride::default()
    };
    let req = SelectRequest {
        overrides: Some(&o),
        ..SelectRequest::new(64, &prompt, &overlaps)
    };
    let d = s.select(&req, &mut rng()).expect("selected");
    // No credit: both cost 2 * 4 + 4 = 12.
    assert!(d.candidates.iter().all(|c| c.cost == 12.0));

    let bad = RouterConfigOverride {
        router_temperature: Some(-1.0),
        ..RouterConfigOverride::default()
    };
    let req = SelectRequest {
        overrides: Some(&bad),
        ..SelectRequest::new(64, &prompt, &overlaps)
    };
    let err = s
        .select(&req, &mut rng())
        .expect_err("negative temperature");
    assert_eq!(
        err.to_string(),
        "invalid router_config_override: router_temperature must be a finite number >= 0, got -1"
    );
}

#[test]
fn expected_output_length_decays_exclusive_blocks() {
    let mut config = SchedulerConfig::new(BS);
    config.track_output_blocks = true;
    let mut s = scheduler_with(config, [WorkerSpec::new(0)]);
    let prompt = blocks(100, 8);
    s.add_request(
        &NewRequest {
            id: RequestId(1),
            worker: w(0),
            isl_tokens: 128,
            block_hashes: &prompt,
            overlap_blocks: 0,
            expected_output_tokens: Some(64),
        },
        Duration::ZERO,
    )
    .expect("added");
    // 32 of 64 tokens generated: 8 prompt + 2 output blocks, each weighing 1 - 32/64 = 0.5.
    s.add_output_tokens(RequestId(1), 32).expect("active");
    let load = s.worker_load(w(0)).expect("registered");
    assert_eq!((load.prefill_tokens, load.decode_blocks), (0, 5.0));
    // Past the expected length the exclusive blocks weigh nothing.
    s.add_output_tokens(RequestId(1), 40).expect("active");
    assert_eq!(s.worker_load(w(0)).map(|l| l.decode_blocks), Some(0.0));
}

#[test]
fn zero_temperature_breaks_ties_uniformly() {
    let mut s = scheduler(4);
    let mut r = rng();
    let mut counts = [0u32; 4];
    for _ in 0..4000 {
        let d = s
            .select(&SelectRequest::new(64, &[1, 2, 3, 4], &[]), &mut r)
            .expect("ok");
        counts[d.chosen.worker.worker_id as usize] += 1;
    }
    assert!(
        counts.iter().all(|&c| (850..1150).contains(&c)),
        "{counts:?}"
    );
}

#[test]
fn softmax_samples_with_the_normalised_cost_gap() {
    // Worker 1 carries 10 more decode blocks: costs 4+4=8 and 18, so c_min=8, c_max=18 and at
    // T=1 worker 1 has relative weight exp(-1): P(worker 0) = 1 / (1 + e^-1) ~ 0.731.
    let mut config = SchedulerConfig::new(BS);
    config.temperature = 1.0;
    let mut s = scheduler_with(config, (0..2).map(WorkerSpec::new));
    add(&mut s, 1, w(1), &blocks(500, 10));
    s.mark_prefill_completed(RequestId(1)).expect("active");
    let mut r = rng();
    let n = 20_000;
    let mut zero = 0;
    for _ in 0..n {
        let d = s
            .select(&SelectRequest::new(64, &[1, 2, 3, 4], &[]), &mut r)
            .expect("ok");
        assert_eq!(d.temperature, 1.0);
        zero += u32::from(d.chosen.worker == w(0));
    }
    let p = f64::from(zero) / f64::from(n);
    let want = 1.0 / (1.0 + (-1.0f64).exp());
    assert!((p - want).abs() < 0.015, "P(worker 0) = {p}, want {want}");
}

#[test]
fn preferred_taints_scale_the_cost() {
    let specs = [
        WorkerSpec::new(0),
        WorkerSpec::new(1).with_taint("gpu-h100"),
    ];
    let mut s = scheduler_with(SchedulerConfig::new(BS), specs);
    let constraints = RoutingConstraints {
        preferred_taints: BTreeMap::from([("gpu-h100".to_owned(), 0.5)]),
        ..RoutingConstraints::default()
    };
    let prompt = blocks(1, 4);
    let req = SelectRequest {
        constraints: Some(&constraints),
        ..SelectRequest::new(64, &prompt, &[])
    };
    let d = s.select(&req, &mut rng()).expect("ok");
    let c1 = cost_of(d.candidates, w(1));
    assert_eq!(cost_of(d.candidates, w(0)).taint_multiplier, 1.0);
    assert!((c1.taint_multiplier - (-(0.5f64).tanh()).exp()).abs() < 1e-12);
    assert!((c1.cost - 8.0 * c1.taint_multiplier).abs() < 1e-12);
    assert_eq!(d.chosen.worker, w(1));
}

/// Routes 64 requests over 8 workers with `choose`, keeping an exact model of each worker's
/// cache to produce overlap scores as an indexer would. Returns requests per worker.
fn simulate(
    mut choose: impl FnMut(u64, &[u64], &[(WorkerWithDpRank, u32)]) -> WorkerWithDpRank,
) -> Vec<u32> {
    let workers = 8u64;
    let mut cached: HashMap<u64, HashSet<u64>> = HashMap::new();
    let mut per_worker = vec![0u32; workers as usize];
    for i in 0..64u64 {
        // Block 0 is shared by everyone; the rest is unique to the request.
        let prompt: Vec<u64> = std::iter::once(0)
            .chain((1..16).map(|p| i * 100 + p))
            .collect();
        let overlaps: Vec<(WorkerWithDpRank, u32)> = (0..workers)
            .map(|wid| {
                let set = cached.get(&wid);
                let n = prompt
                    .iter()
                    .take_while(|h| set.is_some_and(|s| s.contains(h)))
                    .count();
                (w(wid), n as u32)
            })
            .filter(|(_, n)| *n > 0)
            .collect();
        let chosen = choose(i, &prompt, &overlaps);
        cached
            .entry(chosen.worker_id)
            .or_default()
            .extend(prompt.iter().copied());
        per_worker[chosen.worker_id as usize] += 1;
    }
    per_worker
}

/// Every request starts with the same block (as in the Mooncake trace). Chasing overlap alone
/// sends all of them to whichever worker cached that block first; the cost model must spread
/// them, because one shared block is worth far less than the load it would pile up.
#[test]
fn shared_first_block_does_not_collapse_onto_one_worker() {
    // An overlap-only router: the max-overlap worker, lowest id on ties.
    let overlap_only = simulate(|_, _, overlaps| {
        overlaps
            .iter()
            .max_by_key(|(wk, n)| (*n, std::cmp::Reverse(wk.worker_id)))
            .map_or(w(0), |o| o.0)
    });
    assert_eq!(overlap_only, [64, 0, 0, 0, 0, 0, 0, 0]);

    let mut s = scheduler(8);
    let mut r = rng();
    let cost_model = simulate(|i, prompt, overlaps| {
        let req = SelectRequest::new(prompt.len() as u64 * u64::from(BS), prompt, overlaps);
        let chosen = s.select(&req, &mut r).expect("ok").chosen.worker;
        add(&mut s, i, chosen, prompt);
        chosen
    });
    assert_eq!(cost_model, [8; 8], "the cost model spreads evenly");
}

#[test]
fn queued_requests_are_rescored_when_released() {
    let mut config = SchedulerConfig::new(BS);
    config.queue_threshold = LoadThresholds {
        decode_blocks_fraction: Some(0.5),
        ..LoadThresholds::default()
    };
    let specs = (0..2).map(|id| WorkerSpec::new(id).with_kv_capacity(10));
    let mut s = scheduler_with(config, specs);
    add(&mut s, 1, w(0), &blocks(100, 6));
    add(&mut s, 2, w(1), &blocks(200, 8));
    let prompt = blocks(300, 2);
    let req = SelectRequest::new(32, &prompt, &[]);
    assert!(
        s.should_queue(&req).expect("eligible"),
        "both workers above half capacity"
    );

    let mut queue = AdmissionQueue::new(QueuePolicy::Fcfs, 1);
    queue
        .try_push(prompt.clone(), QueueMeta::default())
        .expect("room");
    let refused = queue
        .try_push(vec![9], QueueMeta::default())
        .expect_err("full");
    assert_eq!(refused.into_inner(), vec![9]);

    // Worker 1 drains: the released request is scored against today's load, not the load it
    // saw on arrival (when worker 0 was the cheaper one).
    s.free(RequestId(2)).expect("active");
    let released = queue.pop_if(|p| {
        !s.should_queue(&SelectRequest::new(32, p, &[]))
            .unwrap_or(true)
    });
    let released = released.expect("worker 1 has room now");
    let d = s
        .select(&SelectRequest::new(32, &released, &[]), &mut rng())
        .expect("ok");
    assert_eq!(d.chosen.worker, w(1));
}

#[test]
fn output_tokens_add_no_decode_blocks_by_default_as_in_the_reference() {
    // Regression: output blocks used to grow the decode term always, while the reference's
    // `router_track_output_blocks` is off by default (decode load = active prompt blocks).
    let prompt = blocks(100, 8);
    for (track, expect) in [(false, 8.0), (true, 12.0)] {
        let mut config = SchedulerConfig::new(BS);
        config.track_output_blocks = track;
        let mut s = scheduler_with(config, [WorkerSpec::new(0)]);
        add(&mut s, 1, w(0), &prompt);
        s.add_output_tokens(RequestId(1), 64).expect("active");
        let load = s.worker_load(w(0)).expect("registered");
        assert_eq!(
            (load.prefill_tokens, load.decode_blocks),
            (0, expect),
            "{track}"
        );
        s.free(RequestId(1)).expect("active");
        assert_eq!(s.worker_load(w(0)), Some(Default::default()));
    }
}

#[test]
fn credit_falls_with_the_cached_share_when_asked() {
    let share = CostWeights {
        cached_share_exponent: 2.0,
        ..CostWeights::reference()
    };
    // (overlap, prompt blocks, expected credit per cached block)
    for (overlap, prompt, expect) in [
        (8, 8, 1.0),
        (6, 8, 0.5625),
        (4, 8, 0.25),
        (2, 8, 0.0625),
        (0, 8, 1.0),
        (9, 8, 1.0),
    ] {
        assert_eq!(share.credit(overlap, prompt), expect, "{overlap}/{prompt}");
        for preset in [CostWeights::reference(), CostWeights::load_adaptive()] {
            assert_eq!(preset.credit(overlap, prompt), 1.0, "{overlap}/{prompt}");
        }
    }
}

#[test]
fn load_adaptive_scale_rises_with_the_prefill_backlog() {
    let w = CostWeights::load_adaptive();
    for (backlog, expect) in [
        (0.0, 1.0),
        (0.5, 4.5),
        (1.0, 8.0),
        (3.0, 8.0),
        (-1.0, 1.0),
        (f64::NAN, 1.0),
    ] {
        assert_eq!(w.prefill_scale_at(backlog), expect, "{backlog}");
    }
    assert_eq!(CostWeights::reference().prefill_scale_at(1.0), 1.0);
}

/// Two workers with a 64-token batch budget each. Worker 1 caches the first 6 blocks of an
/// 8-block (128-token) prompt and runs one unrelated 8-block request that has `pending` prompt
/// tokens still to prefill (the rest of its 128 tokens were cached); worker 0 is idle. Checks
/// the scale, both costs and the choice.
fn check_backlog(weights: CostWeights, pending: u64, expect: (f64, f64, f64, u64)) {
    let mut config = SchedulerConfig::new(BS);
    config.cost = weights;
    let specs = (0..2).map(|i| WorkerSpec::new(i).with_max_batched_tokens(64));
    let mut s = scheduler_with(config, specs);
    let running = blocks(500, 8);
    s.add_request(
        &NewRequest {
            id: RequestId(1),
            worker: w(1),
            isl_tokens: 128,
            block_hashes: &running,
            overlap_blocks: ((128 - pending) / u64::from(BS)) as u32,
            expected_output_tokens: None,
        },
        Duration::ZERO,
    )
    .expect("added");
    let prompt = blocks(100, 8);
    let overlaps = [(w(1), 6)];
    let d = s
        .select(&SelectRequest::new(128, &prompt, &overlaps), &mut rng())
        .expect("selected");
    let got = (
        d.prefill_load_scale,
        cost_of(d.candidates, w(0)).cost,
        cost_of(d.candidates, w(1)).cost,
        d.chosen.worker.worker_id,
    );
    assert_eq!(got, expect, "{weights:?} with {pending} tokens pending");
}

#[test]
fn load_adaptive_matches_the_reference_without_backlog_and_keeps_the_cache_under_it() {
    let reference = CostWeights::reference();
    let adaptive = CostWeights::load_adaptive();
    // No backlog (worker 1's request is past its prefill): both score alike.
    // w0 = (128 / 16) + 8 = 16; w1 = (8 - 6) + (8 + 8) = 18: the extra running request
    // drives the conversation off its cache.
    check_backlog(reference, 0, (1.0, 16.0, 18.0, 0));
    check_backlog(adaptive, 0, (1.0, 16.0, 18.0, 0));
    // 64 tokens pending of a 128-token budget: backlog 1/2, scale 1 + 7 / 2 = 4.5.
    // w0 = 4.5 * 8 + 8 = 44; w1 = 4.5 * ((64 + 128) / 16 - 6) + 16 = 4.5 * 6 + 16 = 43.
    check_backlog(adaptive, 64, (4.5, 44.0, 43.0, 1));
    // The reference still leaves: w1 = (12 - 6) + 16 = 22 > 16.
    check_backlog(reference, 64, (1.0, 16.0, 22.0, 0));
    // 128 pending: backlog 1, scale 8. w0 = 8 * 8 + 8 = 72; w1 = 8 * (16 - 6) + 16 = 96: a
    // full queue outweighs the hit, and the request goes to the idle worker.
    check_backlog(adaptive, 128, (8.0, 72.0, 96.0, 0));
}

/// Three workers; worker 1 caches 6 of an 8-block prompt's blocks and runs another request of
/// `running` blocks past its prefill, workers 0 and 2 are idle. Returns worker 0's and worker
/// 1's costs and whether the prompt stayed with its cache on worker 1.
fn choose_with_decode_load(weights: CostWeights, running: u64) -> (f64, f64, bool) {
    let mut config = SchedulerConfig::new(BS);
    config.cost = weights;
    let mut s = scheduler_with(config, (0..3).map(WorkerSpec::new));
    add(&mut s, 1, w(1), &blocks(1000, running));
    s.mark_prefill_completed(RequestId(1)).expect("active");
    let prompt = blocks(100, 8);
    let overlaps = [(w(1), 6)];
    let d = s
        .select(
            &SelectRequest::new(8 * u64::from(BS), &prompt, &overlaps),
            &mut rng(),
        )
        .expect("selected");
    let w1 = cost_of(d.candidates, w(1));
    assert_eq!(w1.decode_blocks, (running + 8) as f64);
    (
        cost_of(d.candidates, w(0)).cost,
        w1.cost,
        d.chosen.worker == w(1),
    )
}

#[test]
fn decode_load_within_the_tolerance_weighs_lightly_and_beyond_it_fully() {
    // kv-locality's prefill side at a fixed scale of 4: 6 of 8 blocks cached credit
    // 1.5 * (6/8)^2 = 0.84375 a block, so the cached worker's prefill term is
    // 4 * (8 - 5.0625) = 11.75 and an idle worker's 4 * 8 = 32.
    let linear = CostWeights {
        prefill_load_scale: 4.0,
        loaded_prefill_load_scale: 4.0,
        overlap_credit: 1.5,
        cached_share_exponent: 2.0,
        ..CostWeights::reference()
    };
    let tolerant = CostWeights {
        balanced_decode_weight: 0.25,
        decode_tolerance: 1.0,
        ..linear
    };
    // 24 blocks running on the cached worker. Every decode block weighing 1, its 32 decode
    // blocks move the prompt off its cache: w1 = 11.75 + 32 = 43.75 > w0 = 32 + 8 = 40.
    assert_eq!(choose_with_decode_load(linear, 24), (40.0, 43.75, false));
    // With the tolerance the mean is 24 / 3 = 8, so up to 16 blocks are balanced: the idle
    // worker's 8 weigh a quarter (w0 = 32 + 2 = 34), and of the cached worker's 32 the 16 above
    // weigh fully: w1 = 11.75 + 0.25 * 32 + 0.75 * 16 = 31.75 < 34, so the prompt keeps its
    // cache.
    assert_eq!(choose_with_decode_load(tolerant, 24), (34.0, 31.75, true));
    // 72 blocks running: mean 24, balanced up to 48; the cached worker's 80 are 32 above:
    // w1 = 11.75 + 0.25 * 80 + 0.75 * 32 = 55.75 > 34, and it is spread.
    assert_eq!(choose_with_decode_load(tolerant, 72), (34.0, 55.75, false));
    // The reference's weight of 1 is the linear cost whatever the tolerance.
    let reference = CostWeights {
        decode_tolerance: 1.0,
        ..linear
    };
    assert_eq!(choose_with_decode_load(reference, 24), (40.0, 43.75, false));
}

#[test]
fn decode_cost_is_the_decode_blocks_at_the_references_weight() {
    let reference = CostWeights::reference();
    let locality = CostWeights::locality();
    for (decode, mean, expect) in [
        (0.0, 0.0, 0.0),
        (10.0, 10.0, 2.5),
        (20.0, 10.0, 5.0),
        (30.0, 10.0, 7.5 + 7.5),
        (30.0, 0.0, 30.0),
    ] {
        assert_eq!(reference.decode_cost(decode, mean), decode);
        assert_eq!(
            locality.decode_cost(decode, mean),
            expect,
            "{decode} / {mean}"
        );
    }
}

#[test]
fn request_weights_replace_the_configured_cost_and_overrides_still_apply() {
    let mut s = scheduler(2);
    let prompt = blocks(100, 8);
    let overlaps = [(w(1), 4)];
    let mut req = SelectRequest::new(128, &prompt, &overlaps);
    let share = CostWeights {
        prefill_load_scale: 8.0,
        loaded_prefill_load_scale: 8.0,
        cached_share_exponent: 2.0,
        ..CostWeights::reference()
    };
    req.weights = Some(share);
    // w1: 8 * (8 - 4 * 0.25) + 8 = 64.
    let d = s.select(&req, &mut rng()).expect("selected");
    assert_eq!(cost_of(d.candidates, w(1)).cost, 64.0);
    assert_eq!(cost_of(d.candidates, w(1)).credit, 0.25);
    // prefill_load_scale 2 on top replaces the whole scale range: w1 = 2 * 7 + 8 = 22.
    let o = RouterConfigOverride {
        prefill_load_scale: Some(2.0),
        ..Default::default()
    };
    req.overrides = Some(&o);
    let d = s.select(&req, &mut rng()).expect("selected");
    assert_eq!(cost_of(d.candidates, w(1)).cost, 22.0);
    assert_eq!(d.prefill_load_scale, 2.0);
    // Invalid base weights are refused like invalid overrides.
    req.overrides = None;
    req.weights = Some(CostWeights {
        cached_share_exponent: -1.0,
        ..share
    });
    let err = s.select(&req, &mut rng()).expect_err("negative exponent");
    assert_eq!(
        err.to_string(),
        "invalid router_config_override: cached_share_exponent must be a finite number >= 0, got -1"
    );
}

/// Lower-tier runs for [`SelectRequest::lower_tiers`].
fn tiers(runs: &[(u64, StorageTier, u32)]) -> Vec<TierOverlap> {
    runs.iter()
        .map(|&(id, tier, blocks)| TierOverlap {
            worker: w(id),
            tier,
            blocks,
        })
        .collect()
}

#[test]
fn a_host_tier_prefix_beats_a_cold_worker_and_loses_to_the_device() {
    let mut s = scheduler(3);
    let prompt = blocks(100, 4);
    let overlaps = [(w(1), 4)];
    let lower = tiers(&[(2, StorageTier::HostPinned, 4)]);
    let req = SelectRequest {
        lower_tiers: &lower,
        ..SelectRequest::new(64, &prompt, &overlaps)
    };
    let d = s.select(&req, &mut rng()).expect("selected");
    // Cold: 4 + 4 = 8. Device: (4 - 4) + 4 = 4. Host: (4 - 0.75 * 4) + 4 = 5.
    let costs: Vec<f64> = (0..3).map(|i| cost_of(d.candidates, w(i)).cost).collect();
    assert_eq!(costs, [8.0, 4.0, 5.0]);
    let host = cost_of(d.candidates, w(2));
    assert_eq!(
        (host.overlap_blocks, host.host_blocks, host.disk_blocks),
        (0, 4, 0)
    );
    assert_eq!(host.weighted_overlap_blocks, 3.0);
    assert_eq!(d.chosen.worker, w(1));

    // Without the device holder the host holder wins.
    let req = SelectRequest {
        lower_tiers: &lower,
        allowed_worker_ids: Some(&[0, 2]),
        ..SelectRequest::new(64, &prompt, &overlaps)
    };
    assert_eq!(
        s.select(&req, &mut rng()).expect("selected").chosen.worker,
        w(2)
    );
}

#[test]
fn a_device_prefix_and_its_host_continuation_earn_device_plus_weighted_host() {
    let mut s = scheduler(3);
    let prompt = blocks(100, 8);
    let overlaps = [(w(1), 2)];
    // Worker 1: device 2, then host 4, then disk 1 and external 1 (external counts as disk).
    // Worker 2: disk only.
    let lower = tiers(&[
        (1, StorageTier::HostPinned, 4),
        (1, StorageTier::Disk, 1),
        (1, StorageTier::External, 1),
        (2, StorageTier::Disk, 4),
    ]);
    let req = SelectRequest {
        lower_tiers: &lower,
        ..SelectRequest::new(128, &prompt, &overlaps)
    };
    let d = s.select(&req, &mut rng()).expect("selected");
    let c1 = cost_of(d.candidates, w(1));
    // 2 + 0.75 * 4 + 0.25 * 2 = 5.5 blocks; prefill 8 - 5.5 = 2.5; decode 8.
    assert_eq!(
        (c1.overlap_blocks, c1.host_blocks, c1.disk_blocks),
        (2, 4, 2)
    );
    assert_eq!(
        (
            c1.weighted_overlap_blocks,
            c1.credited_prefill_blocks,
            c1.cost
        ),
        (5.5, 2.5, 10.5)
    );
    assert_eq!(c1.cached_tokens(BS), 88);
    // Disk earns a quarter: 8 - 0.25 * 4 = 7, plus 8.
    let c2 = cost_of(d.candidates, w(2));
    assert_eq!((c2.weighted_overlap_blocks, c2.cost), (1.0, 15.0));
    assert_eq!(cost_of(d.candidates, w(0)).cost, 16.0);
    assert_eq!(d.chosen.worker, w(1));

    // As in the reference, overlap_score_credit scales the device blocks only.
    let o = RouterConfigOverride {
        overlap_score_credit: Some(0.0),
        ..RouterConfigOverride::default()
    };
    let req = SelectRequest {
        overrides: Some(&o),
        ..req
    };
    let d = s.select(&req, &mut rng()).expect("selected");
    assert_eq!(cost_of(d.candidates, w(1)).credited_prefill_blocks, 4.5);
}

#[test]
fn configured_cache_hit_weights_apply_to_every_cost_preset() {
    let mut config = SchedulerConfig::new(BS);
    config.cache_hit_weights = CacheHitWeights {
        host: 0.5,
        disk: 1.0,
    };
    let mut s = scheduler_with(config, (0..2).map(WorkerSpec::new));
    let prompt = blocks(100, 4);
    let lower = tiers(&[(1, StorageTier::HostPinned, 2), (1, StorageTier::Disk, 2)]);
    for weights in [CostWeights::reference(), CostWeights::load_adaptive()] {
        let req = SelectRequest {
            lower_tiers: &lower,
            weights: Some(weights),
            ..SelectRequest::new(64, &prompt, &[])
        };
        let d = s.select(&req, &mut rng()).expect("selected");
        // 0.5 * 2 + 1.0 * 2 = 3 blocks.
        assert_eq!(cost_of(d.candidates, w(1)).weighted_overlap_blocks, 3.0);
        assert_eq!(cost_of(d.candidates, w(1)).credited_prefill_blocks, 1.0);
    }
}

#[test]
fn zero_cache_hit_weights_reproduce_the_device_only_decision() {
    let mut config = SchedulerConfig::new(BS);
    config.cache_hit_weights = CacheHitWeights::device_only();
    config.temperature = 0.7;
    let mut with_tiers = scheduler_with(config.clone(), (0..4).map(WorkerSpec::new));
    let mut device_only = scheduler_with(config, (0..4).map(WorkerSpec::new));
    for s in [&mut with_tiers, &mut device_only] {
        add(s, 1, w(3), &blocks(500, 6));
    }
    let prompt = blocks(100, 8);
    let overlaps = [(w(1), 3), (w(3), 1)];
    let lower = tiers(&[
        (1, StorageTier::HostPinned, 5),
        (2, StorageTier::HostPinned, 8),
        (0, StorageTier::Disk, 8),
    ]);
    let (mut r1, mut r2) = (rng(), rng());
    for _ in 0..50 {
        let a = with_tiers
            .select(
                &SelectRequest {
                    lower_tiers: &lower,
                    ..SelectRequest::new(128, &prompt, &overlaps)
                },
                &mut r1,
            )
            .expect("selected");
        let (chosen, costs): (_, Vec<u64>) = (
            a.chosen.worker,
            a.candidates.iter().map(|c| c.cost.to_bits()).collect(),
        );
        let b = device_only
            .select(&SelectRequest::new(128, &prompt, &overlaps), &mut r2)
            .expect("selected");
        assert_eq!(chosen, b.chosen.worker);
        assert_eq!(
            costs,
            b.candidates
                .iter()
                .map(|c| c.cost.to_bits())
                .collect::<Vec<_>>()
        );
    }
}

#[test]
fn weighted_cached_tokens_reduce_tracked_prefill_and_free_to_zero() {
    let mut s = scheduler(2);
    let prompt = blocks(100, 4);
    let lower = tiers(&[(1, StorageTier::HostPinned, 4)]);
    let req = SelectRequest {
        lower_tiers: &lower,
        ..SelectRequest::new(64, &prompt, &[])
    };
    let chosen = s.select(&req, &mut rng()).expect("selected").chosen;
    assert_eq!(chosen.worker, w(1));
    // 0.75 * 4 blocks of 16 tokens: 48 tokens expected cached, 16 left to prefill.
    let new = NewRequest {
        id: RequestId(9),
        worker: chosen.worker,
        isl_tokens: 64,
        block_hashes: &prompt,
        overlap_blocks: chosen.overlap_blocks,
        expected_output_tokens: None,
    };
    s.add_request_with_cached_tokens(&new, chosen.cached_tokens(BS), Duration::ZERO)
        .expect("added");
    assert_eq!(s.worker_load(w(1)).expect("registered").prefill_tokens, 16);
    s.free(RequestId(9)).expect("active");
    assert_eq!(s.worker_load(w(1)), Some(WorkerLoad::default()));
}

#[test]
fn locality_keeps_a_long_context_on_its_cache_where_the_reference_moves_it() {
    // w0 caches 36 of the prompt's 40 blocks but also runs another 40-block request that has
    // finished its prefill; w1 is idle.
    let mut s = scheduler(2);
    add(&mut s, 1, w(0), &blocks(1000, 40));
    s.mark_prefill_completed(RequestId(1)).expect("active");
    let prompt = blocks(100, 40);
    let overlaps = [(w(0), 36)];
    let mut req = SelectRequest::new(40 * u64::from(BS), &prompt, &overlaps);
    // The reference: w0 = (40 - 36) + 40 + 40 = 84 > w1 = 40 + 40 = 80, so 36 cached blocks are
    // given up for 40 fewer decode blocks.
    req.weights = Some(CostWeights::reference());
    let d = s.select(&req, &mut rng()).expect("selected");
    assert_eq!(cost_of(d.candidates, w(0)).cost, 84.0);
    assert_eq!(d.chosen.worker, w(1));
    // Locality: the credit is 1.5 * (36 / 40)^2 = 1.215 per cached block, which covers the
    // prompt. Decode blocks within twice the mean (40 / 2 = 20) weigh a quarter, those above
    // fully: w0 = 4 * 0 + 80 / 4 + 0.75 * (80 - 40) = 50 against w1 = 4 * 40 + 40 / 4 = 170.
    req.weights = Some(CostWeights::locality());
    let d = s.select(&req, &mut rng()).expect("selected");
    let w0 = cost_of(d.candidates, w(0));
    assert!((w0.credit - 1.215).abs() < 1e-9, "{w0:?}");
    assert_eq!(w0.cost, 50.0);
    assert_eq!(cost_of(d.candidates, w(1)).cost, 170.0);
    assert_eq!(d.chosen.worker, w(0));
}

#[test]
fn credit_decays_with_prefill_backlog_above_the_fleets_least_when_asked() {
    // w0 holds the whole 8-block prompt but has 2 blocks of another prompt still to prefill;
    // w1 is idle, so w0's backlog is 2 blocks above the floor.
    let mut s = scheduler(2);
    add(&mut s, 1, w(0), &blocks(1000, 2));
    let prompt = blocks(100, 8);
    let overlaps = [(w(0), 8)];
    let mut req = SelectRequest::new(8 * u64::from(BS), &prompt, &overlaps);
    req.weights = Some(CostWeights::reference());
    let d = s.select(&req, &mut rng()).expect("selected");
    // No decay: w0 = (2 + 8 - 8) + (2 + 8) = 12.
    assert_eq!(cost_of(d.candidates, w(0)).credit, 1.0);
    assert_eq!(cost_of(d.candidates, w(0)).cost, 12.0);
    // Decay 1: the credit is 1 / (1 + 1 * 2 / 8) = 0.8, w0 = (10 - 6.4) + 10 = 13.6; w1 at the
    // floor keeps its (empty) credit whole: 8 + 8 = 16.
    req.weights = Some(CostWeights {
        overlap_credit_decay: 1.0,
        ..CostWeights::reference()
    });
    let d = s.select(&req, &mut rng()).expect("selected");
    let w0 = cost_of(d.candidates, w(0));
    assert!((w0.credit - 0.8).abs() < 1e-12, "{w0:?}");
    assert!((w0.cost - 13.6).abs() < 1e-9, "{w0:?}");
    assert_eq!(cost_of(d.candidates, w(1)).cost, 16.0);
    // A negative decay is refused like any other weight.
    req.weights = Some(CostWeights {
        overlap_credit_decay: -1.0,
        ..CostWeights::reference()
    });
    assert!(s.select(&req, &mut rng()).is_err());
}

#[test]
fn avoided_workers_are_skipped_while_another_can_serve_and_chosen_when_none_can() {
    let mut s = scheduler(3);
    let prompt = blocks(300, 4);
    // Worker 1 holds the whole prompt: it would win on overlap alone.
    let overlaps = [(w(1), 4)];
    let req = SelectRequest {
        avoided_worker_ids: &[1],
        ..SelectRequest::new(64, &prompt, &overlaps)
    };
    for _ in 0..20 {
        let chosen = s.select(&req, &mut rng()).expect("selected").chosen.worker;
        assert_ne!(chosen, w(1), "an avoided worker is routed around");
    }
    // Only the avoided worker is allowed: it serves rather than nobody.
    let req = SelectRequest {
        avoided_worker_ids: &[1],
        allowed_worker_ids: Some(&[1]),
        ..SelectRequest::new(64, &prompt, &overlaps)
    };
    assert_eq!(
        s.select(&req, &mut rng()).expect("selected").chosen.worker,
        w(1)
    );
    // A pin overrides the avoidance.
    let req = SelectRequest {
        avoided_worker_ids: &[1],
        pinned_worker: Some(1),
        ..SelectRequest::new(64, &prompt, &overlaps)
    };
    assert_eq!(
        s.select(&req, &mut rng()).expect("selected").chosen.worker,
        w(1)
    );
}

#[test]
fn cached_blocks_a_full_worker_cannot_keep_earn_no_credit() {
    // Prefill weighs 4 decode blocks; both workers hold 20 blocks of KV in all.
    let weights = |capacity_credit| CostWeights {
        prefill_load_scale: 4.0,
        loaded_prefill_load_scale: 4.0,
        capacity_credit,
        ..CostWeights::reference()
    };
    let fleet = |capacity_credit, capacity: Option<u64>| {
        let mut config = SchedulerConfig::new(BS);
        config.cost = weights(capacity_credit);
        let specs = (0..2).map(move |id| match capacity {
            Some(blocks) => WorkerSpec::new(id).with_kv_capacity(blocks),
            None => WorkerSpec::new(id),
        });
        let mut s = scheduler_with(config, specs);
        // Worker 1 runs an unrelated 16-block prompt, past its prefill: 4 blocks of room left.
        add(&mut s, 1, w(1), &blocks(500, 16));
        s.mark_prefill_completed(RequestId(1)).expect("active");
        assert_eq!(s.worker_load(w(1)).map(|l| l.held_blocks), Some(16));
        s
    };
    // A 10-block prompt with 8 blocks cached on worker 1.
    let prompt = blocks(100, 10);
    let overlaps = [(w(1), 8)];
    let req = SelectRequest::new(160, &prompt, &overlaps);

    let mut s = fleet(true, Some(20));
    let d = s.select(&req, &mut rng()).expect("selected");
    // Admitting it, worker 1 must hold all 10 of its blocks in 4 blocks of room: 6 of the 8
    // cached ones go. Prefill 10 - 1.0 * 2 kept = 8, decode 16 + 10: 4 * 8 + 26 = 58.
    let c1 = cost_of(d.candidates, w(1));
    assert_eq!(
        (
            c1.overlap_blocks,
            c1.unkept_blocks,
            c1.credited_prefill_blocks,
            c1.cost
        ),
        (8, 6, 8.0, 58.0)
    );
    // The idle worker: 4 * 10 + 10 = 50.
    assert_eq!(cost_of(d.candidates, w(0)).cost, 50.0);
    assert_eq!(d.chosen.worker, w(0));
    assert!(!d.chosen.to_string().contains("unkept"), "{}", d.chosen);
    assert!(
        c1.to_string().contains("6 unkept for want of capacity"),
        "{c1}"
    );

    // The reference's cost, a worker of unknown capacity, or one with room: all 8 credited.
    for (capacity_credit, capacity) in [(false, Some(20)), (true, None), (true, Some(26))] {
        let mut s = fleet(capacity_credit, capacity);
        let d = s.select(&req, &mut rng()).expect("selected");
        let c1 = cost_of(d.candidates, w(1));
        // Prefill 10 - 8 = 2, decode 26: 4 * 2 + 26 = 34.
        assert_eq!(
            (c1.unkept_blocks, c1.cost, d.chosen.worker),
            (0, 34.0, w(1)),
            "capacity_credit {capacity_credit}, capacity {capacity:?}"
        );
    }

    // Prompt blocks the worker already holds for another request need no room.
    let mut s = fleet(true, Some(20));
    let shared: Vec<u64> = blocks(500, 8).into_iter().chain(blocks(900, 2)).collect();
    let d = s
        .select(&SelectRequest::new(160, &shared, &[(w(1), 8)]), &mut rng())
        .expect("selected");
    assert_eq!(cost_of(d.candidates, w(1)).unkept_blocks, 0);
}

#[test]
fn a_placement_is_charged_for_the_idle_cache_it_evicts_beyond_the_roomiest_workers() {
    // Prefill weighs 4 decode blocks; each worker's KV holds 100 blocks.
    let fleet = |eviction_weight| {
        let mut config = SchedulerConfig::new(BS);
        config.cost = CostWeights {
            prefill_load_scale: 4.0,
            loaded_prefill_load_scale: 4.0,
            eviction_weight,
            ..CostWeights::reference()
        };
        scheduler_with(
            config,
            (0..3).map(|id| WorkerSpec::new(id).with_kv_capacity(100)),
        )
    };
    // A new 10-block prompt whose first 2 blocks (a shared preamble) worker 0 caches. Worker 0
    // caches 95 blocks (5 free), worker 1 caches 40 (60 free), worker 2 nothing (the indexer
    // shows no block of it: 100 free).
    let prompt = blocks(100, 10);
    let overlaps = [(w(0), 2)];
    let resident = [(w(0), 95), (w(1), 40)];
    let mut req = SelectRequest::new(160, &prompt, &overlaps);
    req.resident_blocks = &resident;

    let mut s = fleet(1.0);
    let d = s.select(&req, &mut rng()).expect("selected");
    // Worker 0 allocates 8 new blocks in 5 free: 3 evicted, where worker 2 (100 free) evicts
    // none. Prefill 10 - 2 = 8, decode 10: 4 * (8 + 1.0 * 3) + 10 = 54.
    let c0 = cost_of(d.candidates, w(0));
    assert_eq!((c0.evicted_blocks, c0.cost), (3, 54.0));
    assert!(c0.to_string().contains("evicts 3"), "{c0}");
    // Worker 1 has room for all 10: no charge, 4 * 10 + 10 = 50, as worker 2.
    let c1 = cost_of(d.candidates, w(1));
    assert_eq!((c1.evicted_blocks, c1.cost), (0, 50.0));
    assert_eq!(cost_of(d.candidates, w(2)).cost, 50.0);
    assert_ne!(d.chosen.worker, w(0));
    assert!(!c1.to_string().contains("evicts"), "{c1}");

    // Without the charge the preamble draws the prompt to worker 0: 4 * 8 + 10 = 42.
    let mut s = fleet(0.0);
    let d = s.select(&req, &mut rng()).expect("selected");
    assert_eq!(
        (cost_of(d.candidates, w(0)).cost, d.chosen.worker),
        (42.0, w(0))
    );

    // Every worker full alike: each evicts all it allocates, so none is charged, and the
    // preamble draws the prompt as without the charge.
    let full = [(w(0), 100), (w(1), 100), (w(2), 100)];
    req.resident_blocks = &full;
    let mut s = fleet(1.0);
    let d = s.select(&req, &mut rng()).expect("selected");
    assert!(d.candidates.iter().all(|c| c.evicted_blocks == 0));
    assert_eq!(d.chosen.worker, w(0));

    // Blocks routed to a worker but not yet stored count against its room too: 60 held by a
    // request in flight on worker 2, which the indexer does not show yet.
    req.resident_blocks = &resident;
    let mut s = fleet(1.0);
    add(&mut s, 1, w(2), &blocks(500, 60));
    s.mark_prefill_completed(RequestId(1)).expect("active");
    let d = s.select(&req, &mut rng()).expect("selected");
    // The roomiest is worker 1 (60 free) and worker 2 has 40: neither evicts for 10 blocks,
    // worker 0 still evicts 3 more than they do.
    assert_eq!(
        d.candidates
            .iter()
            .map(|c| c.evicted_blocks)
            .collect::<Vec<_>>(),
        [3, 0, 0]
    );
}

#[test]
fn a_full_workers_evictions_are_charged_by_how_fast_it_has_been_allocating() {
    // Prefill weighs 4 decode blocks; each worker's KV holds 100 blocks.
    let fleet = |churn_eviction_weight| {
        let mut config = SchedulerConfig::new(BS);
        config.cost = CostWeights {
            prefill_load_scale: 4.0,
            loaded_prefill_load_scale: 4.0,
            churn_eviction_weight,
            ..CostWeights::reference()
        };
        let mut s = scheduler_with(
            config,
            (0..3).map(|id| WorkerSpec::new(id).with_kv_capacity(100)),
        );
        // 60 new blocks routed to worker 0, then 20 to worker 1, none to worker 2; all done.
        add(&mut s, 1, w(0), &blocks(1000, 60));
        add(&mut s, 2, w(1), &blocks(2000, 20));
        s.free(RequestId(1)).expect("active");
        s.free(RequestId(2)).expect("active");
        s
    };
    // Every worker's cache is full; a new 10-block prompt whose 2-block preamble each caches.
    let full = [(w(0), 100), (w(1), 100), (w(2), 100)];
    let prompt = blocks(100, 10);
    let overlaps = [(w(0), 2), (w(1), 2), (w(2), 2)];
    let mut req = SelectRequest::new(160, &prompt, &overlaps);
    req.resident_blocks = &full;

    let mut s = fleet(1.0);
    let d = s.select(&req, &mut rng()).expect("selected");
    // Churn halves over the fleet's 300 blocks of capacity: worker 0's 60 blocks weigh
    // 60 * 2^(-20/300) by now, worker 1's 20, worker 2's nothing; their mean is 25.76.
    let churn0 = 60.0 * (-20.0f64 / 300.0).exp2();
    let mean = (churn0 + 20.0) / 3.0;
    let (c0, c1, c2) = (
        cost_of(d.candidates, w(0)),
        cost_of(d.candidates, w(1)),
        cost_of(d.candidates, w(2)),
    );
    // Each evicts the 8 blocks it allocates; worker 0 at the full share (capped at 1), worker 1
    // at 20 / mean, worker 2 (the floor) at none. Prefill 10 - 2 = 8, decode 10.
    assert_eq!((c0.churn_evicted_blocks, c0.churn_share), (8, 1.0));
    assert_eq!(c0.cost, 4.0 * (8.0 + 8.0) + 10.0);
    assert!((c1.churn_share - 20.0 / mean).abs() < 1e-9, "{c1}");
    assert!((c1.cost - (4.0 * (8.0 + 8.0 * 20.0 / mean) + 10.0)).abs() < 1e-9);
    assert_eq!((c2.churn_share, c2.cost), (0.0, 42.0));
    assert_eq!(d.chosen.worker, w(2));
    assert!(c0.to_string().contains("evicts 8 at churn 1.000"), "{c0}");
    assert!(!c2.to_string().contains("evicts"), "{c2}");

    // A continuing prompt with 9 of its 10 blocks cached on worker 0 allocates one block there:
    // 4 * (1 + 1) + 10 = 18 against 4 * 10 + 10 = 50 elsewhere; it stays.
    let overlaps = [(w(0), 9)];
    let mut next = SelectRequest::new(160, &prompt, &overlaps);
    next.resident_blocks = &full;
    let d = s.select(&next, &mut rng()).expect("selected");
    assert_eq!((d.chosen.worker, d.candidates[0].cost), (w(0), 18.0));

    // A worker with room evicts nothing, whatever its churn.
    let roomy = [(w(0), 50), (w(1), 100), (w(2), 100)];
    req.resident_blocks = &roomy;
    let d = s.select(&req, &mut rng()).expect("selected");
    let c0 = cost_of(d.candidates, w(0));
    assert_eq!((c0.churn_evicted_blocks, c0.cost), (0, 42.0));

    // Without the weight, no churn is read and the three tie.
    let mut s = fleet(0.0);
    req.resident_blocks = &full;
    let d = s.select(&req, &mut rng()).expect("selected");
    assert!(
        d.candidates
            .iter()
            .all(|c| (c.churn_share, c.churn_evicted_blocks, c.cost) == (0.0, 0, 42.0)),
        "{:?}",
        d.candidates
    );

    // Churn fades as the fleet allocates: after 3,000 blocks more on worker 2 (ten half-lives),
    // worker 2 churns most and worker 0's 60 blocks weigh almost nothing.
    let mut s = fleet(1.0);
    add(&mut s, 3, w(2), &blocks(5000, 3000));
    s.free(RequestId(3)).expect("active");
    let d = s.select(&req, &mut rng()).expect("selected");
    assert_eq!(cost_of(d.candidates, w(2)).churn_share, 1.0);
    assert!(cost_of(d.candidates, w(0)).churn_share < 0.001);
    assert_ne!(d.chosen.worker, w(2));

    // A worker whose capacity is forgotten is never charged (nor counted in the mean).
    s.set_kv_capacity(w(2), None).expect("registered");
    let d = s.select(&req, &mut rng()).expect("selected");
    let c2 = cost_of(d.candidates, w(2));
    assert_eq!((c2.churn_share, c2.churn_evicted_blocks), (0.0, 0));
}

#[test]
fn a_new_context_is_charged_for_how_much_fuller_a_worker_is_than_the_emptiest() {
    // Prefill weighs 4 decode blocks; each worker's KV holds 100 blocks.
    let fleet = |occupancy_weight| {
        let mut config = SchedulerConfig::new(BS);
        config.cost = CostWeights {
            prefill_load_scale: 4.0,
            loaded_prefill_load_scale: 4.0,
            occupancy_weight,
            ..CostWeights::reference()
        };
        scheduler_with(
            config,
            (0..3).map(|id| WorkerSpec::new(id).with_kv_capacity(100)),
        )
    };
    // Worker 0 holds 40 blocks, worker 1 10, worker 2 none: fills 0.4, 0.1 and 0 (the floor).
    let filling = [(w(0), 40), (w(1), 10), (w(2), 0)];
    // A new 10-block context whose 2-block preamble worker 0 caches.
    let prompt = blocks(100, 10);
    let preamble = [(w(0), 2)];
    let mut req = SelectRequest::new(160, &prompt, &preamble);
    req.resident_blocks = &filling;

    let mut s = fleet(2.0);
    let d = s.select(&req, &mut rng()).expect("selected");
    let (c0, c1, c2) = (
        cost_of(d.candidates, w(0)),
        cost_of(d.candidates, w(1)),
        cost_of(d.candidates, w(2)),
    );
    // Worker 0 allocates 8 blocks, 0.8 of the prompt, at 0.4 above the floor: 2 * 0.4 * 8 *
    // 0.8^2 = 4.096 blocks of prefill on top of its 10 - 2; decode 10 everywhere.
    assert_eq!((c0.new_blocks, c0.occupancy_share), (8, 0.4));
    assert!(
        (c0.cost - (4.0 * (8.0 + 2.0 * 0.4 * 8.0 * 0.64) + 10.0)).abs() < 1e-9,
        "{c0}"
    );
    // Worker 1 allocates all 10 at 0.1 above: 2 * 0.1 * 10 = 2 blocks.
    assert_eq!(c1.new_blocks, 10);
    assert!((c1.occupancy_share - 0.1).abs() < 1e-12, "{c1}");
    assert!((c1.cost - (4.0 * (10.0 + 2.0) + 10.0)).abs() < 1e-9, "{c1}");
    // Worker 2, the emptiest, is not charged, and takes the new context.
    assert_eq!((c2.occupancy_share, c2.cost), (0.0, 50.0));
    assert_eq!(d.chosen.worker, w(2));
    assert!(
        c0.to_string().contains("allocates 8 at fill +0.400"),
        "{c0}"
    );
    assert!(!c2.to_string().contains("allocates"), "{c2}");

    // Without the weight the preamble's credit takes it to worker 0: 4 * 8 + 10.
    let mut plain = fleet(0.0);
    let d = plain.select(&req, &mut rng()).expect("selected");
    assert_eq!((d.chosen.worker, d.candidates[0].cost), (w(0), 42.0));
    assert!(d.candidates.iter().all(|c| c.occupancy_share == 0.0));

    // A continuing context with 9 of its 10 blocks cached on worker 0 allocates one there, a
    // tenth of the prompt: 2 * 0.4 * 1 * 0.01 = 0.008 blocks; it stays.
    let continuing = [(w(0), 9)];
    let mut next = SelectRequest::new(160, &prompt, &continuing);
    next.resident_blocks = &filling;
    let d = s.select(&next, &mut rng()).expect("selected");
    assert_eq!(d.chosen.worker, w(0));
    assert!((d.candidates[0].cost - (4.0 * (1.0 + 0.008) + 10.0)).abs() < 1e-9);

    // Every worker as full as the others: silent, and the preamble decides.
    let full = [(w(0), 100), (w(1), 100), (w(2), 100)];
    req.resident_blocks = &full;
    let d = s.select(&req, &mut rng()).expect("selected");
    assert_eq!((d.chosen.worker, d.candidates[0].cost), (w(0), 42.0));

    // A worker whose capacity is unknown is neither charged nor the floor: worker 1's 0.1 is.
    req.resident_blocks = &filling;
    s.set_kv_capacity(w(2), None).expect("registered");
    let d = s.select(&req, &mut rng()).expect("selected");
    let c0 = cost_of(d.candidates, w(0));
    assert!((c0.occupancy_share - 0.3).abs() < 1e-12, "{c0}");
    assert_eq!(cost_of(d.candidates, w(1)).occupancy_share, 0.0);
    assert_eq!(cost_of(d.candidates, w(2)).occupancy_share, 0.0);
}

#[test]
fn a_reported_capacity_is_set_and_read_back() {
    let mut s = scheduler(1);
    assert_eq!(s.kv_capacity(w(0)), None);
    s.set_kv_capacity(w(0), Some(3125)).expect("registered");
    assert_eq!(s.kv_capacity(w(0)), Some(3125));
    assert!(s.set_kv_capacity(w(9), Some(1)).is_err());
    s.set_kv_capacity(w(0), None).expect("registered");
    assert_eq!(s.kv_capacity(w(0)), None);
}
