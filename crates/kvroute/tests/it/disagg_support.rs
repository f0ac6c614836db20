//! What the disaggregated end-to-end tests of both dialects share (`vllm_disagg`,
//! `sglang_disagg`): `kvroute serve --disagg enforced` over a static fleet of a prefill worker 1
//! and a decode worker 2, the request they send, and the check that nothing is left.

use std::path::Path;

use serde_json::{Value, json};

use crate::e2e::{Fleet, Sse, active_requests, gauge};
use crate::engine_sim::{long_prompt, serve_fleet_file};

/// `kvroute serve --disagg enforced` over the fleet `workers` (TOML `[[workers]]` entries for
/// ids 1 and 2) written in `dir`, serving the word-level model; returns once the router lists
/// both workers.
pub(crate) async fn serve_disaggregated(dir: &Path, workers: &str) -> Fleet {
    serve_fleet_file(dir, workers, &["--disagg", "enforced"]).await
}

/// A chat request over `long_prompt(tag)` that asks for the workers' ids in `nvext`.
pub(crate) fn chat_body(tag: &str, max_tokens: u32, stream: bool) -> Value {
    json!({
        "model": "mock",
        "messages": [{"role": "user", "content": long_prompt(tag)}],
        "max_tokens": max_tokens,
        "stream": stream,
        "nvext": {"extra_fields": ["worker_id"]},
    })
}

/// Waits (bounded) until no request is left on workers 1 and 2 and neither router holds prefill
/// or decode load on them.
pub(crate) async fn assert_no_load(fleet: &Fleet) {
    fleet
        .eventually("no request or load left on either engine", |m| {
            (1..=2).all(|w| {
                active_requests(m, w).is_none_or(|n| n == 0)
                    && gauge(m, "worker_prefill_tokens", w).is_none_or(|v| v == 0.0)
                    && gauge(m, "worker_active_blocks", w).is_none_or(|v| v == 0.0)
            })
        })
        .await;
}

/// Streams a long chat (`chat_body(tag, 2000, true)`) through `fleet`, reads its first chunk,
/// runs `kill` (an engine dies mid-stream) and checks that the stream then ends without `[DONE]`.
pub(crate) async fn stream_cut_mid_way(fleet: &Fleet, tag: &str, kill: impl FnOnce()) {
    let response = fleet
        .http
        .post(format!("{}/v1/chat/completions", fleet.base))
        .json(&chat_body(tag, 2000, true))
        .send()
        .await
        .expect("POST");
    assert_eq!(response.status(), 200);
    let mut sse = Sse::new(response);
    let first = sse
        .next()
        .await
        .expect("a first chunk from the decode engine");
    assert!(first.contains("chat.completion.chunk"), "{first}");
    kill();
    let mut last = String::new();
    while let Some(data) = sse.next().await {
        last = data;
    }
    assert_ne!(
        last, "[DONE]",
        "a stream cut by its engine does not end as if complete"
    );
}
