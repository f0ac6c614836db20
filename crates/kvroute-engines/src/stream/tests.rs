//! The stream state machine: what goes out when, for bodies fed in one piece.

use kvroute_protocols::{Annotated, CompletionUsage, LLMEngineOutput, PreprocessedRequest};

use super::{Action, StreamState};
use crate::config::EngineKind;
use crate::dialect::for_kind;

fn state(kind: EngineKind) -> StreamState {
    let request = PreprocessedRequest::new("m", vec![1, 2, 3]);
    StreamState::new(kind, for_kind(kind).parser(&request), 3)
}

/// Feeds `body`, then ends it the way `end` says (`eof`, `cut`, `stop` or `none`), and checks
/// the actions, written `ids 1 2`, `text x`, `finish eos usage 3+2`, `error ...`, `fail ...`,
/// `end`.
fn check(kind: EngineKind, body: &str, end: &str, expect: &[&str]) {
    let mut state = state(kind);
    let mut actions = state.feed(body.as_bytes());
    actions.extend(match end {
        "eof" => state.end_of_body(),
        "cut" => state.body_error("connection reset".to_owned()),
        "stop" => state.stopped(),
        _ => Vec::new(),
    });
    let got: Vec<String> = actions.iter().map(show).collect();
    assert_eq!(got, expect, "{kind} body {body:?} then {end}");
}

fn show(action: &Action) -> String {
    match action {
        Action::End => "end".to_owned(),
        Action::Fail(kvroute_runtime::EngineError::Unavailable { message }) => {
            format!("fail {message}")
        }
        Action::Fail(other) => format!("fail {other}"),
        Action::Emit(item) => show_item(item),
    }
}

fn show_item(item: &Annotated<LLMEngineOutput>) -> String {
    if let Some(error) = &item.error {
        return format!("error {error}");
    }
    let out = item.data.as_ref().expect("data");
    let mut s = String::new();
    if !out.token_ids.is_empty() {
        s += &format!("ids {}", join(&out.token_ids));
    }
    if let Some(text) = &out.text {
        s += &format!("text {text}");
    }
    if let Some(reason) = &out.finish_reason {
        s += &format!("finish {reason}");
    }
    if let Some(CompletionUsage {
        prompt_tokens,
        completion_tokens,
        prompt_tokens_details,
        ..
    }) = &out.completion_usage
    {
        s += &format!(" usage {prompt_tokens}+{completion_tokens}");
        if let Some(cached) = prompt_tokens_details.and_then(|d| d.cached_tokens) {
            s += &format!(" cached {cached}");
        }
    }
    s.trim().to_owned()
}

fn join(ids: &[u32]) -> String {
    ids.iter().map(u32::to_string).collect::<Vec<_>>().join(" ")
}

const VLLM_BODY: &str = concat!(
    "data: {\"choices\":[{\"index\":0,\"text\":\"a\",\"token_ids\":[10]}]}\n\n",
    "data: {\"choices\":[{\"index\":0,\"text\":\"b\",\"token_ids\":[11],\"finish_reason\":\"length\"}]}\n\n",
    "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":2,\"total_tokens\":5,\"prompt_tokens_details\":{\"cached_tokens\":2}}}\n\n",
    "data: [DONE]\n\n",
);

#[test]
fn the_finish_waits_for_its_usage() {
    check(
        EngineKind::Vllm,
        VLLM_BODY,
        "none",
        // vLLM's text goes along with its ids.
        &[
            "ids 10text a",
            "ids 11text bfinish length usage 3+2 cached 2",
            "end",
        ],
    );
}

#[test]
fn a_finish_without_usage_goes_out_at_done_with_counted_usage() {
    let body = concat!(
        "data: {\"choices\":[{\"index\":0,\"token_ids\":[10],\"finish_reason\":\"stop\"}]}\n\n",
        "data: [DONE]\n\n",
    );
    check(
        EngineKind::Vllm,
        body,
        "none",
        &["ids 10finish eos usage 3+1", "end"],
    );
    // A text-only server has nothing to count.
    let body = concat!(
        "data: {\"choices\":[{\"index\":0,\"text\":\"x\",\"finish_reason\":\"stop\"}]}\n\n",
        "data: [DONE]\n\n",
    );
    check(
        EngineKind::Openai,
        body,
        "none",
        &["text xfinish stop", "end"],
    );
}

#[test]
fn a_finish_survives_a_lost_usage_chunk() {
    let body =
        "data: {\"choices\":[{\"index\":0,\"token_ids\":[10],\"finish_reason\":\"length\"}]}\n\n";
    check(
        EngineKind::Vllm,
        body,
        "cut",
        &["ids 10finish length usage 3+1", "end"],
    );
    check(
        EngineKind::Vllm,
        body,
        "eof",
        &["ids 10finish length usage 3+1", "end"],
    );
}

#[test]
fn a_stream_cut_before_the_finish_is_unavailable() {
    let body = "data: {\"choices\":[{\"index\":0,\"token_ids\":[10]}]}\n\n";
    check(
        EngineKind::Vllm,
        body,
        "cut",
        &[
            "ids 10",
            "fail lost the vllm engine's stream after 1 tokens: connection reset",
            "end",
        ],
    );
    check(
        EngineKind::Vllm,
        body,
        "eof",
        &[
            "ids 10",
            "fail vllm engine closed the stream before finishing, after 1 tokens",
            "end",
        ],
    );
}

#[test]
fn done_without_a_finish_is_an_error_item() {
    check(
        EngineKind::Sglang,
        "data: [DONE]\n\n",
        "none",
        &[
            "error sglang engine ended the stream without a finish reason",
            "end",
        ],
    );
}

#[test]
fn a_stop_ends_with_cancelled() {
    let body = "data: {\"choices\":[{\"index\":0,\"token_ids\":[10]}]}\n\n";
    check(
        EngineKind::Vllm,
        body,
        "stop",
        &["ids 10", "finish cancelled", "end"],
    );
}

#[test]
fn nothing_follows_the_end() {
    let mut state = state(EngineKind::Vllm);
    let first = state.feed(VLLM_BODY.as_bytes());
    assert_eq!(first.last(), Some(&Action::End));
    assert!(state.is_ended());
    assert_eq!(state.feed(VLLM_BODY.as_bytes()), Vec::new());
    assert_eq!(state.end_of_body(), Vec::new());
    assert_eq!(state.stopped(), Vec::new());
}

#[test]
fn an_error_chunk_ends_the_stream_with_one_error_item() {
    let body = concat!(
        "data: {\"choices\":[{\"index\":0,\"token_ids\":[10]}]}\n\n",
        "data: {\"error\":{\"message\":\"boom\",\"code\":500}}\n\n",
        "data: [DONE]\n\n",
    );
    check(
        EngineKind::Vllm,
        body,
        "eof",
        &["ids 10", "error vllm engine error 500: boom", "end"],
    );
}

#[test]
fn sglang_finishes_at_done_and_llamacpp_at_its_last_chunk() {
    let sglang = concat!(
        "data: {\"output_ids\":[10],\"meta_info\":{\"completion_tokens\":1,\"prompt_tokens\":3,",
        "\"cached_tokens\":1,\"finish_reason\":{\"type\":\"length\",\"length\":1}}}\n\n",
    );
    check(EngineKind::Sglang, sglang, "none", &[]);
    check(
        EngineKind::Sglang,
        &format!("{sglang}data: [DONE]\n\n"),
        "none",
        &["ids 10finish length usage 3+1 cached 1", "end"],
    );
    let llamacpp = concat!(
        "data: {\"content\":\"a\",\"tokens\":[10],\"stop\":false}\n\n",
        "data: {\"content\":\"\",\"tokens\":[],\"stop\":true,\"stop_type\":\"eos\",",
        "\"tokens_predicted\":1,\"tokens_evaluated\":3,\"timings\":{\"cache_n\":0}}\n\n",
    );
    check(
        EngineKind::Llamacpp,
        llamacpp,
        "none",
        &["ids 10", "finish eos usage 3+1 cached 0", "end"],
    );
}

#[test]
fn usage_beside_the_finish_counts_and_a_later_one_wins() {
    // llama.cpp's OpenAI endpoint puts the usage in the finishing chunk.
    let inline = concat!(
        "data: {\"choices\":[{\"index\":0,\"text\":\"x\",\"finish_reason\":\"length\"}],",
        "\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":1,\"total_tokens\":4,",
        "\"prompt_tokens_details\":{\"cached_tokens\":2}}}\n\n",
        "data: [DONE]\n\n",
    );
    check(
        EngineKind::Openai,
        inline,
        "none",
        &["text xfinish length usage 3+1 cached 2", "end"],
    );
    // vLLM with continuous usage: a running count beside the finish, then the final usage.
    let running = concat!(
        "data: {\"choices\":[{\"index\":0,\"token_ids\":[10],\"finish_reason\":\"length\"}],",
        "\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":1,\"total_tokens\":4}}\n\n",
        "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":1,",
        "\"total_tokens\":4,\"prompt_tokens_details\":{\"cached_tokens\":2}}}\n\n",
        "data: [DONE]\n\n",
    );
    check(
        EngineKind::Vllm,
        running,
        "none",
        &["ids 10finish length usage 3+1 cached 2", "end"],
    );
}

#[test]
fn an_undecodable_stream_is_an_error_item() {
    let mut state = state(EngineKind::Vllm);
    let actions = state.feed(b"data: \xff\n\n");
    assert_eq!(
        actions,
        vec![
            Action::Emit(Box::new(Annotated::from_error(
                "malformed vllm stream: an event-stream line is not UTF-8"
            ))),
            Action::End
        ]
    );
}
