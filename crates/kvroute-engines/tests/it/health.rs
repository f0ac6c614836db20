//! Health checks and the configuration that shapes every request.

use kvroute_engines::{EngineKind, HealthError, HttpEngine, HttpEngineConfig};
use kvroute_protocols::PreprocessedRequest;
use serde_json::json;

use crate::support::{After, MockEngine, Reply, refused_url, run};

#[tokio::test]
async fn health_asks_the_dialects_endpoint() {
    for (kind, path) in [
        (EngineKind::Vllm, "/health"),
        (EngineKind::Sglang, "/health"),
        (EngineKind::Trtllm, "/health"),
        (EngineKind::Llamacpp, "/health"),
        (EngineKind::Openai, "/v1/models"),
    ] {
        let mut mock = MockEngine::start(vec![Reply::json(200, &json!({"status": "ok"}))]).await;
        let engine = HttpEngine::new(HttpEngineConfig::new(kind, &mock.base_url)).unwrap();
        assert_eq!(engine.health().await, Ok(()), "{kind}");
        let got = mock.request().await;
        assert_eq!(
            (got.method.as_str(), got.path.as_str()),
            ("GET", path),
            "{kind}"
        );
    }
}

#[tokio::test]
async fn an_unhealthy_engine_says_why() {
    let body =
        json!({"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}});
    let mock = MockEngine::start(vec![Reply::json(503, &body)]).await;
    let engine =
        HttpEngine::new(HttpEngineConfig::new(EngineKind::Llamacpp, &mock.base_url)).unwrap();
    assert_eq!(
        engine.health().await,
        Err(HealthError::Unhealthy {
            url: format!("{}/health", mock.base_url),
            status: 503,
            message: "Loading model".to_owned(),
        })
    );
}

#[tokio::test]
async fn an_unreachable_engine_is_reported() {
    let url = refused_url().await;
    let engine = HttpEngine::new(HttpEngineConfig::new(EngineKind::Vllm, &url)).unwrap();
    match engine.health().await {
        Err(HealthError::Unreachable { url: got, .. }) => assert_eq!(got, format!("{url}/health")),
        other => panic!("expected Unreachable, got {other:?}"),
    }
}

#[tokio::test]
async fn served_model_name_api_key_and_default_max_tokens_are_applied() {
    let done = r#"data: {"choices":[{"index":0,"token_ids":[2],"finish_reason":"stop"}]}"#;
    let mut mock = MockEngine::start(vec![Reply::sse(
        &[done.to_owned(), "data: [DONE]".to_owned()],
        After::End,
    )])
    .await;
    let mut config = HttpEngineConfig::new(EngineKind::Vllm, format!("{}/", mock.base_url));
    config.served_model_name = Some("served".to_owned());
    config.api_key = Some("sk-test".to_owned());
    config.default_max_tokens = Some(64);
    let engine = HttpEngine::new(config).unwrap();
    let outcome = run(&engine, PreprocessedRequest::new("frontend-name", vec![1])).await;
    assert!(outcome.failure.is_none(), "{:?}", outcome.failure);
    let got = mock.request().await;
    assert_eq!(got.body["model"], json!("served"));
    assert_eq!(got.body["max_tokens"], json!(64));
    assert_eq!(
        got.headers
            .get("authorization")
            .and_then(|v| v.to_str().ok()),
        Some("Bearer sk-test")
    );
    assert_eq!(
        got.headers.get("accept").and_then(|v| v.to_str().ok()),
        Some("text/event-stream")
    );
}
