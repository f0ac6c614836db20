//! Decoding engine KV event payloads built by hand, in every shape engines send.

use kvroute_protocols::ProtocolError;
use kvroute_protocols::kv_events::ExternalSequenceBlockHash as H;
use kvroute_protocols::zmq_events::{
    BlockExtraKeys, BlockRemoved, BlockStored, EngineEventBatch, EngineKvEvent, MmExtraKey,
};
use kvroute_protocols::{decode_event_batch, decode_zmq_frames};
use proptest::prelude::*;
use rmpv::Value;

fn pack(v: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, v).expect("writing to a Vec cannot fail");
    out
}

fn arr(items: Vec<Value>) -> Value {
    Value::Array(items)
}

fn s(text: &str) -> Value {
    Value::from(text)
}

fn ints(items: &[u64]) -> Value {
    arr(items.iter().map(|&i| Value::from(i)).collect())
}

fn map(entries: Vec<(&str, Value)>) -> Value {
    Value::Map(entries.into_iter().map(|(k, v)| (s(k), v)).collect())
}

fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[u32], block_size: u32) -> BlockStored {
    BlockStored {
        block_hashes: hashes.iter().map(|&h| H(h)).collect(),
        parent_block_hash: parent.map(H),
        token_ids: tokens.to_vec(),
        block_size,
        ..BlockStored::default()
    }
}

fn removed(hashes: &[u64]) -> BlockRemoved {
    BlockRemoved {
        block_hashes: hashes.iter().map(|&h| H(h)).collect(),
        ..BlockRemoved::default()
    }
}

/// A batch whose events all decoded.
fn ok(ts: f64, events: Vec<EngineKvEvent>, dp_rank: Option<u32>) -> EngineEventBatch {
    EngineEventBatch {
        ts,
        events,
        dp_rank,
        errors: Vec::new(),
    }
}

#[track_caller]
fn check(payload: &Value, expect: Result<EngineEventBatch, &str>) {
    let got = decode_event_batch(&pack(payload)).map_err(|e| e.to_string());
    assert_eq!(got, expect.map_err(str::to_owned));
}

#[test]
fn array_encoded_events_as_older_vllm_and_sglang_send_them() {
    let payload = arr(vec![
        Value::F64(1.5),
        arr(vec![
            arr(vec![
                s("BlockStored"),
                ints(&[10, 11]),
                Value::Nil,
                ints(&[1, 2, 3, 4]),
                Value::from(2),
                Value::Nil,
                s("GPU"),
            ]),
            arr(vec![s("BlockRemoved"), ints(&[10])]),
            arr(vec![s("AllBlocksCleared")]),
        ]),
        Value::from(3),
    ]);
    let mut first = stored(&[10, 11], None, &[1, 2, 3, 4], 2);
    first.medium = Some("GPU".into());
    check(
        &payload,
        Ok(ok(
            1.5,
            vec![
                EngineKvEvent::BlockStored(first),
                EngineKvEvent::BlockRemoved(removed(&[10])),
                EngineKvEvent::AllBlocksCleared,
            ],
            Some(3),
        )),
    );
}

#[test]
fn map_encoded_events_as_newer_vllm_sends_them() {
    let payload = arr(vec![
        Value::from(7), // an integer timestamp is accepted too
        arr(vec![
            map(vec![
                ("type", s("BlockStored")),
                ("block_hashes", arr(vec![Value::from(-1i64)])),
                ("parent_block_hash", Value::from(99)),
                ("token_ids", ints(&[5, 6])),
                ("block_size", Value::from(2)),
                ("lora_name", s("adapter-a")),
                ("extra_keys", Value::Nil),
                ("group_idx", Value::from(0)),
            ]),
            map(vec![
                ("type", s("BlockRemoved")),
                ("block_hashes", ints(&[1, 2])),
                ("medium", s("CPU")),
            ]),
        ]),
    ]);
    let mut first = stored(&[u64::MAX], Some(99), &[5, 6], 2);
    first.lora_name = Some("adapter-a".into());
    first.group_idx = Some(0);
    let mut second = removed(&[1, 2]);
    second.medium = Some("CPU".into());
    check(
        &payload,
        Ok(ok(
            7.0,
            vec![
                EngineKvEvent::BlockStored(first),
                EngineKvEvent::BlockRemoved(second),
            ],
            None,
        )),
    );
}

#[test]
fn byte_hashes_fold_to_their_last_eight_bytes() {
    let digest: Vec<u8> = (0u8..32).collect();
    let payload = arr(vec![
        Value::F64(0.0),
        arr(vec![arr(vec![
            s("BlockStored"),
            arr(vec![Value::Binary(digest), Value::Binary(vec![1, 2])]),
            Value::Binary(vec![0xff; 8]),
            ints(&[1, 2]),
            Value::from(1),
        ])]),
        Value::Nil,
    ]);
    check(
        &payload,
        Ok(ok(
            0.0,
            vec![EngineKvEvent::BlockStored(stored(
                &[0x18191a1b1c1d1e1f, 0x0102],
                Some(u64::MAX),
                &[1, 2],
                1,
            ))],
            None,
        )),
    );
}

#[test]
fn trailing_unknown_fields_and_eagle_token_pairs_are_accepted() {
    let payload = arr(vec![
        Value::F64(2.0),
        arr(vec![
            arr(vec![
                s("BlockStored"),
                ints(&[1]),
                Value::Nil,
                // SGLang's EAGLE bigrams: one [token, next token] pair per token of the page.
                arr(vec![ints(&[1, 2]), ints(&[2, 3]), ints(&[3, 4])]),
                Value::from(3),
                Value::from(4),
                Value::Nil,
                s("lora"),
                Value::Nil,
                Value::from(0),
                s("full_attention"),
                Value::Nil,
                s("LOCAL"),
                s("some future field"),
            ]),
            arr(vec![
                s("BlockRemoved"),
                ints(&[1]),
                Value::Nil,
                Value::from(0),
                Value::Nil,
                ints(&[1]),
            ]),
            arr(vec![s("AllBlocksCleared"), Value::from(1)]),
        ]),
        Value::from(0),
        s("extra batch field"),
    ]);
    let mut first = stored(&[1], None, &[1, 2, 3], 3);
    first.lora_id = Some(4);
    first.lora_name = Some("lora".into());
    first.group_idx = Some(0);
    first.kv_cache_spec_kind = Some("full_attention".into());
    first.locality = Some("LOCAL".into());
    let mut second = removed(&[1]);
    second.group_idx = Some(0);
    check(
        &payload,
        Ok(ok(
            2.0,
            vec![
                EngineKvEvent::BlockStored(first),
                EngineKvEvent::BlockRemoved(second),
                EngineKvEvent::AllBlocksCleared,
            ],
            Some(0),
        )),
    );
}

/// vLLM 0.33 as its publisher encodes it (captured from `vllm.distributed.kv_events` with
/// msgspec): maps with every field it knows, per-block `extra_keys` untagged (the LoRA name, then
/// `(mm identifier, offset)` pairs, then the cache salt, then prompt-embedding digests).
#[test]
fn vllm_0_33_map_fields_and_extra_keys() {
    let extra = arr(vec![
        // First block of a salted LoRA request with an image starting in it.
        arr(vec![
            s("adapter"),
            arr(vec![s("img-1"), Value::from(2)]),
            s("tenant"),
        ]),
        Value::Nil,
        // A later block: the image continues (offset negative), prompt embeddings follow.
        arr(vec![
            s("adapter"),
            arr(vec![s("img-1"), Value::from(-2i64)]),
            Value::Binary(vec![7; 32]),
        ]),
        // Shapes the decoder does not know are counted, not rejected.
        arr(vec![s("adapter"), Value::Boolean(true), s("a"), s("b")]),
    ]);
    let payload = arr(vec![
        Value::F64(1.0),
        arr(vec![
            map(vec![
                ("type", s("BlockStored")),
                ("block_hashes", ints(&[1, 2, 3, 4])),
                ("parent_block_hash", Value::Nil),
                ("token_ids", ints(&[1, 2, 3, 4, 5, 6, 7, 8])),
                ("block_size", Value::from(2)),
                ("lora_id", Value::from(9)),
                ("medium", s("GPU")),
                ("lora_name", s("adapter")),
                ("extra_keys", extra),
                ("group_idx", Value::from(1)),
                ("kv_cache_spec_kind", s("sliding_window")),
                ("kv_cache_spec_sliding_window", Value::from(4096)),
                ("locality", s("LOCAL")),
                ("ownership", Value::Nil),
                ("session_id", s("chat-1")),
                ("lookahead_token_ids", arr(vec![ints(&[9])])),
            ]),
            map(vec![
                ("type", s("BlockRemoved")),
                ("block_hashes", ints(&[4])),
                ("medium", s("STORAGE")),
                ("group_idx", Value::from(1)),
                ("locality", s("REMOTE")),
            ]),
        ]),
        Value::from(2),
    ]);
    let mut first = stored(&[1, 2, 3, 4], None, &[1, 2, 3, 4, 5, 6, 7, 8], 2);
    first.lora_id = Some(9);
    first.medium = Some("GPU".into());
    first.lora_name = Some("adapter".into());
    first.group_idx = Some(1);
    first.kv_cache_spec_kind = Some("sliding_window".into());
    first.kv_cache_spec_sliding_window = Some(4096);
    first.locality = Some("LOCAL".into());
    let mm = |offset| MmExtraKey {
        identifier: "img-1".into(),
        offset,
    };
    first.extra_keys = vec![
        BlockExtraKeys {
            cache_salt: Some("tenant".into()),
            mm: vec![mm(2)],
            ..BlockExtraKeys::default()
        },
        BlockExtraKeys::default(),
        BlockExtraKeys {
            mm: vec![mm(-2)],
            prompt_embeds: vec![vec![7; 32]],
            ..BlockExtraKeys::default()
        },
        BlockExtraKeys {
            cache_salt: Some("a".into()),
            unknown: 2,
            ..BlockExtraKeys::default()
        },
    ];
    assert!(first.extra_keys[0].has_content_keys());
    assert!(!first.extra_keys[1].has_content_keys());
    let mut second = removed(&[4]);
    second.medium = Some("STORAGE".into());
    second.group_idx = Some(1);
    second.locality = Some("REMOTE".into());
    check(
        &payload,
        Ok(ok(
            1.0,
            vec![
                EngineKvEvent::BlockStored(first),
                EngineKvEvent::BlockRemoved(second),
            ],
            Some(2),
        )),
    );
}

/// SGLang 0.5's maps carry `cache_salt` (on every event of a salted request) and `session_id`.
#[test]
fn sglang_cache_salt() {
    let payload = arr(vec![
        Value::F64(1.0),
        arr(vec![map(vec![
            ("type", s("BlockStored")),
            ("block_hashes", arr(vec![Value::from(-5i64)])),
            ("parent_block_hash", Value::from(-6i64)),
            ("token_ids", ints(&[1])),
            ("block_size", Value::from(1)),
            ("lora_id", Value::Nil),
            ("medium", s("CPU_PINNED")),
            ("cache_salt", s("tenant")),
            ("session_id", s("s")),
        ])]),
        Value::from(0),
    ]);
    let mut event = stored(&[-5i64 as u64], Some(-6i64 as u64), &[1], 1);
    event.medium = Some("CPU_PINNED".into());
    event.cache_salt = Some("tenant".into());
    check(
        &payload,
        Ok(ok(1.0, vec![EngineKvEvent::BlockStored(event)], Some(0))),
    );
}

/// vLLM's offloading connector announces a lower-tier copy it has no tokens for with
/// `token_ids: []` and `block_size: 0`: decoded (the listener skips it), not an error.
#[test]
fn placeholders_without_tokens_decode() {
    let payload = arr(vec![
        Value::F64(1.0),
        arr(vec![map(vec![
            ("type", s("BlockStored")),
            ("block_hashes", ints(&[5])),
            ("parent_block_hash", Value::Nil),
            ("token_ids", ints(&[])),
            ("block_size", Value::from(0)),
            ("lora_id", Value::Nil),
            ("medium", s("CPU")),
            ("lora_name", Value::Nil),
            ("group_idx", Value::from(0)),
        ])]),
    ]);
    let mut event = stored(&[5], None, &[], 0);
    event.medium = Some("CPU".into());
    event.group_idx = Some(0);
    check(
        &payload,
        Ok(ok(1.0, vec![EngineKvEvent::BlockStored(event)], None)),
    );
}

/// One event that does not decode costs only itself: the batch's other events are kept.
#[test]
fn a_bad_event_is_reported_and_the_others_kept() {
    let payload = arr(vec![
        Value::F64(1.0),
        arr(vec![
            arr(vec![s("BlockRemoved"), ints(&[1])]),
            arr(vec![s("BlockMoved")]),
            map(vec![("type", s("BlockRemoved")), ("block_hashes", s("x"))]),
            arr(vec![s("AllBlocksCleared")]),
        ]),
    ]);
    check(
        &payload,
        Ok(EngineEventBatch {
            ts: 1.0,
            events: vec![
                EngineKvEvent::BlockRemoved(removed(&[1])),
                EngineKvEvent::AllBlocksCleared,
            ],
            dp_rank: None,
            errors: vec![
                ProtocolError::KvEvent(
                    "events[1] has unknown type \"BlockMoved\", expected one of BlockStored, \
                     BlockRemoved, AllBlocksCleared"
                        .into(),
                ),
                ProtocolError::KvEvent(
                    "events[2] BlockRemoved.block_hashes must be an array, got a string".into(),
                ),
            ],
        }),
    );
}

#[test]
fn rmp_serde_tuples_decode_like_msgspec_arrays() {
    // What a Rust publisher using serde tuples emits: the same msgpack arrays.
    let batch = (
        3.25f64,
        vec![(
            "BlockStored",
            vec![7u64, 8],
            Some(6u64),
            vec![1u32, 2, 3, 4],
            2u32,
        )],
        Some(1u32),
    );
    let bytes = rmp_serde::to_vec(&batch).expect("encodes");
    let got = decode_event_batch(&bytes).expect("decodes");
    assert_eq!(got.ts, 3.25);
    assert_eq!(got.dp_rank, Some(1));
    let EngineKvEvent::BlockStored(b) = &got.events[0] else {
        panic!("not stored: {got:?}")
    };
    assert_eq!(
        b.token_blocks().collect::<Vec<_>>(),
        vec![&[1, 2][..], &[3, 4][..]]
    );
    assert_eq!(b.parent_block_hash, Some(H(6)));
}

#[test]
fn frames_carry_a_big_endian_sequence_number() {
    let payload = pack(&arr(vec![Value::F64(1.0), arr(vec![])]));
    let msg = decode_zmq_frames(b"kv-events", &258u64.to_be_bytes(), &payload).expect("decodes");
    assert_eq!(msg.seq, 258);
    assert_eq!(msg.topic, b"kv-events");
    assert!(msg.batch.events.is_empty());
    assert_eq!(
        decode_zmq_frames(b"", &[0, 1], &payload)
            .unwrap_err()
            .to_string(),
        "malformed KV event payload: sequence frame must be 8 bytes (big-endian u64), got 2 bytes"
    );
}

#[test]
fn malformed_payloads_are_typed_errors() {
    let table: Vec<(Value, &str)> = vec![
        (
            Value::from(5),
            "batch must be an array [ts, events, dp_rank], got an integer",
        ),
        (
            arr(vec![Value::F64(0.0)]),
            "batch must have at least 2 elements [ts, events], got 1",
        ),
        (
            arr(vec![s("now"), arr(vec![])]),
            "batch ts must be a number, got a string",
        ),
        (
            arr(vec![Value::F64(0.0), map(vec![])]),
            "batch events must be an array, got a map",
        ),
        (
            arr(vec![Value::F64(0.0), arr(vec![]), Value::from(-1i64)]),
            "batch dp_rank must be an unsigned integer in range, got -1",
        ),
    ];
    for (payload, message) in table {
        check(
            &payload,
            Err(&format!("malformed KV event payload: {message}")),
        );
    }
}

#[test]
fn malformed_events_are_typed_errors() {
    let stored_with = |block_size: Value, hashes: Value, tokens: Value| {
        arr(vec![
            s("BlockStored"),
            hashes,
            Value::Nil,
            tokens,
            block_size,
        ])
    };
    let extra_keys = |keys: Value| {
        map(vec![
            ("type", s("BlockStored")),
            ("block_hashes", ints(&[1])),
            ("token_ids", ints(&[1])),
            ("block_size", Value::from(1)),
            ("extra_keys", keys),
        ])
    };
    let table: Vec<(Value, &str)> = vec![
        (
            arr(vec![s("BlockMoved")]),
            "events[0] has unknown type \"BlockMoved\", expected one of BlockStored, BlockRemoved, AllBlocksCleared",
        ),
        (
            arr(vec![]),
            "events[0] must start with its type name (BlockStored, BlockRemoved, AllBlocksCleared)",
        ),
        (
            map(vec![("block_hashes", ints(&[]))]),
            "events[0] has no string \"type\" (BlockStored, BlockRemoved, AllBlocksCleared)",
        ),
        (
            Value::Boolean(true),
            "events[0] must be an array or a map, got a boolean",
        ),
        (
            stored_with(Value::from(0), ints(&[1]), ints(&[1])),
            "events[0] BlockStored.block_size must be at least 1 when token_ids are given, got 0",
        ),
        (
            stored_with(Value::Nil, ints(&[]), ints(&[])),
            "events[0] BlockStored.block_size is missing",
        ),
        (
            stored_with(Value::from(1u64 << 40), ints(&[]), ints(&[])),
            "events[0] BlockStored.block_size must be an unsigned integer in range, got 1099511627776",
        ),
        (
            stored_with(Value::from(1), arr(vec![s("abc")]), ints(&[])),
            "events[0] BlockStored.block_hashes[0] must be an integer or bytes, got a string",
        ),
        (
            arr(vec![s("BlockRemoved")]),
            "events[0] BlockRemoved.block_hashes is missing",
        ),
        (
            stored_with(Value::from(1), ints(&[1]), ints(&[1u64 << 33])),
            "events[0] BlockStored.token_ids[0] must be an unsigned integer in range, got 8589934592",
        ),
        (
            stored_with(
                Value::from(1),
                ints(&[1]),
                arr(vec![ints(&[1, 2]), ints(&[3])]),
            ),
            "events[0] BlockStored.token_ids[1] must be a [token, token] pair, got an array",
        ),
        (
            extra_keys(arr(vec![])),
            "events[0] BlockStored.extra_keys must have one entry per block hash (1), got 0",
        ),
        (
            extra_keys(arr(vec![s("salt")])),
            "events[0] BlockStored.extra_keys[0] must be nil or an array, got a string",
        ),
        (
            extra_keys(Value::from(1)),
            "events[0] BlockStored.extra_keys must be an array, got an integer",
        ),
        (
            map(vec![
                ("type", s("BlockRemoved")),
                ("block_hashes", ints(&[1])),
                ("group_idx", s("0")),
            ]),
            "events[0] BlockRemoved.group_idx must be an unsigned integer, got a string",
        ),
    ];
    for (event, message) in table {
        let payload = arr(vec![Value::F64(0.0), arr(vec![event])]);
        check(
            &payload,
            Ok(EngineEventBatch {
                ts: 0.0,
                events: Vec::new(),
                dp_rank: None,
                errors: vec![ProtocolError::KvEvent(message.into())],
            }),
        );
    }
}

#[test]
fn non_msgpack_bytes_are_errors() {
    // A str8 marker with its length byte missing.
    let e = decode_event_batch(&[0xd9]).unwrap_err().to_string();
    assert!(
        e.starts_with("malformed KV event payload: payload is not msgpack"),
        "{e}"
    );
    let e = decode_event_batch(&[]).unwrap_err().to_string();
    assert!(
        e.starts_with("malformed KV event payload: payload is not msgpack"),
        "{e}"
    );
    let mut trailing = pack(&arr(vec![Value::F64(1.0), arr(vec![])]));
    trailing.push(0);
    assert_eq!(
        decode_event_batch(&trailing).unwrap_err().to_string(),
        "malformed KV event payload: 1 trailing bytes after the msgpack batch"
    );
    // An array header claiming four billion elements fails on the short input, without allocating.
    let e = decode_event_batch(&[0xdd, 0xff, 0xff, 0xff, 0xff])
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("malformed KV event payload: payload is not msgpack"),
        "{e}"
    );
    // Deep nesting stops at the depth limit instead of overflowing the stack.
    let deep = vec![0x91u8; 100_000];
    assert!(decode_event_batch(&deep).is_err());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Arbitrary bytes never panic the decoder.
    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        let _ = decode_event_batch(&bytes);
    }

    /// Every BlockStored we can express survives a msgpack trip in array form.
    #[test]
    fn stored_events_round_trip(
        hashes in proptest::collection::vec(any::<u64>(), 0..8),
        parent in proptest::option::of(any::<u64>()),
        tokens in proptest::collection::vec(any::<u32>(), 0..32),
        block_size in 1u32..64,
        dp_rank in proptest::option::of(any::<u32>()),
    ) {
        let payload = arr(vec![
            Value::F64(1.0),
            arr(vec![arr(vec![
                s("BlockStored"),
                ints(&hashes),
                parent.map_or(Value::Nil, Value::from),
                arr(tokens.iter().map(|&t| Value::from(t)).collect()),
                Value::from(block_size),
            ])]),
            dp_rank.map_or(Value::Nil, Value::from),
        ]);
        let got = decode_event_batch(&pack(&payload)).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(got.dp_rank, dp_rank);
        prop_assert_eq!(
            got.events,
            vec![EngineKvEvent::BlockStored(stored(&hashes, parent, &tokens, block_size))]
        );
    }
}
