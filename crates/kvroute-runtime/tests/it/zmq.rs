//! The ZMQ KV event listener against a publisher that writes the engines' documented frames:
//! `[topic, seq (8-byte big-endian), msgpack([ts, [events], dp_rank])]`.

use std::sync::Arc;

use bytes::Bytes;
use kvroute_protocols::kv_events::{
    ExternalSequenceBlockHash, KvCacheEventData, KvCacheRemoveData, LocalBlockHash, StorageTier,
};
use kvroute_runtime::{
    BlockHasher, BlockSalt, KvEventPublisher, ZmqKvListener, ZmqKvListenerConfig,
};
use rmpv::Value;
use zeromq::{PubSocket, Socket, SocketSend, ZmqMessage};

use crate::support::eventually;

/// A stand-in content hash: the sum of the tokens plus 1000 for a LoRA block.
fn hasher() -> BlockHasher {
    Arc::new(|tokens: &[u32], salt: BlockSalt<'_>| {
        LocalBlockHash(
            tokens.iter().map(|&t| u64::from(t)).sum::<u64>()
                + if salt.lora_name.is_some() { 1000 } else { 0 },
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
fn block_removed(hashes: &[u64], medium: Option<&str>) -> Value {
    let mut entries = vec![
        (Value::from("type"), Value::from("BlockRemoved")),
        (
            Value::from("block_hashes"),
            Value::Array(hashes.iter().map(|&h| Value::from(h)).collect()),
        ),
    ];
    if let Some(medium) = medium {
        entries.push((Value::from("medium"), Value::from(medium)));
    }
    Value::Map(entries)
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
    // arrives. Those lost before count as a gap from sequence 0 (no replay socket here).
    let mut seq = 0;
    send(&mut engine, seq, payload(vec![], 0)).await;
    while listener.stats().messages == 0 {
        seq += 1;
        send(&mut engine, seq, payload(vec![], 0)).await;
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    let baseline = listener.stats();
    assert_eq!(baseline.events, 0);
    assert!(baseline.lost_messages <= seq, "{baseline:?}");

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
                // A lower tier holds its own chains.
                block_stored(&[13], None, &[5, 6], "CPU"),
                block_removed(&[11], None),
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
    send(
        &mut engine,
        seq + 7,
        payload(vec![block_removed(&[13], Some("CPU"))], 3),
    )
    .await;
    eventually("all events to arrive", || listener.stats().events == 5).await;

    let stats = listener.stats();
    assert_eq!(
        (
            stats.gaps - baseline.gaps,
            stats.lost_messages - baseline.lost_messages,
            stats.decode_errors
        ),
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

/// An engine's replay service: on `[identity, b"", start seq]`, re-sends every buffered batch
/// from that sequence number as `[identity, b"", topic, seq, payload]` (current vLLM and SGLang)
/// or `[identity, b"", seq, payload]` (vLLM 0.10), then the end marker (sequence -1).
async fn replay_service(mut socket: zeromq::RouterSocket, buffer: ReplayBuffer, topic: bool) {
    use zeromq::SocketRecv;
    let reply = |identity: &Bytes, seq: Bytes, payload: Bytes| {
        let mut frames = vec![identity.clone(), Bytes::new()];
        if topic {
            frames.push(Bytes::from_static(b"kv-events"));
        }
        frames.extend([seq, payload]);
        ZmqMessage::try_from(frames).unwrap()
    };
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
            let seq = Bytes::copy_from_slice(&seq.to_be_bytes());
            socket
                .send(reply(identity, seq, payload.into()))
                .await
                .unwrap();
        }
        let end = reply(identity, Bytes::from_static(&[0xff; 8]), Bytes::new());
        socket.send(end).await.unwrap();
    }
}

async fn a_gap_is_filled_from_the_engines_replay_socket(topic_frame: bool) {
    let mut engine = PubSocket::new();
    let endpoint = engine.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
    let mut router = zeromq::RouterSocket::new();
    let replay_endpoint = router.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
    let buffer = ReplayBuffer::default();
    let service = tokio::spawn(replay_service(router, buffer.clone(), topic_frame));

    let publisher = KvEventPublisher::new(4, 1024);
    let config = ZmqKvListenerConfig::new(endpoint).with_replay(replay_endpoint);
    let listener = ZmqKvListener::connect(config, hasher(), publisher.clone())
        .await
        .unwrap();
    // Every batch goes to the replay buffer, as an engine keeps them.
    let mut seq = 0;
    let probe = payload(vec![], 0);
    buffer.lock().push((seq, probe.clone()));
    send(&mut engine, seq, probe.clone()).await;
    while listener.stats().messages == 0 {
        seq += 1;
        buffer.lock().push((seq, probe.clone()));
        send(&mut engine, seq, probe.clone()).await;
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    eventually("probes lost before the subscription to be replayed", || {
        listener.stats().messages == seq + 1
    })
    .await;
    let baseline = listener.stats();
    assert_eq!(baseline.lost_messages, 0, "{baseline:?}");
    // Four batches, one block each; the middle two never reach the subscriber.
    for (i, hash) in [21u64, 22, 23, 24].into_iter().enumerate() {
        let seq = seq + 1 + i as u64;
        let batch = payload(vec![block_stored(&[hash], None, &[1, 2], "GPU")], 0);
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
        (
            stats.gaps - baseline.gaps,
            stats.replayed_messages - baseline.replayed_messages,
            stats.lost_messages
        ),
        (1, 2, 0),
        "{stats:?}"
    );
    let stored: Vec<u64> = publisher
        .range(0, 100)
        .unwrap()
        .iter()
        .map(|e| match &e.event.data {
            KvCacheEventData::Stored(s) => s.blocks[0].block_hash.0,
            other => panic!("expected Stored, got {other:?}"),
        })
        .collect();
    assert_eq!(
        stored,
        vec![21, 22, 23, 24],
        "replayed batches are republished in sequence order"
    );
    service.abort();
}

/// Regression: current vLLM and SGLang answer a replay request with four frames (a topic before
/// the sequence number); the listener expected three and lost every missed batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_with_four_frames_fills_a_gap() {
    a_gap_is_filled_from_the_engines_replay_socket(true).await;
}

/// vLLM 0.10's three-frame replay answer still works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_with_three_frames_fills_a_gap() {
    a_gap_is_filled_from_the_engines_replay_socket(false).await;
}
