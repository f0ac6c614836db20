//! Reads a client's `nvext` the way kvroute's frontend does: decode and validate the JSON, let the
//! routing headers override the body, round-trip it through the request plane's bincode, and show
//! the typed error a bad value gets.
//!
//! Run with `cargo run -p kvroute-protocols --example nvext`.

use kvroute_protocols::{
    Limits, NvExt, ProtocolError, SessionAction, apply_header_routing_overrides, codec,
    parse_nvext_json,
};

fn main() -> Result<(), ProtocolError> {
    // The `nvext` object of an OpenAI request opening a sticky session, as a Dynamo client sends it.
    let body = br#"{
        "session_control": {"session_id": "chat-42", "action": "open", "timeout": 600},
        "agent_hints": {"priority": 5},
        "dp_rank": 1,
        "some_future_field": true
    }"#;
    let nvext = parse_nvext_json(body, &Limits::default())?;
    let session = nvext
        .session_control
        .as_ref()
        .expect("session_control parsed");
    println!(
        "session {:?}: action {:?}, timeout {} s",
        session.session_id, session.action, session.timeout
    );
    assert_eq!(session.action, Some(SessionAction::Open));
    assert_eq!(session.timeout, 600);

    // Routing headers win over the body: pin the worker, and `u32::MAX` leaves the dp rank unset.
    let headers: [(&str, &[u8]); 2] =
        [("X-Worker-Instance-Id", b"7"), ("x-dp-rank", b"4294967295")];
    let routed = apply_header_routing_overrides(Some(nvext), headers)?.expect("nvext present");
    println!(
        "after headers: backend {:?}, decode {:?}, dp rank {:?}",
        routed.backend_instance_id, routed.decode_worker_id, routed.dp_rank
    );
    assert_eq!(routed.backend_instance_id, Some(7));
    assert_eq!(routed.decode_worker_id, Some(7));
    assert_eq!(routed.dp_rank, Some(1));

    // JSON leaves out every unset field; bincode (the request plane) round-trips the same value.
    let json = serde_json::to_string(&routed).expect("nvext serializes");
    println!("as JSON: {json}");
    assert!(!json.contains("null") && !json.contains("some_future_field"));
    let frame = codec::encode(&routed)?;
    let back: NvExt = codec::decode(&frame, frame.len())?;
    println!(
        "as bincode: {} bytes, round-trips: {}",
        frame.len(),
        back == routed
    );
    assert_eq!(back, routed);

    // A bad value is an error that says what was wrong and what was expected.
    let bad = br#"{"session_control": {"session_id": "chat-42", "timeout": 0}}"#;
    let err = parse_nvext_json(bad, &Limits::default()).expect_err("timeout 0 is rejected");
    println!("rejected: {err}");
    assert!(err.to_string().contains("timeout"));
    Ok(())
}
