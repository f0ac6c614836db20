//! Decoding of engine KV event payloads (msgpack) and ZMQ frames. No input may panic.

#![no_main]

use kvroute_protocols::{decode_event_batch, decode_zmq_frames};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = decode_event_batch(data);
    if data.len() >= 8 {
        let (seq, payload) = data.split_at(8);
        if let Ok(msg) = decode_zmq_frames(b"kv-events", seq, payload) {
            assert_eq!(
                msg.seq,
                u64::from_be_bytes(seq.try_into().expect("8 bytes"))
            );
        }
    }
});
