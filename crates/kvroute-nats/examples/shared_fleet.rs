//! Two routers and one worker sharing discovery and KV events through NATS.
//!
//! Starts a throwaway `nats-server -js` (it must be on PATH), registers a worker in the
//! discovery bucket, publishes two of its KV events to JetStream, and shows that a router
//! started before and one started after both list the worker and read both events.
//!
//! `cargo run -p kvroute-nats --example shared_fleet`

use std::time::Duration;

use futures::StreamExt;
use kvroute_nats::testing::NatsServer;
use kvroute_nats::{
    EventStreamConfig, Nats, NatsConfig, NatsDiscovery, NatsDiscoveryConfig, NatsEventPlane,
};
use kvroute_protocols::kv_events::{KvCacheEvent, KvCacheEventData, RouterEvent, StorageTier};
use kvroute_runtime::{
    Discovery, EventPlane, InstanceInfo, KV_EVENT_SUBJECT, decode_router_event, encode_router_event,
};

/// One process's view of the shared fleet.
async fn open(url: &str, name: &str) -> (NatsDiscovery, NatsEventPlane) {
    let nats = Nats::connect(&NatsConfig::new(url).with_client_name(name))
        .await
        .expect("connect");
    let discovery = NatsDiscovery::start(&nats, &NatsDiscoveryConfig::default())
        .await
        .expect("discovery");
    let plane = NatsEventPlane::start(nats, &EventStreamConfig::default())
        .await
        .expect("event stream");
    (discovery, plane)
}

/// The (worker, event id) of the next KV event on `subscription`.
async fn next_event(subscription: &mut kvroute_runtime::Subscription) -> (u64, u64) {
    let message = tokio::time::timeout(Duration::from_secs(10), subscription.next())
        .await
        .expect("an event within 10 s")
        .expect("an open subscription");
    let event = decode_router_event(&message.payload).expect("a KV event");
    (event.worker_id, event.event.event_id)
}

#[tokio::main]
async fn main() {
    let server = NatsServer::start();
    let url = server.url();
    let (_, early_plane) = open(&url, "router-early").await;
    let mut early = early_plane.subscribe(KV_EVENT_SUBJECT).await.unwrap();

    // The worker registers (no router address needed) and publishes two events.
    let (worker_discovery, worker_plane) = open(&url, "worker-7").await;
    let _lease = worker_discovery
        .register(InstanceInfo::new(7, "127.0.0.1:9007", 16))
        .await
        .expect("register");
    for event_id in 0..2 {
        let event = RouterEvent {
            worker_id: 7,
            storage_tier: StorageTier::Device,
            event: KvCacheEvent {
                event_id,
                data: KvCacheEventData::Cleared,
                dp_rank: 0,
            },
        };
        worker_plane
            .publish(KV_EVENT_SUBJECT, encode_router_event(&event))
            .await
            .unwrap();
    }

    let first = [next_event(&mut early).await, next_event(&mut early).await];
    println!("the early router read events {first:?}");
    assert_eq!(first, [(7, 0), (7, 1)]);

    // A router that starts now lists the worker at once and replays the stream.
    let (late_discovery, late_plane) = open(&url, "router-late").await;
    let listed: Vec<u64> = late_discovery.watch().borrow().keys().copied().collect();
    println!("the late router lists workers {listed:?}");
    assert_eq!(listed, [7]);
    let mut late = late_plane.subscribe(KV_EVENT_SUBJECT).await.unwrap();
    let replayed = [next_event(&mut late).await, next_event(&mut late).await];
    println!("the late router replayed events {replayed:?}");
    assert_eq!(replayed, first);
}
