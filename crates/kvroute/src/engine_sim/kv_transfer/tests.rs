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

/// The pull `params` ask for.
fn pull_of(params: &Value) -> Pull {
    match asked(params) {
        Ok(Asked::RemotePrefill(pull)) => pull,
        other => panic!("a pull: {other:?}"),
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
    let pull = pull_of(&params);
    assert_eq!((pull.host.as_str(), pull.port), ("127.0.0.1", 8100));
    assert_eq!(
        transfers.take(&pull.engine_id, &pull.block_ids, &prompt),
        Ok(32)
    );
    let again = transfers
        .take(&pull.engine_id, &pull.block_ids, &prompt)
        .unwrap_err();
    assert!(again.contains("already read"), "{again}");
}

#[test]
fn unknown_expired_or_foreign_blocks_are_refused() {
    let prompt: Vec<u32> = (0..40).collect();
    let expired = Transfers::new(Duration::ZERO);
    let pull = pull_of(&expired.hold(&engine(), &prompt, 16));
    let err = expired
        .take(&pull.engine_id, &pull.block_ids, &prompt)
        .unwrap_err();
    assert!(err.contains("expired"), "{err}");

    let transfers = Transfers::new(Duration::from_secs(60));
    let pull = pull_of(&transfers.hold(&engine(), &prompt, 16));
    let other: Vec<u32> = (100..140).collect();
    let err = transfers
        .take(&pull.engine_id, &pull.block_ids, &other)
        .unwrap_err();
    assert!(err.contains("another prompt"), "{err}");

    let pull = pull_of(&transfers.hold(&engine(), &prompt, 16));
    let err = transfers
        .take("sim-9", &pull.block_ids, &prompt)
        .unwrap_err();
    assert!(err.contains("holds no such blocks"), "{err}");

    let err = asked(&json!({"do_remote_prefill": true})).unwrap_err();
    assert!(err.contains("remote_engine_id"), "{err}");
    let err = asked(&json!({"do_remote_prefill": true, "remote_engine_id": "e",
                            "remote_block_ids": [1], "remote_host": "h"}))
    .unwrap_err();
    assert!(err.contains("remote_port"), "{err}");
}

#[test]
fn the_request_side_flags_decide_what_is_asked() {
    let asks = json!({
        "do_remote_decode": true,
        "do_remote_prefill": false,
        "remote_engine_id": null,
        "remote_block_ids": null,
        "remote_host": null,
        "remote_port": null,
    });
    assert_eq!(asked(&asks), Ok(Asked::RemoteDecode));
    assert_eq!(asked(&json!({})), Ok(Asked::Nothing));
    assert!(asked(&json!({"do_remote_decode": true, "do_remote_prefill": true})).is_err());
    // A prompt shorter than a block transfers nothing.
    let transfers = Transfers::new(Duration::from_secs(60));
    let pull = pull_of(&transfers.hold(&engine(), &[1, 2, 3], 16));
    assert!(pull.block_ids.is_empty());
    assert_eq!(
        transfers.take(&pull.engine_id, &pull.block_ids, &[1, 2, 3]),
        Ok(0)
    );
}
