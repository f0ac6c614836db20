//! The real llama.cpp exchanges recorded in `tests/fixtures/llamacpp/` (xllamacpp 2026.10.11549,
//! see its README and INDEX), replayed: the body kvroute sends for the same request must be the
//! one the recording sent (which llama.cpp accepted), and kvroute must read the recorded stream
//! into the ids, finish reason and usage the recording shows.

use bytes::Bytes;
use kvroute_engines::{EngineKind, HealthError, HttpEngine, HttpEngineConfig};
use kvroute_protocols::{FinishReason, PreprocessedRequest};
use serde_json::Value;

use crate::support::{After, MockEngine, Reply, fixtures_dir, next, run, start};

/// One recorded exchange: its meta, request body (if any) and response body, byte for byte.
struct Recording {
    meta: Value,
    request: Option<Value>,
    response: Vec<u8>,
}

fn recording(name: &str) -> Recording {
    let dir = fixtures_dir().join("llamacpp");
    let read = |file: &str| {
        std::fs::read(dir.join(file)).unwrap_or_else(|e| panic!("{name}: {file}: {e}"))
    };
    let meta: Value = serde_json::from_slice(&read(&format!("{name}.meta.json"))).expect("meta");
    let request = meta["request"]
        .as_str()
        .map(|f| serde_json::from_slice(&read(f)).expect("request json"));
    let response = read(meta["response"].as_str().expect("response file"));
    Recording {
        meta,
        request,
        response,
    }
}

impl Recording {
    /// The recorded answer: the body in pieces of one event each (as the server flushed them),
    /// then `after`.
    fn reply(&self, after: After) -> Reply {
        let text = String::from_utf8(self.response.clone()).expect("utf-8 body");
        let pieces = text
            .split_inclusive("\n\n")
            .map(|p| Bytes::from(p.to_owned()))
            .collect();
        Reply::Stream {
            status: self.meta["status"].as_u64().expect("status") as u16,
            content_type: self.meta["content_type"].as_str().expect("type").to_owned(),
            pieces,
            gap: std::time::Duration::ZERO,
            after,
        }
    }

    /// The recorded stream's chunks.
    fn chunks(&self) -> Vec<Value> {
        String::from_utf8_lossy(&self.response)
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .filter(|d| d.trim() != "[DONE]")
            .map(|d| serde_json::from_str(d).expect("chunk json"))
            .collect()
    }
}

/// The kvroute request that asks what the recorded `/completion` body asks.
fn request_for(body: &Value) -> PreprocessedRequest {
    let mut r = PreprocessedRequest::new(
        body["model"].as_str().unwrap_or_default(),
        serde_json::from_value(body["prompt"].clone()).expect("token id prompt"),
    );
    let num = |k: &str| body.get(k).and_then(Value::as_u64).map(|n| n as u32);
    r.stop_conditions.max_tokens = num("n_predict").or(num("max_tokens"));
    r.stop_conditions.stop = body
        .get("stop")
        .map(|s| serde_json::from_value(s.clone()).unwrap());
    r.stop_conditions.ignore_eos = body.get("ignore_eos").and_then(Value::as_bool);
    r.sampling_options.temperature = body
        .get("temperature")
        .and_then(Value::as_f64)
        .map(|t| t as f32);
    r.sampling_options.seed = body.get("seed").and_then(Value::as_i64);
    r.output_options.logprobs = num("n_probs");
    r
}

/// `body` without the fields kvroute has no request option for (the recordings force an end
/// token with `logit_bias`; the OpenAI-endpoint recordings add `return_tokens` to show it is
/// ignored there).
fn without(body: &Value, fields: &[&str]) -> Value {
    let mut body = body.clone();
    for f in fields {
        body.as_object_mut().expect("object").remove(*f);
    }
    body
}

#[tokio::test]
async fn recorded_streams_replay() {
    // (exchange, finish reason, cached prompt tokens); the rest is read from the recording.
    let cases = [
        ("completion_stream", FinishReason::Length, 0),
        ("completion_stream_repeat", FinishReason::Length, 68),
        ("completion_stream_extend", FinishReason::Length, 84),
        ("completion_stream_stop", FinishReason::Stop, 68),
        ("completion_stream_eos", FinishReason::Eos, 68),
        ("completion_stream_ignore_eos", FinishReason::Length, 68),
        ("completion_stream_n_probs", FinishReason::Length, 68),
        ("slot_reuse_1", FinishReason::Length, 0),
        ("slot_reuse_2", FinishReason::Length, 205),
        ("slot_reuse_3", FinishReason::Length, 205),
    ];
    for (name, finish, cached) in cases {
        let rec = recording(name);
        let recorded_body = rec.request.clone().expect("a request body");
        let mut mock = MockEngine::start(vec![rec.reply(After::End)]).await;
        let engine =
            HttpEngine::new(HttpEngineConfig::new(EngineKind::Llamacpp, &mock.base_url)).unwrap();
        let outcome = run(&engine, request_for(&recorded_body)).await;
        let sent = mock.request().await;
        assert_eq!(sent.path, "/completion", "{name}");
        assert_eq!(
            sent.body,
            without(&recorded_body, &["logit_bias"]),
            "{name}: body sent"
        );

        let chunks = rec.chunks();
        let (last, partial) = chunks.split_last().expect("chunks");
        let streamed: Vec<u32> = partial
            .iter()
            .flat_map(|c| serde_json::from_value::<Vec<u32>>(c["tokens"].clone()).unwrap())
            .collect();
        assert!(outcome.failure.is_none(), "{name}: {:?}", outcome.failure);
        assert_eq!(
            outcome.token_ids(),
            streamed,
            "{name}: every streamed id, once"
        );
        let out = outcome.last();
        assert_eq!(out.finish_reason, Some(finish), "{name}");
        let usage = out.completion_usage.expect("usage");
        assert_eq!(
            u64::from(usage.prompt_tokens),
            last["tokens_evaluated"].as_u64().unwrap(),
            "{name}"
        );
        assert_eq!(
            u64::from(usage.completion_tokens),
            last["tokens_predicted"].as_u64().unwrap(),
            "{name}"
        );
        assert_eq!(
            usage.prompt_tokens_details.and_then(|d| d.cached_tokens),
            Some(cached),
            "{name}: cached prompt tokens"
        );
        assert!(
            outcome.outputs().iter().all(|o| o.text.is_none()),
            "{name}: ids only"
        );
        if name == "completion_stream_n_probs" {
            let log_probs: Vec<f64> = outcome
                .outputs()
                .iter()
                .flat_map(|o| o.log_probs.clone().unwrap_or_default())
                .collect();
            assert_eq!(
                log_probs.len(),
                streamed.len(),
                "{name}: one log prob per id"
            );
            assert!(
                log_probs.iter().all(|lp| *lp <= 0.0),
                "{name}: {log_probs:?}"
            );
        }
    }
}

#[tokio::test]
async fn an_end_token_is_streamed_and_reported_as_eos() {
    let rec = recording("completion_stream_eos");
    let mock = MockEngine::start(vec![rec.reply(After::End)]).await;
    let engine =
        HttpEngine::new(HttpEngineConfig::new(EngineKind::Llamacpp, &mock.base_url)).unwrap();
    let outcome = run(&engine, request_for(rec.request.as_ref().unwrap())).await;
    assert_eq!(outcome.token_ids(), vec![4], "<|im_end|> is id 4");
    assert_eq!(outcome.last().finish_reason, Some(FinishReason::Eos));
}

#[tokio::test]
async fn recorded_refusals_are_error_items_with_the_engines_message() {
    for name in [
        "completion_error_empty_prompt",
        "completion_error_bad_field",
        "completion_error_invalid_token",
        "completion_error_too_long",
        "completion_error_missing_prompt",
    ] {
        let rec = recording(name);
        let recorded: Value = serde_json::from_slice(&rec.response).unwrap();
        let message = recorded["error"]["message"].as_str().unwrap();
        let mut mock = MockEngine::start(vec![rec.reply(After::End)]).await;
        let engine =
            HttpEngine::new(HttpEngineConfig::new(EngineKind::Llamacpp, &mock.base_url)).unwrap();
        let body = rec.request.clone().unwrap();
        // kvroute cannot send a body without a prompt or with a mistyped field; for those any
        // request will do, for the others it must send the recorded body.
        let producible =
            body["prompt"].is_array() && body.get("n_predict").is_none_or(Value::is_u64);
        let request = if producible {
            request_for(&body)
        } else {
            PreprocessedRequest::new("tiny", vec![3])
        };
        let outcome = run(&engine, request).await;
        if producible {
            assert_eq!(mock.request().await.body, body, "{name}: body sent");
        }
        let item = outcome.error_message();
        assert!(
            item.contains(&format!("HTTP 400 Bad Request: {message}")),
            "{name}: {item}"
        );
    }
}

#[tokio::test]
async fn dropping_the_recorded_cancel_stream_closes_the_connection() {
    // The recording's client read 8 chunks and closed the connection; llama.cpp then cancelled
    // the task. Here the engine holds the connection open after those chunks, as the real one
    // was still generating.
    let rec = recording("cancel");
    let mut mock = MockEngine::start(vec![rec.reply(After::Hang)]).await;
    let engine =
        HttpEngine::new(HttpEngineConfig::new(EngineKind::Llamacpp, &mock.base_url)).unwrap();
    let body = rec.request.clone().unwrap();
    let (mut stream, context) = start(&engine, request_for(&body));
    let mut ids = Vec::new();
    for _ in 0..8 {
        ids.extend(next(&mut stream).await.unwrap().data.unwrap().token_ids);
    }
    assert_eq!(ids, vec![309, 310, 357, 438, 307, 428, 431, 423]);
    assert_eq!(mock.request().await.body, body);
    context.stop_generating();
    let cancelled = next(&mut stream).await.unwrap().data.unwrap();
    assert_eq!(cancelled.finish_reason, Some(FinishReason::Cancelled));
    mock.abandoned().await;
}

#[tokio::test]
async fn the_openai_endpoint_recording_reads_as_text_with_usage() {
    // llama.cpp's /v1/completions ignores `return_tokens`: the plain OpenAI dialect's case. Its
    // finishing chunk carries the usage, with the cached prompt tokens.
    let rec = recording("v1_completions_stream");
    let mut mock = MockEngine::start(vec![rec.reply(After::End)]).await;
    let engine =
        HttpEngine::new(HttpEngineConfig::new(EngineKind::Openai, &mock.base_url)).unwrap();
    let body = rec.request.clone().unwrap();
    let outcome = run(&engine, request_for(&body)).await;
    assert_eq!(
        mock.request().await.body,
        without(&body, &["return_tokens"])
    );
    assert!(outcome.failure.is_none());
    let text: String = outcome
        .outputs()
        .iter()
        .filter_map(|o| o.text.clone())
        .collect();
    assert_eq!(text, "PQhe d");
    assert!(outcome.token_ids().is_empty());
    let last = outcome.last();
    assert_eq!(last.finish_reason, Some(FinishReason::Length));
    let usage = last.completion_usage.expect("usage");
    assert_eq!((usage.prompt_tokens, usage.completion_tokens), (69, 4));
    assert_eq!(
        usage.prompt_tokens_details.and_then(|d| d.cached_tokens),
        Some(68)
    );
}

#[tokio::test]
async fn the_recorded_health_answer_is_healthy() {
    let rec = recording("health");
    let mut mock = MockEngine::start(vec![rec.reply(After::End)]).await;
    let engine =
        HttpEngine::new(HttpEngineConfig::new(EngineKind::Llamacpp, &mock.base_url)).unwrap();
    assert_eq!(engine.health().await, Ok::<(), HealthError>(()));
    assert_eq!(mock.request().await.path, "/health");
}
