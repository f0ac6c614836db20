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
        // The holder answers at its address: a true duplicate.
        let holder = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let holder = holder.local_addr().unwrap().to_string();
        let _lease = discovery
            .register(InstanceInfo::new(5, holder.clone(), 16))
            .await
            .unwrap();
        let error = discovery
            .register(InstanceInfo::new(5, "127.0.0.1:9999", 16))
            .await
            .unwrap_err();
        assert!(
            matches!(&error, DiscoveryError::DuplicateId { id: 5, address } if *address == holder),
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

/// An address on which nothing listens (bound, then released).
fn dead_address() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().to_string()
}

#[test]
fn a_crashed_worker_restarted_with_the_same_id_takes_over_its_dead_lease() {
    let server = NatsServer::start();
    run(async {
        // A long TTL: waiting for the old lease to lapse would take 20 s.
        let ttl = config(10_000);
        let router = NatsDiscovery::start(&connect(&server.url(), "r").await, &ttl)
            .await
            .unwrap();
        let watch = router.watch();
        let crashed = NatsDiscovery::start(&connect(&server.url(), "old").await, &ttl)
            .await
            .unwrap();
        let restarted = NatsDiscovery::start(&connect(&server.url(), "new").await, &ttl)
            .await
            .unwrap();
        let same = dead_address();
        let other = dead_address();
        // Restarted on the same address (the new process holds it, so the old one is dead),
        // then on another one where the old process no longer answers.
        for (old, new) in [(&same, &same), (&same, &other)] {
            crashed
                .register(InstanceInfo::new(1, old.clone(), 16))
                .await
                .unwrap()
                .abandon();
            let started = tokio::time::Instant::now();
            let lease = restarted
                .register(InstanceInfo::new(1, new.clone(), 16))
                .await
                .unwrap_or_else(|e| panic!("restart at {new} after a crash at {old}: {e}"));
            assert!(
                started.elapsed() < Duration::from_secs(3),
                "took over at once, not after the lease lapsed: {:?}",
                started.elapsed()
            );
            eventually("the router lists the restarted worker", || {
                watch.borrow().get(&1).map(|i| i.address.as_str()) == Some(new.as_str())
            })
            .await;
            lease.abandon();
        }
    });
}

#[test]
fn a_worker_whose_registration_was_taken_over_stops_renewing_it() {
    let server = NatsServer::start();
    run(async {
        let ttl = config(900);
        let router = NatsDiscovery::start(&connect(&server.url(), "r").await, &ttl)
            .await
            .unwrap();
        let watch = router.watch();
        let old = NatsDiscovery::start(&connect(&server.url(), "old").await, &ttl)
            .await
            .unwrap();
        let new = NatsDiscovery::start(&connect(&server.url(), "new").await, &ttl)
            .await
            .unwrap();
        // The old process still renews but does not answer at its address (hung, or cut off).
        let (old_address, new_address) = (dead_address(), dead_address());
        let _old_lease = old
            .register(InstanceInfo::new(2, old_address, 16))
            .await
            .unwrap();
        let _new_lease = new
            .register(InstanceInfo::new(2, new_address.clone(), 16))
            .await
            .unwrap();
        // Several renewal periods: a renewal that overwrote the new registration would show.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(3);
        let mut seen = Vec::new();
        while tokio::time::Instant::now() < deadline {
            let address = watch.borrow().get(&2).map(|i| i.address.clone());
            if seen.last() != Some(&address) {
                seen.push(address);
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(
            seen.last(),
            Some(&Some(new_address.clone())),
            "the registration stays the new process's: {seen:?}"
        );
        assert!(
            seen.len() <= 2,
            "the old process must not take the key back: {seen:?}"
        );
    });
}

#[test]
fn revoking_a_lease_that_was_taken_over_leaves_the_new_registration() {
    let server = NatsServer::start();
    run(async {
        let ttl = config(3000);
        let discovery = NatsDiscovery::start(&connect(&server.url(), "w").await, &ttl)
            .await
            .unwrap();
        let router = NatsDiscovery::start(&connect(&server.url(), "r").await, &ttl)
            .await
            .unwrap();
        let watch = router.watch();
        let old = discovery
            .register(InstanceInfo::new(3, dead_address(), 16))
            .await
            .unwrap();
        let address = dead_address();
        let _new = discovery
            .register(InstanceInfo::new(3, address.clone(), 16))
            .await
            .unwrap();
        eventually("the new registration is listed", || {
            watch.borrow().get(&3).map(|i| i.address.as_str()) == Some(address.as_str())
        })
        .await;
        old.revoke();
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(
            watch.borrow().get(&3).map(|i| i.address.clone()),
            Some(address),
            "the old lease's revocation must not delete the new registration"
        );
    });
}
