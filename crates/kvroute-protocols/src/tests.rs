//! Data-driven JSON, header, codec and envelope cases.
//!
//! Each `check` takes an input and the expected outcome as text: the canonical re-serialized JSON
//! on success, or `error: <message>` on failure, so a table of cases reads like a spec.

use crate::codec;
use crate::headers::apply_header_routing_overrides;
use crate::{
    Annotated, FinishReason, LLMEngineOutput, Limits, NvExt, PreprocessedRequest, RequestPhase,
    RoutingHints, SessionAction, SessionControl, WorkerLoadReport, parse_nvext_json,
};

/// Small enough that a test can exceed it.
const LIMITS: Limits = Limits {
    max_token_data_len: 4,
};

#[track_caller]
fn check(input: &str, expect: &str) {
    let got = match parse_nvext_json(input.as_bytes(), &LIMITS) {
        Ok(ext) => {
            let json = serde_json::to_string(&ext).expect("NvExt serializes");
            // Whatever we emit must read back to the same value.
            let back: NvExt = serde_json::from_str(&json).expect("own output parses");
            assert_eq!(back, ext, "JSON round trip of {input}");
            let bin = codec::encode(&ext).expect("NvExt encodes");
            assert_eq!(codec::decode::<NvExt>(&bin, 1 << 20).expect("decodes"), ext);
            json
        }
        Err(e) => format!("error: {e}"),
    };
    assert_eq!(got, expect, "input: {input}");
}

#[test]
fn session_control_reference_examples() {
    check(
        r#"{"session_control": {"session_id": "sub-1", "action": "open", "timeout": 60}}"#,
        r#"{"session_control":{"session_id":"sub-1","action":"open","timeout":60}}"#,
    );
    check(
        r#"{"session_control": {"session_id": "sub-1", "action": "close"}}"#,
        r#"{"session_control":{"session_id":"sub-1","action":"close","timeout":300}}"#,
    );
    check(
        r#"{"session_control": {"session_id": "sub-1"}}"#,
        r#"{"session_control":{"session_id":"sub-1","timeout":300}}"#,
    );
    check(
        r#"{"session_control": {"session_id": "sub-1", "action": "bind", "timeout": 31536000}}"#,
        r#"{"session_control":{"session_id":"sub-1","action":"bind","timeout":31536000}}"#,
    );
    check(
        r#"{"session_control": {"session_id": "sub-1", "action": null}}"#,
        r#"{"session_control":{"session_id":"sub-1","timeout":300}}"#,
    );
}

#[test]
fn nvext_fields_round_trip_and_none_is_omitted() {
    check("{}", "{}");
    check(r#"{"backend_instance_id": null, "dp_rank": null}"#, "{}");
    check(
        r#"{"greed_sampling": true, "use_raw_prompt": false, "annotations": ["query_instance_id:1"],
            "backend_instance_id": 7, "token_data": [1, 2, 3, 4], "max_thinking_tokens": 512,
            "extra_fields": ["worker_id", "timing"], "prefill_worker_id": 11,
            "decode_worker_id": 12, "dp_rank": 3, "prefill_dp_rank": 1,
            "agent_hints": {"priority": -2, "osl": 128, "speculative_prefill": true,
                            "latency_sensitivity": 0.5},
            "request_timestamp_ms": 1700000000000.5,
            "session_control": {"session_id": "s", "action": "open", "timeout": 60},
            "routing_constraints": {"required_taints": ["gpu=h100"],
                                    "preferred_taints": {"zone=a": 2.0}}}"#,
        concat!(
            r#"{"greed_sampling":true,"use_raw_prompt":false,"annotations":["query_instance_id:1"],"#,
            r#""backend_instance_id":7,"token_data":[1,2,3,4],"max_thinking_tokens":512,"#,
            r#""extra_fields":["worker_id","timing"],"prefill_worker_id":11,"decode_worker_id":12,"#,
            r#""dp_rank":3,"prefill_dp_rank":1,"agent_hints":{"priority":-2,"osl":128,"#,
            r#""speculative_prefill":true,"latency_sensitivity":0.5},"#,
            r#""request_timestamp_ms":1700000000000.5,"#,
            r#""session_control":{"session_id":"s","action":"open","timeout":60},"#,
            r#""routing_constraints":{"required_taints":["gpu=h100"],"#,
            r#""preferred_taints":{"zone=a":2.0}}}"#,
        ),
    );
    check(r#"{"agent_hints": {}}"#, r#"{"agent_hints":{}}"#);
    check(
        r#"{"routing_constraints": {}}"#,
        r#"{"routing_constraints":{}}"#,
    );
}

#[test]
fn unknown_fields_are_ignored() {
    check(
        r#"{"backend_instance_id": 7, "future_field": {"x": [1, 2]},
            "session_control": {"session_id": "a", "ttl_hint": 5}}"#,
        r#"{"backend_instance_id":7,"session_control":{"session_id":"a","timeout":300}}"#,
    );
}

#[test]
fn invalid_values_name_field_value_and_expectation() {
    check(
        r#"{"session_control": {"session_id": "sub-1", "action": "open", "timeout": 0}}"#,
        "error: session_control.timeout must be 1..=31536000 seconds, got 0",
    );
    check(
        r#"{"session_control": {"session_id": "sub-1", "timeout": 31536001}}"#,
        "error: session_control.timeout must be 1..=31536000 seconds, got 31536001",
    );
    check(
        r#"{"session_control": {"session_id": ""}}"#,
        "error: session_control.session_id must be 1..=256 bytes, got 0 bytes",
    );
    let long = format!(
        r#"{{"session_control": {{"session_id": "{}"}}}}"#,
        "x".repeat(257)
    );
    check(
        &long,
        "error: session_control.session_id must be 1..=256 bytes, got 257 bytes",
    );
    let max = format!(
        r#"{{"session_control": {{"session_id": "{}"}}}}"#,
        "x".repeat(256)
    );
    assert!(parse_nvext_json(max.as_bytes(), &LIMITS).is_ok());
    check(
        r#"{"token_data": [1, 2, 3, 4, 5]}"#,
        "error: token_data must be at most 4 tokens, got 5 tokens",
    );
}

#[test]
fn wrong_types_are_rejected_with_their_path() {
    check(
        r#"{"session_control": {"session_id": "sub-1", "action": "reopen"}}"#,
        "error: invalid JSON at `session_control.action`: unknown variant `reopen`, \
         expected one of `open`, `bind`, `close` at line 1 column 62",
    );
    check(
        r#"{"session_control": {"session_id": "sub-1", "action": "Open"}}"#,
        "error: invalid JSON at `session_control.action`: unknown variant `Open`, \
         expected one of `open`, `bind`, `close` at line 1 column 60",
    );
    check(
        r#"{"session_control": {"action": "open"}}"#,
        "error: invalid JSON at `session_control`: missing field `session_id` \
         at line 1 column 38",
    );
    check(
        r#"{"session_control": {"session_id": "s", "timeout": -1}}"#,
        "error: invalid JSON at `session_control.timeout`: invalid value: integer `-1`, \
         expected u64 at line 1 column 53",
    );
    check(
        r#"{"backend_instance_id": "7"}"#,
        "error: invalid JSON at `backend_instance_id`: invalid type: string \"7\", \
         expected u64 at line 1 column 27",
    );
    check(
        r#"{"token_data": [1, -2]}"#,
        "error: invalid JSON at `token_data[1]`: invalid value: integer `-2`, \
         expected u32 at line 1 column 21",
    );
    check(
        r#"{"agent_hints": {"priority": "high"}}"#,
        "error: invalid JSON at `agent_hints.priority`: invalid type: string \"high\", \
         expected i32 at line 1 column 35",
    );
    check(
        r#"{"dp_rank": 1} x"#,
        "error: invalid JSON at `.`: trailing characters at line 1 column 16",
    );
    // serde reads a struct from a JSON array too (positional fields); types are still checked.
    check(
        "[1]",
        "error: invalid JSON at `[0]`: invalid type: integer `1`, expected a boolean \
         at line 1 column 2",
    );
    check(
        r#"{"dp_rank": 1"#,
        "error: invalid JSON at `.`: EOF while parsing an object at line 1 column 13",
    );
}

#[track_caller]
fn check_headers(body: Option<&str>, headers: &[(&str, &str)], expect: &str) {
    let nvext = body.map(|b| NvExt::from_json(b.as_bytes()).expect("body parses"));
    let got = match apply_header_routing_overrides(
        nvext,
        headers.iter().map(|(n, v)| (*n, v.as_bytes())),
    ) {
        Ok(ext) => serde_json::to_string(&ext).expect("serializes"),
        Err(e) => format!("error: {e}"),
    };
    assert_eq!(got, expect, "body {body:?} headers {headers:?}");
}

#[test]
fn header_overrides() {
    // All four headers, over a body that sets the same fields: headers win.
    check_headers(
        Some(
            r#"{"backend_instance_id": 1, "decode_worker_id": 2, "prefill_worker_id": 3,
                 "dp_rank": 4, "prefill_dp_rank": 5, "greed_sampling": true}"#,
        ),
        &[
            ("x-worker-instance-id", "100"),
            ("x-prefill-instance-id", "200"),
            ("x-dp-rank", "7"),
            ("x-prefill-dp-rank", "8"),
        ],
        r#"{"greed_sampling":true,"backend_instance_id":100,"prefill_worker_id":200,"decode_worker_id":100,"dp_rank":7,"prefill_dp_rank":8}"#,
    );
    // Headers create nvext when the body has none; names are case-insensitive.
    check_headers(
        None,
        &[
            ("X-Worker-Instance-Id", " 42 "),
            ("content-type", "application/json"),
        ],
        r#"{"backend_instance_id":42,"decode_worker_id":42}"#,
    );
    // No routing headers: the request stays without nvext.
    check_headers(None, &[("accept", "text/event-stream")], "null");
    // u32::MAX means unset: it overrides nothing, the body value stays.
    check_headers(
        Some(r#"{"dp_rank": 4, "prefill_dp_rank": 5}"#),
        &[
            ("x-dp-rank", "4294967295"),
            ("x-prefill-dp-rank", "4294967295"),
        ],
        r#"{"dp_rank":4,"prefill_dp_rank":5}"#,
    );
    check_headers(None, &[("x-prefill-dp-rank", "4294967295")], "null");
    // The last of repeated headers wins.
    check_headers(
        None,
        &[("x-dp-rank", "1"), ("x-dp-rank", "2")],
        r#"{"dp_rank":2}"#,
    );
}

#[test]
fn unparsable_headers_are_errors() {
    check_headers(
        None,
        &[("x-worker-instance-id", "abc")],
        r#"error: header x-worker-instance-id must be an unsigned 64-bit integer, got "abc""#,
    );
    check_headers(
        None,
        &[("x-dp-rank", "-1")],
        r#"error: header x-dp-rank must be an unsigned 32-bit integer, got "-1""#,
    );
    check_headers(
        None,
        &[("x-prefill-dp-rank", "4294967296")],
        r#"error: header x-prefill-dp-rank must be an unsigned 32-bit integer, got "4294967296""#,
    );
    check_headers(
        None,
        &[("x-prefill-instance-id", "")],
        r#"error: header x-prefill-instance-id must be an unsigned 64-bit integer, got """#,
    );
    let bad_utf8 = apply_header_routing_overrides(None, [("x-dp-rank", &b"\xff1"[..])]);
    assert_eq!(
        bad_utf8.unwrap_err().to_string(),
        "header x-dp-rank must be an unsigned 32-bit integer, got \"\u{fffd}1\""
    );
}

#[test]
fn pinned_phases_match_the_reference() {
    let hints = |json: &str| -> RoutingHints { serde_json::from_str(json).expect("parses") };
    let table: &[(&str, [bool; 3])] = &[
        // [prefill, decode, aggregated]
        ("{}", [false, false, false]),
        (r#"{"backend_instance_id": 1}"#, [true, true, true]),
        (r#"{"prefill_worker_id": 1}"#, [true, false, false]),
        (r#"{"prefill_dp_rank": 0}"#, [true, false, false]),
        (r#"{"decode_worker_id": 1}"#, [false, true, false]),
        (r#"{"dp_rank": 0}"#, [false, true, true]),
        (
            r#"{"lora_name": "a", "priority": 3}"#,
            [false, false, false],
        ),
    ];
    for (json, expect) in table {
        let h = hints(json);
        let got = [
            h.is_pinned(RequestPhase::Prefill),
            h.is_pinned(RequestPhase::Decode),
            h.is_pinned(RequestPhase::Aggregated),
        ];
        assert_eq!(&got, expect, "{json}");
    }
    let h = hints(r#"{"backend_instance_id": 1, "decode_worker_id": 2}"#);
    assert_eq!(h.pinned_worker(RequestPhase::Decode), Some(2));
    assert_eq!(h.pinned_worker(RequestPhase::Prefill), Some(1));
}

#[test]
fn finish_reason_wire_names() {
    let table: &[(FinishReason, &str)] = &[
        (FinishReason::Eos, r#""eos""#),
        (FinishReason::Length, r#""length""#),
        (FinishReason::Stop, r#""stop""#),
        (FinishReason::Cancelled, r#""cancelled""#),
        (FinishReason::ContentFilter, r#""content_filter""#),
        (FinishReason::Error("boom".into()), r#"{"error":"boom"}"#),
    ];
    for (reason, json) in table {
        assert_eq!(&serde_json::to_string(reason).expect("serializes"), json);
        assert_eq!(
            &serde_json::from_str::<FinishReason>(json).expect("parses"),
            reason
        );
    }
    let abort: FinishReason = serde_json::from_str(r#""abort""#).expect("alias parses");
    assert_eq!(abort, FinishReason::Cancelled);
}

#[test]
fn annotated_envelope() {
    let data = Annotated::from_data(LLMEngineOutput {
        token_ids: vec![5],
        ..Default::default()
    });
    assert_eq!(
        serde_json::to_string(&data).expect("ok"),
        r#"{"data":{"token_ids":[5]}}"#
    );
    assert!(!data.is_error());

    let err: Annotated<LLMEngineOutput> = Annotated::from_error("worker died");
    assert_eq!(
        serde_json::to_string(&err).expect("ok"),
        r#"{"event":"error","error":"worker died"}"#
    );
    assert!(err.is_error());
    assert_eq!(err.error_message(), Some("worker died"));

    // The reference's older error shape: event `error` with the message as a comment.
    let old: Annotated<LLMEngineOutput> =
        serde_json::from_str(r#"{"event":"error","comment":["oops"]}"#).expect("parses");
    assert!(old.is_error());
    assert_eq!(old.error_message(), Some("oops"));

    let ann: Annotated<LLMEngineOutput> =
        Annotated::from_annotation("worker_instance_id", vec!["7".into()]);
    assert!(!ann.is_error());
    assert_eq!(
        serde_json::to_string(&ann).expect("ok"),
        r#"{"event":"worker_instance_id","comment":["7"]}"#
    );
}

#[test]
fn preprocessed_request_json_omits_none_and_keeps_extra_args() {
    let mut req = PreprocessedRequest::new("m", vec![1, 2]);
    req.extra_args = Some(serde_json::json!({"k": [1, null, "x"]}));
    req.routing_mut().session_control =
        Some(SessionControl::new("s1").with_action(SessionAction::Close));
    let json = serde_json::to_string(&req).expect("ok");
    assert_eq!(
        json,
        concat!(
            r#"{"model":"m","token_ids":[1,2],"stop_conditions":{},"sampling_options":{},"#,
            r#""output_options":{},"eos_token_ids":[],"annotations":[],"#,
            r#""routing":{"session_control":{"session_id":"s1","action":"close","timeout":300}},"#,
            r#""extra_args":{"k":[1,null,"x"]}}"#
        )
    );
    // A minimal request needs only its tokens.
    let min = crate::parse_request_json(br#"{"token_ids": [3]}"#).expect("parses");
    assert_eq!(min, PreprocessedRequest::new("", vec![3]));
    // The JSON value travels through bincode as text and comes back equal.
    let bin = codec::encode(&req).expect("encodes");
    assert_eq!(
        codec::decode::<PreprocessedRequest>(&bin, 1 << 20).expect("decodes"),
        req
    );
    // Routing validation applies to requests too.
    let bad =
        br#"{"token_ids": [], "routing": {"session_control": {"session_id": "s", "timeout": 0}}}"#;
    assert_eq!(
        crate::parse_request_json(bad).unwrap_err().to_string(),
        "session_control.timeout must be 1..=31536000 seconds, got 0"
    );
}

#[test]
fn builders_default_everything_but_tokens() {
    let ext = NvExt::builder()
        .backend_instance_id(9)
        .dp_rank(1)
        .build()
        .expect("builds");
    assert_eq!(
        serde_json::to_string(&ext).expect("ok"),
        r#"{"backend_instance_id":9,"dp_rank":1}"#
    );
    let req = PreprocessedRequest::builder()
        .model("m")
        .token_ids(vec![1, 2, 3])
        .build()
        .expect("builds");
    assert_eq!(req, PreprocessedRequest::new("m", vec![1, 2, 3]));
    let missing = PreprocessedRequest::builder().model("m").build();
    assert!(missing.unwrap_err().to_string().contains("token_ids"));
}

#[test]
fn codec_rejects_garbage_without_panicking() {
    let limit = 1024;
    let frame = codec::encode(&PreprocessedRequest::new("m", vec![1; 10])).expect("encodes");
    // Every truncation fails cleanly.
    for cut in 0..frame.len() {
        assert!(
            codec::decode::<PreprocessedRequest>(&frame[..cut], limit).is_err(),
            "cut {cut}"
        );
    }
    // Trailing bytes are rejected.
    let mut longer = frame.clone();
    longer.push(0);
    assert!(codec::decode::<PreprocessedRequest>(&longer, limit).is_err());
    // Length prefixes claiming 2^60 bytes or elements run out of input instead of allocating.
    let truncated = "malformed bincode frame: frame ends before the value does \
                     (truncated, or a corrupt length prefix)";
    let huge_string = (1u64 << 60).to_le_bytes();
    let e = codec::decode::<PreprocessedRequest>(&huge_string, limit).unwrap_err();
    assert_eq!(e.to_string(), truncated);
    let mut huge_vec = vec![1u8, 0, 0, 0, 0, 0, 0, 0, b'm'];
    huge_vec.extend_from_slice(&(1u64 << 60).to_le_bytes());
    let e = codec::decode::<PreprocessedRequest>(&huge_vec, limit).unwrap_err();
    assert_eq!(e.to_string(), truncated);
    // A frame longer than the limit is refused before decoding.
    assert_eq!(
        codec::decode::<PreprocessedRequest>(&frame, 8)
            .unwrap_err()
            .to_string(),
        format!(
            "bincode frame of {} bytes exceeds the limit of 8 bytes",
            frame.len()
        )
    );
    // Encoding past the limit is an error too.
    assert!(codec::encode_bounded(&vec![0u32; 100], 64).is_err());
}

#[track_caller]
fn check_load_report(input: &str, expect: &str) {
    let got = match WorkerLoadReport::from_json(input.as_bytes()) {
        Ok(report) => {
            let json = serde_json::to_string(&report).expect("a report serializes");
            let bin = codec::encode(&report).expect("a report encodes");
            assert_eq!(
                codec::decode::<WorkerLoadReport>(&bin, 1 << 10).expect("decodes"),
                report
            );
            format!("{json} requests={:?}", report.requests())
        }
        Err(e) => format!("error: {e}"),
    };
    assert_eq!(got, expect, "input: {input}");
}

#[test]
fn load_reports_decode_with_defaults_and_validate() {
    // The reference's `ActiveLoad` shape (its other fields ignored), rank defaulting to 0.
    check_load_report(
        r#"{"worker_id": 7, "kv_used_blocks": 120, "active_decode_blocks": 3}"#,
        r#"{"worker_id":7,"dp_rank":0,"kv_used_blocks":120} requests=None"#,
    );
    check_load_report(
        r#"{"worker_id": 7, "dp_rank": 2, "requests_running": 3, "requests_waiting": 4}"#,
        r#"{"worker_id":7,"dp_rank":2,"requests_running":3,"requests_waiting":4} requests=Some(7)"#,
    );
    check_load_report(
        r#"{"worker_id": 7, "requests_running": 0, "requests_waiting": 0}"#,
        r#"{"worker_id":7,"dp_rank":0,"requests_running":0,"requests_waiting":0} requests=Some(0)"#,
    );
    check_load_report(
        r#"{"worker_id": 7}"#,
        "error: worker load report must be at least one of kv_used_blocks, kv_total_blocks, \
         requests_running + requests_waiting, got no figure",
    );
    // A capacity: alone it is a figure; it must be at least 1 and at least the blocks in use.
    check_load_report(
        r#"{"worker_id": 7, "kv_total_blocks": 3125}"#,
        r#"{"worker_id":7,"dp_rank":0,"kv_total_blocks":3125} requests=None"#,
    );
    check_load_report(
        r#"{"worker_id": 7, "kv_used_blocks": 40, "kv_total_blocks": 3125}"#,
        r#"{"worker_id":7,"dp_rank":0,"kv_used_blocks":40,"kv_total_blocks":3125} requests=None"#,
    );
    check_load_report(
        r#"{"worker_id": 7, "kv_total_blocks": 0}"#,
        "error: kv_total_blocks must be at least 1, got 0",
    );
    check_load_report(
        r#"{"worker_id": 7, "kv_used_blocks": 41, "kv_total_blocks": 40}"#,
        "error: kv_used_blocks must be at most kv_total_blocks (40), got 41",
    );
    check_load_report(
        r#"{"worker_id": 7, "requests_running": 3}"#,
        "error: requests_waiting must be present when requests_running is, got nothing",
    );
    check_load_report(
        r#"{"worker_id": 7, "kv_used_blocks": 1, "requests_waiting": 3}"#,
        "error: requests_running must be present when requests_waiting is, got nothing",
    );
    check_load_report(
        r#"{"worker_id": 7, "requests_running": 18446744073709551615, "requests_waiting": 1}"#,
        "error: requests_running + requests_waiting must be at most 18446744073709551615, \
         got 18446744073709551615 + 1",
    );
    check_load_report(
        r#"{"worker_id": 7, "requests_running": -1, "requests_waiting": 0}"#,
        "error: invalid JSON at `requests_running`: invalid value: integer `-1`, expected u64 \
         at line 1 column 39",
    );
    check_load_report(
        r#"{"dp_rank": 1, "kv_used_blocks": 1}"#,
        "error: invalid JSON at `.`: missing field `worker_id` at line 1 column 35",
    );
}

#[test]
fn load_report_builders_match_the_decoded_form() {
    let report = WorkerLoadReport::new(9)
        .with_dp_rank(1)
        .with_requests(2, 5)
        .with_kv_used_blocks(64);
    assert_eq!(report.validate(), Ok(()));
    assert_eq!(report.worker(), crate::WorkerWithDpRank::new(9, 1));
    assert_eq!(report.requests(), Some(7));
    let json = serde_json::to_vec(&report).expect("serializes");
    assert_eq!(WorkerLoadReport::from_json(&json), Ok(report));
    assert!(WorkerLoadReport::new(9).validate().is_err());
}
