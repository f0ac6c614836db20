//! vLLM's KV connector handshake: what a prefill and a decode engine are sent, and how a
//! prefill's whole answer becomes the output the prefill router reads.

use kvroute_protocols::{FinishReason, PrefillResult, PreprocessedRequest};
use kvroute_runtime::WorkerRole;
use serde_json::{Value, json};

use super::remote_decode;
use crate::config::EngineKind;
use crate::dialect::{Built, Target, for_kind};
use crate::stream::{Action, StreamState};

fn request() -> PreprocessedRequest {
    let mut r = PreprocessedRequest::new("m", vec![1, 2, 3]);
    r.stop_conditions.max_tokens = Some(8);
    r.stop_conditions.min_tokens = Some(2);
    r
}

fn build(role: WorkerRole, r: &PreprocessedRequest) -> (Built, Value) {
    let target = Target {
        model: "m",
        max_tokens: r.stop_conditions.max_tokens,
        role,
    };
    let built = for_kind(EngineKind::Vllm)
        .build(r, &target)
        .expect("builds");
    let body = serde_json::from_slice(&built.body).expect("json");
    (built, body)
}

/// What the NixlConnector of a prefill engine returns (`request_finished`).
fn nixl_params() -> Value {
    json!({
        "do_remote_prefill": true,
        "do_remote_decode": false,
        "remote_block_ids": [4, 5],
        "remote_engine_id": "prefill-0",
        "remote_host": "10.0.0.1",
        "remote_port": 5600,
        "tp_size": 1,
    })
}

#[test]
fn a_prefill_engine_is_asked_for_one_whole_token_for_remote_decode() {
    let (built, body) = build(WorkerRole::Prefill, &request());
    assert!(built.whole);
    assert_eq!(body["stream"], json!(false));
    assert_eq!(body.get("stream_options"), None);
    assert_eq!(body["max_tokens"], json!(1));
    assert_eq!(body.get("min_tokens"), None);
    assert_eq!(
        body["kv_transfer_params"],
        json!({
            "do_remote_decode": true,
            "do_remote_prefill": false,
            "remote_engine_id": null,
            "remote_block_ids": null,
            "remote_host": null,
            "remote_port": null,
        })
    );
    assert_eq!(body["kv_transfer_params"], remote_decode());
    assert_eq!(body["prompt"], json!([1, 2, 3]));
}

#[test]
fn a_decode_engine_gets_the_prefills_parameters_verbatim_and_streams() {
    let mut r = request();
    r.prefill_result = Some(PrefillResult {
        disaggregated_params: nixl_params(),
        prompt_tokens_details: None,
    });
    let (built, body) = build(WorkerRole::Decode, &r);
    assert!(!built.whole);
    assert_eq!(body["kv_transfer_params"], nixl_params());
    assert_eq!(body["stream"], json!(true));
    assert_eq!(body["max_tokens"], json!(8));
    assert_eq!(body["min_tokens"], json!(2));

    // Served aggregated (no prefill result), or by an aggregated engine: no handshake.
    let (_, body) = build(WorkerRole::Decode, &request());
    assert_eq!(body.get("kv_transfer_params"), None);
    let (built, body) = build(WorkerRole::Aggregated, &r);
    assert!(!built.whole);
    assert_eq!(body.get("kv_transfer_params"), None);
}

#[test]
fn a_prefills_whole_answer_carries_its_transfer_parameters() {
    let r = request();
    let parser = for_kind(EngineKind::Vllm).parser(&r);
    let mut state = StreamState::new(EngineKind::Vllm, parser, 3).whole();
    // vLLM's non-streamed `CompletionResponse`, `kv_transfer_params` at the top level.
    let answer = json!({
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 1,
        "model": "m",
        "choices": [{
            "index": 0,
            "text": "x",
            "token_ids": [42],
            "logprobs": null,
            "finish_reason": "length",
            "stop_reason": null,
        }],
        "usage": {
            "prompt_tokens": 3,
            "completion_tokens": 1,
            "total_tokens": 4,
            "prompt_tokens_details": {"cached_tokens": 0},
        },
        "kv_transfer_params": nixl_params(),
    })
    .to_string();
    let (head, tail) = answer.as_bytes().split_at(answer.len() / 2);
    assert!(state.feed(head).is_empty(), "nothing before the whole body");
    assert!(state.feed(tail).is_empty());
    let actions = state.end_of_body();
    let [Action::Emit(item), Action::End] = actions.as_slice() else {
        panic!("one output then the end: {actions:?}");
    };
    let output = item.data.as_ref().expect("data");
    assert_eq!(output.token_ids, vec![42]);
    assert_eq!(output.finish_reason, Some(FinishReason::Length));
    assert_eq!(output.disaggregated_params, Some(nixl_params()));
    assert_eq!(output.completion_usage.map(|u| u.prompt_tokens), Some(3));
}

#[test]
fn a_whole_answer_that_is_no_completion_is_refused() {
    let r = request();
    let parser = for_kind(EngineKind::Vllm).parser(&r);
    let mut state = StreamState::new(EngineKind::Vllm, parser, 3).whole();
    assert!(state.feed(b"{\"detail\": 1}").is_empty());
    let actions = state.end_of_body();
    let Some(Action::Emit(item)) = actions.first() else {
        panic!("an error item: {actions:?}");
    };
    assert!(item.is_error(), "{item:?}");
}
