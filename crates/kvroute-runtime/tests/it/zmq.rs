//! The ZMQ KV event listener against a publisher that writes the engines' documented frames:
//! `[topic, seq (8-byte big-endian), msgpack([ts, [events], dp_rank])]`.

use std::sync::Arc;

use bytes::Bytes;
use kvroute_protocols::kv_events::{
    ExternalSequenceBlockHash, KvCacheEventData, KvCacheRemoveData, LocalBlockHash, StorageTier,
};
use kvroute_runtime::{BlockHasher, KvEventPublisher, ZmqKvListener, ZmqKvListenerConfig};
use rmpv::Value;
use zeromq::{PubSocket, Socket, SocketSend, ZmqMessage};

use crate::support::eventually;

/// A stand-in content hash: the sum of the tokens plus 1000 for a LoRA block.
fn hasher() -> BlockHasher {
    Arc::new(|tokens: &[u32], lora: Option<&str>| {
        LocalBlockHash(
            tokens.iter().map(|&t| u64::from(t)).sum::<u64>()
                + if lora.is_some() { 1000 } else { 0 },
        )
    })
}

fn payload(events: Vec<Value>, dp_rank: u32) -> Vec<u8> {
    let batch = Value::Array(vec![
        Value::F64(1.7e9),
        Value::Array(events),
        Value::from(dp_rank),
    ]);
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, &batch).unwrap();
    out
}

/// vLLM's array form: `["BlockStored", hashes, parent, tokens, block_size, lora_id, medium]`.
fn block_stored(hashes: &[u64], parent: Option<u64>, tokens: &[u32], medium: &str) -> Value {
    Value::Array(vec![
        Value::from("BlockStored"),
        Value::Array(hashes.iter().map(|&h| Value::from(h)).collect()),
        parent.map_or(Value::Nil, Value::from),
        Value::Array(tokens.iter().map(|&t| Value::from(t)).collect()),
        Value::from(2u32),
        Value::Nil,
        Value::from(medium),
    ])
}

/// Newer vLLM's map form.
fn block_removed(hashes: &[u64]) -> Value {
    Value::Map(vec![
        (Value::from("type"), Value::from("BlockRemoved")),
        (
            Value::from("block_hashes"),
            Value::Array(hashes.iter().map(|&h| Value::from(h)).collect()),
        ),
    ])
}

async fn send(socket: &mut PubSocket, seq: u64, payload: Vec<u8>) {
    let frames = vec![
        Bytes::from_static(b"kv-events"),
        Bytes::copy_from_slice(&seq.to_be_bytes()),
        Bytes::from(payload),
    ];
    socket
        .send(ZmqMessage::try_from(frames).unwrap())
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_events_are_decoded_numbered_and_gaps_counted() {
    let mut engine = PubSocket::new();
    let endpoint = engine.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
    let publisher = KvEventPublisher::new(4, 1024);
    let listener = ZmqKvListener::connect(
        ZmqKvListenerConfig::new(endpoint),
        hasher(),
        publisher.clone(),
    )
    .await
    .unwrap();

    // PUB/SUB drops messages until the subscription has propagated: send empty batches until one
    // arrives. The first message received sets the sequence baseline.
    let mut seq = 0;
    while listener.stats().messages == 0 {
        seq += 1;
        send(&mut engine, seq, payload(vec![], 0)).await;
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    let baseline = listener.stats();
    assert_eq!((baseline.gaps, baseline.events), (0, 0));

    send(
        &mut engine,
        seq + 1,
        payload(
            vec![block_stored(&[11, 12], None, &[1, 2, 3, 4, 5], "GPU")],
            3,
        ),
    )
    .await;
    send(
        &mut engine,
        seq + 2,
        payload(
            vec![
                block_stored(&[13], Some(12), &[5, 6], "CPU"),
                block_removed(&[11]),
            ],
            3,
        ),
    )
    .await;
    // Sequence numbers seq + 3 and seq + 4 are lost.
    send(
        &mut engine,
        seq + 5,
        payload(vec![Value::Array(vec![Value::from("AllBlocksCleared")])], 0),
    )
    .await;
    // A malformed event is skipped without stopping the listener.
    send(&mut engine, seq + 6, b"not msgpack at all".to_vec()).await;
    send(&mut engine, seq + 7, payload(vec![block_removed(&[13])], 0)).await;
    eventually("all events to arrive", || listener.stats().events == 5).await;

    let stats = listener.stats();
    assert_eq!(
        (stats.gaps, stats.lost_messages, stats.decode_errors),
        (1, 2, 1),
        "{stats:?}"
    );
    let events = publisher.range(0, 100).unwrap();
    let ids: Vec<u64> = events.iter().map(|e| e.event.event_id).collect();
    assert_eq!(
        ids,
        vec![0, 1, 2, 3, 4],
        "republished events get consecutive ids"
    );
    assert!(events.iter().all(|e| e.worker_id == 4));
    match &events[0].event.data {
        KvCacheEventData::Stored(s) => {
            assert_eq!(s.parent_hash, None);
            let blocks: Vec<_> = s
                .blocks
                .iter()
                .map(|b| (b.block_hash.0, b.tokens_hash.0))
                .collect();
            assert_eq!(
                blocks,
                vec![(11, 3), (12, 7)],
                "the partial trailing block is not hashed"
            );
        }
        other => panic!("expected Stored, got {other:?}"),
    }
    assert_eq!(events[0].event.dp_rank, 3);
    assert_eq!(events[1].storage_tier, StorageTier::HostPinned);
    assert_eq!(
        events[2].event.data,
        KvCacheEventData::Removed(KvCacheRemoveData {
            block_hashes: vec![ExternalSequenceBlockHash(11)]
        })
    );
    assert_eq!(events[3].event.data, KvCacheEventData::Cleared);
}

/// The batches an engine keeps for replay, by sequence number.
type ReplayBuffer = Arc<parking_lot::Mutex<Vec<(u64, Vec<u8>)>>>;

/// vLLM's replay service: on `[identity, b"", start seq]`, re-sends every buffered batch from that
/// sequence number as `[identity, b"", seq, payload]`, then `[identity, b"", -1, b""]`.
async fn replay_service(mut socket: zeromq::RouterSocket, buffer: ReplayBuffer) {
    use zeromq::SocketRecv;
    while let Ok(request) = socket.recv().await {
        let frames = request.into_vec();
        let [identity, _, start] = &frames[..] else {
            continue;
        };
        let start = u64::from_be_bytes(start[..].try_into().unwrap());
        let batches: Vec<_> = buffer
            .lock()
            .iter()
            .filter(|(s, _)| *s >= start)
            .cloned()
            .collect();
        for (seq, payload) in batches {
            let reply = vec![
                identity.clone(),
                Bytes::new(),
                Bytes::copy_from_slice(&seq.to_be_bytes()),
                payload.into(),
            ];
            socket
                .send(ZmqMessage::try_from(reply).unwrap())
                .await
                .unwrap();
        }
        let end = vec![
            identity.clone(),
            Bytes::new(),
            Bytes::from_static(&[0xff; 8]),
            Bytes::new(),
        ];
        socket
            .send(ZmqMessage::try_from(end).unwrap())
            .await
            .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gap_is_filled_from_the_engines_replay_socket() {
    let mut engine = PubSocket::new();
    let endpoint = engine.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
    let mut router = zeromq::RouterSocket::new();
    let replay_endpoint = router.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
    let buffer = ReplayBuffer::default();
    let service = tokio::spawn(replay_service(router, buffer.clone()));

    let publisher = KvEventPublisher::new(4, 1024);
    let config = ZmqKvListenerConfig::new(endpoint).with_replay(replay_endpoint);
    let listener = ZmqKvListener::connect(config, hasher(), publisher.clone())
        .await
        .unwrap();
    let mut seq = 0;
    while listener.stats().messages == 0 {
        seq += 1;
        send(&mut engine, seq, payload(vec![], 0)).await;
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    // Four batches, one block each; the middle two never reach the subscriber.
    for (i, hash) in [21u64, 22, 23, 24].into_iter().enumerate() {
        let seq = seq + 1 + i as u64;
        let batch = payload(vec![block_removed(&[hash])], 0);
        buffer.lock().push((seq, batch.clone()));
        if hash == 21 || hash == 24 {
            send(&mut engine, seq, batch).await;
        }
    }
    eventually("all four events to be republished", || {
        listener.stats().events == 4
    })
    .await;
    let stats = listener.stats();
    assert_eq!(
        (stats.gaps, stats.replayed_messages, stats.lost_messages),
        (1, 2, 0),
        "{stats:?}"
    );
    let removed: Vec<u64> = publisher
        .range(0, 100)
        .unwrap()
        .iter()
        .map(|e| match &e.event.data {
            KvCacheEventData::Removed(r) => r.block_hashes[0].0,
            other => panic!("expected Removed, got {other:?}"),
        })
        .collect();
    assert_eq!(
        removed,
        vec![21, 22, 23, 24],
        "replayed batches are republished in sequence order"
    );
    service.abort();
}
