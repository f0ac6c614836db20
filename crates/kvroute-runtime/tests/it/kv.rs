//! KV events: numbered publishing, a late-joining router's rebuild from the dump, and gap
//! recovery from the worker's ring.

use std::collections::BTreeSet;
use std::sync::Arc;

use futures::StreamExt;
use kvroute_protocols::kv_events::{
    ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheRemoveData, KvCacheStoreData,
    KvCacheStoredBlockData, LocalBlockHash, RouterEvent,
};
use kvroute_runtime::{
    EventPlane, InProcessEventPlane, KV_EVENT_SUBJECT, KvEventPublisher, RequestError,
    WorkerServerConfig,
};

use crate::support::{TestEngine, bounded, connect, start_worker_with};

fn stored(hash: u64) -> KvCacheEventData {
    KvCacheEventData::Stored(KvCacheStoreData {
        parent_hash: None,
        blocks: vec![KvCacheStoredBlockData {
            block_hash: ExternalSequenceBlockHash(hash),
            tokens_hash: LocalBlockHash(hash * 10),
        }],
    })
}

fn removed(hash: u64) -> KvCacheEventData {
    KvCacheEventData::Removed(KvCacheRemoveData {
        block_hashes: vec![ExternalSequenceBlockHash(hash)],
    })
}

/// The router's view of one worker: the set of cached engine block hashes.
#[derive(Default)]
struct View {
    blocks: BTreeSet<u64>,
    last_id: Option<u64>,
}

impl View {
    /// Applies an event idempotently (a dump may already reflect events after its id).
    fn apply(&mut self, event: &RouterEvent) {
        match &event.event.data {
            KvCacheEventData::Stored(s) => {
                self.blocks.extend(s.blocks.iter().map(|b| b.block_hash.0))
            }
            KvCacheEventData::Removed(r) => r.block_hashes.iter().for_each(|h| {
                self.blocks.remove(&h.0);
            }),
            KvCacheEventData::Cleared => self.blocks.clear(),
        }
    }
}

/// An engine stand-in: applies each operation to its block set, publishes it, and keeps its dump
/// current.
fn engine_step(
    engine: &TestEngine,
    publisher: &KvEventPublisher,
    blocks: &mut BTreeSet<u64>,
    step: u64,
) {
    let hash = step % 13;
    let data = if blocks.contains(&hash) {
        blocks.remove(&hash);
        removed(hash)
    } else {
        blocks.insert(hash);
        stored(hash)
    };
    publisher.publish(0, data);
    *engine.dump.lock() = blocks
        .iter()
        .map(|h| KvCacheEvent {
            event_id: 0,
            data: stored(*h),
            dp_rank: 0,
        })
        .collect();
}

#[tokio::test]
async fn a_late_router_rebuilds_from_the_dump_and_fills_a_gap_from_the_ring() {
    let plane = Arc::new(InProcessEventPlane::default());
    let publisher = KvEventPublisher::with_event_plane(5, 8, plane.clone());
    let (server, engine) =
        start_worker_with(WorkerServerConfig::new(5).with_kv_events(publisher.clone())).await;
    let client = connect(&server).await;
    let mut truth = BTreeSet::new();
    for step in 0..20 {
        engine_step(&engine, &publisher, &mut truth, step);
    }

    // The router joins late: subscribe first, then dump, so nothing falls between the two.
    let mut events = plane.subscribe(KV_EVENT_SUBJECT).await.unwrap();
    let dump = client.kv_dump().await.expect("dump");
    assert_eq!(dump.last_event_id, Some(19));
    assert!(
        dump.events
            .iter()
            .all(|e| e.worker_id == 5 && e.event.event_id == 19)
    );
    let mut view = View {
        last_id: dump.last_event_id,
        ..View::default()
    };
    dump.events.iter().for_each(|e| view.apply(e));
    assert_eq!(
        view.blocks, truth,
        "the dump alone rebuilds the worker's state"
    );

    for step in 20..30 {
        engine_step(&engine, &publisher, &mut truth, step);
    }
    // Three events are lost on the way (ids 22..=24); the router notices the jump and asks.
    let mut lost = 0;
    while view.last_id != Some(29) {
        let message = bounded("the next event", events.next())
            .await
            .expect("subscription open");
        let event = message.router_event().unwrap();
        if (22..=24).contains(&event.event.event_id) {
            lost += 1;
            continue;
        }
        let expected = view.last_id.map_or(0, |id| id + 1);
        if event.event.event_id > expected {
            let missing = client
                .kv_events_range(expected, event.event.event_id - 1)
                .await
                .expect("gap fill");
            let ids: Vec<u64> = missing.iter().map(|e| e.event.event_id).collect();
            assert_eq!(ids, (expected..event.event.event_id).collect::<Vec<_>>());
            missing.iter().for_each(|e| view.apply(e));
        }
        view.apply(&event);
        view.last_id = Some(event.event.event_id);
    }
    assert_eq!(lost, 3);
    assert_eq!(
        view.blocks, truth,
        "dump plus events plus the filled gap equal the worker's state"
    );
}

#[tokio::test]
async fn the_ring_answers_only_what_it_holds() {
    let publisher = KvEventPublisher::new(3, 4);
    let (server, _engine) =
        start_worker_with(WorkerServerConfig::new(3).with_kv_events(publisher.clone())).await;
    let client = connect(&server).await;
    assert_eq!(
        client.kv_events_range(0, 10).await.unwrap(),
        vec![],
        "nothing published yet"
    );
    for hash in 0..10 {
        publisher.publish(1, stored(hash));
    }
    let ids =
        |events: Vec<RouterEvent>| events.iter().map(|e| e.event.event_id).collect::<Vec<_>>();
    assert_eq!(
        ids(client.kv_events_range(6, 9).await.unwrap()),
        vec![6, 7, 8, 9]
    );
    assert_eq!(
        ids(client.kv_events_range(8, 100).await.unwrap()),
        vec![8, 9],
        "clipped to the newest"
    );
    assert_eq!(
        ids(client.kv_events_range(12, 100).await.unwrap()),
        Vec::<u64>::new()
    );
    match client.kv_events_range(2, 7).await {
        Err(RequestError::EventsUnavailable { message }) => {
            assert!(message.contains("6..=9"), "{message}")
        }
        other => panic!("expected EventsUnavailable, got {other:?}"),
    }
    let events = client.kv_events_range(9, 9).await.unwrap();
    assert_eq!(events[0].event.dp_rank, 1);
    assert_eq!(events[0].worker_id, 3);
}

#[tokio::test]
async fn a_worker_without_kv_events_says_so() {
    let (server, _engine) = start_worker_with(WorkerServerConfig::new(1)).await;
    let client = connect(&server).await;
    assert!(matches!(
        client.kv_dump().await,
        Err(RequestError::Unsupported { .. })
    ));
    assert!(matches!(
        client.kv_events_range(0, 1).await,
        Err(RequestError::Unsupported { .. })
    ));
}
