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
        plane.publish_now("a.*", Bytes::new()).is_err(),
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
