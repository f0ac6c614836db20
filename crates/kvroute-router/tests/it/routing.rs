//! Routing through the push router: KV events, queries, pins, direct mode, gaps, sessions.

use std::sync::atomic::Ordering;

use kvroute_protocols::{SessionAction, SessionControl, WorkerWithDpRank};
use kvroute_router::{KvResponse, KvRouterError, Policy, RouteError, RouteSource};
use kvroute_runtime::Discovery;
use kvroute_sessions::AffinityStore;

use crate::support::{Behaviour, Fleet, drain, eventually, idle, request, run};

fn prompt(seed: u32, len: u32) -> Vec<u32> {
    (0..len).map(|i| seed * 1000 + i).collect()
}

#[test]
fn second_turn_lands_on_the_worker_holding_the_prefix() {
    run(async {
        let fleet = Fleet::start(3).await;
        let router = fleet.router(Policy::Kv).await;
        let p = prompt(1, 32);
        let KvResponse::Stream(mut first) = router
            .generate(request(p.clone(), Behaviour::Complete))
            .await
            .unwrap()
        else {
            panic!("expected a stream");
        };
        let home = first.worker();
        assert_eq!(first.decision().overlap_blocks, 0);
        assert_eq!(drain(&mut first).await, (5, false));
        drop(first);
        let holder = home;
        eventually("the router indexed the prompt", || {
            router.with_core(|c| c.with_index(|i| i.block_count(holder, Default::default())) == 8)
        })
        .await;
        let mut longer = p.clone();
        longer.extend(prompt(2, 8));
        let KvResponse::Stream(mut second) = router
            .generate(request(longer, Behaviour::Complete))
            .await
            .unwrap()
        else {
            panic!("expected a stream");
        };
        let d = second.decision().clone();
        assert_eq!((d.worker, d.overlap_blocks, d.prompt_blocks), (home, 8, 10));
        assert_eq!(d.source, RouteSource::Selected);
        assert_eq!(
            d.candidates.len(),
            3,
            "every worker is a candidate with its cost"
        );
        let chosen = d.candidates.iter().find(|c| c.worker == home).unwrap();
        let other = d.candidates.iter().find(|c| c.worker != home).unwrap();
        assert!(chosen.cost < other.cost, "{chosen} vs {other}");
        assert_eq!(chosen.credited_prefill_blocks, 2.0);
        drain(&mut second).await;
        drop(second);
        assert!(idle(&router));
        let text = router.metrics_text();
        assert!(text.contains("kvroute_router_requests_total 2"), "{text}");
        assert!(
            text.contains("kvroute_router_requests_finished_total{outcome=\"ok\"} 2"),
            "{text}"
        );
        assert!(
            text.contains("kvroute_router_routing_overhead_seconds_count{phase=\"hashing\"} 2"),
            "{text}"
        );
        assert!(
            text.contains("kvroute_router_worker_active_blocks{"),
            "{text}"
        );
        assert!(
            text.contains("kvroute_router_output_tokens_total 10"),
            "{text}"
        );
    });
}

#[test]
fn query_only_returns_the_choice_and_leaves_no_state() {
    run(async {
        let fleet = Fleet::start(2).await;
        let router = fleet.router(Policy::RoundRobin).await;
        let p = prompt(3, 16);
        let mut req = request(p.clone(), Behaviour::Complete);
        req.annotations.push("query_instance_id:".to_owned());
        let mut first = None;
        for _ in 0..3 {
            let KvResponse::Query(answer) = router.generate(req.clone()).await.unwrap() else {
                panic!("a query must not be routed");
            };
            assert_eq!(answer.token_ids, p);
            // Round-robin does not advance on queries.
            assert_eq!(*first.get_or_insert(answer.worker), answer.worker);
        }
        assert!(idle(&router));
        assert!(router.with_core(|c| c.sessions().store().is_empty()));
        for w in &fleet.workers {
            assert_eq!(w.engine.started.load(Ordering::SeqCst), 0);
        }
        assert!(
            router
                .metrics_text()
                .contains("kvroute_router_queries_total 3")
        );
    });
}

#[test]
fn preselected_worker_bypasses_selection_and_is_tracked() {
    run(async {
        let fleet = Fleet::start(3).await;
        let router = fleet.router(Policy::Kv).await;
        let mut req = request(prompt(4, 12), Behaviour::Stall);
        req.routing_mut().backend_instance_id = Some(2);
        let KvResponse::Stream(stream) = router.generate(req).await.unwrap() else {
            panic!("expected a stream");
        };
        assert_eq!(stream.worker(), WorkerWithDpRank::from_worker_id(2));
        assert_eq!(stream.decision().source, RouteSource::Pinned);
        let load =
            router.with_core(|c| c.worker_load(WorkerWithDpRank::from_worker_id(2)).unwrap());
        assert_eq!(load.active_requests, 1);
        drop(stream);
        assert!(idle(&router));
    });
}

#[test]
fn direct_mode_errors_clearly_without_a_worker_id() {
    run(async {
        let fleet = Fleet::start(2).await;
        let router = fleet.router(Policy::Direct).await;
        let err = router
            .generate(request(prompt(5, 8), Behaviour::Complete))
            .await
            .unwrap_err();
        assert!(matches!(
            err,
            KvRouterError::Route(RouteError::NoWorkerId { .. })
        ));
        assert!(err.to_string().contains("backend_instance_id"), "{err}");
        let mut req = request(prompt(5, 8), Behaviour::Complete);
        req.routing_mut().backend_instance_id = Some(1);
        let KvResponse::Stream(mut s) = router.generate(req).await.unwrap() else {
            panic!("expected a stream");
        };
        assert_eq!(s.worker().worker_id, 1);
        drain(&mut s).await;
        drop(s);
        assert!(idle(&router));
    });
}

#[test]
fn lost_events_are_fetched_from_the_worker() {
    run(async {
        let fleet = Fleet::start(1).await;
        let router = fleet.router(Policy::Kv).await;
        let engine = &fleet.worker(1).engine;
        let w1 = WorkerWithDpRank::from_worker_id(1);
        engine.store(&prompt(6, 8));
        eventually("event 0 applied", || {
            router.with_core(|c| c.expected_event_id(1) == Some(1))
        })
        .await;
        engine.muted.store(true, Ordering::SeqCst);
        engine.store(&prompt(7, 12)); // event 1: lost on the way
        engine.muted.store(false, Ordering::SeqCst);
        engine.store(&prompt(8, 4)); // event 2: reveals the gap
        eventually("the gap was filled", || {
            router
                .with_core(|c| c.with_index(|i| i.block_count(w1, Default::default())) == 2 + 3 + 1)
        })
        .await;
        let stats = router.with_core(|c| c.stats());
        assert_eq!((stats.gaps_detected, stats.events_recovered), (1, 1));
    });
}

#[test]
fn a_joining_worker_is_dumped_and_a_leaving_one_removed() {
    run(async {
        let mut fleet = Fleet::start(1).await;
        let router = fleet.router(Policy::Kv).await;
        // Worker 2 held blocks before this router knew it.
        fleet.add(2, Some("true")).await;
        fleet.add(3, Some("false")).await;
        eventually("workers 2 and 3 joined", || {
            router.with_core(|c| c.has_worker(2) && c.has_worker(3))
        })
        .await;
        assert_eq!(
            router.with_core(|c| c.kv_mode(3)),
            Some(kvroute_router::KvMode::Approximate)
        );
        fleet.worker(2).engine.muted.store(true, Ordering::SeqCst);
        fleet.worker(2).engine.store(&prompt(9, 8));
        fleet.worker(2).engine.muted.store(false, Ordering::SeqCst);
        // A re-registration makes the router dump the worker again.
        fleet.workers.retain_mut(|w| {
            if w.id == 3 {
                w.kill();
                false
            } else {
                true
            }
        });
        eventually("worker 3 left", || router.with_core(|c| !c.has_worker(3))).await;
        let w2 = fleet.workers.iter_mut().find(|w| w.id == 2).unwrap();
        w2.lease.take();
        eventually("worker 2 left", || router.with_core(|c| !c.has_worker(2))).await;
        let addr = w2.server.local_addr().to_string();
        w2.lease = Some(
            fleet
                .discovery
                .register(kvroute_runtime::InstanceInfo::new(
                    2,
                    addr,
                    crate::support::BLOCK,
                ))
                .await
                .unwrap(),
        );
        let w = WorkerWithDpRank::from_worker_id(2);
        eventually("worker 2's dump applied", || {
            router.with_core(|c| c.with_index(|i| i.block_count(w, Default::default())) == 2)
        })
        .await;
    });
}

#[test]
fn session_open_and_deferred_close_reach_the_worker() {
    run(async {
        let fleet = Fleet::start(3).await;
        let router = fleet.router(Policy::Kv).await;
        let turn = |action: Option<SessionAction>, seed: u32| {
            let mut req = request(prompt(seed, 8), Behaviour::Complete);
            req.routing_mut().session_control = Some(SessionControl {
                action,
                ..SessionControl::new("agent-1")
            });
            req
        };
        let KvResponse::Stream(mut s) = router
            .generate(turn(Some(SessionAction::Open), 10))
            .await
            .unwrap()
        else {
            panic!("expected a stream");
        };
        let home = s.worker().worker_id;
        let engine = &fleet.worker(home).engine;
        assert_eq!(
            engine.sessions.lock().len(),
            1,
            "open runs before the request is sent"
        );
        assert_eq!(engine.sessions.lock()[0].action, Some(SessionAction::Open));
        drain(&mut s).await;
        drop(s);
        // Different prompts still stick to the session's worker.
        for seed in 11..14 {
            let KvResponse::Stream(mut s) = router.generate(turn(None, seed)).await.unwrap() else {
                panic!("expected a stream");
            };
            assert_eq!(
                (s.worker().worker_id, s.decision().source),
                (home, RouteSource::Sticky)
            );
            drain(&mut s).await;
        }
        let KvResponse::Stream(mut s) = router
            .generate(turn(Some(SessionAction::Close), 14))
            .await
            .unwrap()
        else {
            panic!("expected a stream");
        };
        assert_eq!(s.worker().worker_id, home);
        assert_eq!(
            engine.sessions.lock().len(),
            1,
            "close waits for the stream's end"
        );
        drain(&mut s).await;
        drop(s);
        eventually("the deferred close reached the worker", || {
            engine.sessions.lock().len() == 2
        })
        .await;
        assert_eq!(engine.sessions.lock()[1].action, Some(SessionAction::Close));
        assert!(router.with_core(|c| c.sessions().store().is_empty()));
        assert!(idle(&router));
    });
}

#[test]
fn a_worker_without_the_routers_block_size_is_ignored() {
    run(async {
        let fleet = Fleet::start(1).await;
        let info = kvroute_runtime::InstanceInfo::new(9, "127.0.0.1:1", 64);
        let _lease = fleet.discovery.register(info).await.unwrap();
        let router = fleet.router(Policy::Kv).await;
        assert!(router.with_core(|c| c.has_worker(1) && !c.has_worker(9)));
    });
}
