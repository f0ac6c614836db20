//! The load invariant: random operation streams agree with a naive model at every step, and
//! every figure returns to zero once all requests have ended (freed or expired).

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use kvroute_scheduler::{
    NewRequest, RequestId, Scheduler, SchedulerConfig, SelectRequest, WorkerLoad, WorkerSpec,
};
use proptest::prelude::*;

use crate::support::{rng, w};

const BS: u32 = 4;
const WORKERS: u64 = 6;
const ONE: u64 = 1 << 16;
const TTL: u64 = 50;
const GRACE: u64 = 10;

/// Who owns a request in the reconcile operations.
fn owned(id: RequestId) -> bool {
    id.0.is_multiple_of(3)
}

#[derive(Debug, Clone)]
enum Op {
    /// Add a request on `worker` whose prompt is the first `len` blocks of prompt family `family`.
    Add {
        worker: u64,
        family: u64,
        len: u64,
        overlap: u32,
        /// Slower-tier cached tokens on top of the device overlap (added with
        /// `add_request_with_cached_tokens`; may exceed the prompt).
        lower_tokens: Option<u64>,
        expected: Option<u32>,
    },
    PrefillDone(usize),
    Output(usize, u64),
    Free(usize),
    /// Advance the clock by this many seconds and run expiry.
    Tick(u64),
    /// `worker`'s engine reports holding `requests` (reconciled, ids divisible by 3 owned).
    Report {
        worker: u64,
        requests: u64,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..WORKERS, 0..3u64, 0..8u64, 0..4u32, proptest::option::of(0..40u64), proptest::option::of(1..40u32))
            .prop_map(|(worker, family, len, overlap, lower_tokens, expected)| Op::Add { worker, family, len, overlap, lower_tokens, expected }),
        2 => any::<prop::sample::Index>().prop_map(|i| Op::PrefillDone(i.index(1 << 16))),
        3 => (any::<prop::sample::Index>(), 0..12u64).prop_map(|(i, n)| Op::Output(i.index(1 << 16), n)),
        3 => any::<prop::sample::Index>().prop_map(|i| Op::Free(i.index(1 << 16))),
        1 => (1..30u64).prop_map(Op::Tick),
        1 => (0..WORKERS, 0..4u64).prop_map(|(worker, requests)| Op::Report { worker, requests }),
    ]
}

/// One active request as the naive model sees it.
#[derive(Debug, Clone)]
struct ModelReq {
    worker: u64,
    prompt: Vec<u64>,
    prefill: u64,
    out_tokens: u64,
    expected: Option<u32>,
    started: u64,
}

impl ModelReq {
    fn fraction(&self) -> u64 {
        match self.expected {
            Some(e) => {
                let done = self.out_tokens.min(u64::from(e));
                ONE - ONE * done / u64::from(e)
            }
            None => ONE,
        }
    }
}

/// Recomputes every worker's load from scratch.
fn model_load(reqs: &BTreeMap<u64, ModelReq>, worker: u64) -> WorkerLoad {
    let mine: Vec<(&u64, &ModelReq)> = reqs.iter().filter(|(_, r)| r.worker == worker).collect();
    let mut holders: HashMap<u64, Vec<u64>> = HashMap::new();
    for (id, r) in &mine {
        for h in &r.prompt {
            holders.entry(*h).or_default().push(**id);
        }
    }
    let shared = holders.values().filter(|v| v.len() >= 2).count() as u64;
    let mut weighted = 0u64;
    for (id, r) in &mine {
        let exclusive_prompt = holders
            .values()
            .filter(|v| v.len() == 1 && v[0] == **id)
            .count() as u64;
        let exclusive = exclusive_prompt + r.out_tokens / u64::from(BS);
        weighted += exclusive * r.fraction();
    }
    let output_blocks: u64 = mine.iter().map(|(_, r)| r.out_tokens / u64::from(BS)).sum();
    WorkerLoad {
        active_requests: mine.len() as u64,
        prefill_tokens: mine.iter().map(|(_, r)| r.prefill).sum(),
        shared_blocks: shared,
        decode_blocks: shared as f64 + weighted as f64 / ONE as f64,
        held_blocks: holders.len() as u64 + output_blocks,
    }
}

fn run(ops: &[Op]) -> Result<(), TestCaseError> {
    let mut config = SchedulerConfig::new(BS);
    config.request_expiry = Duration::from_secs(TTL);
    config.report_grace = Duration::from_secs(GRACE);
    // The model grows output blocks, so the scheduler must too.
    config.track_output_blocks = true;
    let mut s = Scheduler::new(config).expect("valid config");
    for id in 0..WORKERS {
        s.add_worker(&WorkerSpec::new(id)).expect("fresh worker");
    }
    let mut model: BTreeMap<u64, ModelReq> = BTreeMap::new();
    let mut next_id = 0u64;
    let mut now = 0u64;
    let pick = |model: &BTreeMap<u64, ModelReq>, i: usize| {
        model.keys().nth(i % model.len().max(1)).copied()
    };

    for op in ops {
        match *op {
            Op::Add {
                worker,
                family,
                len,
                overlap,
                lower_tokens,
                expected,
            } => {
                // Family prompts share their prefix, so requests on one worker overlap.
                let prompt: Vec<u64> = (0..len).map(|p| family * 1000 + p).collect();
                let isl = len * u64::from(BS) + 3;
                let req = NewRequest {
                    id: RequestId(next_id),
                    worker: w(worker),
                    isl_tokens: isl,
                    block_hashes: &prompt,
                    overlap_blocks: overlap,
                    expected_output_tokens: expected,
                };
                let device_tokens = u64::from(overlap) * u64::from(BS);
                let at = Duration::from_secs(now);
                let cached = match lower_tokens {
                    None => {
                        s.add_request(&req, at)
                            .map_err(|e| TestCaseError::fail(e.to_string()))?;
                        device_tokens
                    }
                    Some(lower) => {
                        s.add_request_with_cached_tokens(&req, device_tokens + lower, at)
                            .map_err(|e| TestCaseError::fail(e.to_string()))?;
                        device_tokens + lower
                    }
                };
                let prefill = isl.saturating_sub(cached);
                model.insert(
                    next_id,
                    ModelReq {
                        worker,
                        prompt,
                        prefill,
                        out_tokens: 0,
                        expected,
                        started: now,
                    },
                );
                next_id += 1;
            }
            Op::PrefillDone(i) => {
                if let Some(id) = pick(&model, i) {
                    s.mark_prefill_completed(RequestId(id)).expect("active");
                    model.get_mut(&id).expect("picked").prefill = 0;
                }
            }
            Op::Output(i, n) => {
                if let Some(id) = pick(&model, i) {
                    s.add_output_tokens(RequestId(id), n).expect("active");
                    let r = model.get_mut(&id).expect("picked");
                    r.prefill = 0;
                    r.out_tokens += n;
                }
            }
            Op::Free(i) => {
                if let Some(id) = pick(&model, i) {
                    s.free(RequestId(id)).expect("active");
                    model.remove(&id);
                }
            }
            Op::Tick(dt) => {
                now += dt;
                let mut expired = s.expire(Duration::from_secs(now));
                expired.sort();
                let mut want: Vec<RequestId> = model
                    .iter()
                    .filter(|(_, r)| r.started + TTL <= now)
                    .map(|(id, _)| RequestId(*id))
                    .collect();
                want.sort();
                prop_assert_eq!(&expired, &want);
                model.retain(|_, r| r.started + TTL > now);
            }
            Op::Report { worker, requests } => {
                let freed = s
                    .reconcile_reported(w(worker), requests, Duration::from_secs(now), owned)
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
                let tracked = model.values().filter(|r| r.worker == worker).count() as u64;
                let mut stale: Vec<(u64, u64)> = model
                    .iter()
                    .filter(|(id, r)| {
                        r.worker == worker && !owned(RequestId(**id)) && now - r.started > GRACE
                    })
                    .map(|(id, r)| (r.started, *id))
                    .collect();
                stale.sort();
                let excess = tracked.saturating_sub(requests) as usize;
                let want: Vec<RequestId> = stale
                    .iter()
                    .take(excess)
                    .map(|&(_, id)| RequestId(id))
                    .collect();
                prop_assert_eq!(&freed, &want);
                for id in &want {
                    model.remove(&id.0);
                }
            }
        }
        for id in 0..WORKERS {
            prop_assert_eq!(
                s.worker_load(w(id)),
                Some(model_load(&model, id)),
                "worker {}",
                id
            );
        }
    }

    // End every remaining request, half by free and half by expiry.
    let ids: Vec<u64> = model.keys().copied().collect();
    for id in ids.iter().step_by(2) {
        s.free(RequestId(*id)).expect("active");
    }
    let expired = s.expire(Duration::from_secs(now + TTL));
    prop_assert_eq!(expired.len(), ids.len() / 2);
    prop_assert_eq!(s.active_requests(), 0);
    for id in 0..WORKERS {
        prop_assert_eq!(s.worker_load(w(id)), Some(WorkerLoad::default()));
    }
    // No block is still considered active anywhere: a fresh prompt from every family is new
    // everywhere, so its decode term is exactly its own length on every worker.
    let prompt: Vec<u64> = (0..3)
        .flat_map(|f| (0..8).map(move |p| f * 1000 + p))
        .collect();
    let req = SelectRequest::new(prompt.len() as u64 * u64::from(BS), &prompt, &[]);
    let decision = s.select(&req, &mut rng()).expect("workers exist");
    for c in decision.candidates {
        prop_assert_eq!(c.decode_blocks, prompt.len() as f64);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn load_matches_model_and_drains_to_zero(ops in proptest::collection::vec(op(), 1..120)) {
        run(&ops)?;
    }
}

#[test]
fn expiry_counts_in_metrics_and_leaves_no_load() {
    let mut s = crate::support::scheduler(2);
    crate::support::add(&mut s, 1, w(0), &[1, 2, 3]);
    assert_eq!(s.expire(Duration::from_secs(299)), vec![]);
    assert_eq!(s.expire(Duration::from_secs(300)), vec![RequestId(1)]);
    assert_eq!(s.metrics().snapshot().requests_expired, 1);
    assert_eq!(s.worker_load(w(0)), Some(WorkerLoad::default()));
    // The router's guard may still free it later: that is reported, not a panic.
    assert!(s.free(RequestId(1)).is_err());
}

#[test]
fn removing_a_worker_drops_its_requests() {
    let mut s = crate::support::scheduler(2);
    crate::support::add(&mut s, 1, w(0), &[1, 2]);
    crate::support::add(&mut s, 2, w(1), &[1, 2]);
    assert_eq!(s.remove_worker(0), vec![RequestId(1)]);
    assert_eq!(s.active_requests(), 1);
    assert_eq!(s.worker_load(w(0)), None);
    assert_eq!(s.worker_load(w(1)).map(|l| l.active_requests), Some(1));
}
