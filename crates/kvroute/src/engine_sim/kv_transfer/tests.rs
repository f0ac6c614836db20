use std::time::Duration;

use serde_json::json;

use super::*;

fn engine() -> EngineAddress {
    EngineAddress {
        engine_id: "sim-0".into(),
        host: "127.0.0.1".into(),
        port: 8100,
    }
}

#[test]
fn a_prefill_names_its_full_blocks_and_a_decode_takes_them_once() {
    let transfers = Transfers::new(Duration::from_secs(60));
    let prompt: Vec<u32> = (0..40).collect();
    let params = transfers.hold(&engine(), &prompt, 16);
    assert_eq!(
        params,
        json!({
            "do_remote_prefill": true,
            "do_remote_decode": false,
            "remote_block_ids": [0, 1],
            "remote_engine_id": "sim-0",
            "remote_host": "127.0.0.1",
            "remote_port": 8100,
        })
    );
    assert_eq!(
        transfers.handshake(&params, &prompt),
        Ok(Handshake::RemotePrefill {
            transferred_tokens: 32
        })
    );
    let again = transfers.handshake(&params, &prompt).unwrap_err();
    assert!(again.contains("already read"), "{again}");
}

#[test]
fn unknown_expired_or_foreign_blocks_are_refused() {
    let prompt: Vec<u32> = (0..40).collect();
    let expired = Transfers::new(Duration::ZERO);
    let params = expired.hold(&engine(), &prompt, 16);
    let err = expired.handshake(&params, &prompt).unwrap_err();
    assert!(err.contains("expired"), "{err}");

    let transfers = Transfers::new(Duration::from_secs(60));
    let params = transfers.hold(&engine(), &prompt, 16);
    let other: Vec<u32> = (100..140).collect();
    let err = transfers.handshake(&params, &other).unwrap_err();
    assert!(err.contains("another prompt"), "{err}");

    let mut forged = transfers.hold(&engine(), &prompt, 16);
    forged["remote_engine_id"] = json!("sim-9");
    let err = transfers.handshake(&forged, &prompt).unwrap_err();
    assert!(err.contains("holds no such blocks"), "{err}");

    let err = transfers
        .handshake(&json!({"do_remote_prefill": true}), &prompt)
        .unwrap_err();
    assert!(err.contains("remote_engine_id"), "{err}");
}

#[test]
fn the_request_side_flags_decide_the_handshake() {
    let transfers = Transfers::new(Duration::from_secs(60));
    let asks = json!({
        "do_remote_decode": true,
        "do_remote_prefill": false,
        "remote_engine_id": null,
        "remote_block_ids": null,
        "remote_host": null,
        "remote_port": null,
    });
    assert_eq!(
        transfers.handshake(&asks, &[1]),
        Ok(Handshake::RemoteDecode)
    );
    assert_eq!(transfers.handshake(&json!(null), &[1]), Ok(Handshake::None));
    // A prompt shorter than a block transfers nothing.
    let short = transfers.hold(&engine(), &[1, 2, 3], 16);
    assert_eq!(
        transfers.handshake(&short, &[1, 2, 3]),
        Ok(Handshake::RemotePrefill {
            transferred_tokens: 0
        })
    );
}
