//! The push router: modes, in-flight accounting, backoff and failover.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use futures::StreamExt;
use kvroute_runtime::{
    Discovery, InstanceInfo, PushRouter, PushRouterConfig, RequestError, RouteError, RouteMode,
    StaticDiscovery, WorkerServer,
};

use crate::support::{Item, Job, TestEngine, bounded, first_error, start_worker};

type Router = PushRouter<Job, Item>;

async fn fleet(n: u64) -> (Vec<WorkerServer>, Vec<Arc<TestEngine>>, Vec<InstanceInfo>) {
    let mut servers = Vec::new();
    let mut engines = Vec::new();
    let mut infos = Vec::new();
    for id in 1..=n {
        let (server, engine) = start_worker(id).await;
        infos.push(InstanceInfo::new(id, server.local_addr().to_string(), 16));
        servers.push(server);
        engines.push(engine);
    }
    (servers, engines, infos)
}

fn router(infos: Vec<InstanceInfo>) -> Router {
    let discovery = StaticDiscovery::from_instances(infos).unwrap();
    PushRouter::new(discovery.watch(), PushRouterConfig::default())
}

async fn run(router: &Router, mode: RouteMode) -> u64 {
    let stream = router
        .generate("r", &Job::new(2), mode)
        .await
        .expect("routed");
    let worker = stream.worker_id();
    let items: Vec<_> = stream.collect().await;
    assert_eq!(items.len(), 2);
    worker
}

fn started(engines: &[Arc<TestEngine>]) -> Vec<usize> {
    engines
        .iter()
        .map(|e| e.started.load(Ordering::SeqCst))
        .collect()
}

#[tokio::test]
async fn round_robin_spreads_evenly_and_direct_hits_its_worker() {
    let (_servers, engines, infos) = fleet(3).await;
    let router = router(infos);
    for _ in 0..9 {
        run(&router, RouteMode::RoundRobin).await;
    }
    assert_eq!(started(&engines), vec![3, 3, 3]);
    assert_eq!(run(&router, RouteMode::Direct(2)).await, 2);
    assert_eq!(started(&engines), vec![3, 4, 3]);
    match router
        .generate("r", &Job::new(1), RouteMode::Direct(9))
        .await
    {
        Err(RouteError::UnknownWorker { id: 9 }) => {}
        other => panic!("expected UnknownWorker, got {other:?}"),
    }
    for _ in 0..30 {
        run(&router, RouteMode::Random).await;
    }
    assert!(
        started(&engines).iter().all(|&n| n > 3),
        "random reaches every worker: {:?}",
        started(&engines)
    );
}

#[tokio::test]
async fn power_of_two_choices_avoids_the_loaded_worker() {
    let (_servers, engines, infos) = fleet(3).await;
    let router = router(infos);
    let mut held = Vec::new();
    for _ in 0..10 {
        held.push(
            router
                .generate("hold", &Job::slow(u32::MAX, 5), RouteMode::Direct(1))
                .await
                .unwrap(),
        );
    }
    assert_eq!(router.in_flight(1), 10);
    for _ in 0..30 {
        run(&router, RouteMode::PowerOfTwoChoices).await;
    }
    let counts = started(&engines);
    // Worker 1 is picked only when both choices land on it.
    assert!(counts[0] - 10 < counts[1].min(counts[2]), "{counts:?}");
    drop(held);
    assert_eq!(
        router.in_flight(1),
        0,
        "dropping routed streams releases their in-flight count"
    );
}

#[tokio::test]
async fn an_unreachable_worker_backs_off_and_requests_go_elsewhere() {
    let (_servers, engines, mut infos) = fleet(2).await;
    let dead = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    infos.push(InstanceInfo::new(
        3,
        dead.local_addr().unwrap().to_string(),
        16,
    ));
    drop(dead);
    let router = router(infos);
    for _ in 0..6 {
        let worker = run(&router, RouteMode::RoundRobin).await;
        assert_ne!(worker, 3);
    }
    assert!(router.is_backing_off(3));
    assert_eq!(
        started(&engines).iter().sum::<usize>(),
        6,
        "every request was served despite the dead worker"
    );
    match router
        .generate("r", &Job::new(1), RouteMode::Direct(3))
        .await
    {
        Err(RouteError::Request {
            worker_id: 3,
            source,
        }) => assert!(source.is_worker_unavailable()),
        other => panic!("a directed request has nowhere else to go, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_dying_mid_stream_lets_the_caller_migrate() {
    let (servers, _engines, infos) = fleet(2).await;
    let config = PushRouterConfig {
        backoff_initial: Duration::from_secs(30),
        ..PushRouterConfig::default()
    };
    let router: Router = PushRouter::new(
        StaticDiscovery::from_instances(infos).unwrap().watch(),
        config,
    );
    let mut stream = router
        .generate("r", &Job::slow(u32::MAX, 2), RouteMode::Direct(1))
        .await
        .unwrap();
    bounded("first item", stream.next()).await.unwrap().unwrap();
    servers[0].abort();
    let error = bounded("the typed error", first_error(&mut stream)).await;
    assert!(
        matches!(error, Some(RequestError::WorkerUnavailable { .. })),
        "{error:?}"
    );
    drop(stream);
    assert_eq!(router.in_flight(1), 0);
    // The caller migrates: the next request avoids the dead worker.
    for _ in 0..4 {
        assert_eq!(run(&router, RouteMode::RoundRobin).await, 2);
    }
}

#[tokio::test]
async fn the_pooled_connection_serves_unary_calls() {
    let (_servers, engines, infos) = fleet(2).await;
    let router = router(infos);
    let client = router.client(2).await.expect("connection to worker 2");
    assert_eq!(client.worker_id(), 2);
    let open = kvroute_protocols::SessionControl::new("s")
        .with_action(kvroute_protocols::SessionAction::Open);
    client.session_control(&open).await.unwrap();
    assert!(engines[1].sessions.lock().contains("s"));
    assert!(engines[0].sessions.lock().is_empty());
    run(&router, RouteMode::Direct(2)).await;
    assert_eq!(
        router.client(2).await.unwrap().open_streams(),
        0,
        "the same pooled connection, now idle"
    );
    assert!(matches!(
        router.client(9).await,
        Err(RouteError::UnknownWorker { id: 9 })
    ));
}

#[tokio::test]
async fn the_router_follows_discovery_as_workers_come_and_go() {
    let (_servers, engines, infos) = fleet(2).await;
    let discovery = kvroute_runtime::InProcessDiscovery::new(Duration::from_millis(300));
    let router: Router = PushRouter::new(discovery.watch(), PushRouterConfig::default());
    assert!(matches!(
        router
            .generate("r", &Job::new(1), RouteMode::RoundRobin)
            .await,
        Err(RouteError::NoWorkers { role: None })
    ));
    let first = discovery.register(infos[0].clone()).await.unwrap();
    let second = discovery.register(infos[1].clone()).await.unwrap();
    for _ in 0..4 {
        run(&router, RouteMode::RoundRobin).await;
    }
    assert_eq!(started(&engines), vec![2, 2]);
    // Worker 1 crashes: its lease stops renewing and expires.
    first.abandon();
    crate::support::eventually("worker 1's lease to expire", || {
        !discovery.watch().borrow().contains_key(&1)
    })
    .await;
    for _ in 0..4 {
        assert_eq!(run(&router, RouteMode::RoundRobin).await, 2);
    }
    drop(second);
}
