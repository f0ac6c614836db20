//! The routers' shared index snapshot (a JetStream object) and resuming the KV event stream
//! after the position a snapshot reflects.

use bytes::Bytes;
use futures::StreamExt;
use kvroute_nats::NatsSnapshotStore;
use kvroute_nats::testing::NatsServer;
use kvroute_runtime::{
    EventPlane, EventPlaneError, KV_EVENT_SUBJECT, SnapshotStore, decode_router_event,
    encode_router_event,
};

use crate::{BOUND, cleared, connect, plane, run};

#[test]
fn a_snapshot_is_saved_replaced_and_loaded_whole_by_another_router() {
    let server = NatsServer::start();
    run(async {
        let a = NatsSnapshotStore::start(&connect(&server.url(), "a").await, "aggregated")
            .await
            .unwrap();
        let b = NatsSnapshotStore::start(&connect(&server.url(), "b").await, "aggregated")
            .await
            .unwrap();
        let other = NatsSnapshotStore::start(&connect(&server.url(), "c").await, "prefill")
            .await
            .unwrap();
        assert_eq!(b.load().await.unwrap(), None);
        assert_eq!(b.age().await.unwrap(), None);
        // Several chunks' worth, with a pattern that catches reordering.
        let big: Bytes = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
        a.save(big.clone()).await.unwrap();
        assert_eq!(b.load().await.unwrap(), Some(big));
        let age = b.age().await.unwrap().expect("an age once saved");
        assert!(age < BOUND, "{age:?}");
        // A newer snapshot replaces it; another name is another slot.
        a.save(Bytes::from_static(b"newer")).await.unwrap();
        assert_eq!(b.load().await.unwrap(), Some(Bytes::from_static(b"newer")));
        assert_eq!(other.load().await.unwrap(), None);
    });
}

#[test]
fn a_subscription_resumes_after_a_stream_position() {
    let server = NatsServer::start();
    run(async {
        let worker = plane(&server.url(), "worker").await;
        for id in 0..40 {
            worker
                .publish(KV_EVENT_SUBJECT, encode_router_event(&cleared(3, id)))
                .await
                .unwrap();
        }
        assert!(worker.settle(BOUND).await);
        assert!(worker.keeps_history());
        let router = plane(&server.url(), "router").await;
        let mut all = router.subscribe(KV_EVENT_SUBJECT).await.unwrap();
        let mut positions = Vec::new();
        for _ in 0..40 {
            let message = tokio::time::timeout(BOUND, all.next())
                .await
                .expect("an event within the bound")
                .unwrap();
            let id = decode_router_event(&message.payload)
                .unwrap()
                .event
                .event_id;
            positions.push((message.sequence.expect("JetStream positions"), id));
        }
        let (after, last_seen) = positions[24];
        let mut resumed = router
            .subscribe_after(KV_EVENT_SUBJECT, after)
            .await
            .unwrap();
        let message = tokio::time::timeout(BOUND, resumed.next())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            decode_router_event(&message.payload)
                .unwrap()
                .event
                .event_id,
            last_seen + 1,
            "resumes with the event after the position"
        );
        assert_eq!(message.sequence, Some(after + 1));
        // Only the KV event stream keeps history.
        let refused = router.subscribe_after("load.*", 1).await;
        assert!(matches!(refused, Err(EventPlaneError::Unsupported { .. })));
        // A position past the end waits for the events still to come.
        let end = positions.last().unwrap().0;
        let mut tail = router.subscribe_after(KV_EVENT_SUBJECT, end).await.unwrap();
        worker
            .publish(KV_EVENT_SUBJECT, encode_router_event(&cleared(3, 40)))
            .await
            .unwrap();
        let message = tokio::time::timeout(BOUND, tail.next())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            decode_router_event(&message.payload)
                .unwrap()
                .event
                .event_id,
            40
        );
    });
}
