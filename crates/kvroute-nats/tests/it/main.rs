//! kvroute-nats against a real `nats-server -js`, one throwaway server per test.

mod auth;
mod discovery;
mod event_plane;
mod sessions;
mod snapshots;

use std::time::Duration;

use kvroute_nats::{EventStreamConfig, Nats, NatsConfig, NatsEventPlane};
use kvroute_protocols::kv_events::{KvCacheEvent, KvCacheEventData, RouterEvent, StorageTier};

/// The longest any test waits for something to happen (far beyond what it takes).
const BOUND: Duration = Duration::from_secs(15);

fn run<F: std::future::Future<Output = ()>>(f: F) {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
        .block_on(f);
}

async fn connect(url: &str, name: &str) -> Nats {
    Nats::connect(
        &NatsConfig::new(url)
            .with_namespace("test")
            .with_client_name(name),
    )
    .await
    .unwrap()
}

/// Waits (up to [`BOUND`]) until `check` holds.
async fn eventually(what: &str, mut check: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + BOUND;
    while !check() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting: {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// An event plane on its own connection named `name`, with the default stream.
async fn plane(url: &str, name: &str) -> NatsEventPlane {
    NatsEventPlane::start(connect(url, name).await, &EventStreamConfig::default())
        .await
        .unwrap()
}

/// A `Cleared` event, numbered `event_id`, from `worker_id`.
fn cleared(worker_id: u64, event_id: u64) -> RouterEvent {
    RouterEvent {
        worker_id,
        storage_tier: StorageTier::Device,
        event: KvCacheEvent {
            event_id,
            data: KvCacheEventData::Cleared,
            dp_rank: 0,
        },
    }
}
