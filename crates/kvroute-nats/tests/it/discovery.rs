//! Registrations in a KV bucket: visible to every router, unique ids, leases that lapse.

use std::time::Duration;

use kvroute_nats::testing::NatsServer;
use kvroute_nats::{NatsDiscovery, NatsDiscoveryConfig};
use kvroute_runtime::{Discovery, DiscoveryError, InstanceInfo};

use crate::{connect, eventually, run};

fn config(ttl_ms: u64) -> NatsDiscoveryConfig {
    NatsDiscoveryConfig {
        lease_ttl: Duration::from_millis(ttl_ms),
    }
}

#[test]
fn a_registration_is_seen_by_every_router_and_its_revocation_too() {
    let server = NatsServer::start();
    run(async {
        let worker = NatsDiscovery::start(&connect(&server.url(), "worker").await, &config(3000))
            .await
            .unwrap();
        let router = NatsDiscovery::start(&connect(&server.url(), "router").await, &config(3000))
            .await
            .unwrap();
        let watch = router.watch();
        let lease = worker
            .register(InstanceInfo::new(11, "127.0.0.1:9011", 16))
            .await
            .unwrap();
        eventually("the router lists worker 11", || {
            watch.borrow().get(&11).map(|i| i.address.as_str()) == Some("127.0.0.1:9011")
        })
        .await;
        // Renewals keep it listed well past the TTL.
        tokio::time::sleep(Duration::from_millis(4000)).await;
        assert!(
            watch.borrow().contains_key(&11),
            "renewed leases stay listed"
        );
        // A router that starts now lists it at once.
        let late = NatsDiscovery::start(&connect(&server.url(), "late").await, &config(3000))
            .await
            .unwrap();
        assert!(late.watch().borrow().contains_key(&11));
        lease.revoke();
        eventually("revocation reaches the router", || {
            !watch.borrow().contains_key(&11)
        })
        .await;
    });
}

#[test]
fn a_duplicate_id_is_refused_naming_the_holder_and_bad_instances_are_invalid() {
    let server = NatsServer::start();
    run(async {
        let discovery = NatsDiscovery::start(&connect(&server.url(), "w").await, &config(3000))
            .await
            .unwrap();
        let _lease = discovery
            .register(InstanceInfo::new(5, "127.0.0.1:9005", 16))
            .await
            .unwrap();
        let error = discovery
            .register(InstanceInfo::new(5, "127.0.0.1:9999", 16))
            .await
            .unwrap_err();
        assert!(
            matches!(&error, DiscoveryError::DuplicateId { id: 5, address } if address == "127.0.0.1:9005"),
            "{error}"
        );
        let invalid = discovery
            .register(InstanceInfo::new(6, "", 16))
            .await
            .unwrap_err();
        assert!(
            matches!(invalid, DiscoveryError::InvalidInstance { .. }),
            "{invalid}"
        );
    });
}

#[test]
fn a_killed_worker_disappears_within_the_lease_ttl() {
    let server = NatsServer::start();
    run(async {
        let ttl = Duration::from_millis(1200);
        let worker = NatsDiscovery::start(&connect(&server.url(), "w").await, &config(1200))
            .await
            .unwrap();
        let router = NatsDiscovery::start(&connect(&server.url(), "r").await, &config(1200))
            .await
            .unwrap();
        let watch = router.watch();
        let lease = worker
            .register(InstanceInfo::new(21, "127.0.0.1:9021", 16))
            .await
            .unwrap();
        eventually("listed", || watch.borrow().contains_key(&21)).await;
        let killed = tokio::time::Instant::now();
        lease.abandon();
        eventually("the lapsed registration is dropped", || {
            !watch.borrow().contains_key(&21)
        })
        .await;
        let took = killed.elapsed();
        // The TTL plus one reaper tick (a quarter of it), with room for a loaded machine (the
        // server drops the key itself, silently, so only the watcher's reaping removes it).
        assert!(
            took <= ttl * 3,
            "dropped {took:?} after the last renewal could have happened; TTL {ttl:?}"
        );
    });
}
