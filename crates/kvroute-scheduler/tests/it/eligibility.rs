//! Eligibility filters, in their order, each with its typed error.

use kvroute_protocols::{RoutingConstraints, WorkerId};
use kvroute_scheduler::{
    FilterStage, LoadThresholds, PrefillThreshold, SchedulerConfig, SelectError, SelectRequest,
    WorkerSpec,
};

use crate::support::{BS, add, blocks, rng, scheduler_with};

/// The request knobs the table varies.
#[derive(Default)]
struct Case {
    allowed: Option<&'static [WorkerId]>,
    pin: Option<WorkerId>,
    rank: Option<u32>,
    required: &'static [&'static str],
}

/// Fleet: worker 1 (ranks 0..2, taint "a"), worker 2 (rank 0, taint "b"), worker 3 (rank 0,
/// taint "a", overloaded by a pending prefill of 160 tokens against a limit of 100).
fn check(case: Case, expect: Result<&[(u64, u32)], SelectError>) {
    let mut config = SchedulerConfig::new(BS);
    config.busy = LoadThresholds {
        prefill_tokens: Some(PrefillThreshold::Absolute(100)),
        ..LoadThresholds::default()
    };
    let specs = [
        WorkerSpec::new(1).with_dp_ranks(0, 2).with_taint("a"),
        WorkerSpec::new(2).with_taint("b"),
        WorkerSpec::new(3).with_taint("a"),
    ];
    let mut s = scheduler_with(config, specs);
    add(&mut s, 99, crate::support::w(3), &blocks(1, 10));

    let constraints = RoutingConstraints {
        required_taints: case.required.iter().map(|t| (*t).to_owned()).collect(),
        ..RoutingConstraints::default()
    };
    let req = SelectRequest {
        allowed_worker_ids: case.allowed,
        pinned_worker: case.pin,
        pinned_dp_rank: case.rank,
        constraints: Some(&constraints),
        ..SelectRequest::new(16, &[42], &[])
    };
    let got = s.select(&req, &mut rng()).map(|d| {
        let mut v: Vec<(u64, u32)> = d
            .candidates
            .iter()
            .map(|c| (c.worker.worker_id, c.worker.dp_rank))
            .collect();
        v.sort();
        v
    });
    assert_eq!(got.as_deref().map_err(Clone::clone), expect);
}

#[test]
fn no_constraints_leave_every_worker_that_is_not_busy() {
    check(Case::default(), Ok(&[(1, 0), (1, 1), (2, 0)]));
}

#[test]
fn allowed_worker_ids_filter_first() {
    check(
        Case {
            allowed: Some(&[2]),
            ..Case::default()
        },
        Ok(&[(2, 0)]),
    );
    check(
        Case {
            allowed: Some(&[7]),
            ..Case::default()
        },
        Err(SelectError::NoEndpoints {
            stage: FilterStage::AllowedWorkerIds,
        }),
    );
    check(
        Case {
            allowed: Some(&[2]),
            pin: Some(1),
            ..Case::default()
        },
        Err(SelectError::PinnedWorkerNotAllowed { worker_id: 1 }),
    );
}

#[test]
fn exact_pins_select_a_worker_and_optionally_a_rank() {
    check(
        Case {
            pin: Some(1),
            ..Case::default()
        },
        Ok(&[(1, 0), (1, 1)]),
    );
    check(
        Case {
            pin: Some(1),
            rank: Some(1),
            ..Case::default()
        },
        Ok(&[(1, 1)]),
    );
    check(
        Case {
            pin: Some(8),
            ..Case::default()
        },
        Err(SelectError::PinnedWorkerUnknown { worker_id: 8 }),
    );
    check(
        Case {
            pin: Some(1),
            rank: Some(5),
            ..Case::default()
        },
        Err(SelectError::DpRankOutOfRange {
            worker_id: 1,
            dp_rank: 5,
            start: 0,
            end: 2,
        }),
    );
}

#[test]
fn a_dp_rank_alone_filters_every_worker() {
    check(
        Case {
            rank: Some(1),
            ..Case::default()
        },
        Ok(&[(1, 1)]),
    );
    check(
        Case {
            rank: Some(4),
            ..Case::default()
        },
        Err(SelectError::NoEndpoints {
            stage: FilterStage::DpRank,
        }),
    );
}

#[test]
fn required_taints_filter_before_load() {
    check(
        Case {
            required: &["b"],
            ..Case::default()
        },
        Ok(&[(2, 0)]),
    );
    check(
        Case {
            required: &["a", "b"],
            ..Case::default()
        },
        Err(SelectError::NoEndpoints {
            stage: FilterStage::RequiredTaints,
        }),
    );
    check(
        Case {
            required: &["never-seen"],
            ..Case::default()
        },
        Err(SelectError::NoEndpoints {
            stage: FilterStage::RequiredTaints,
        }),
    );
}

#[test]
fn busy_workers_are_skipped_with_their_own_errors() {
    check(
        Case {
            pin: Some(3),
            ..Case::default()
        },
        Err(SelectError::PinnedWorkerOverloaded {
            worker_id: 3,
            dp_rank: None,
        }),
    );
    check(
        Case {
            allowed: Some(&[3]),
            ..Case::default()
        },
        Err(SelectError::AllEligibleWorkersOverloaded { eligible: 1 }),
    );
}

#[test]
fn an_empty_fleet_has_no_endpoints() {
    let mut s = scheduler_with(SchedulerConfig::new(BS), []);
    let err = s
        .select(&SelectRequest::new(16, &[1], &[]), &mut rng())
        .expect_err("empty");
    assert_eq!(err.to_string(), "no endpoints: no worker is registered");
    assert_eq!(s.metrics().snapshot().selection_errors, 1);
}
