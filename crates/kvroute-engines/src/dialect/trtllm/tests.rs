//! TensorRT-LLM's context / generation exchange, and SGLang's bootstrap fields.

use kvroute_protocols::{BootstrapInfo, PrefillResult, PreprocessedRequest};
use kvroute_runtime::WorkerRole;
use serde_json::{Value, json};

use crate::config::EngineKind;
use crate::dialect::{Built, Target, for_kind};
use crate::stream::{Action, StreamState};

fn request() -> PreprocessedRequest {
    let mut r = PreprocessedRequest::new("m", vec![1, 2, 3]);
    r.stop_conditions.max_tokens = Some(8);
    r
}

fn build(kind: EngineKind, role: WorkerRole, r: &PreprocessedRequest) -> (Built, Value) {
    let target = Target {
        model: "m",
        max_tokens: r.stop_conditions.max_tokens,
        role,
    };
    let built = for_kind(kind).build(r, &target).expect("builds");
    let body = serde_json::from_slice(&built.body).expect("json");
    (built, body)
}

/// What a context engine answers in `choices[0].disaggregated_params`.
fn context_params() -> Value {
    json!({
        "request_type": "context_only",
        "first_gen_tokens": [42],
        "ctx_request_id": 7,
        "encoded_opaque_state": "b3BhcXVl",
        "draft_tokens": null,
    })
}

#[test]
fn a_context_engine_gets_context_only_and_answers_whole_with_its_params() {
    let (built, body) = build(EngineKind::Trtllm, WorkerRole::Prefill, &request());
    assert!(built.whole);
    assert_eq!(
        body["disaggregated_params"],
        json!({"request_type": "context_only"})
    );
    assert_eq!(
        (body["stream"].clone(), body["max_tokens"].clone()),
        (json!(false), json!(1))
    );
    assert_eq!(
        body.get("kv_transfer_params"),
        None,
        "no other dialect's fields"
    );

    let parser = for_kind(EngineKind::Trtllm).parser(&request());
    let mut state = StreamState::new(EngineKind::Trtllm, parser, 3).whole();
    let answer = json!({
        "id": "cmpl-1", "object": "text_completion", "model": "m",
        "choices": [{"index": 0, "text": "", "token_ids": [42], "finish_reason": "length",
                     "stop_reason": null, "disaggregated_params": context_params()}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
    });
    assert!(state.feed(answer.to_string().as_bytes()).is_empty());
    let actions = state.end_of_body();
    let Some(Action::Emit(item)) = actions.first() else {
        panic!("an output: {actions:?}");
    };
    let output = item.data.as_ref().expect("data");
    assert_eq!(output.disaggregated_params, Some(context_params()));
}

#[test]
fn a_generation_engine_gets_the_context_params_as_generation_only() {
    let mut r = request();
    r.prefill_result = Some(PrefillResult {
        disaggregated_params: context_params(),
        prompt_tokens_details: None,
    });
    let (built, body) = build(EngineKind::Trtllm, WorkerRole::Decode, &r);
    assert!(!built.whole);
    let mut expect = context_params();
    expect["request_type"] = json!("generation_only");
    assert_eq!(body["disaggregated_params"], expect);
    assert_eq!(body["stream"], json!(true));
    let (_, aggregated) = build(EngineKind::Trtllm, WorkerRole::Aggregated, &r);
    assert_eq!(aggregated.get("disaggregated_params"), None);
}

#[test]
fn sglang_engines_of_a_pair_get_the_same_bootstrap_fields() {
    let mut r = request();
    let plain = build(EngineKind::Sglang, WorkerRole::Decode, &r).1;
    assert_eq!(plain.get("bootstrap_room"), None);
    r.bootstrap_info = Some(BootstrapInfo {
        bootstrap_host: "10.0.0.2".into(),
        bootstrap_port: 8998,
        bootstrap_room: 12345,
    });
    for role in [WorkerRole::Prefill, WorkerRole::Decode] {
        let (built, body) = build(EngineKind::Sglang, role, &r);
        assert!(!built.whole, "SGLang streams on both sides");
        assert_eq!(body["bootstrap_host"], json!("10.0.0.2"));
        assert_eq!(body["bootstrap_port"], json!(8998));
        assert_eq!(body["bootstrap_room"], json!(12345));
    }
}
