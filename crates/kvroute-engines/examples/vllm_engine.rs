//! Puts an `HttpEngine` in front of a vLLM server: the prompt goes out as token ids, the streamed
//! output comes back as token ids with a finish reason. A few lines of axum stand in for vLLM here
//! (answering as vLLM's OpenAI server does), so the example runs anywhere.
//!
//! Run with `cargo run -p kvroute-engines --example vllm_engine`.

use axum::Router;
use axum::routing::{get, post};
use futures::StreamExt;
use kvroute_engines::{EngineKind, HttpEngine, HttpEngineConfig};
use kvroute_protocols::{FinishReason, PreprocessedRequest};
use kvroute_runtime::{Engine, RequestContext};

/// vLLM's streamed `/v1/completions` answer with `return_token_ids`: " Paris" "." then EOS.
const VLLM_STREAM: &str = concat!(
    r#"data: {"object":"text_completion","model":"m","choices":[{"index":0,"text":" Paris","finish_reason":null,"token_ids":[12366]}]}"#,
    "\n\n",
    r#"data: {"object":"text_completion","model":"m","choices":[{"index":0,"text":".","finish_reason":null,"token_ids":[13]}]}"#,
    "\n\n",
    r#"data: {"object":"text_completion","model":"m","choices":[{"index":0,"text":"","finish_reason":"stop","token_ids":[128009]}]}"#,
    "\n\n",
    r#"data: {"object":"text_completion","model":"m","choices":[],"usage":{"prompt_tokens":6,"completion_tokens":3,"total_tokens":9}}"#,
    "\n\n",
    "data: [DONE]\n\n",
);

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // The stand-in vLLM on a free loopback port.
    let fake_vllm = Router::new().route("/health", get(|| async { "" })).route(
        "/v1/completions",
        post(|| async { ([("content-type", "text/event-stream")], VLLM_STREAM) }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let base_url = format!("http://{}", listener.local_addr()?);
    tokio::spawn(async move { axum::serve(listener, fake_vllm).await });

    let engine = HttpEngine::new(HttpEngineConfig::new("vllm".parse()?, base_url))?;
    engine.health().await?;
    println!(
        "{} engine at {} is healthy",
        engine.kind(),
        engine.generate_url()
    );
    assert_eq!(engine.kind(), EngineKind::Vllm);

    // What a router sends a worker: the prompt already tokenized.
    let request = PreprocessedRequest::new("m", vec![128000, 791, 6864, 315, 9822, 374]);
    let stream = engine.generate(request, RequestContext::new("req-1"))?;
    let outputs: Vec<_> = stream.collect().await;
    let mut tokens = Vec::new();
    let mut finish = None;
    for item in &outputs {
        assert!(item.error.is_none(), "{:?}", item.error);
        if let Some(output) = &item.data {
            tokens.extend_from_slice(&output.token_ids);
            finish = finish.or(output.finish_reason.clone());
        }
    }
    println!("streamed token ids {tokens:?}, finish reason {finish:?}");
    assert_eq!(tokens, [12366, 13, 128009]);
    // vLLM says `stop` with no `stop_reason` when the model ended on its own end token.
    assert_eq!(finish, Some(FinishReason::Eos));

    // A misspelt engine kind is caught when the config is read.
    let err = "vllm2".parse::<EngineKind>().expect_err("no such engine");
    println!("rejected: {err}");
    assert!(err.to_string().contains("expected one of"));
    Ok(())
}
