//! kvroute's own vLLM-compatible publisher ([`VllmKvPublisher`]) against the listener: what the
//! listener misses on the PUB socket (it subscribed late) it fetches from the replay socket.

use std::sync::Arc;

use kvroute_protocols::kv_events::{
    ExternalSequenceBlockHash as H, KvCacheEventData, LocalBlockHash,
};
use kvroute_protocols::zmq_events::{BlockRemoved, BlockStored, EngineEventBatch, EngineKvEvent};
use kvroute_runtime::{
    BlockHasher, BlockSalt, KvEventPublisher, VllmKvPublisher, ZmqKvListener, ZmqKvListenerConfig,
};

use crate::support::eventually;

fn hasher() -> BlockHasher {
    Arc::new(|tokens: &[u32], _: BlockSalt<'_>| {
        LocalBlockHash(tokens.iter().map(|&t| u64::from(t)).sum())
    })
}

fn batch(events: Vec<EngineKvEvent>) -> EngineEventBatch {
    EngineEventBatch {
        ts: 1.0,
        events,
        dp_rank: Some(0),
        errors: Vec::new(),
    }
}

fn stored(hash: u64, parent: Option<u64>) -> EngineKvEvent {
    EngineKvEvent::BlockStored(BlockStored {
        block_hashes: vec![H(hash)],
        parent_block_hash: parent.map(H),
        token_ids: vec![hash as u32, 1],
        block_size: 2,
        medium: Some("GPU".into()),
        ..BlockStored::default()
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_listener_replays_what_the_publisher_sent_before() {
    let engine = VllmKvPublisher::bind("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", "", 100)
        .await
        .unwrap();
    // Sent before anyone subscribed: only the replay socket still has these.
    engine.publish(&batch(vec![stored(10, None)]));
    engine.publish(&batch(vec![stored(11, Some(10))]));
    let publisher = KvEventPublisher::new(1, 1024);
    let config = ZmqKvListenerConfig::new(engine.endpoint())
        .with_replay(engine.replay_endpoint())
        .with_block_size(2);
    let listener = ZmqKvListener::connect(config, hasher(), publisher.clone())
        .await
        .unwrap();
    // PUB drops messages until the subscription has propagated: keep publishing empty batches
    // until one arrives; the gap before it is filled from the replay socket.
    while listener.stats().messages == 0 {
        engine.publish(&batch(vec![]));
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    engine.publish(&batch(vec![EngineKvEvent::BlockRemoved(BlockRemoved {
        block_hashes: vec![H(11)],
        medium: Some("GPU".into()),
        ..BlockRemoved::default()
    })]));
    eventually("the two stores and the removal to be republished", || {
        listener.stats().events == 3
    })
    .await;
    let stats = listener.stats();
    assert_eq!(
        (stats.lost_messages, stats.decode_errors),
        (0, 0),
        "{stats:?}"
    );
    assert!(stats.replayed_messages >= 2, "{stats:?}");
    let events: Vec<_> = publisher
        .range(0, 10)
        .unwrap()
        .into_iter()
        .map(|e| match e.event.data {
            KvCacheEventData::Stored(s) => (
                "stored",
                s.blocks[0].block_hash.0,
                Some(s.blocks[0].tokens_hash.0),
            ),
            KvCacheEventData::Removed(r) => ("removed", r.block_hashes[0].0, None),
            KvCacheEventData::Cleared => ("cleared", 0, None),
        })
        .collect();
    assert_eq!(
        events,
        vec![
            ("stored", 10, Some(11)),
            ("stored", 11, Some(12)),
            ("removed", 11, None)
        ]
    );
}
