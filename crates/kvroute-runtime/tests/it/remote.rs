//! Cross-process plumbing without a broker: the `subscribe_kv_events` stream, the KV event bridge
//! onto an event plane, and registration with a registry server (leases, crash, deregistration,
//! re-registration after a registry restart, watching).

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use kvroute_protocols::kv_events::{KvCacheEventData, RouterEvent};
use kvroute_runtime::{
    Discovery, EventPlane, InProcessDiscovery, InProcessEventPlane, InstanceInfo, InstanceSet,
    KV_EVENT_SUBJECT, KvEventBridge, KvEventBridgeConfig, KvEventPublisher, RegistryServer,
    RemoteDiscovery, RemoteDiscoveryConfig, RequestError, WorkerServerConfig,
};
use tokio::sync::watch;

use crate::support::{bounded, connect, eventually, start_worker_with};

async fn next_ids(stream: &mut kvroute_runtime::ClientStream<RouterEvent>, n: usize) -> Vec<u64> {
    let mut got = Vec::new();
    while got.len() < n {
        let event = bounded("a KV event", stream.next()).await;
        got.push(event.expect("stream open").expect("event").event.event_id);
    }
    got
}

#[tokio::test]
async fn a_subscription_gets_the_backlog_then_live_events_until_dropped() {
    let publisher = KvEventPublisher::new(3, 8);
    let config = WorkerServerConfig::new(3).with_kv_events(publisher.clone());
    let (server, _engine) = start_worker_with(config).await;
    let client = connect(&server).await;
    for _ in 0..3 {
        publisher.publish(0, KvCacheEventData::Cleared);
    }

    let mut from_one = client.subscribe_kv_events(Some(1)).await.unwrap();
    let mut live_only = client.subscribe_kv_events(None).await.unwrap();
    assert_eq!(next_ids(&mut from_one, 2).await, vec![1, 2]);
    publisher.publish(0, KvCacheEventData::Cleared);
    assert_eq!(next_ids(&mut from_one, 1).await, vec![3]);
    assert_eq!(next_ids(&mut live_only, 1).await, vec![3]);
    assert_eq!(client.open_streams(), 2);
    drop(from_one);
    drop(live_only);
    eventually("both subscriptions to close", || client.open_streams() == 0).await;

    // Asking for an id the ring no longer holds is refused, naming what it holds.
    for _ in 0..10 {
        publisher.publish(0, KvCacheEventData::Cleared);
    }
    let refused = client
        .subscribe_kv_events(Some(0))
        .await
        .unwrap()
        .next()
        .await;
    let Some(Err(RequestError::EventsUnavailable { message })) = refused else {
        panic!("expected EventsUnavailable, got {refused:?}");
    };
    assert!(message.contains("holds events 6..=13"), "{message}");
}

#[tokio::test]
async fn a_worker_without_kv_events_refuses_subscriptions() {
    let (server, _engine) = start_worker_with(WorkerServerConfig::new(4)).await;
    let client = connect(&server).await;
    let first = client.subscribe_kv_events(None).await.unwrap().next().await;
    assert!(
        matches!(first, Some(Err(RequestError::Unsupported { .. }))),
        "{first:?}"
    );
}

#[tokio::test]
async fn the_bridge_forwards_every_listed_workers_events_and_resumes_after_reconnects() {
    let publisher = KvEventPublisher::new(5, 64);
    let config = WorkerServerConfig::new(5).with_kv_events(publisher.clone());
    let (server, _engine) = start_worker_with(config).await;
    let info = InstanceInfo::new(5, server.local_addr().to_string(), 16);
    let (tx, rx) = watch::channel(InstanceSet::default());
    let plane = Arc::new(InProcessEventPlane::default());
    let mut events = plane.subscribe(KV_EVENT_SUBJECT).await.unwrap();
    let _bridge = KvEventBridge::start(rx, plane.clone(), KvEventBridgeConfig::default());

    tx.send_replace(Arc::new([(5, info.clone())].into_iter().collect()));
    // The bridge subscribes from "now"; publish until its feed is up, then expect order.
    let first = bounded("the first forwarded event", async {
        loop {
            publisher.publish(0, KvCacheEventData::Cleared);
            tokio::select! {
                m = events.next() => return m.unwrap().router_event().unwrap(),
                () = tokio::time::sleep(Duration::from_millis(20)) => {}
            }
        }
    })
    .await;
    assert_eq!(first.worker_id, 5);
    let mut expected = first.event.event_id + 1;
    // Events published from now on arrive in order, wherever the bridge had got to.
    let last = publisher
        .publish(0, KvCacheEventData::Cleared)
        .event
        .event_id;
    while expected <= last {
        let m = bounded("a forwarded event", events.next()).await.unwrap();
        assert_eq!(m.router_event().unwrap().event.event_id, expected);
        expected += 1;
    }

    // A worker that leaves discovery is no longer followed.
    tx.send_replace(InstanceSet::default());
    tokio::time::sleep(Duration::from_millis(50)).await;
    publisher.publish(0, KvCacheEventData::Cleared);
    let quiet = tokio::time::timeout(Duration::from_millis(200), events.next()).await;
    assert!(quiet.is_err(), "no events after removal, got {quiet:?}");
}

#[tokio::test]
async fn the_bridge_leaves_out_local_workers_whose_publishers_forward_to_the_plane() {
    // Worker 6 is served over the request plane but forwards to the plane itself; worker 7 is
    // only reachable over the request plane.
    let local = KvEventPublisher::new(6, 64);
    let remote = KvEventPublisher::new(7, 64);
    let (local_server, _local_engine) =
        start_worker_with(WorkerServerConfig::new(6).with_kv_events(local.clone())).await;
    let (remote_server, _remote_engine) =
        start_worker_with(WorkerServerConfig::new(7).with_kv_events(remote.clone())).await;
    let (tx, rx) = watch::channel(InstanceSet::default());
    let plane: Arc<dyn EventPlane> = Arc::new(InProcessEventPlane::default());
    let mut events = plane.subscribe(KV_EVENT_SUBJECT).await.unwrap();
    assert!(local.forward_to(plane.clone()));
    let _bridge = KvEventBridge::start_except(
        rx,
        plane.clone(),
        KvEventBridgeConfig::default(),
        [6].into_iter().collect(),
    );
    tx.send_replace(Arc::new(
        [
            (
                6,
                InstanceInfo::new(6, local_server.local_addr().to_string(), 16),
            ),
            (
                7,
                InstanceInfo::new(7, remote_server.local_addr().to_string(), 16),
            ),
        ]
        .into_iter()
        .collect(),
    ));
    // Once the bridge follows worker 7, every event of both workers arrives exactly once: a
    // bridge that also followed worker 6 would deliver its events twice.
    bounded("the bridge to follow worker 7", async {
        loop {
            remote.publish(0, KvCacheEventData::Cleared);
            tokio::select! {
                m = events.next() => {
                    if m.unwrap().router_event().unwrap().worker_id == 7 {
                        return;
                    }
                }
                () = tokio::time::sleep(Duration::from_millis(20)) => {}
            }
        }
    })
    .await;
    while tokio::time::timeout(Duration::from_millis(100), events.next())
        .await
        .is_ok()
    {}
    let mut sent = Vec::new();
    for _ in 0..5 {
        sent.push((
            6,
            local.publish(0, KvCacheEventData::Cleared).event.event_id,
        ));
        sent.push((
            7,
            remote.publish(0, KvCacheEventData::Cleared).event.event_id,
        ));
    }
    let mut got = Vec::new();
    while let Ok(Some(m)) = tokio::time::timeout(Duration::from_millis(300), events.next()).await {
        let event = m.router_event().unwrap();
        got.push((event.worker_id, event.event.event_id));
    }
    got.sort_unstable();
    sent.sort_unstable();
    assert_eq!(got, sent);
}

fn quick() -> RemoteDiscoveryConfig {
    RemoteDiscoveryConfig {
        retry_interval: Duration::from_millis(20),
        ..RemoteDiscoveryConfig::default()
    }
}

async fn listed(rx: &mut watch::Receiver<InstanceSet>, expect: &[u64]) {
    let what = format!("the registry to list {expect:?}");
    bounded(&what, async {
        loop {
            if rx.borrow_and_update().keys().copied().collect::<Vec<_>>() == expect {
                return;
            }
            rx.changed().await.expect("watch open");
        }
    })
    .await;
}

#[tokio::test]
async fn registration_lists_renews_and_deregisters() {
    // A short lease, so renewals are exercised several times in the test.
    let registry = RegistryServer::bind(
        "127.0.0.1:0",
        InProcessDiscovery::new(Duration::from_millis(150)),
    )
    .await
    .unwrap();
    let mut rx = registry.discovery().watch();
    let remote = RemoteDiscovery::new(registry.local_addr().to_string(), quick());
    let lease = remote
        .register(InstanceInfo::new(1, "127.0.0.1:1", 16))
        .await
        .unwrap();
    listed(&mut rx, &[1]).await;

    // The same id again is refused with the holder's address.
    let duplicate = remote
        .register(InstanceInfo::new(1, "127.0.0.1:2", 16))
        .await;
    assert!(
        duplicate
            .as_ref()
            .is_err_and(|e| e.to_string().contains("127.0.0.1:1")),
        "{duplicate:?}"
    );

    // Renewals keep it listed across several lease lifetimes.
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert!(rx.borrow().contains_key(&1));

    // A second process can watch the fleet through the registry.
    let watcher = RemoteDiscovery::new(registry.local_addr().to_string(), quick());
    let mut remote_rx = watcher.watch();
    listed(&mut remote_rx, &[1]).await;

    lease.revoke();
    assert!(remote.flush(Duration::from_secs(5)).await);
    listed(&mut rx, &[]).await;
    listed(&mut remote_rx, &[]).await;
}

#[tokio::test]
async fn a_crashed_worker_disappears_at_once_and_a_restarted_registry_is_rejoined() {
    let registry = RegistryServer::bind(
        "127.0.0.1:0",
        InProcessDiscovery::new(Duration::from_secs(30)),
    )
    .await
    .unwrap();
    let addr = registry.local_addr();
    let mut rx = registry.discovery().watch();
    let crashing = RemoteDiscovery::new(addr.to_string(), quick());
    let staying = RemoteDiscovery::new(addr.to_string(), quick());
    let crash = crashing
        .register(InstanceInfo::new(1, "127.0.0.1:1", 16))
        .await
        .unwrap();
    let _stay = staying
        .register(InstanceInfo::new(2, "127.0.0.1:2", 16))
        .await
        .unwrap();
    listed(&mut rx, &[1, 2]).await;

    // A crash closes the worker's connection: gone long before the 30 s lease would expire.
    crash.abandon();
    listed(&mut rx, &[2]).await;

    // The registry restarts on the same address; the surviving worker registers again.
    drop(registry);
    let registry = bounded("rebinding the registry's port", async {
        loop {
            match RegistryServer::bind(addr, InProcessDiscovery::new(Duration::from_secs(30))).await
            {
                Ok(registry) => return registry,
                Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        }
    })
    .await;
    let mut rx = registry.discovery().watch();
    listed(&mut rx, &[2]).await;
}

#[tokio::test]
async fn a_registry_with_a_block_size_refuses_other_sizes_by_name() {
    let registry = RegistryServer::bind_with_block_size(
        "127.0.0.1:0",
        InProcessDiscovery::new(Duration::from_secs(5)),
        16,
    )
    .await
    .unwrap();
    let remote = RemoteDiscovery::new(
        registry.local_addr().to_string(),
        RemoteDiscoveryConfig::default(),
    );
    let refused = remote
        .register(InstanceInfo::new(4, "127.0.0.1:1", 32))
        .await
        .map(|_| ());
    match refused {
        Err(kvroute_runtime::DiscoveryError::InvalidInstance { id: 4, reason }) => assert!(
            reason.contains("kv_block_size 32 differs from the router's block size 16"),
            "{reason}"
        ),
        other => panic!("expected a refusal naming both block sizes, got {other:?}"),
    }
    assert!(registry.discovery().watch().borrow().is_empty());
    let _lease = remote
        .register(InstanceInfo::new(5, "127.0.0.1:2", 16))
        .await
        .expect("the router's block size is accepted");
    assert_eq!(
        registry
            .discovery()
            .watch()
            .borrow()
            .keys()
            .copied()
            .collect::<Vec<_>>(),
        vec![5]
    );
}

#[tokio::test]
async fn a_registry_refusing_engines_tells_an_engine_worker_why_and_lets_mock_workers_in() {
    let registry = kvroute_runtime::RegistryServer::bind_with_checks(
        "127.0.0.1:0",
        InProcessDiscovery::new(Duration::from_secs(5)),
        kvroute_runtime::RegistryChecks::default()
            .with_block_size(16)
            .refusing_engines("no tokenizer: pass --model NAME,tokenizer=PATH"),
    )
    .await
    .unwrap();
    let remote = RemoteDiscovery::new(
        registry.local_addr().to_string(),
        RemoteDiscoveryConfig::default(),
    );
    let mut engine = InstanceInfo::new(4, "127.0.0.1:1", 16);
    engine
        .metadata
        .insert("engine".to_owned(), "llamacpp".to_owned());
    match remote.register(engine).await.map(|_| ()) {
        Err(kvroute_runtime::DiscoveryError::InvalidInstance { id: 4, reason }) => {
            assert!(reason.contains("--model NAME,tokenizer="), "{reason}");
        }
        other => panic!("expected the engine worker refused, got {other:?}"),
    }
    assert!(registry.discovery().watch().borrow().is_empty());
    let _lease = remote
        .register(InstanceInfo::new(5, "127.0.0.1:2", 16))
        .await
        .expect("a worker without an engine is accepted");
    let mut mock = InstanceInfo::new(6, "127.0.0.1:3", 16);
    mock.metadata
        .insert("engine".to_owned(), "mocker".to_owned());
    let _mock = remote
        .register(mock)
        .await
        .expect("a simulated engine needs no tokenizer");
}
