//! The encoder against payloads captured from vLLM 0.33's own msgspec structs, and against this
//! crate's decoder.

use kvroute_protocols::kv_events::ExternalSequenceBlockHash as H;
use kvroute_protocols::zmq_events::{
    BlockRemoved, BlockStored, EngineEventBatch, EngineKvEvent, decode_event_batch,
    decode_zmq_frames,
};

use super::encode_vllm_batch;

fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[u32], block_size: u32) -> BlockStored {
    BlockStored {
        block_hashes: hashes.iter().map(|&h| H(h)).collect(),
        parent_block_hash: parent.map(H),
        token_ids: tokens.to_vec(),
        block_size,
        medium: Some("GPU".into()),
        ..BlockStored::default()
    }
}

fn batch(ts: f64, events: Vec<EngineKvEvent>, dp_rank: Option<u32>) -> EngineEventBatch {
    EngineEventBatch {
        ts,
        events,
        dp_rank,
        errors: Vec::new(),
    }
}

/// `encode` gives exactly the bytes vLLM wrote, and the decoder reads them back to `batch`.
fn check(batch: &EngineEventBatch, captured: &str) {
    let bytes = encode_vllm_batch(batch);
    assert_eq!(
        bytes.iter().map(|b| format!("{b:02x}")).collect::<String>(),
        captured
    );
    assert_eq!(&decode_event_batch(&bytes).expect("decodes"), batch);
}

/// Captured with `msgspec.msgpack.Encoder().encode(KVEventBatch(ts=1.5, events=[BlockStored(
/// block_hashes=[11, 2**64-1], parent_block_hash=None, token_ids=[1,2,3,4], block_size=2,
/// lora_id=None, medium="GPU", lora_name=None), BlockStored(block_hashes=[12],
/// parent_block_hash=2**64-1, token_ids=[5,6], ...), BlockRemoved(block_hashes=[11],
/// medium="GPU"), AllBlocksCleared()], data_parallel_rank=0))` from vLLM 0.33.0's
/// `vllm.distributed.kv_events` (loaded as `tests/python/kv_publishers/standins.py` does).
#[test]
fn stored_removed_and_cleared_as_vllm_0_33_encodes_them() {
    let b = batch(
        1.5,
        vec![
            EngineKvEvent::BlockStored(stored(&[11, u64::MAX], None, &[1, 2, 3, 4], 2)),
            EngineKvEvent::BlockStored(stored(&[12], Some(u64::MAX), &[5, 6], 2)),
            EngineKvEvent::BlockRemoved(BlockRemoved {
                block_hashes: vec![H(11)],
                medium: Some("GPU".into()),
                ..BlockRemoved::default()
            }),
            EngineKvEvent::AllBlocksCleared,
        ],
        Some(0),
    );
    check(
        &b,
        "93cb3ff800000000000094de0008a474797065ab426c6f636b53746f726564ac626c6f636b5f686173686573\
         920bcfffffffffffffffffb1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f69647394010203\
         04aa626c6f636b5f73697a6502a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0\
         de0008a474797065ab426c6f636b53746f726564ac626c6f636b5f686173686573910cb1706172656e745f62\
         6c6f636b5f68617368cfffffffffffffffffa9746f6b656e5f696473920506aa626c6f636b5f73697a6502a7\
         6c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c083a474797065ac426c6f636b5265\
         6d6f766564ac626c6f636b5f686173686573910ba66d656469756da347505581a474797065b0416c6c426c6f\
         636b73436c656172656400",
    );
}

/// Captured likewise: no dp rank (nil, not omitted: the batch is `array_like`), a group and a
/// locality (optional fields written after the required ones), 20 tokens (`array16`), wide
/// integers, a removal without a medium.
#[test]
fn optional_fields_wide_integers_and_no_dp_rank() {
    let mut first = stored(
        &[(1 << 40) + 7],
        Some(300),
        &(100..120).collect::<Vec<_>>(),
        20,
    );
    first.group_idx = Some(1);
    first.locality = Some("LOCAL".into());
    let b = batch(
        1_767_225_600.25,
        vec![
            EngineKvEvent::BlockStored(first),
            EngineKvEvent::BlockRemoved(BlockRemoved {
                block_hashes: vec![H((1 << 40) + 7), H(70_000)],
                medium: None,
                group_idx: Some(0),
                locality: None,
            }),
        ],
        None,
    );
    check(
        &b,
        "93cb41da556e4010000092de000aa474797065ab426c6f636b53746f726564ac626c6f636b5f686173686573\
         91cf0000010000000007b1706172656e745f626c6f636b5f68617368cd012ca9746f6b656e5f696473dc0014\
         6465666768696a6b6c6d6e6f7071727374757677aa626c6f636b5f73697a6514a76c6f72615f6964c0a66d65\
         6469756da3475055a96c6f72615f6e616d65c0a967726f75705f69647801a86c6f63616c697479a54c4f4341\
         4c84a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657392cf0000010000000007ce\
         00011170a66d656469756dc0a967726f75705f69647800c0",
    );
}

#[test]
fn the_frames_decode_with_their_sequence_number() {
    let b = batch(
        2.0,
        vec![EngineKvEvent::BlockStored(stored(&[7], None, &[9; 16], 16))],
        Some(3),
    );
    let payload = encode_vllm_batch(&b);
    let message = decode_zmq_frames(b"", &41u64.to_be_bytes(), &payload).expect("decodes");
    assert_eq!((message.topic, message.seq, message.batch), (vec![], 41, b));
}
