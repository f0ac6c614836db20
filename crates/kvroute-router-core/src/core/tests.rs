use std::time::Duration;

use kvroute_indexer::hash::{HashSalt, compute_block_hashes};
use kvroute_protocols::kv_events::{
    ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheStoreData,
    KvCacheStoredBlockData, RouterEvent, StorageTier,
};
use kvroute_protocols::{
    RequestPhase, RoutingHints, SessionAction, SessionControl, WorkerLoadReport, WorkerWithDpRank,
};
use kvroute_scheduler::{CacheHitWeights, RequestId, WorkerSpec};
use kvroute_sessions::{AffinityStore, SessionCommand};
use rand::SeedableRng;
use rand::rngs::StdRng;

use crate::{KvMode, KvRouterCore, Policy, RouteError, RouteRequest, RouteSource, RouterConfig};

const BS: u32 = 4;
const T0: Duration = Duration::ZERO;

fn w(id: u64) -> WorkerWithDpRank {
    WorkerWithDpRank::from_worker_id(id)
}

fn core(policy: Policy, workers: &[(u64, KvMode)]) -> KvRouterCore {
    let mut core = KvRouterCore::new(RouterConfig::new(BS).with_policy(policy)).unwrap();
    for &(id, mode) in workers {
        core.add_worker(&WorkerSpec::new(id), mode).unwrap();
    }
    core
}

fn rng() -> StdRng {
    StdRng::seed_from_u64(42)
}

/// A `Stored` event from `worker` caching every full block of `tokens` (engine ids 1000 + i).
fn stored(worker: u64, event_id: u64, tokens: &[u32]) -> RouterEvent {
    let local = compute_block_hashes(tokens, BS as usize, &HashSalt::default());
    RouterEvent {
        worker_id: worker,
        storage_tier: StorageTier::Device,
        event: KvCacheEvent {
            event_id,
            dp_rank: 0,
            data: KvCacheEventData::Stored(KvCacheStoreData {
                parent_hash: None,
                blocks: local
                    .iter()
                    .enumerate()
                    .map(|(i, &h)| KvCacheStoredBlockData {
                        block_hash: ExternalSequenceBlockHash(1000 + i as u64 + event_id * 100),
                        tokens_hash: h,
                    })
                    .collect(),
            }),
        },
    }
}

fn prompt(len: u32) -> Vec<u32> {
    (0..len).collect()
}

/// Every worker's load reads zero and nothing is in flight.
fn assert_idle(core: &KvRouterCore) {
    assert_eq!(core.active_requests(), 0);
    assert_eq!(core.scheduler().active_requests(), 0);
    for worker in core.workers() {
        let load = core.worker_load(worker).unwrap();
        assert_eq!(load.active_requests, 0, "{worker}");
        assert_eq!(load.prefill_tokens, 0, "{worker}");
        assert_eq!(load.decode_blocks, 0.0, "{worker}");
    }
}

#[test]
fn the_predicted_hit_leaves_out_what_the_worker_cannot_keep() {
    let mut core = core(Policy::KvLocality, &[(1, KvMode::Events)]);
    let p = prompt(16);
    assert_eq!(core.apply_event(&stored(1, 0, &p)), None);
    // Room for 6 blocks, 5 of them held by a running request of another prompt.
    let capacity = WorkerLoadReport::new(1).with_kv_total_blocks(6);
    assert_eq!(core.on_load_report(&capacity, T0), Ok(vec![]));
    let other: Vec<u32> = (100..120).collect();
    core.route(&RouteRequest::new(RequestId(1), &other), T0, &mut rng())
        .unwrap();
    // The cached prompt's 4 blocks need 4 free ones and find 1: 3 of its cached blocks go.
    let r = core
        .route(&RouteRequest::new(RequestId(2), &p), T0, &mut rng())
        .unwrap();
    assert_eq!((r.overlap_blocks, r.cost.unkept_blocks), (4, 3));
    assert_eq!(r.predicted_cached_tokens(BS), 4);
    assert_eq!(r.predicted_hit_rate(BS), 0.25);
    // Once the other request is gone the worker keeps them all.
    assert!(core.on_finished(RequestId(1)).is_empty());
    assert!(core.on_finished(RequestId(2)).is_empty());
    let r = core
        .route(&RouteRequest::new(RequestId(3), &p), T0, &mut rng())
        .unwrap();
    assert_eq!((r.overlap_blocks, r.cost.unkept_blocks), (4, 0));
    assert_eq!(r.predicted_cached_tokens(BS), 16);
    assert!(core.on_finished(RequestId(3)).is_empty());
    assert_idle(&core);
}

#[test]
fn kv_policy_follows_cached_prefix_from_events() {
    let mut core = core(Policy::Kv, &[(1, KvMode::Events), (2, KvMode::Events)]);
    let p = prompt(16);
    assert_eq!(core.apply_event(&stored(2, 0, &p)), None);
    let r = core
        .route(&RouteRequest::new(RequestId(1), &p), T0, &mut rng())
        .unwrap();
    assert_eq!(r.worker, w(2));
    assert_eq!(
        (r.overlap_blocks, r.prompt_blocks, r.isl_tokens),
        (4, 4, 16)
    );
    assert_eq!(r.source, RouteSource::Selected);
    assert_eq!(r.candidates.len(), 2);
    assert_eq!(r.cost.credited_prefill_blocks, 0.0);
    assert_eq!(r.predicted_hit_rate(BS), 1.0);
    assert_eq!(core.worker_load(w(2)).unwrap().active_requests, 1);
    core.on_first_token(RequestId(1)).unwrap();
    core.on_output_tokens(RequestId(1), 5).unwrap();
    assert!(core.on_finished(RequestId(1)).is_empty());
    assert_idle(&core);
}

#[test]
fn approximate_workers_learn_from_their_own_decisions() {
    let mut core = core(Policy::Kv, &[(1, KvMode::Approximate)]);
    let p = prompt(12);
    let first = core
        .route(&RouteRequest::new(RequestId(1), &p), T0, &mut rng())
        .unwrap();
    assert_eq!(first.overlap_blocks, 0);
    core.on_finished(RequestId(1));
    let again = core
        .query(&RouteRequest::new(RequestId(2), &p), T0, &mut rng())
        .unwrap();
    assert_eq!(again.overlap_blocks, 3);
    // Events of an approximate worker are ignored; predictions expire with their TTL.
    assert_eq!(core.apply_event(&stored(1, 0, &prompt(40))), None);
    assert_eq!(core.stats().events_ignored, 1);
    core.expire(core.config().approx.ttl + Duration::from_secs(1));
    let later = core
        .query(&RouteRequest::new(RequestId(3), &p), T0, &mut rng())
        .unwrap();
    assert_eq!(later.overlap_blocks, 0);
}

#[test]
fn a_prompt_in_flight_on_an_event_worker_counts_as_cached_there_until_its_events_come() {
    let mut core = core(Policy::Kv, &[(1, KvMode::Events), (2, KvMode::Events)]);
    let p = prompt(16);
    let first = core
        .route(&RouteRequest::new(RequestId(1), &p), T0, &mut rng())
        .unwrap();
    assert_eq!(first.overlap_blocks, 0);
    // No event yet: the next request for the same prefix follows the first, credited its blocks.
    let follower = core
        .query(&RouteRequest::new(RequestId(2), &p), T0, &mut rng())
        .unwrap();
    assert_eq!(
        (follower.worker, follower.overlap_blocks),
        (first.worker, 4)
    );
    // The events arrive; past the in-flight TTL only they count.
    let other = if first.worker == w(1) { 2 } else { 1 };
    assert_eq!(core.apply_event(&stored(other, 0, &prompt(8))), None);
    core.on_finished(RequestId(1));
    core.expire(core.config().inflight_ttl + Duration::from_secs(1));
    let later = core
        .query(&RouteRequest::new(RequestId(3), &p), T0, &mut rng())
        .unwrap();
    assert_eq!((later.worker, later.overlap_blocks), (w(other), 2));
    // Turned off, nothing is credited before the events.
    let mut config = RouterConfig::new(BS).with_policy(Policy::Kv);
    config.inflight_ttl = Duration::ZERO;
    let mut off = KvRouterCore::new(config).unwrap();
    off.add_worker(&WorkerSpec::new(1), KvMode::Events).unwrap();
    off.route(&RouteRequest::new(RequestId(1), &p), T0, &mut rng())
        .unwrap();
    let again = off
        .query(&RouteRequest::new(RequestId(2), &p), T0, &mut rng())
        .unwrap();
    assert_eq!(again.overlap_blocks, 0);
    off.on_finished(RequestId(1));
    assert_idle(&core);
    assert_idle(&off);
}

#[test]
fn a_prompt_in_flight_counts_no_more_once_its_prefill_is_done() {
    let mut core = core(Policy::Kv, &[(1, KvMode::Events), (2, KvMode::Events)]);
    let p = prompt(16);
    let first = core
        .route(&RouteRequest::new(RequestId(1), &p), T0, &mut rng())
        .unwrap();
    let credited = |core: &mut KvRouterCore, id: u64| {
        let q = core
            .query(&RouteRequest::new(RequestId(id), &p), T0, &mut rng())
            .unwrap();
        q.candidates
            .iter()
            .find(|c| c.worker == first.worker)
            .map(|c| c.overlap_blocks)
    };
    assert_eq!(credited(&mut core, 10), Some(4));
    // The first token: the engine has published the blocks, and only its events count now
    // (none came here, so nothing is credited; once they come, they are).
    core.on_first_token(RequestId(1)).unwrap();
    assert_eq!(credited(&mut core, 11), Some(0));
    let engine = first.worker.worker_id;
    assert_eq!(core.apply_event(&stored(engine, 0, &p)), None);
    assert_eq!(credited(&mut core, 12), Some(4));
    assert!(core.on_finished(RequestId(1)).is_empty());
    // A request that fails before its first token leaves no claim behind either.
    let mut core = self::core(Policy::Kv, &[(1, KvMode::Events)]);
    core.route(&RouteRequest::new(RequestId(2), &p), T0, &mut rng())
        .unwrap();
    let follower = core
        .query(&RouteRequest::new(RequestId(3), &p), T0, &mut rng())
        .unwrap();
    assert_eq!(follower.overlap_blocks, 4);
    assert!(core.on_failed(RequestId(2)).is_empty());
    let after = core
        .query(&RouteRequest::new(RequestId(4), &p), T0, &mut rng())
        .unwrap();
    assert_eq!(after.overlap_blocks, 0);
    assert_idle(&core);
}

#[test]
fn selection_policies() {
    fn check(policy: Policy, expect: &[u64]) {
        let mut core = core(
            policy,
            &[
                (1, KvMode::Events),
                (2, KvMode::Events),
                (3, KvMode::Events),
            ],
        );
        let p = prompt(8);
        // Worker 3 caches the prompt: kv goes there while it is not overloaded.
        core.apply_event(&stored(3, 0, &p));
        let mut rng = rng();
        let got: Vec<u64> = (0..expect.len() as u64)
            .map(|i| {
                let r = core
                    .route(&RouteRequest::new(RequestId(i), &p), T0, &mut rng)
                    .unwrap();
                core.on_finished(RequestId(i));
                r.worker.worker_id
            })
            .collect();
        assert_eq!(got, expect, "{policy}");
    }
    check(Policy::RoundRobin, &[1, 2, 3, 1, 2]);
    check(Policy::Kv, &[3, 3, 3, 3, 3]);
    // Seeded: the same every run, and not all on one worker.
    check(Policy::Random, &[1, 2, 2, 3, 2]);
}

#[test]
fn pinned_worker_bypasses_selection_but_is_tracked() {
    let mut core = core(Policy::Kv, &[(1, KvMode::Events), (2, KvMode::Events)]);
    let p = prompt(8);
    core.apply_event(&stored(2, 0, &p));
    let hints = RoutingHints {
        backend_instance_id: Some(1),
        ..RoutingHints::default()
    };
    let req = RouteRequest::new(RequestId(7), &p).with_hints(&hints);
    let r = core.route(&req, T0, &mut rng()).unwrap();
    assert_eq!(
        (r.worker, r.source, r.candidates.len()),
        (w(1), RouteSource::Pinned, 1)
    );
    let load = core.worker_load(w(1)).unwrap();
    assert_eq!((load.active_requests, load.prefill_tokens), (1, 8));
    // A prefill pin only applies to the prefill phase.
    let hints = RoutingHints {
        prefill_worker_id: Some(2),
        ..RoutingHints::default()
    };
    let req = RouteRequest::new(RequestId(8), &p)
        .with_hints(&hints)
        .with_phase(RequestPhase::Prefill);
    assert_eq!(core.route(&req, T0, &mut rng()).unwrap().worker, w(2));
    // Pinning an unknown worker fails and records nothing.
    let hints = RoutingHints {
        backend_instance_id: Some(9),
        ..RoutingHints::default()
    };
    let req = RouteRequest::new(RequestId(9), &p).with_hints(&hints);
    assert!(matches!(
        core.route(&req, T0, &mut rng()),
        Err(RouteError::Select(_))
    ));
    core.on_failed(RequestId(7));
    core.on_finished(RequestId(8));
    assert_idle(&core);
}

#[test]
fn direct_policy_needs_a_worker_id() {
    let mut core = core(Policy::Direct, &[(1, KvMode::Events)]);
    let p = prompt(8);
    let err = core
        .route(&RouteRequest::new(RequestId(1), &p), T0, &mut rng())
        .unwrap_err();
    assert_eq!(
        err,
        RouteError::NoWorkerId {
            phase: RequestPhase::Aggregated
        }
    );
    assert!(err.to_string().contains("backend_instance_id"));
    let hints = RoutingHints {
        backend_instance_id: Some(1),
        ..RoutingHints::default()
    };
    let req = RouteRequest::new(RequestId(1), &p).with_hints(&hints);
    assert_eq!(core.route(&req, T0, &mut rng()).unwrap().worker, w(1));
}

#[test]
fn query_touches_no_state() {
    let mut core = core(
        Policy::RoundRobin,
        &[(1, KvMode::Approximate), (2, KvMode::Events)],
    );
    let p = prompt(8);
    let hints = RoutingHints {
        session_control: Some(SessionControl::new("s").with_action(SessionAction::Bind)),
        ..RoutingHints::default()
    };
    for i in 0..3 {
        let req = RouteRequest::new(RequestId(i), &p).with_hints(&hints);
        let q = core.query(&req, T0, &mut rng()).unwrap();
        assert_eq!(q.worker, w(1), "round-robin turn must not advance");
        assert_eq!(q.session_open, None);
    }
    assert_idle(&core);
    assert_eq!(core.approx_index().live_blocks(), 0);
    assert!(core.sessions().store().is_empty());
    // The real decision matches the query.
    let req = RouteRequest::new(RequestId(0), &p).with_hints(&hints);
    assert_eq!(core.route(&req, T0, &mut rng()).unwrap().worker, w(1));
    assert_eq!(core.sessions().store().len(), 1);
}

#[test]
fn duplicate_ids_are_refused() {
    let mut core = core(Policy::Kv, &[(1, KvMode::Events)]);
    let p = prompt(8);
    core.route(&RouteRequest::new(RequestId(1), &p), T0, &mut rng())
        .unwrap();
    let err = core
        .route(&RouteRequest::new(RequestId(1), &p), T0, &mut rng())
        .unwrap_err();
    assert!(matches!(err, RouteError::Load(_)));
    assert_eq!(core.worker_load(w(1)).unwrap().active_requests, 1);
}

#[test]
fn event_gaps_are_detected_per_worker_and_late_events_skipped() {
    let mut core = core(Policy::Kv, &[(1, KvMode::Events)]);
    assert_eq!(core.apply_event(&stored(1, 0, &prompt(4))), None);
    let gap = core.apply_event(&stored(1, 3, &prompt(8))).unwrap();
    assert_eq!((gap.worker, gap.missing), (w(1), 1..3));
    assert_eq!(core.expected_event_id(1), Some(4));
    assert_eq!(core.apply_event(&stored(1, 2, &prompt(12))), None);
    let stats = core.stats();
    assert_eq!(
        (stats.events_applied, stats.gaps_detected, stats.events_late),
        (2, 1, 1)
    );
    // Recovery applies the missing events untracked.
    core.apply_recovered(&stored(1, 2, &prompt(12)));
    let q = core
        .query(
            &RouteRequest::new(RequestId(1), &prompt(12)),
            T0,
            &mut rng(),
        )
        .unwrap();
    assert_eq!(q.overlap_blocks, 3);
}

#[test]
fn dump_replaces_a_workers_blocks_and_resumes_ids() {
    let mut core = core(Policy::Kv, &[(1, KvMode::Events)]);
    core.apply_event(&stored(1, 0, &prompt(16)));
    core.apply_dump(1, Some(9), &[stored(1, 9, &prompt(8))]);
    let q = core
        .query(
            &RouteRequest::new(RequestId(1), &prompt(16)),
            T0,
            &mut rng(),
        )
        .unwrap();
    assert_eq!(q.overlap_blocks, 2);
    assert_eq!(core.expected_event_id(1), Some(10));
    assert_eq!(core.apply_event(&stored(1, 10, &prompt(4))), None);
}

#[test]
fn sessions_open_stick_and_close() {
    let mut core = core(Policy::Kv, &[(1, KvMode::Events), (2, KvMode::Events)]);
    let p = prompt(8);
    let turn = |action: Option<SessionAction>| RoutingHints {
        session_control: Some(SessionControl {
            action,
            ..SessionControl::new("chat")
        }),
        ..RoutingHints::default()
    };
    let open = turn(Some(SessionAction::Open));
    let r = core
        .route(
            &RouteRequest::new(RequestId(1), &p).with_hints(&open),
            T0,
            &mut rng(),
        )
        .unwrap();
    let bound = r.worker;
    assert!(matches!(r.session_open, Some(SessionCommand::Open { worker, .. }) if worker == bound));
    core.session_opened(RequestId(1), true, T0).unwrap();
    assert!(core.on_finished(RequestId(1)).is_empty());
    // Later turns stick, even though the other worker now caches the prompt.
    let other = if bound == w(1) { 2 } else { 1 };
    core.apply_event(&stored(other, 0, &p));
    let mid = turn(None);
    for id in 2..5 {
        let r = core
            .route(
                &RouteRequest::new(RequestId(id), &p).with_hints(&mid),
                T0,
                &mut rng(),
            )
            .unwrap();
        assert_eq!((r.worker, r.source), (bound, RouteSource::Sticky));
        core.on_finished(RequestId(id));
    }
    // The last turn's close runs after its response.
    let close = turn(Some(SessionAction::Close));
    let r = core
        .route(
            &RouteRequest::new(RequestId(5), &p).with_hints(&close),
            T0,
            &mut rng(),
        )
        .unwrap();
    assert_eq!(r.worker, bound);
    let cmds = core.on_finished(RequestId(5));
    assert_eq!(
        cmds,
        vec![SessionCommand::Close {
            session_id: "chat".into(),
            worker: bound
        }]
    );
    assert!(core.sessions().store().is_empty());
    assert_idle(&core);
}

#[test]
fn failed_open_rolls_back_and_closes() {
    let mut core = core(Policy::Kv, &[(1, KvMode::Events)]);
    let p = prompt(8);
    let hints = RoutingHints {
        session_control: Some(SessionControl::new("s").with_action(SessionAction::Open)),
        ..RoutingHints::default()
    };
    core.route(
        &RouteRequest::new(RequestId(1), &p).with_hints(&hints),
        T0,
        &mut rng(),
    )
    .unwrap();
    core.session_opened(RequestId(1), true, T0).unwrap();
    assert_eq!(core.sessions().store().len(), 1);
    let cmds = core.on_failed(RequestId(1));
    assert_eq!(
        cmds,
        vec![SessionCommand::Close {
            session_id: "s".into(),
            worker: w(1)
        }]
    );
    assert!(core.sessions().store().is_empty());
    assert_idle(&core);
}

#[test]
fn removing_a_worker_drops_its_load_and_blocks() {
    let mut core = core(Policy::Kv, &[(1, KvMode::Events), (2, KvMode::Events)]);
    let p = prompt(8);
    core.apply_event(&stored(1, 0, &p));
    core.route(&RouteRequest::new(RequestId(1), &p), T0, &mut rng())
        .unwrap();
    assert_eq!(core.remove_worker(1), vec![RequestId(1)]);
    assert!(!core.has_worker(1));
    let r = core
        .route(&RouteRequest::new(RequestId(2), &p), T0, &mut rng())
        .unwrap();
    assert_eq!((r.worker, r.overlap_blocks), (w(2), 0));
    core.on_failed(RequestId(1));
    core.on_finished(RequestId(2));
    assert_idle(&core);
}

#[test]
fn expire_keeps_routed_requests_however_long_they_wait_and_frees_unowned_load() {
    let mut core = core(Policy::Kv, &[(1, KvMode::Events)]);
    core.route(&RouteRequest::new(RequestId(1), &prompt(8)), T0, &mut rng())
        .unwrap();
    // Another replica's request, which nobody here will end if that replica goes quiet.
    let load = core.request_load(RequestId(1)).unwrap();
    core.add_remote_request(RequestId(2), &load, T0).unwrap();
    let ttl = core.config().scheduler.request_expiry;
    // A request queued in a saturated engine for many expiry periods is still load.
    let later = ttl + Duration::from_secs(1);
    assert_eq!(core.expire(later).requests, vec![RequestId(2)]);
    assert_eq!(core.expire(later * 5).requests, vec![]);
    assert_eq!(core.worker_load(w(1)).unwrap().active_requests, 1);
    assert_eq!(core.scheduler().metrics().snapshot().requests_expired, 1);
    core.on_finished(RequestId(1));
    assert_idle(&core);
}

#[test]
fn a_load_report_frees_other_replicas_requests_the_worker_no_longer_holds() {
    let mut core = core(Policy::Kv, &[(1, KvMode::Events), (2, KvMode::Events)]);
    core.route(&RouteRequest::new(RequestId(1), &prompt(8)), T0, &mut rng())
        .unwrap();
    let routed_to = core.request_worker(RequestId(1)).unwrap();
    let load = core.request_load(RequestId(1)).unwrap();
    // Three requests of a replica that died, on the same worker, the last one recent.
    for (id, at) in [(10, 0), (11, 1), (12, 58)] {
        core.add_remote_request(RequestId(id), &load, Duration::from_secs(at))
            .unwrap();
    }
    let now = Duration::from_secs(60);
    let report = WorkerLoadReport::new(routed_to.worker_id).with_requests(0, 1);
    // The engine holds one request (ours, queued); the two old remote ones go, the one routed
    // within the grace stays, and ours stays whatever the report says.
    assert_eq!(
        core.on_load_report(&report, now),
        Ok(vec![RequestId(10), RequestId(11)])
    );
    assert_eq!(core.worker_load(routed_to).unwrap().active_requests, 2);
    assert_eq!(core.reported_load(routed_to), Some(&report));
    assert_eq!(core.scheduler().metrics().snapshot().requests_reconciled, 2);
    // An idle report frees the last remote request once it is old enough, never ours.
    let idle = WorkerLoadReport::new(routed_to.worker_id).with_requests(0, 0);
    assert_eq!(core.on_load_report(&idle, now), Ok(vec![]));
    assert_eq!(
        core.on_load_report(&idle, Duration::from_secs(70)),
        Ok(vec![RequestId(12)])
    );
    assert_eq!(core.request_worker(RequestId(1)), Some(routed_to));
    assert_eq!(core.stats().load_reports_applied, 3);
    // Their replica's late `Freed` is harmless.
    assert!(core.on_finished(RequestId(10)).is_empty());
    core.on_finished(RequestId(1));
    assert_idle(&core);
}

#[test]
fn load_reports_without_counts_are_recorded_bad_ones_refused_unknown_ones_skipped() {
    let mut core = core(Policy::Kv, &[(1, KvMode::Events)]);
    let load = kvroute_scheduler::RequestLoad {
        worker: w(1),
        prefill_tokens: 8,
        block_hashes: vec![1, 2],
        expected_output_tokens: None,
    };
    core.add_remote_request(RequestId(10), &load, T0).unwrap();
    let later = Duration::from_secs(60);
    // Blocks only: recorded, no request count to hold the load against.
    let blocks = WorkerLoadReport::new(1).with_kv_used_blocks(40);
    assert_eq!(core.on_load_report(&blocks, later), Ok(vec![]));
    assert_eq!(core.reported_load(w(1)), Some(&blocks));
    assert_eq!(core.worker_load(w(1)).unwrap().active_requests, 1);
    // Half a queue is refused and changes nothing.
    let half = WorkerLoadReport {
        requests_running: Some(0),
        ..WorkerLoadReport::new(1)
    };
    let err = core.on_load_report(&half, later).unwrap_err();
    assert_eq!(
        err.to_string(),
        "requests_waiting must be present when requests_running is, got nothing"
    );
    assert_eq!(core.reported_load(w(1)), Some(&blocks));
    // A rank or a worker this core does not serve: skipped, counted, not recorded.
    for report in [
        WorkerLoadReport::new(1).with_dp_rank(3).with_requests(0, 0),
        WorkerLoadReport::new(9).with_requests(0, 0),
    ] {
        assert_eq!(core.on_load_report(&report, later), Ok(vec![]));
        assert_eq!(core.reported_load(report.worker()), None);
    }
    assert_eq!(core.stats().load_reports_unregistered, 2);
    assert_eq!(core.stats().load_reports_applied, 1);
    // A stated capacity reaches the scheduler's cost.
    assert_eq!(core.scheduler().kv_capacity(w(1)), None);
    let capacity = WorkerLoadReport::new(1).with_kv_total_blocks(3125);
    assert_eq!(core.on_load_report(&capacity, later), Ok(vec![]));
    assert_eq!(core.scheduler().kv_capacity(w(1)), Some(3125));
    // Removing the worker forgets its report.
    assert_eq!(core.remove_worker(1), vec![RequestId(10)]);
    assert_eq!(core.reported_load(w(1)), None);
}

#[test]
fn a_report_not_renewed_within_the_ttl_is_forgotten() {
    let mut core = core(Policy::Kv, &[(1, KvMode::Events)]);
    let ttl = core.config().report_ttl;
    let report = WorkerLoadReport::new(1).with_requests(2, 0);
    core.on_load_report(&report, T0).unwrap();
    core.expire(T0 + ttl);
    assert_eq!(
        core.reported_load(w(1)),
        Some(&report),
        "kept up to the ttl"
    );
    // Renewed: the ttl counts from the newest report.
    core.on_load_report(&report, T0 + ttl).unwrap();
    core.expire(T0 + ttl + ttl);
    assert_eq!(core.reported_load(w(1)), Some(&report));
    core.expire(T0 + ttl + ttl + Duration::from_millis(1));
    assert_eq!(
        core.reported_load(w(1)),
        None,
        "the worker stopped reporting"
    );
}

/// A `Stored` event from `worker` caching, in `tier`, full blocks `from..to` of `tokens`, its
/// chain continuing block `from - 1` (engine id `5000 + block`, the same in every tier, as an
/// engine's content hash is).
fn stored_blocks(
    worker: u64,
    event_id: u64,
    tier: StorageTier,
    tokens: &[u32],
    blocks: std::ops::Range<usize>,
) -> RouterEvent {
    let local = compute_block_hashes(tokens, BS as usize, &HashSalt::default());
    let ext = |i: usize| ExternalSequenceBlockHash(5000 + i as u64);
    RouterEvent {
        worker_id: worker,
        storage_tier: tier,
        event: KvCacheEvent {
            event_id,
            dp_rank: 0,
            data: KvCacheEventData::Stored(KvCacheStoreData {
                parent_hash: blocks.start.checked_sub(1).map(ext),
                blocks: blocks
                    .map(|i| KvCacheStoredBlockData {
                        block_hash: ext(i),
                        tokens_hash: local[i],
                    })
                    .collect(),
            }),
        },
    }
}

fn events_core(weights: CacheHitWeights) -> KvRouterCore {
    let config = RouterConfig::new(BS)
        .with_policy(Policy::Kv)
        .with_cache_hit_weights(weights);
    let mut core = KvRouterCore::new(config).unwrap();
    for id in 1..=3 {
        core.add_worker(&WorkerSpec::new(id), KvMode::Events)
            .unwrap();
    }
    core
}

#[test]
fn a_host_tier_prefix_beats_a_cold_worker_and_loses_to_the_device() {
    let mut core = events_core(CacheHitWeights::reference());
    let p = prompt(16);
    core.apply_event(&stored_blocks(1, 0, StorageTier::Device, &p, 0..4));
    core.apply_event(&stored_blocks(2, 0, StorageTier::HostPinned, &p, 0..4));
    let r = core
        .query(&RouteRequest::new(RequestId(1), &p), T0, &mut rng())
        .unwrap();
    assert_eq!(r.worker, w(1));
    let cost = |id| {
        r.candidates
            .iter()
            .find(|c| c.worker == w(id))
            .unwrap()
            .cost
    };
    // Device: 0 + 4. Host: 4 - 0.75 * 4 = 1, + 4. Cold: 4 + 4.
    assert_eq!((cost(1), cost(2), cost(3)), (4.0, 5.0, 8.0));

    let hints = RoutingHints {
        allowed_worker_ids: Some(vec![2, 3]),
        ..RoutingHints::default()
    };
    let req = RouteRequest::new(RequestId(2), &p).with_hints(&hints);
    let r = core.route(&req, T0, &mut rng()).unwrap();
    assert_eq!(r.worker, w(2));
    assert_eq!(
        (
            r.overlap_blocks,
            r.cost.host_blocks,
            r.cost.weighted_overlap_blocks
        ),
        (0, 4, 3.0)
    );
    // 16 tokens, 12 expected cached from the host: 4 left to prefill.
    assert_eq!(core.worker_load(w(2)).unwrap().prefill_tokens, 4);
    core.on_finished(RequestId(2));
    assert_idle(&core);
}

#[test]
fn a_device_prefix_and_its_offloaded_continuation_earn_weighted_credit() {
    let mut core = events_core(CacheHitWeights::reference());
    let p = prompt(32);
    // Device blocks 0..2, host 2..4 (continuing device block 1), disk 4..6 (continuing host 3).
    core.apply_event(&stored_blocks(1, 0, StorageTier::Device, &p, 0..2));
    core.apply_event(&stored_blocks(1, 1, StorageTier::HostPinned, &p, 2..4));
    core.apply_event(&stored_blocks(1, 2, StorageTier::Disk, &p, 4..6));
    assert_eq!(core.with_index(|i| i.error_counts()).parent_not_found, 0);
    let hints = RoutingHints {
        allowed_worker_ids: Some(vec![1]),
        ..RoutingHints::default()
    };
    let req = RouteRequest::new(RequestId(1), &p).with_hints(&hints);
    let r = core.route(&req, T0, &mut rng()).unwrap();
    assert_eq!(
        (r.overlap_blocks, r.cost.host_blocks, r.cost.disk_blocks),
        (2, 2, 2)
    );
    // 2 + 0.75 * 2 + 0.25 * 2 = 4 blocks; prefill 8 - 4 = 4.
    assert_eq!(r.cost.weighted_overlap_blocks, 4.0);
    assert_eq!(r.cost.credited_prefill_blocks, 4.0);
    // 32 tokens less 16 expected cached.
    assert_eq!(core.worker_load(w(1)).unwrap().prefill_tokens, 16);
    core.on_failed(RequestId(1));
    assert_idle(&core);
}

#[test]
fn zero_cache_hit_weights_route_as_if_lower_tiers_were_unknown() {
    // One core sees offloaded blocks and weighs them 0; the other never hears of them.
    let mut weighed = events_core(CacheHitWeights::device_only());
    let mut unaware = events_core(CacheHitWeights::reference());
    let prompts: Vec<Vec<u32>> = (0..6u32)
        .map(|i| (0..24).map(|t| i % 3 * 1000 + t).collect())
        .collect();
    for core in [&mut weighed, &mut unaware] {
        core.apply_event(&stored_blocks(1, 0, StorageTier::Device, &prompts[0], 0..2));
        core.apply_event(&stored_blocks(3, 0, StorageTier::Device, &prompts[1], 0..1));
    }
    weighed.apply_event(&stored_blocks(
        1,
        1,
        StorageTier::HostPinned,
        &prompts[0],
        2..6,
    ));
    weighed.apply_event(&stored_blocks(2, 0, StorageTier::Disk, &prompts[1], 0..6));
    weighed.apply_event(&stored_blocks(
        3,
        1,
        StorageTier::HostPinned,
        &prompts[2],
        0..6,
    ));
    let (mut r1, mut r2) = (rng(), rng());
    for (i, p) in prompts.iter().enumerate() {
        let req = RouteRequest::new(RequestId(i as u64), p);
        let a = weighed.route(&req, T0, &mut r1).unwrap();
        let b = unaware.route(&req, T0, &mut r2).unwrap();
        assert_eq!(a.worker, b.worker, "request {i}");
        let bits = |r: &crate::Routed| -> Vec<u64> {
            r.candidates.iter().map(|c| c.cost.to_bits()).collect()
        };
        assert_eq!(bits(&a), bits(&b), "request {i}");
        for worker in weighed.workers().collect::<Vec<_>>() {
            assert_eq!(weighed.worker_load(worker), unaware.worker_load(worker));
        }
    }
    for i in 0..prompts.len() as u64 {
        weighed.on_finished(RequestId(i));
        unaware.on_finished(RequestId(i));
    }
    assert_idle(&weighed);
    assert_idle(&unaware);
}

#[test]
fn cache_hit_weights_out_of_range_fail_the_core_naming_the_key() {
    let config = RouterConfig::new(BS).with_cache_hit_weights(CacheHitWeights {
        host: 0.75,
        disk: 2.0,
    });
    assert_eq!(
        KvRouterCore::new(config)
            .map(|_| ())
            .map_err(|e| e.to_string()),
        Err("disk_cache_hit_weight must be a number in 0..=1, got 2".to_owned())
    );
}

/// A live router queues events under its lock and applies them after: nothing is visible until
/// applied, the queue keeps the core's order (a removal queued after stores wins), and the
/// applied index is the one `apply_event` builds.
#[test]
fn queued_events_apply_after_the_lock_as_apply_event_does() {
    let workers = [(1, KvMode::Events), (2, KvMode::Events)];
    let (mut direct, mut queued) = (core(Policy::Kv, &workers), core(Policy::Kv, &workers));
    let events = [
        stored(1, 0, &prompt(16)),
        stored(2, 0, &prompt(8)),
        stored(1, 1, &(100..120).collect::<Vec<_>>()),
    ];
    for ev in &events {
        assert_eq!(direct.apply_event(ev), None);
        assert_eq!(queued.queue_event(ev.clone()), None);
    }
    let local = compute_block_hashes(&prompt(16), BS as usize, &HashSalt::default());
    assert_eq!(queued.shared_index().find_matches(&local).max_score(), 0);
    queued.shared_index().apply_queued();
    assert!(queued.with_index(|q| direct.with_index(|d| q.same_content(d))));
    assert_eq!(queued.shared_index().find_matches(&local).max_score(), 4);
    assert_eq!(queued.stats().events_applied, 3);

    // A late event is counted and never queued; a removal made under the lock lands after the
    // events queued before it.
    assert_eq!(queued.queue_event(events[0].clone()), None);
    assert_eq!(queued.stats().events_late, 1);
    assert_eq!(queued.queue_event(stored(2, 1, &prompt(16))), None);
    queued.remove_worker(2);
    queued.shared_index().apply_queued();
    assert_eq!(
        queued.with_index(|i| i.block_count(w(2), StorageTier::Device)),
        0
    );
    assert_eq!(
        queued.with_index(|i| i.block_count(w(1), StorageTier::Device)),
        9
    );
}

/// A snapshot holds the events queued before it, applied or not.
#[test]
fn snapshot_holds_queued_events() {
    let mut core = core(Policy::Kv, &[(1, KvMode::Events)]);
    assert_eq!(core.queue_event(stored(1, 0, &prompt(16))), None);
    assert_eq!(core.snapshot(7).blocks(), 4);
}

/// A request prepared outside the core (hashed and matched on the shared index) is routed as
/// `route` routes it; a preparation of another prompt is ignored, not trusted.
#[test]
fn prepared_requests_route_as_route_does() {
    let workers = [
        (1, KvMode::Events),
        (2, KvMode::Events),
        (3, KvMode::Events),
    ];
    let (mut plain, mut prepared) = (core(Policy::Kv, &workers), core(Policy::Kv, &workers));
    for c in [&mut plain, &mut prepared] {
        c.apply_event(&stored(1, 0, &prompt(32)));
        c.apply_event(&stored(2, 0, &prompt(12)));
        c.apply_event(&stored(3, 0, &(500..540).collect::<Vec<_>>()));
    }
    let preparer = prepared.preparer();
    let (mut rng_a, mut rng_b) = (rng(), rng());
    let prompts: Vec<Vec<u32>> = vec![
        prompt(32),
        prompt(12),
        (500..530).collect(),
        prompt(40),
        (900..960).collect(),
    ];
    for (i, p) in prompts.iter().enumerate() {
        let req = RouteRequest::new(RequestId(i as u64), p);
        let a = plain.route(&req, T0, &mut rng_a).unwrap();
        let b = prepared
            .route_prepared(&req, preparer.prepare(&req), T0, &mut rng_b)
            .unwrap();
        assert_eq!(
            (a.worker, a.overlap_blocks),
            (b.worker, b.overlap_blocks),
            "{i}"
        );
        assert_eq!(a.candidates, b.candidates, "{i}");
    }
    // Worker 1 holds prompt(32); a preparation made for another request is not used, whatever
    // its prompt's length.
    let p = prompt(32);
    let req = RouteRequest::new(RequestId(100), &p);
    let other = (900..932).collect::<Vec<u32>>();
    for wrong in [
        RouteRequest::new(RequestId(99), &other),
        RouteRequest::new(RequestId(100), &other[..8]),
    ] {
        let routed = prepared
            .query_prepared(&req, preparer.prepare(&wrong), T0, &mut rng_b)
            .unwrap();
        assert_eq!((routed.worker, routed.overlap_blocks), (w(1), 8));
    }
    for i in 0..prompts.len() as u64 {
        plain.on_finished(RequestId(i));
        prepared.on_finished(RequestId(i));
    }
    assert_idle(&plain);
    assert_idle(&prepared);
}

#[test]
fn an_approximate_worker_whose_engine_reports_far_fewer_cached_tokens_loses_its_stale_predictions()
{
    let mut core = core(Policy::Kv, &[(1, KvMode::Approximate)]);
    // Two conversations served on worker 1: both predicted held there.
    let a: Vec<u32> = (0..32).collect();
    let b: Vec<u32> = (100..132).collect();
    for (id, p) in [(1, &a), (2, &b)] {
        core.route(&RouteRequest::new(RequestId(id), p), T0, &mut rng())
            .unwrap();
        core.on_finished(RequestId(id));
    }
    let predicted = |core: &mut KvRouterCore, p: &[u32], id: u64| {
        core.query(&RouteRequest::new(RequestId(id), p), T0, &mut rng())
            .unwrap()
            .overlap_blocks
    };
    assert_eq!(predicted(&mut core, &a, 90), 8);
    assert_eq!(predicted(&mut core, &b, 91), 8);

    // Conversation `a` again, predicted 32 tokens cached. A near miss (a block or so short)
    // changes nothing.
    let routed = core
        .route(&RouteRequest::new(RequestId(3), &a), T0, &mut rng())
        .unwrap();
    assert_eq!(routed.overlap_blocks, 8);
    assert_eq!(core.on_cache_report(RequestId(3), 28), 0);
    core.on_finished(RequestId(3));
    // Again, and the engine had none of it: the first shortfall is learnt as the worker's
    // capacity (an eviction and a restart look alike the first time), and nothing is dropped.
    core.route(&RouteRequest::new(RequestId(4), &a), T0, &mut rng())
        .unwrap();
    assert_eq!(core.on_cache_report(RequestId(4), 0), 0);
    let worker = WorkerWithDpRank::from_worker_id(1);
    assert!(core.approx_index().capacity(worker).is_some());
    core.on_finished(RequestId(4));
    assert_eq!(
        predicted(&mut core, &b, 92),
        8,
        "b is younger than the capacity"
    );
    // Conversation `b`, far too young to be evicted, and the engine (restarted) has none of it:
    // the cache was lost, and every other prediction for the worker goes.
    core.route(&RouteRequest::new(RequestId(5), &b), T0, &mut rng())
        .unwrap();
    assert_eq!(
        core.on_cache_report(RequestId(5), 0),
        8,
        "a's 8 blocks dropped"
    );
    core.on_finished(RequestId(5));
    assert_eq!(
        predicted(&mut core, &a, 93),
        0,
        "a is no longer believed held"
    );
    assert_eq!(
        predicted(&mut core, &b, 94),
        8,
        "the prompt just served is held now"
    );
    // Workers with events are never touched, and unknown requests are ignored.
    assert_eq!(core.on_cache_report(RequestId(77), 0), 0);
    assert_idle(&core);
}

#[test]
fn a_request_sent_away_from_its_cached_prefix_counts_the_tokens_it_forgoes() {
    let mut core = core(Policy::Kv, &[(1, KvMode::Events), (2, KvMode::Events)]);
    let first_prompt = prompt(64);
    let first = core
        .route(
            &RouteRequest::new(RequestId(1), &first_prompt),
            T0,
            &mut rng(),
        )
        .unwrap();
    // Nothing was cached anywhere: nothing forgone.
    assert_eq!(first.forgone_cached_tokens(BS), 0);
    // Half of the second prompt is in flight on the first's worker, which is busy with it: the
    // reference's weights send it to the idle worker and forgo those 8 blocks.
    let mut second_prompt = prompt(32);
    second_prompt.extend(1000..1032);
    let second = core
        .route(
            &RouteRequest::new(RequestId(2), &second_prompt),
            T0,
            &mut rng(),
        )
        .unwrap();
    assert_ne!(second.worker, first.worker);
    assert_eq!(second.overlap_blocks, 0);
    assert_eq!(second.forgone_cached_tokens(BS), 32);
    // The same prompt again follows its cache: nothing forgone.
    let third = core
        .route(
            &RouteRequest::new(RequestId(3), &second_prompt),
            T0,
            &mut rng(),
        )
        .unwrap();
    assert_eq!(third.worker, second.worker);
    assert_eq!(third.forgone_cached_tokens(BS), 0);
    for id in 1..=3 {
        core.on_finished(RequestId(id));
    }
    assert_idle(&core);
}

/// A core over two workers of `mode` holding 20 blocks of KV each, whose cost is the default's
/// with or without its eviction charge.
fn two_workers_of_20_blocks(mode: KvMode, eviction_weight: f64) -> KvRouterCore {
    let mut config = RouterConfig::new(BS).with_policy(Policy::Kv);
    config.scheduler.cost = kvroute_scheduler::CostWeights {
        eviction_weight,
        ..kvroute_scheduler::CostWeights::locality()
    };
    let mut core = KvRouterCore::new(config).unwrap();
    for id in [1, 2] {
        let spec = WorkerSpec::new(id).with_kv_capacity(20);
        core.add_worker(&spec, mode).unwrap();
    }
    core
}

#[test]
fn a_new_conversation_goes_where_it_evicts_nothing_rather_than_to_its_preamble() {
    // Worker 1 holds an 18-block conversation that opened with a 2-block preamble: 2 of its 20
    // blocks are free. A new 10-block conversation over the same preamble would evict 6 of the
    // old conversation's blocks there, and nothing on the empty worker 2.
    let preamble = prompt(8);
    let old: Vec<u32> = preamble.iter().copied().chain(100..164).collect();
    let new: Vec<u32> = preamble.iter().copied().chain(500..532).collect();
    for mode in [KvMode::Events, KvMode::Approximate] {
        let chosen = |eviction_weight: f64, prepare: bool| {
            let mut core = two_workers_of_20_blocks(mode, eviction_weight);
            if mode == KvMode::Events {
                assert_eq!(core.apply_event(&stored(1, 0, &old)), None);
            } else {
                // The router's own decision is what predicts it there.
                let hints = RoutingHints {
                    backend_instance_id: Some(1),
                    ..RoutingHints::default()
                };
                let req = RouteRequest::new(RequestId(1), &old).with_hints(&hints);
                assert_eq!(core.route(&req, T0, &mut rng()).unwrap().worker, w(1));
                assert!(core.on_finished(RequestId(1)).is_empty());
            }
            let req = RouteRequest::new(RequestId(2), &new);
            let routed = if prepare {
                let prepared = core.preparer().prepare(&req);
                core.route_prepared(&req, prepared, T0, &mut rng())
            } else {
                core.route(&req, T0, &mut rng())
            }
            .unwrap();
            let on_1 = routed
                .candidates
                .iter()
                .find(|c| c.worker == w(1))
                .copied()
                .unwrap();
            assert!(core.on_finished(RequestId(2)).is_empty());
            assert_idle(&core);
            (routed.worker, on_1.overlap_blocks, on_1.evicted_blocks)
        };
        // Without the charge the preamble's credit draws it to worker 1.
        assert_eq!(chosen(0.0, false), (w(1), 2, 0), "{mode:?}");
        for prepare in [false, true] {
            assert_eq!(
                chosen(1.0, prepare),
                (w(2), 2, 6),
                "{mode:?}, prepared {prepare}"
            );
        }
    }
}
