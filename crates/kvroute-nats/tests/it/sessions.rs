//! Sticky-session bindings shared through a KV bucket: visible to every replica, refreshed
//! across replicas, removed everywhere, and reported expired only by their last writer.

use std::time::Duration;

use kvroute_nats::testing::NatsServer;
use kvroute_nats::{NatsAffinityStore, NatsAffinityStoreConfig};
use kvroute_protocols::WorkerWithDpRank;
use kvroute_sessions::{AffinityBinding, AffinityKind, AffinityStore};

use crate::{BOUND, connect, run};

fn binding(worker: u64) -> AffinityBinding {
    AffinityBinding {
        worker: WorkerWithDpRank::from_worker_id(worker),
        kind: AffinityKind::EngineBacked,
    }
}

async fn store(url: &str, origin: u64) -> NatsAffinityStore {
    NatsAffinityStore::start(
        &connect(url, &format!("router-{origin}")).await,
        &NatsAffinityStoreConfig::new(origin),
    )
    .await
    .unwrap()
}

/// Polls `check` with the replica's clock `now` until it holds (bounded).
async fn until(what: &str, mut check: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + BOUND;
    while !check() {
        assert!(tokio::time::Instant::now() < deadline, "timed out: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[test]
fn a_binding_made_on_one_replica_is_honoured_and_removed_on_the_others() {
    let server = NatsServer::start();
    run(async {
        let a = store(&server.url(), 1).await;
        let b = store(&server.url(), 2).await;
        let c = store(&server.url(), 3).await;
        let ttl = Duration::from_secs(60);
        let now = Duration::from_secs(1);
        a.put("conv-1", binding(4), ttl, now).unwrap();
        until("b sees the binding", || {
            b.peek("conv-1", now).map(|t| t.binding) == Some(binding(4))
        })
        .await;
        until("c sees the binding", || {
            c.get("conv-1", now).map(|t| t.binding) == Some(binding(4))
        })
        .await;
        // A re-bind elsewhere wins everywhere (last writer wins).
        c.put("conv-1", binding(5), ttl, now).unwrap();
        for (name, replica) in [("a", &a), ("b", &b)] {
            until(&format!("{name} sees the re-bind"), || {
                replica.peek("conv-1", now).map(|t| t.binding) == Some(binding(5))
            })
            .await;
        }
        assert_eq!(b.remove("conv-1"), Some(binding(5)));
        until("the removal reaches a and c", || {
            a.peek("conv-1", now).is_none() && c.peek("conv-1", now).is_none()
        })
        .await;
        assert!(a.remote_applied() >= 2 && a.write_failures() == 0);
    });
}

#[test]
fn only_the_last_writer_reports_an_expired_binding() {
    let server = NatsServer::start();
    run(async {
        let a = store(&server.url(), 1).await;
        let b = store(&server.url(), 2).await;
        let ttl = Duration::from_secs(8);
        let start = Duration::from_secs(10);
        a.put("conv-2", binding(3), ttl, start).unwrap();
        until("b mirrors it", || b.peek("conv-2", start).is_some()).await;
        // Both replicas' clocks pass the TTL: the writer reports it (its engine session must be
        // closed once), the mirror drops it silently.
        let later = start + Duration::from_secs(30);
        let from_a = a.expire(later);
        let from_b = b.expire(later);
        assert_eq!(from_a.len(), 1, "{from_a:?}");
        assert_eq!(from_a[0].binding, binding(3));
        assert!(from_b.is_empty(), "{from_b:?}");
        assert!(a.is_empty() && b.is_empty());
    });
}

#[test]
fn a_binding_written_while_nats_is_down_reaches_the_others_when_it_returns() {
    let mut server = NatsServer::start();
    run(async {
        let a = store(&server.url(), 1).await;
        let b = store(&server.url(), 2).await;
        let ttl = Duration::from_secs(60);
        let now = Duration::from_secs(1);
        server.stop();
        // The router keeps serving the session from its own mirror meanwhile.
        a.put("during-outage", binding(7), ttl, now).unwrap();
        assert_eq!(
            a.peek("during-outage", now).map(|t| t.binding),
            Some(binding(7))
        );
        until("the write fails while NATS is down", || {
            a.write_failures() > 0
        })
        .await;
        server.restart();
        until("b sees the binding once NATS is back", || {
            b.peek("during-outage", now).map(|t| t.binding) == Some(binding(7))
        })
        .await;
        assert!(a.resent() >= 1, "resent {}", a.resent());
    });
}
