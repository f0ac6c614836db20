//! How failures are typed: an engine that cannot serve now fails the request context with
//! `Unavailable` (the router may migrate); an engine that refuses gives one error item.

use std::time::Duration;

use kvroute_engines::{EngineKind, HttpEngine, HttpEngineConfig};
use kvroute_protocols::PreprocessedRequest;
use serde_json::json;

use kvroute_runtime::EngineError;

use crate::support::{After, MockEngine, Reply, engine, next, refused_url, run, start};

fn request() -> PreprocessedRequest {
    let mut r = PreprocessedRequest::new("m", vec![1, 2, 3]);
    r.stop_conditions.max_tokens = Some(4);
    r
}

fn vllm_token(id: u32) -> String {
    format!(
        r#"data: {{"choices":[{{"index":0,"text":"x","token_ids":[{id}],"finish_reason":null}}]}}"#
    )
}

#[tokio::test]
async fn connection_refused_is_unreachable_so_the_router_moves_it_for_free() {
    for kind in EngineKind::ALL {
        let url = refused_url().await;
        let engine = HttpEngine::new(HttpEngineConfig::new(kind, &url)).unwrap();
        let outcome = run(&engine, request()).await;
        assert!(outcome.items.is_empty(), "{kind}: {:?}", outcome.items);
        let message = outcome.unreachable();
        assert!(
            message.contains(&url) && message.contains("cannot be reached"),
            "{kind}: {message}"
        );
    }
}

#[tokio::test]
async fn overload_statuses_are_unavailable() {
    for status in [503, 429, 502, 504] {
        let body = json!({"error": {"message": "server busy", "type": "ServiceUnavailableError", "code": status}});
        let mock = MockEngine::start(vec![Reply::json(status, &body)]).await;
        let outcome = run(&engine(EngineKind::Vllm, &mock), request()).await;
        assert!(outcome.items.is_empty(), "{status}: {:?}", outcome.items);
        let message = outcome.unavailable();
        assert!(
            message.contains(&format!("HTTP {status}")) && message.contains("server busy"),
            "{status}: {message}"
        );
    }
}

#[tokio::test]
async fn client_errors_and_500_are_error_items() {
    let cases = [
        (
            400,
            json!({"error": {"message": "max_tokens must be at least 1", "type": "BadRequestError", "code": 400}}),
            "HTTP 400 Bad Request: max_tokens must be at least 1",
        ),
        (
            413,
            json!({"detail": "prompt too large"}),
            "HTTP 413 Payload Too Large: prompt too large",
        ),
        (
            422,
            json!({"object": "error", "message": "bad field", "type": "422", "code": 422}),
            "HTTP 422 Unprocessable Entity: bad field",
        ),
        (
            500,
            json!({"error": {"code": 500, "message": "internal", "type": "server_error"}}),
            "HTTP 500 Internal Server Error: internal",
        ),
    ];
    for (status, body, want) in cases {
        let mock = MockEngine::start(vec![Reply::json(status, &body)]).await;
        let outcome = run(&engine(EngineKind::Sglang, &mock), request()).await;
        let message = outcome.error_message();
        assert!(
            message.contains(want) && message.starts_with("sglang engine at http://127.0.0.1"),
            "{status}: {message}"
        );
    }
}

#[tokio::test]
async fn a_connection_cut_mid_stream_is_unavailable() {
    let mock = MockEngine::start(vec![Reply::sse(
        &[vllm_token(10), vllm_token(11)],
        After::Cut,
    )])
    .await;
    let engine = engine(EngineKind::Vllm, &mock);
    let (mut stream, context) = start(&engine, request());
    for id in [10, 11] {
        let item = next(&mut stream).await.expect("a token");
        assert_eq!(item.data.expect("data").token_ids, vec![id]);
    }
    mock.cut();
    assert!(
        next(&mut stream).await.is_none(),
        "the stream ends at the cut"
    );
    match context.failure() {
        Some(EngineError::Unavailable { message }) => assert!(
            message.contains("lost the vllm engine's stream after 2 tokens"),
            "{message}"
        ),
        other => panic!("expected Unavailable, got {other:?}"),
    }
}

#[tokio::test]
async fn a_stream_closed_before_the_finish_is_unavailable() {
    let mock = MockEngine::start(vec![Reply::sse(&[vllm_token(10)], After::End)]).await;
    let outcome = run(&engine(EngineKind::Vllm, &mock), request()).await;
    assert_eq!(outcome.token_ids(), vec![10]);
    assert!(
        outcome
            .unavailable()
            .contains("closed the stream before finishing")
    );
}

#[tokio::test]
async fn a_malformed_chunk_is_an_error_item_naming_it() {
    let events = [vllm_token(10), r#"data: {"choices": "many"}"#.to_owned()];
    let mock = MockEngine::start(vec![Reply::sse(&events, After::Hang)]).await;
    let outcome = run(&engine(EngineKind::Vllm, &mock), request()).await;
    assert!(outcome.failure.is_none());
    assert_eq!(outcome.items.len(), 2);
    let message = outcome.items[1].error_message().expect("error item");
    assert!(
        message.starts_with("malformed vllm stream chunk: invalid type: string \"many\""),
        "{message}"
    );
}

#[tokio::test]
async fn an_answer_that_is_not_an_event_stream_is_an_error_item() {
    let body = json!({"choices": [{"text": "whole answer"}]});
    let mock = MockEngine::start(vec![Reply::json(200, &body)]).await;
    let outcome = run(&engine(EngineKind::Openai, &mock), request()).await;
    let message = outcome.error_message();
    assert!(
        message.contains("answered `application/json` instead of an event stream"),
        "{message}"
    );
}

#[tokio::test]
async fn no_answer_within_the_first_byte_timeout_is_a_timeout() {
    let mock = MockEngine::start(vec![Reply::Stall]).await;
    let mut config = HttpEngineConfig::new(EngineKind::Vllm, &mock.base_url);
    config.first_byte_timeout = Some(Duration::from_millis(50));
    let engine = HttpEngine::new(config).unwrap();
    let outcome = run(&engine, request()).await;
    assert!(outcome.items.is_empty());
    assert!(
        outcome.timed_out().contains("first-byte limit of 50ms"),
        "{}",
        outcome.timed_out()
    );
}

#[tokio::test]
async fn a_stream_that_goes_quiet_mid_body_ends_at_the_idle_limit() {
    let mock = MockEngine::start(vec![Reply::sse(&[vllm_token(10)], After::Hang)]).await;
    let mut config = HttpEngineConfig::new(EngineKind::Vllm, &mock.base_url);
    config.idle_timeout = Some(Duration::from_millis(100));
    let engine = HttpEngine::new(config).unwrap();
    let started = std::time::Instant::now();
    let outcome = run(&engine, request()).await;
    assert!(started.elapsed() >= Duration::from_millis(100));
    assert_eq!(outcome.token_ids(), vec![10]);
    let message = outcome.unavailable();
    assert!(
        message.contains("lost the vllm engine's stream after 1 tokens")
            && message.contains("timed out waiting for the next piece"),
        "{message}"
    );
}

#[tokio::test]
async fn a_stream_paced_within_the_idle_limit_runs_past_it() {
    // Each piece comes well within the limit, the whole stream takes longer than it: the idle
    // deadline moves with every piece.
    let mut events: Vec<String> = (10..13).map(vllm_token).collect();
    events.push(
        r#"data: {"choices":[{"index":0,"text":"x","token_ids":[13],"finish_reason":"length"}]}"#
            .to_owned(),
    );
    let mock = MockEngine::start(vec![Reply::paced(
        &events,
        Duration::from_millis(60),
        After::End,
    )])
    .await;
    let mut config = HttpEngineConfig::new(EngineKind::Vllm, &mock.base_url);
    config.idle_timeout = Some(Duration::from_millis(150));
    let engine = HttpEngine::new(config).unwrap();
    let started = std::time::Instant::now();
    let outcome = run(&engine, request()).await;
    assert!(started.elapsed() >= Duration::from_millis(180));
    assert!(outcome.failure.is_none(), "{outcome:?}");
    assert_eq!(outcome.token_ids(), vec![10, 11, 12, 13], "{outcome:?}");
}

#[tokio::test]
async fn an_engine_4xx_carries_its_status_and_a_context_overflow_its_code() {
    // llama.cpp's answer to a prompt over its context.
    let body = json!({"error": {"code": 400, "message": "the request exceeds the available context size, try increasing it", "type": "exceed_context_size_error", "n_prompt_tokens": 700, "n_ctx": 512}});
    let mock = MockEngine::start(vec![Reply::json(400, &body)]).await;
    let outcome = run(&engine(EngineKind::Llamacpp, &mock), request()).await;
    let message = outcome.error_message();
    assert!(message.contains("HTTP 400"), "{message}");
    assert_eq!(outcome.items[0].error_status(), Some(400));
    assert_eq!(
        outcome.items[0].error_code(),
        Some("context_length_exceeded")
    );
    // Another 4xx keeps its status, without a code.
    let body = json!({"error": {"code": 404, "message": "model not found"}});
    let mock = MockEngine::start(vec![Reply::json(404, &body)]).await;
    let outcome = run(&engine(EngineKind::Vllm, &mock), request()).await;
    assert_eq!(outcome.items[0].error_status(), Some(404));
    assert_eq!(outcome.items[0].error_code(), None);
}

#[tokio::test]
async fn unsupported_requests_are_refused_before_any_http() {
    let mock = MockEngine::start(vec![Reply::Stall]).await;
    let engine = engine(EngineKind::Vllm, &mock);
    let mut r = request();
    r.sampling_options.n = Some(2);
    let context = kvroute_runtime::RequestContext::new("r");
    let refused = kvroute_runtime::Engine::generate(&engine, r, context).err();
    assert!(
        matches!(&refused, Some(kvroute_runtime::EngineError::Rejected { message }) if message.contains("n = 2")),
        "{refused:?}"
    );
}
