use futures::StreamExt;

use super::*;

fn check(pattern: &str, subject: &str, expect: bool) {
    let pattern: Vec<String> = tokens(pattern, true)
        .unwrap()
        .into_iter()
        .map(str::to_owned)
        .collect();
    let subject = tokens(subject, false).unwrap();
    assert_eq!(
        matches(&pattern, &subject),
        expect,
        "{pattern:?} vs {subject:?}"
    );
}

#[test]
fn patterns_match_like_nats() {
    check("kv_events", "kv_events", true);
    check("kv_events", "kv_events.1", false);
    check("kv_events.*", "kv_events.1", true);
    check("kv_events.*", "kv_events.1.2", false);
    check("kv_events.>", "kv_events.1.2", true);
    check("kv_events.>", "kv_events", false);
    check("*.1", "kv_events.1", true);
    check(">", "a.b.c", true);
    check("a.*.c", "a.b.d", false);
}

#[test]
fn malformed_subjects_are_refused() {
    let plane = InProcessEventPlane::default();
    for bad in ["", "a..b", "a.>.b", "a b"] {
        assert!(plane.subscribe_now(bad).is_err(), "pattern {bad:?}");
    }
    assert!(
        plane.publish_now("a.*", Bytes::new(), None).is_err(),
        "wildcards are not subjects"
    );
}

#[tokio::test]
async fn subscribers_get_matching_messages_in_order() {
    let plane = InProcessEventPlane::new(16);
    let mut all = plane.subscribe("kv.>").await.unwrap();
    let mut one = plane.subscribe("kv.1").await.unwrap();
    for (subject, byte) in [("kv.1", 1u8), ("kv.2", 2), ("other", 3), ("kv.1", 4)] {
        plane
            .publish(subject, Bytes::from(vec![byte]))
            .await
            .unwrap();
    }
    drop(plane);
    let all: Vec<u8> = all.by_ref().map(|m| m.payload[0]).collect().await;
    let one: Vec<(String, u8)> = one
        .by_ref()
        .map(|m| (m.subject.to_string(), m.payload[0]))
        .collect()
        .await;
    assert_eq!(all, vec![1, 2, 4]);
    assert_eq!(one, vec![("kv.1".to_owned(), 1), ("kv.1".to_owned(), 4)]);
}

#[tokio::test]
async fn a_lagging_subscriber_loses_old_messages_but_keeps_going() {
    let plane = InProcessEventPlane::new(2);
    let mut sub = plane.subscribe("s").await.unwrap();
    for byte in 0..5u8 {
        plane.publish("s", Bytes::from(vec![byte])).await.unwrap();
    }
    drop(plane);
    let got: Vec<u8> = sub.by_ref().map(|m| m.payload[0]).collect().await;
    assert_eq!(got, vec![3, 4]);
}

fn removed(worker_id: u64, event_id: u64) -> RouterEvent {
    use kvroute_protocols::kv_events::{
        ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheRemoveData, StorageTier,
    };
    RouterEvent {
        worker_id,
        storage_tier: StorageTier::Device,
        event: KvCacheEvent {
            event_id,
            data: KvCacheEventData::Removed(KvCacheRemoveData {
                block_hashes: vec![ExternalSequenceBlockHash(7), ExternalSequenceBlockHash(9)],
            }),
            dp_rank: 0,
        },
    }
}

#[tokio::test]
async fn the_in_process_plane_hands_kv_events_over_without_encoding_them() {
    let plane = InProcessEventPlane::new(16);
    let mut kv = plane.subscribe(crate::KV_EVENT_SUBJECT).await.unwrap();
    let mut all = plane.subscribe(">").await.unwrap();
    plane.publish_router_event(removed(3, 1)).await.unwrap();
    // One a remote publisher encoded reads the same way.
    plane
        .publish(crate::KV_EVENT_SUBJECT, encode_router_event(&removed(3, 2)))
        .await
        .unwrap();
    drop(plane);
    let kv: Vec<Message> = kv.by_ref().collect().await;
    let all: Vec<Message> = all.by_ref().collect().await;
    assert_eq!(kv, all);
    assert_eq!(kv.len(), 2);
    assert!(kv[0].payload.is_empty() && kv[0].event.is_some());
    assert!(kv[1].event.is_none());
    assert_eq!(kv[0].router_event().unwrap(), removed(3, 1));
    assert_eq!(kv[1].router_event().unwrap(), removed(3, 2));
    assert_eq!(&*kv[0].subject, crate::KV_EVENT_SUBJECT);
}

/// A plane that only moves bytes: the trait's own `publish_router_event` encodes.
struct Bytewise(InProcessEventPlane);

impl EventPlane for Bytewise {
    fn publish<'a>(
        &'a self,
        subject: &'a str,
        payload: Bytes,
    ) -> BoxFuture<'a, Result<(), EventPlaneError>> {
        self.0.publish(subject, payload)
    }

    fn subscribe<'a>(
        &'a self,
        pattern: &'a str,
    ) -> BoxFuture<'a, Result<Subscription, EventPlaneError>> {
        self.0.subscribe(pattern)
    }
}

#[tokio::test]
async fn a_plane_that_moves_bytes_gets_kv_events_encoded() {
    let plane = Bytewise(InProcessEventPlane::new(4));
    let mut kv = plane.subscribe(crate::KV_EVENT_SUBJECT).await.unwrap();
    plane.publish_router_event(removed(5, 8)).await.unwrap();
    drop(plane);
    let message = kv.next().await.unwrap();
    assert!(message.event.is_none());
    assert_eq!(
        decode_router_event(&message.payload).unwrap(),
        removed(5, 8)
    );
}
