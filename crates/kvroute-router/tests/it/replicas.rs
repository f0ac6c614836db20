//! Router replicas sharing active load over one event plane (`KvPushRouterConfig::load_sync`):
//! a request routed by one replica counts on its worker at every replica until it ends, and a
//! replica that falls silent has its requests freed elsewhere after the configured silence; a
//! worker's load report frees other replicas' requests it no longer holds.

use std::time::Duration;

use futures::StreamExt;
use kvroute_protocols::{WorkerLoadReport, WorkerWithDpRank};
use kvroute_router::{
    KvMode, KvPushRouter, KvPushRouterConfig, KvResponse, LoadSyncConfig, Policy,
};
use kvroute_runtime::{Discovery as _, EventPlane as _, LOAD_REPORT_SUBJECT, encode_load_report};

use crate::support::{BLOCK, Behaviour, Fleet, eventually, idle, request, run};

async fn replica(fleet: &Fleet, router_id: u64) -> KvPushRouter {
    let mut config = KvPushRouterConfig::new(BLOCK);
    config.core.policy = Policy::Kv;
    config.default_kv_mode = KvMode::Events;
    config.expire_interval = Duration::from_millis(50);
    config.load_sync = Some(LoadSyncConfig {
        router_id,
        heartbeat: Duration::from_millis(50),
        silence: Duration::from_millis(400),
        ..LoadSyncConfig::new(0)
    });
    KvPushRouter::start(config, fleet.discovery.watch(), fleet.plane.clone())
        .await
        .unwrap()
}

fn active_on(router: &KvPushRouter, worker: u64) -> u64 {
    router.with_core(|c| {
        c.worker_load(WorkerWithDpRank::from_worker_id(worker))
            .map_or(0, |l| l.active_requests)
    })
}

fn prefill_on(router: &KvPushRouter, worker: u64) -> u64 {
    router.with_core(|c| {
        c.worker_load(WorkerWithDpRank::from_worker_id(worker))
            .map_or(0, |l| l.prefill_tokens)
    })
}

async fn send(
    router: &KvPushRouter,
    tokens: Vec<u32>,
    behaviour: Behaviour,
) -> kvroute_router::KvRoutedStream {
    match router.generate(request(tokens, behaviour)).await.unwrap() {
        KvResponse::Stream(stream) => stream,
        KvResponse::Query(_) => panic!("not a query"),
    }
}

#[test]
fn a_request_routed_by_one_replica_loads_its_worker_at_every_replica_until_it_ends() {
    run(async {
        let fleet = Fleet::start(3).await;
        let a = replica(&fleet, 1).await;
        let b = replica(&fleet, 2).await;
        let c = replica(&fleet, 3).await;
        let mut stalled = send(&a, (0..64).collect(), Behaviour::Stall).await;
        let worker = stalled.worker().worker_id;
        // The first token ends its prefill everywhere; the request stays active.
        let first = stalled.next().await.expect("a first item");
        assert!(first.is_ok());
        for (name, replica) in [("b", &b), ("c", &c)] {
            eventually(&format!("replica {name} counts the request"), || {
                active_on(replica, worker) == 1 && prefill_on(replica, worker) == 0
            })
            .await;
        }
        // Another replica now avoids the busy worker for an unrelated prompt.
        let mut other = send(&b, (1000..1064).collect(), Behaviour::Complete).await;
        assert_ne!(
            other.worker().worker_id,
            worker,
            "replica b chose the worker replica a keeps busy"
        );
        while other.next().await.is_some() {}
        drop(other);
        drop(stalled);
        for replica in [&a, &b, &c] {
            eventually("every replica's load drains to zero", || idle(replica)).await;
        }
        assert_eq!(b.load_sync_stats().unwrap().remote_requests, 0);
        assert_eq!(b.load_sync_stats().unwrap().undecodable, 0);
    });
}

#[test]
fn a_silent_replicas_requests_are_freed_after_the_silence() {
    run(async {
        let fleet = Fleet::start(2).await;
        let a = replica(&fleet, 1).await;
        let b = replica(&fleet, 2).await;
        let stalled = send(&a, (0..32).collect(), Behaviour::Stall).await;
        let worker = stalled.worker().worker_id;
        eventually("replica b counts a's request", || {
            active_on(&b, worker) == 1
        })
        .await;
        // Replica a dies: its background tasks stop, so it never says the request ended.
        drop(a);
        eventually("replica b frees the silent replica's request", || idle(&b)).await;
        assert_eq!(b.load_sync_stats().unwrap().remote_freed, 1);
        drop(stalled);
    });
}

/// Publishes `report` as a worker would (its reporter, or the bridge).
async fn publish_report(fleet: &Fleet, report: &WorkerLoadReport) {
    fleet
        .plane
        .publish(LOAD_REPORT_SUBJECT, encode_load_report(report))
        .await
        .unwrap();
}

fn metric(text: &str, sample: &str) -> Option<f64> {
    text.lines()
        .find_map(|line| line.strip_prefix(sample)?.trim().parse().ok())
}

#[test]
fn a_workers_report_frees_other_replicas_requests_it_no_longer_holds_but_never_a_local_one() {
    run(async {
        let fleet = Fleet::start(2).await;
        let a = replica(&fleet, 1).await;
        let b = {
            let mut config = KvPushRouterConfig::new(BLOCK);
            config.core.policy = Policy::Kv;
            // Free at once what the report leaves out (the default waits 5 s for requests
            // the engine may not have received yet).
            config.core.scheduler.report_grace = Duration::ZERO;
            config.expire_interval = Duration::from_millis(50);
            config.load_sync = Some(LoadSyncConfig {
                router_id: 2,
                heartbeat: Duration::from_millis(50),
                // Long enough that only the report can free a's request here.
                silence: Duration::from_secs(60),
                ..LoadSyncConfig::new(0)
            });
            KvPushRouter::start(config, fleet.discovery.watch(), fleet.plane.clone())
                .await
                .unwrap()
        };
        let stalled = send(&a, (0..32).collect(), Behaviour::Stall).await;
        let worker = stalled.worker().worker_id;
        eventually("replica b counts a's request", || {
            active_on(&b, worker) == 1
        })
        .await;

        // The worker says it holds nothing (as if a's request had ended and the end were
        // lost): b frees a's request, a keeps its own, which its guard ends.
        publish_report(&fleet, &WorkerLoadReport::new(worker).with_requests(0, 0)).await;
        eventually(
            "replica b frees the request the worker no longer holds",
            || active_on(&b, worker) == 0,
        )
        .await;
        assert_eq!(b.load_sync_stats().unwrap().remote_requests, 0);
        let text = b.metrics_text();
        assert_eq!(
            metric(&text, "kvroute_router_requests_reconciled_total"),
            Some(1.0)
        );
        let labels = format!("{{worker=\"{worker}\",dp_rank=\"0\"}}");
        assert_eq!(
            metric(
                &text,
                &format!("kvroute_router_worker_reported_requests{labels}")
            ),
            Some(0.0)
        );
        assert_eq!(
            active_on(&a, worker),
            1,
            "a report never frees a local request"
        );
        let text = a.metrics_text();
        assert_eq!(
            metric(&text, "kvroute_router_requests_reconciled_total"),
            Some(0.0)
        );
        assert_eq!(
            metric(
                &text,
                "kvroute_router_load_reports_total{outcome=\"applied\"}"
            ),
            Some(1.0)
        );

        // A report that does not validate, one that is not JSON, and one about a worker
        // nobody serves: counted, and nothing changes.
        publish_report(&fleet, &WorkerLoadReport::new(worker)).await;
        fleet
            .plane
            .publish(LOAD_REPORT_SUBJECT, "not json".into())
            .await
            .unwrap();
        publish_report(&fleet, &WorkerLoadReport::new(999).with_requests(1, 0)).await;
        eventually("a counts the bad reports", || {
            let text = a.metrics_text();
            metric(
                &text,
                "kvroute_router_load_reports_total{outcome=\"invalid\"}",
            ) == Some(2.0)
                && metric(
                    &text,
                    "kvroute_router_load_reports_total{outcome=\"unregistered\"}",
                ) == Some(1.0)
        })
        .await;
        assert_eq!(active_on(&a, worker), 1);

        drop(stalled);
        for replica in [&a, &b] {
            eventually("every replica's load drains to zero", || idle(replica)).await;
        }
    });
}

/// Issue 29, item 4: in approximate mode (engines without KV events) each replica used to
/// predict only from its own decisions, so a conversation whose turns alternate between two
/// replicas bounced between workers. Replicas now share their predictions with their load.
#[test]
fn replicas_in_approximate_mode_share_their_predictions_so_alternating_turns_stay_on_one_worker() {
    run(async {
        let fleet = Fleet::start(4).await;
        let approximate = |router_id| {
            let mut config = KvPushRouterConfig::new(BLOCK);
            config.core.policy = Policy::Kv;
            config.default_kv_mode = KvMode::Approximate;
            config.expire_interval = Duration::from_millis(50);
            config.load_sync = Some(LoadSyncConfig {
                router_id,
                heartbeat: Duration::from_millis(50),
                silence: Duration::from_secs(5),
                ..LoadSyncConfig::new(0)
            });
            let watch = fleet.discovery.watch();
            let plane = fleet.plane.clone();
            async move { KvPushRouter::start(config, watch, plane).await.unwrap() }
        };
        let a = approximate(1).await;
        let b = approximate(2).await;
        let replicas = [&a, &b];
        let conversations = 8u32;
        let turns = 4u32;
        let mut turn_workers: Vec<Vec<u64>> = vec![Vec::new(); conversations as usize];
        for turn in 0..turns {
            for (c, workers) in turn_workers.iter_mut().enumerate() {
                // Each turn repeats the conversation so far and adds 8 blocks to it.
                let base = 100_000 * (c as u32 + 1);
                let tokens: Vec<u32> = (base..base + (turn + 1) * 8 * BLOCK).collect();
                // Turns alternate between the replicas, starting with a different one per
                // conversation.
                let router = replicas[(turn as usize + c) % 2];
                let other = replicas[(turn as usize + c + 1) % 2];
                let before = other.load_sync_stats().unwrap().remote_predictions;
                let mut stream = send(router, tokens, Behaviour::Complete).await;
                workers.push(stream.worker().worker_id);
                while stream.next().await.is_some() {}
                eventually("the other replica records the prediction", || {
                    other.load_sync_stats().unwrap().remote_predictions > before
                })
                .await;
                // And has seen the request end, so that only the prediction, not load, tells
                // the workers apart.
                eventually("the other replica frees the request", || idle(other)).await;
            }
        }
        for (c, workers) in turn_workers.iter().enumerate() {
            assert!(
                workers.iter().all(|w| *w == workers[0]),
                "conversation {c} moved between workers across replicas: {workers:?}"
            );
        }
        let text = a.replica_metrics_text();
        assert!(
            text.contains("kvroute_router_replica_remote_predictions_total 16"),
            "{text}"
        );
        for replica in [&a, &b] {
            eventually("every replica's load drains to zero", || idle(replica)).await;
        }
    });
}

/// The prefill and decode routers of one process serve different workers: each shares load only
/// with the routers of its own scope (issue 29, item 13: a process's other-phase router was
/// announced as a replica, twice per process).
#[test]
fn replicas_share_load_only_within_their_scope() {
    run(async {
        let fleet = Fleet::start(2).await;
        let scoped = |router_id, scope| {
            let mut config = KvPushRouterConfig::new(BLOCK);
            config.core.policy = Policy::Kv;
            config.expire_interval = Duration::from_millis(50);
            config.load_sync = Some(
                LoadSyncConfig {
                    heartbeat: Duration::from_millis(50),
                    ..LoadSyncConfig::new(router_id)
                }
                .with_scope(scope),
            );
            let watch = fleet.discovery.watch();
            let plane = fleet.plane.clone();
            async move { KvPushRouter::start(config, watch, plane).await.unwrap() }
        };
        let prefill_a = scoped(1, "prefill").await;
        let decode_a = scoped(2, "decode").await;
        let prefill_b = scoped(3, "prefill").await;
        let stalled = send(&prefill_a, (0..32).collect(), Behaviour::Stall).await;
        let worker = stalled.worker().worker_id;
        eventually("the other prefill router counts the request", || {
            active_on(&prefill_b, worker) == 1
        })
        .await;
        // Give the decode router every chance to have seen it (several heartbeats).
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(active_on(&decode_a, worker), 0, "another scope's load");
        assert_eq!(decode_a.load_sync_stats().unwrap().remote_requests, 0);
        drop(stalled);
        for replica in [&prefill_a, &decode_a, &prefill_b] {
            eventually("every replica's load drains to zero", || idle(replica)).await;
        }
    });
}
