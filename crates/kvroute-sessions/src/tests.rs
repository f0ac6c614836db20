//! Unit tests of the in-memory store in virtual time.

use std::time::Duration;

use kvroute_protocols::WorkerWithDpRank;

use crate::{AffinityBinding, AffinityKind, AffinityStore, InMemoryAffinityStore, StoreError};

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

fn binding(worker: u64, kind: AffinityKind) -> AffinityBinding {
    AffinityBinding {
        worker: WorkerWithDpRank::new(worker, 1),
        kind,
    }
}

#[test]
fn get_slides_the_ttl_and_peek_does_not() {
    let store = InMemoryAffinityStore::new(10);
    store
        .put("s", binding(1, AffinityKind::RouterOnly), secs(10), secs(0))
        .expect("room");
    // Refreshed at t=8: now lives until t=18.
    assert!(store.get("s", secs(8)).is_some());
    // Peeks at t=15 and t=17 do not extend it.
    assert!(store.peek("s", secs(15)).is_some());
    assert!(store.peek("s", secs(17)).is_some());
    assert_eq!(store.peek("s", secs(18)), None);
    assert_eq!(
        store.get("s", secs(18)),
        None,
        "get does not revive an expired binding"
    );
    let expired = store.expire(secs(18));
    assert_eq!(expired.len(), 1);
    assert_eq!(expired[0].session_id, "s");
    assert!(store.is_empty());
}

#[test]
fn expire_reports_each_binding_once() {
    let store = InMemoryAffinityStore::new(10);
    store
        .put(
            "a",
            binding(1, AffinityKind::EngineBacked),
            secs(5),
            secs(0),
        )
        .expect("room");
    store
        .put("b", binding(2, AffinityKind::RouterOnly), secs(50), secs(0))
        .expect("room");
    assert_eq!(store.expire(secs(4)), vec![]);
    let first = store.expire(secs(5));
    assert_eq!(
        first
            .iter()
            .map(|e| e.session_id.as_str())
            .collect::<Vec<_>>(),
        ["a"]
    );
    assert_eq!(store.expire(secs(6)), vec![]);
    assert_eq!(store.len(), 1);
}

#[test]
fn the_bound_refuses_new_sessions_but_not_rebinds() {
    let store = InMemoryAffinityStore::new(2);
    store
        .put("a", binding(1, AffinityKind::RouterOnly), secs(5), secs(0))
        .expect("room");
    store
        .put("b", binding(1, AffinityKind::RouterOnly), secs(5), secs(0))
        .expect("room");
    let err = store
        .put("c", binding(1, AffinityKind::RouterOnly), secs(5), secs(0))
        .expect_err("full");
    assert_eq!(err, StoreError::Full { max_sessions: 2 });
    assert_eq!(
        err.to_string(),
        "affinity store is full (2 sessions); expire or close sessions, or raise max_sessions"
    );
    let out = store
        .put(
            "a",
            binding(2, AffinityKind::EngineBacked),
            secs(5),
            secs(1),
        )
        .expect("rebind");
    assert_eq!(out.replaced, Some(binding(1, AffinityKind::RouterOnly)));
    store.remove("b");
    store
        .put("c", binding(1, AffinityKind::RouterOnly), secs(5), secs(0))
        .expect("room again");
}

#[test]
fn remove_if_token_spares_a_newer_binding() {
    let store = InMemoryAffinityStore::new(10);
    let old = store
        .put("s", binding(1, AffinityKind::RouterOnly), secs(5), secs(0))
        .expect("room");
    store
        .put("s", binding(2, AffinityKind::RouterOnly), secs(5), secs(0))
        .expect("room");
    assert!(!store.remove_if_token("s", old.token));
    assert_eq!(
        store.peek("s", secs(1)).map(|t| t.binding),
        Some(binding(2, AffinityKind::RouterOnly))
    );
}
