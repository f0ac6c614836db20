//! KV events through JetStream: per-worker subjects, replay for late subscribers, idempotent
//! re-publishing; other subjects through NATS core.

use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use kvroute_nats::testing::NatsServer;
use kvroute_runtime::{EventPlane, KV_EVENT_SUBJECT, decode_router_event, encode_router_event};

use crate::{BOUND, cleared, eventually, plane, run};

async fn next_events(
    subscription: &mut kvroute_runtime::Subscription,
    n: usize,
) -> Vec<(u64, u64)> {
    let mut got = Vec::new();
    while got.len() < n {
        let message = tokio::time::timeout(BOUND, subscription.next())
            .await
            .expect("a KV event within the bound")
            .expect("the subscription stays open");
        assert_eq!(&*message.subject, KV_EVENT_SUBJECT);
        let event = decode_router_event(&message.payload).unwrap();
        got.push((event.worker_id, event.event.event_id));
    }
    got
}

#[test]
fn kv_events_reach_every_router_in_order_and_a_late_router_replays_them() {
    let server = NatsServer::start();
    run(async {
        let worker = plane(&server.url(), "worker").await;
        let early = plane(&server.url(), "router-a").await;
        let mut live = early.subscribe(KV_EVENT_SUBJECT).await.unwrap();
        for id in 0..50 {
            worker
                .publish(KV_EVENT_SUBJECT, encode_router_event(&cleared(7, id)))
                .await
                .unwrap();
            worker
                .publish(KV_EVENT_SUBJECT, encode_router_event(&cleared(8, id)))
                .await
                .unwrap();
        }
        let got = next_events(&mut live, 100).await;
        let of = |w: u64| -> Vec<u64> {
            got.iter()
                .filter(|(x, _)| *x == w)
                .map(|(_, id)| *id)
                .collect()
        };
        let expected: Vec<u64> = (0..50).collect();
        assert_eq!(of(7), expected, "worker 7's events in order");
        assert_eq!(of(8), expected, "worker 8's events in order");
        // A router that starts now replays the stream from its oldest event.
        let late = plane(&server.url(), "router-b").await;
        let mut replay = late.subscribe(KV_EVENT_SUBJECT).await.unwrap();
        let replayed = next_events(&mut replay, 100).await;
        assert_eq!(replayed, got, "the late router sees the same stream");
        assert_eq!(worker.published(), 100);
    });
}

#[test]
fn a_re_published_event_is_stored_once() {
    let server = NatsServer::start();
    run(async {
        let worker = plane(&server.url(), "worker").await;
        for id in [0, 1, 1, 2, 2, 2, 3] {
            worker
                .publish(KV_EVENT_SUBJECT, encode_router_event(&cleared(3, id)))
                .await
                .unwrap();
        }
        eventually("the three duplicates are acknowledged as such", || {
            worker.duplicates() == 3
        })
        .await;
        let mut replay = worker.subscribe(KV_EVENT_SUBJECT).await.unwrap();
        let got = next_events(&mut replay, 4).await;
        assert_eq!(got, vec![(3, 0), (3, 1), (3, 2), (3, 3)]);
        // Nothing more is pending: a fifth message would be a duplicate stored twice.
        let more = tokio::time::timeout(std::time::Duration::from_millis(300), replay.next()).await;
        assert!(more.is_err(), "no duplicate was stored: {more:?}");
        assert_eq!(worker.publish_failures(), 0);
    });
}

#[test]
fn other_subjects_are_plain_publish_subscribe_and_bad_input_is_refused() {
    let server = NatsServer::start();
    run(async {
        let a = plane(&server.url(), "a").await;
        let b = plane(&server.url(), "b").await;
        let mut load = b.subscribe("load.*").await.unwrap();
        // NATS core delivers only to subscriptions the server already holds, and b's SUB and a's
        // PUB travel on two connections: probe until b hears a, so the messages below cannot
        // race the subscription (with other tests' servers busy, they lost it one run in seven).
        let deadline = tokio::time::Instant::now() + BOUND;
        loop {
            a.publish("load.probe", Bytes::new()).await.unwrap();
            a.nats().flush().await.unwrap();
            match tokio::time::timeout(Duration::from_millis(100), load.next()).await {
                Ok(Some(message)) => {
                    assert_eq!(&*message.subject, "load.probe");
                    break;
                }
                Ok(None) => panic!("b's subscription ended"),
                Err(_) => assert!(
                    tokio::time::Instant::now() < deadline,
                    "b never received a's probe"
                ),
            }
        }
        a.publish("load.r1", Bytes::from_static(b"one"))
            .await
            .unwrap();
        a.publish("other.r1", Bytes::from_static(b"not for b"))
            .await
            .unwrap();
        a.publish("load.r2", Bytes::from_static(b"two"))
            .await
            .unwrap();
        // The next two messages that are not late probes.
        let mut received = Vec::new();
        while received.len() < 2 {
            let message = tokio::time::timeout(BOUND, load.next())
                .await
                .unwrap()
                .unwrap();
            if &*message.subject != "load.probe" {
                received.push(message);
            }
        }
        let (first, second) = (&received[0], &received[1]);
        assert_eq!(
            (&*first.subject, &first.payload[..]),
            ("load.r1", &b"one"[..])
        );
        assert_eq!(
            (&*second.subject, &second.payload[..]),
            ("load.r2", &b"two"[..])
        );
        assert!(a.publish("load.*", Bytes::new()).await.is_err());
        assert!(a.subscribe("a..b").await.is_err());
        let not_an_event = a
            .publish(KV_EVENT_SUBJECT, Bytes::from_static(b"{}"))
            .await
            .unwrap_err();
        assert!(
            not_an_event.to_string().contains("RouterEvent"),
            "{not_an_event}"
        );
    });
}

#[test]
fn thousands_of_events_from_many_workers_reach_every_router_without_a_stall() {
    let server = NatsServer::start();
    run(async {
        let (workers, routers, n) = (8u64, 3usize, 1000u64);
        let mut subscriptions = Vec::new();
        for r in 0..routers {
            let plane = plane(&server.url(), &format!("r{r}")).await;
            subscriptions.push((plane.subscribe(KV_EVENT_SUBJECT).await.unwrap(), plane));
        }
        let mut publishers = Vec::new();
        for w in 0..workers {
            let plane = plane(&server.url(), &format!("w{w}")).await;
            publishers.push(tokio::spawn(async move {
                for id in 0..n {
                    plane
                        .publish(KV_EVENT_SUBJECT, encode_router_event(&cleared(w, id)))
                        .await
                        .unwrap();
                }
                assert!(plane.settle(BOUND).await, "every event acknowledged");
                assert_eq!((plane.published(), plane.publish_failures()), (n, 0));
            }));
        }
        for p in publishers {
            p.await.unwrap();
        }
        for (subscription, _plane) in &mut subscriptions {
            let got = next_events(subscription, (workers * n) as usize).await;
            for w in 0..workers {
                let ids: Vec<u64> = got
                    .iter()
                    .filter(|(x, _)| *x == w)
                    .map(|(_, id)| *id)
                    .collect();
                assert_eq!(ids, (0..n).collect::<Vec<_>>(), "worker {w}");
            }
        }
    });
}
