//! The direct path to an engine of the same process (`LocalEngines`): every scenario runs over
//! the connection and directly, and the caller must see the same thing both ways.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use futures::StreamExt;
use kvroute_runtime::{
    ClientConfig, Discovery, InstanceInfo, LocalEngines, LocalRegistration, PushRouter,
    PushRouterConfig, RequestError, RouteMode, RoutedStream, StaticDiscovery, WorkerServer,
};

use crate::support::{Item, Job, STOPPED, TestEngine, bounded, eventually, start_worker};

type Router = PushRouter<Job, Item>;

/// One worker, served over loopback, and a router that reaches it over the connection
/// (`local: false`) or directly.
struct Setup {
    engine: Arc<TestEngine>,
    router: Router,
    _server: WorkerServer,
    _registration: Option<LocalRegistration>,
}

async fn setup(local: bool, first_response_timeout: Option<Duration>) -> Setup {
    let (server, engine) = start_worker(1).await;
    let address = server.local_addr().to_string();
    let engines = LocalEngines::new();
    let registration = local.then(|| engines.register(address.clone(), engine.clone()));
    let config = PushRouterConfig {
        client: ClientConfig {
            first_response_timeout,
            ..ClientConfig::default()
        },
        local: engines,
        ..PushRouterConfig::default()
    };
    let discovery =
        StaticDiscovery::from_instances(vec![InstanceInfo::new(1, address, 16)]).unwrap();
    Setup {
        engine,
        router: PushRouter::new(discovery.watch(), config),
        _server: server,
        _registration: registration,
    }
}

async fn send(setup: &Setup, job: Job) -> RoutedStream<Item> {
    setup
        .router
        .generate("req-7", &job, RouteMode::Direct(1))
        .await
        .expect("routed")
}

/// Every item of a stream: a data item's value, or an error's text.
async fn items(mut stream: RoutedStream<Item>) -> Vec<Result<u32, String>> {
    let mut out = Vec::new();
    while let Some(item) = bounded("the next item", stream.next()).await {
        out.push(
            item.map(|i| i.data.expect("data item"))
                .map_err(|e| format!("{e:?}")),
        );
    }
    out
}

#[tokio::test]
async fn a_local_stream_delivers_what_the_connection_does() {
    for local in [false, true] {
        let setup = setup(local, None).await;
        let mut stream = send(&setup, Job::new(3)).await;
        assert_eq!(stream.stream_mut().is_local(), local);
        assert_eq!(stream.stream_mut().worker_id(), 1);
        assert_eq!(setup.router.in_flight(1), 1);
        let first = bounded("first", stream.next()).await.unwrap().unwrap();
        assert_eq!(first.id.as_deref(), Some("req-7"), "the engine saw the id");
        assert_eq!(items(stream).await, vec![Ok(1), Ok(2)], "local={local}");
        assert_eq!(setup.router.in_flight(1), 0, "released at the end");
        assert_eq!(setup.engine.killed(), 0, "a normal end kills nothing");
    }
}

#[tokio::test]
async fn a_local_engine_needs_no_listener() {
    // Nothing listens at the address: only the direct path can serve it.
    let engines = LocalEngines::new();
    let engine = Arc::new(TestEngine::default());
    let registration = engines.register("127.0.0.1:1", engine.clone());
    assert!(engines.contains("127.0.0.1:1"));
    let discovery =
        StaticDiscovery::from_instances(vec![InstanceInfo::new(1, "127.0.0.1:1", 16)]).unwrap();
    let config = PushRouterConfig {
        local: engines.clone(),
        ..PushRouterConfig::default()
    };
    let router: Router = PushRouter::new(discovery.watch(), config);
    let stream = router
        .generate("r", &Job::new(2), RouteMode::RoundRobin)
        .await
        .unwrap();
    assert_eq!(items(stream).await, vec![Ok(0), Ok(1)]);
    assert_eq!(engine.started.load(Ordering::SeqCst), 1);

    // Unregistered, the address is a connection again, and nobody is there.
    drop(registration);
    assert!(engines.is_empty());
    let refused = router
        .generate("r", &Job::new(2), RouteMode::Direct(1))
        .await;
    assert!(refused.is_err(), "{refused:?}");
}

#[tokio::test]
async fn dropping_or_killing_a_local_stream_kills_the_request() {
    for local in [false, true] {
        let setup = setup(local, None).await;
        let mut dropped = send(&setup, Job::slow(u32::MAX, 1)).await;
        bounded("first", dropped.next()).await.unwrap().unwrap();
        let mut killed = send(&setup, Job::slow(u32::MAX, 1)).await;
        bounded("first", killed.next()).await.unwrap().unwrap();
        assert_eq!(setup.engine.active.load(Ordering::SeqCst), 2);
        drop(dropped);
        killed.stream_mut().kill();
        assert!(
            killed.next().await.is_none(),
            "a killed stream ends at once"
        );
        drop(killed);
        eventually("both slots to free", || {
            setup.engine.active.load(Ordering::SeqCst) == 0
        })
        .await;
        assert_eq!(setup.engine.killed(), 2, "local={local}");
        assert_eq!(setup.router.in_flight(1), 0);
    }
}

#[tokio::test]
async fn stop_on_a_local_stream_lets_the_engine_finish() {
    for local in [false, true] {
        let setup = setup(local, None).await;
        let mut stream = send(&setup, Job::slow(u32::MAX, 5)).await;
        bounded("first", stream.next()).await.unwrap().unwrap();
        stream.stream_mut().stop();
        let rest = items(stream).await;
        assert_eq!(rest.last(), Some(&Ok(STOPPED)), "local={local}: {rest:?}");
        assert_eq!(setup.engine.killed(), 0, "a stop is not a kill");
        eventually("the slot to free", || {
            setup.engine.active.load(Ordering::SeqCst) == 0
        })
        .await;
    }
}

#[tokio::test]
async fn a_silent_local_engine_trips_the_first_response_timeout() {
    for local in [false, true] {
        let setup = setup(local, Some(Duration::from_millis(50))).await;
        let mut stream = send(&setup, Job::slow(3, 60_000)).await;
        match bounded("the timeout", stream.next()).await {
            Some(Err(RequestError::FirstResponseTimeout { after })) => {
                assert_eq!(after, Duration::from_millis(50))
            }
            other => panic!("local={local}: expected a first-response timeout, got {other:?}"),
        }
        assert!(stream.next().await.is_none());
        eventually("the timed-out request to be killed", || {
            setup.engine.active.load(Ordering::SeqCst) == 0
        })
        .await;
        assert_eq!(setup.engine.killed(), 1);
    }
}

#[tokio::test]
async fn engine_refusals_and_failures_arrive_as_the_same_errors() {
    let jobs = [
        Job {
            reject: Some("prompt too long".to_owned()),
            ..Job::new(3)
        },
        Job {
            unavailable_after: Some(0),
            ..Job::new(3)
        },
        Job {
            unavailable_after: Some(2),
            ..Job::new(3)
        },
    ];
    for job in jobs {
        let mut seen = Vec::new();
        for local in [false, true] {
            let setup = setup(local, None).await;
            let got = items(send(&setup, job.clone()).await).await;
            assert_eq!(setup.router.in_flight(1), 0);
            seen.push(got);
        }
        // An error names the worker's address, which differs per setup.
        let normalise = |items: &[Result<u32, String>]| -> Vec<Result<u32, String>> {
            items
                .iter()
                .map(|i| i.clone().map_err(|e| strip_address(&e)))
                .collect()
        };
        assert_eq!(normalise(&seen[0]), normalise(&seen[1]), "{job:?}");
        assert!(
            matches!(seen[1].last(), Some(Err(_))),
            "the failure is the last item: {:?}",
            seen[1]
        );
    }
}

/// The error text with the worker's `addr: "..."` blanked.
fn strip_address(error: &str) -> String {
    match error.find("addr: \"") {
        Some(start) => {
            let rest = &error[start + 7..];
            let end = rest.find('"').map_or(rest.len(), |e| e + 1);
            format!("{}addr: _{}", &error[..start], &rest[end..])
        }
        None => error.to_owned(),
    }
}
