//! Discovery: registration, watching, leases, and the static fleet file.

use std::time::Duration;

use kvroute_runtime::{
    Discovery, DiscoveryError, DiscoveryEvent, InProcessDiscovery, InstanceInfo, StaticDiscovery,
    StaticFleetError, WorkerRole, diff_instances,
};

use crate::support::bounded;

#[tokio::test(start_paused = true)]
async fn watchers_see_registrations_and_deregistrations() {
    let discovery = InProcessDiscovery::new(Duration::from_secs(3));
    let mut watch = discovery.watch();
    let before = watch.borrow_and_update().clone();
    assert!(before.is_empty());
    let a = discovery
        .register(InstanceInfo::new(1, "127.0.0.1:1", 16))
        .await
        .unwrap();
    let b = discovery
        .register(
            InstanceInfo::new(2, "127.0.0.1:2", 16)
                .with_role(WorkerRole::Decode)
                .with_dp_size(4),
        )
        .await
        .unwrap();
    bounded("a change", watch.changed()).await.unwrap();
    let now = watch.borrow_and_update().clone();
    assert_eq!(now.keys().copied().collect::<Vec<_>>(), vec![1, 2]);
    assert_eq!(now[&2].dp_size, 4);
    let events = diff_instances(&before, &now);
    assert!(
        matches!(&events[..], [DiscoveryEvent::Added(x), DiscoveryEvent::Added(y)] if x.id == 1 && y.id == 2)
    );

    a.revoke();
    bounded("a change", watch.changed()).await.unwrap();
    let after = watch.borrow_and_update().clone();
    assert_eq!(
        diff_instances(&now, &after),
        vec![DiscoveryEvent::Removed(1)]
    );
    drop(b);
    assert!(
        discovery.watch().borrow().is_empty(),
        "dropping a lease deregisters at once"
    );
}

#[tokio::test(start_paused = true)]
async fn a_renewed_lease_survives_and_an_abandoned_one_expires() {
    let ttl = Duration::from_secs(3);
    let discovery = InProcessDiscovery::new(ttl);
    let live = discovery
        .register(InstanceInfo::new(1, "127.0.0.1:1", 16))
        .await
        .unwrap();
    let crashed = discovery
        .register(InstanceInfo::new(2, "127.0.0.1:2", 16))
        .await
        .unwrap();
    crashed.abandon();
    tokio::time::sleep(ttl * 2).await;
    let set = discovery.watch().borrow().clone();
    assert_eq!(
        set.keys().copied().collect::<Vec<_>>(),
        vec![1],
        "the crashed worker expired, the live one stayed"
    );
    tokio::time::sleep(ttl * 5).await;
    assert!(discovery.watch().borrow().contains_key(&1));
    drop(live);
}

#[tokio::test(start_paused = true)]
async fn bad_and_duplicate_registrations_are_refused() {
    let discovery = InProcessDiscovery::new(Duration::from_secs(3));
    let _a = discovery
        .register(InstanceInfo::new(1, "127.0.0.1:1", 16))
        .await
        .unwrap();
    match discovery
        .register(InstanceInfo::new(1, "127.0.0.1:9", 16))
        .await
    {
        Err(DiscoveryError::DuplicateId { id: 1, address }) => assert_eq!(address, "127.0.0.1:1"),
        other => panic!("expected DuplicateId, got {other:?}"),
    }
    match discovery
        .register(InstanceInfo::new(2, "127.0.0.1:2", 0))
        .await
    {
        Err(e @ DiscoveryError::InvalidInstance { .. }) => {
            assert!(e.to_string().contains("kv_block_size"))
        }
        other => panic!("expected InvalidInstance, got {other:?}"),
    }
}

const FLEET: &str = r#"
[[workers]]
id = 1
address = "10.0.0.1:7100"
kv_block_size = 16

[[workers]]
id = 2
address = "10.0.0.2:7100"
role = "prefill"
kv_block_size = 16
dp_size = 2
metadata = { model = "llama-3-8b" }
"#;

#[tokio::test]
async fn a_static_fleet_file_lists_its_workers() {
    let fleet = StaticDiscovery::from_toml_str(FLEET).unwrap();
    let set = fleet.watch().borrow().clone();
    assert_eq!(set[&1].role, WorkerRole::Aggregated);
    assert_eq!(set[&1].dp_size, 1);
    assert_eq!(set[&2].role, WorkerRole::Prefill);
    assert_eq!(set[&2].metadata["model"], "llama-3-8b");
    assert!(
        fleet.register(set[&2].clone()).await.is_ok(),
        "a listed worker may register"
    );
    assert!(matches!(
        fleet.register(InstanceInfo::new(3, "10.0.0.3:1", 16)).await,
        Err(DiscoveryError::ReadOnly)
    ));

    let json = r#"{"workers": [{"id": 4, "address": "127.0.0.1:1", "kv_block_size": 32, "role": "decode"}]}"#;
    let fleet = StaticDiscovery::from_json_str(json).unwrap();
    assert_eq!(fleet.instances()[&4].role, WorkerRole::Decode);

    let dir = std::env::temp_dir().join(format!("kvroute-fleet-{}.toml", std::process::id()));
    std::fs::write(&dir, FLEET).unwrap();
    assert_eq!(
        StaticDiscovery::from_file(&dir).unwrap().instances().len(),
        2
    );
    std::fs::remove_file(&dir).unwrap();
}

#[test]
fn a_bad_fleet_file_names_the_problem() {
    let check = |text: &str, expect: &str| {
        let error = StaticDiscovery::from_toml_str(text)
            .unwrap_err()
            .to_string();
        assert!(
            error.contains(expect),
            "{error:?} should mention {expect:?}"
        );
    };
    check(
        "[[workers]]\nid = 1\naddress = \"a:1\"\nkv_block_size = 16\n[[workers]]\nid = 1\naddress = \"b:1\"\nkv_block_size = 16\n",
        "already registered",
    );
    check(
        "[[workers]]\nid = 1\naddress = \"a:1\"\nkv_block_size = 16\nrole = \"leader\"\n",
        "leader",
    );
    check("[[workers]]\nid = 1\naddress = \"a:1\"\n", "kv_block_size");
    check(
        "[[workers]]\nid = 1\naddress = \"a:1\"\nkv_block_size = 16\ndp_size = 0\n",
        "dp_size",
    );
    check(
        "[[workers]]\nid = 1\naddress = \"a:1\"\nkv_block_size = 16\n[extra]\n",
        "extra",
    );
    assert!(matches!(
        StaticDiscovery::from_file("/nonexistent/fleet.toml"),
        Err(StaticFleetError::Io { .. })
    ));
}
