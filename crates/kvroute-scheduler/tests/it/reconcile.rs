//! Holding the tracked load against what a worker reports: which requests go, which stay.

use std::time::Duration;

use kvroute_protocols::WorkerWithDpRank;
use kvroute_scheduler::{
    LoadError, NewRequest, RequestId, Scheduler, SchedulerConfig, WorkerLoad, WorkerSpec,
};

use crate::support::{BS, scheduler_with, w};

const GRACE: Duration = Duration::from_secs(5);

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

/// A scheduler with worker 0 (ranks 0 and 1) holding, on rank 0, requests `(id, started
/// secs)` of one block each; the grace is [`GRACE`].
fn tracked(requests: &[(u64, u64)]) -> Scheduler {
    let mut config = SchedulerConfig::new(BS);
    config.report_grace = GRACE;
    let mut s = scheduler_with(config, [WorkerSpec::new(0).with_dp_ranks(0, 2)]);
    for &(id, started) in requests {
        let hashes = [id];
        let req = NewRequest {
            id: RequestId(id),
            worker: w(0),
            isl_tokens: u64::from(BS),
            block_hashes: &hashes,
            overlap_blocks: 0,
            expected_output_tokens: None,
        };
        s.add_request(&req, secs(started)).expect("request added");
    }
    s
}

/// Requests `(id, started secs)` on rank 0, of which `owned` are owned; worker 0 reports
/// `reported` at `now` secs: checks the freed ids and the requests left on rank 0.
#[track_caller]
fn check(requests: &[(u64, u64)], owned: &[u64], reported: u64, now: u64, expect: &[u64]) {
    let mut s = tracked(requests);
    let freed = s
        .reconcile_reported(w(0), reported, secs(now), |id| owned.contains(&id.0))
        .expect("worker registered");
    let want: Vec<RequestId> = expect.iter().map(|&id| RequestId(id)).collect();
    assert_eq!(freed, want);
    let left = s.worker_load(w(0)).expect("registered").active_requests;
    assert_eq!(left, (requests.len() - expect.len()) as u64);
    assert_eq!(
        s.metrics().snapshot().requests_reconciled,
        expect.len() as u64
    );
}

#[test]
fn frees_the_oldest_unowned_requests_beyond_the_report() {
    // Four tracked, two reported: the two oldest go (added out of age order).
    check(&[(3, 2), (1, 0), (4, 3), (2, 1)], &[], 2, 60, &[1, 2]);
    // An idle worker: everything unowned goes.
    check(&[(1, 0), (2, 1)], &[], 0, 60, &[1, 2]);
    // The engine holds as many or more than tracked (others' requests, or not yet seen here).
    check(&[(1, 0), (2, 1)], &[], 2, 60, &[]);
    check(&[(1, 0)], &[], 9, 60, &[]);
}

#[test]
fn owned_requests_are_never_freed_and_still_count() {
    // Owned ones count toward the tracked total but are skipped: the excess falls on others.
    check(&[(1, 0), (2, 1), (3, 2)], &[1], 1, 60, &[2, 3]);
    check(&[(1, 0), (2, 1), (3, 2)], &[1, 2, 3], 0, 60, &[]);
    // Only as many as the excess, even when more are unowned.
    check(&[(1, 0), (2, 1), (3, 2)], &[1], 2, 60, &[2]);
}

#[test]
fn requests_younger_than_the_grace_stay() {
    // At 10 s with a 5 s grace: started at 4 is 6 s old (goes), at 5 exactly 5 s (stays).
    check(&[(1, 4), (2, 5), (3, 9)], &[], 0, 10, &[1]);
    // Before the grace has passed since the epoch nothing is old enough.
    check(&[(1, 0)], &[], 0, 4, &[]);
    check(&[(1, 0)], &[], 0, 5, &[]);
}

#[test]
fn reports_are_per_rank_and_unknown_workers_are_errors() {
    let mut s = tracked(&[(1, 0)]);
    let rank1 = WorkerWithDpRank::new(0, 1);
    assert_eq!(
        s.reconcile_reported(rank1, 0, secs(60), |_| false),
        Ok(vec![])
    );
    assert_eq!(s.worker_load(w(0)).unwrap().active_requests, 1);
    assert_eq!(
        s.reconcile_reported(w(9), 0, secs(60), |_| false),
        Err(LoadError::UnknownWorker(w(9)))
    );
}

#[test]
fn reconciled_requests_leave_no_load_and_their_late_free_is_an_error() {
    let mut s = tracked(&[(1, 0), (2, 0)]);
    // Request 2 shares request 1's block, so freeing 1 must hand the block to 2 alone.
    let hashes = [1];
    s.add_request(
        &NewRequest {
            id: RequestId(3),
            worker: w(0),
            isl_tokens: u64::from(BS),
            block_hashes: &hashes,
            overlap_blocks: 0,
            expected_output_tokens: None,
        },
        secs(1),
    )
    .unwrap();
    assert_eq!(
        s.reconcile_reported(w(0), 1, secs(60), |id| id == RequestId(3)),
        Ok(vec![RequestId(1), RequestId(2)])
    );
    // The replica that routed request 1 reports its end after all.
    assert_eq!(
        s.free(RequestId(1)),
        Err(LoadError::UnknownRequest(RequestId(1)))
    );
    // Expiry skips what reconciliation already freed.
    assert_eq!(s.expire(secs(10_000)), vec![RequestId(3)]);
    assert_eq!(s.worker_load(w(0)), Some(WorkerLoad::default()));
    assert_eq!(s.active_requests(), 0);
}
