//! Hand-computed costs, tie-breaking, the softmax distribution, the shared-first-block trap, and
//! the admission queue re-scoring released requests.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use kvroute_protocols::{RouterConfigOverride, RoutingConstraints, WorkerWithDpRank};
use kvroute_scheduler::{
    AdmissionQueue, CandidateCost, LoadThresholds, NewRequest, QueueMeta, QueuePolicy, RequestId,
    SchedulerConfig, SelectRequest, WorkerSpec,
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
    let mut s = scheduler(1);
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
