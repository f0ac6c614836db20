//! What a client sees when engines fail in the ways real ones do: an engine that refuses a
//! prompt (a 4xx) keeps its status; an engine that cannot be reached costs no migration and is
//! ejected; an engine that sends nothing within its first-byte limit is moved away from, and a
//! 504 comes back when every worker timed out; an engine that streams text without token ids is
//! counted and never restarted from the beginning. Every load gauge returns to zero.

use kvroute_router::Policy;
use kvroute_router::http::HttpConfig;
use serde_json::{Value, json};

use super::{Server, Sse, test_config};
use crate::support::{Behaviour, Fleet, TEXT_ONLY_WORDS, eventually, idle, run};

fn prompt(behaviour: Behaviour) -> Value {
    json!({
        "model": "mock",
        "prompt": format!("hello there {} friend", behaviour.magic_word()),
        "max_tokens": 3,
        "nvext": {"extra_fields": ["worker_id"]},
    })
}

/// The value of the sample of `name` whose labels include every one of `labels`.
fn sample(metrics: &str, name: &str, labels: &[&str]) -> Option<f64> {
    metrics.lines().find_map(|line| {
        let rest = line.strip_prefix(name)?;
        if !rest.starts_with(['{', ' ']) || !labels.iter().all(|l| rest.contains(l)) {
            return None;
        }
        rest.rsplit(' ').next()?.parse().ok()
    })
}

fn no_migrations() -> HttpConfig {
    HttpConfig {
        max_migrations: 0,
        ..test_config()
    }
}

#[test]
fn an_engine_refusal_keeps_its_4xx_status_streamed_or_not_and_is_not_a_failure() {
    run(async {
        let fleet = Fleet::start(2).await;
        let router = fleet.router(Policy::Kv).await;
        let server = Server::start(router.clone(), test_config()).await;

        let (status, body) = server
            .json("/v1/completions", &prompt(Behaviour::RefuseTooLong))
            .await;
        assert_eq!(status, 400, "{body}");
        assert_eq!(body["error"]["code"], "context_length_exceeded", "{body}");
        assert_eq!(body["error"]["type"], "invalid_request_error", "{body}");
        assert!(
            body["error"]["message"]
                .as_str()
                .unwrap()
                .contains("exceeds the available context size"),
            "{body}"
        );

        // Streamed: the status waits for the first item, so the refusal is a 400 too, not a
        // 200 whose stream carries the error.
        let mut streamed = prompt(Behaviour::RefuseTooLong);
        streamed["stream"] = json!(true);
        let resp = server
            .post("/v1/completions", &streamed)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 400);
        let body: Value = resp.json().await.unwrap();
        assert_eq!(body["error"]["code"], "context_length_exceeded", "{body}");

        let (_, metrics) = server.get("/metrics").await;
        assert_eq!(
            sample(
                &metrics,
                "kvroute_router_requests_finished_total",
                &["outcome=\"rejected\""]
            ),
            Some(2.0),
            "{metrics}"
        );
        assert_eq!(
            sample(
                &metrics,
                "kvroute_router_requests_finished_total",
                &["outcome=\"error\""]
            ),
            None,
            "an engine's refusal is not a router failure: {metrics}"
        );
        assert_eq!(
            sample(&metrics, "kvroute_router_worker_ejections_total", &[]),
            None,
            "nor does it eject a worker: {metrics}"
        );
        eventually("all load is freed", || idle(&router)).await;
    });
}

#[test]
fn an_engine_that_refuses_connections_costs_no_migration_and_is_ejected() {
    run(async {
        let fleet = Fleet::start(2).await;
        *fleet.worker(1).engine.forced.lock() = Some(Behaviour::Unreachable);
        let router = fleet.router(Policy::RoundRobin).await;
        // Not one migration allowed: moving off a dead engine must not need one.
        let server = Server::start(router.clone(), no_migrations()).await;
        for i in 0..6 {
            let (status, body) = server
                .json("/v1/completions", &prompt(Behaviour::Complete))
                .await;
            assert_eq!(status, 200, "request {i}: {body}");
            assert_eq!(body["nvext"]["worker_id"]["decode_worker_id"], 2, "{body}");
        }
        assert_eq!(
            fleet
                .worker(1)
                .engine
                .started
                .load(std::sync::atomic::Ordering::SeqCst),
            1,
            "the dead engine is tried once, then routed around while ejected"
        );
        let (_, metrics) = server.get("/metrics").await;
        assert_eq!(
            sample(
                &metrics,
                "kvroute_router_worker_ejections_total",
                &["worker=\"1\"", "reason=\"unreachable\""]
            ),
            Some(1.0),
            "{metrics}"
        );
        assert_eq!(
            sample(&metrics, "kvroute_router_worker_ejected", &["worker=\"1\""]),
            Some(1.0),
            "{metrics}"
        );
        eventually("all load is freed", || idle(&router)).await;
    });
}

#[test]
fn a_first_byte_timeout_moves_the_request_and_is_a_504_when_every_worker_timed_out() {
    run(async {
        let fleet = Fleet::start(2).await;
        *fleet.worker(1).engine.forced.lock() = Some(Behaviour::FirstByteTimeout);
        let router = fleet.router(Policy::RoundRobin).await;
        let server = Server::start(router.clone(), test_config()).await;
        for _ in 0..4 {
            let (status, body) = server
                .json("/v1/completions", &prompt(Behaviour::Complete))
                .await;
            assert_eq!(status, 200, "{body}");
            assert_eq!(body["nvext"]["worker_id"]["decode_worker_id"], 2, "{body}");
        }
        let (_, metrics) = server.get("/metrics").await;
        let timeouts = sample(
            &metrics,
            "kvroute_router_worker_failures_total",
            &["worker=\"1\"", "reason=\"timeout\""],
        )
        .unwrap_or(0.0);
        assert!(timeouts >= 1.0, "{metrics}");

        // Every engine times out: the client gets a 504 `timeout`, streamed or not.
        *fleet.worker(2).engine.forced.lock() = Some(Behaviour::FirstByteTimeout);
        let (status, body) = server
            .json("/v1/completions", &prompt(Behaviour::Complete))
            .await;
        assert_eq!(status, 504, "{body}");
        assert_eq!(body["error"]["code"], "timeout", "{body}");
        let mut streamed = prompt(Behaviour::Complete);
        streamed["stream"] = json!(true);
        let resp = server
            .post("/v1/completions", &streamed)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 504);
        eventually("all load is freed", || idle(&router)).await;
    });
}

#[test]
fn text_without_token_ids_is_counted_and_never_restarted_after_a_loss() {
    run(async {
        let fleet = Fleet::start(2).await;
        let router = fleet.router(Policy::Kv).await;
        let server = Server::start(router.clone(), test_config()).await;

        let (status, body) = server
            .json("/v1/completions", &prompt(Behaviour::TextOnly))
            .await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["choices"][0]["text"], TEXT_ONLY_WORDS.concat());
        assert_eq!(
            body["usage"]["completion_tokens"], 7,
            "the engine's own count: {body}"
        );
        let (_, metrics) = server.get("/metrics").await;
        assert_eq!(
            sample(&metrics, "kvroute_router_output_tokens_total", &[]),
            Some(7.0),
            "{metrics}"
        );

        // Lost after its first words: the client keeps one continuous (if cut) answer and a
        // clear error, never the first words again from another worker.
        let mut streamed = prompt(Behaviour::TextThenLost);
        streamed["stream"] = json!(true);
        let resp = server
            .post("/v1/completions", &streamed)
            .send()
            .await
            .unwrap();
        let mut sse = Sse::new(resp);
        let mut text = String::new();
        let mut error = None;
        while let Some(event) = sse.next().await {
            if event == "[DONE]" {
                break;
            }
            let v: Value = serde_json::from_str(&event).unwrap();
            if v.get("error").is_some() {
                error = Some(v);
                break;
            }
            text.push_str(v["choices"][0]["text"].as_str().unwrap_or_default());
        }
        assert_eq!(text, TEXT_ONLY_WORDS[0], "no repeat from another worker");
        let error = error.expect("the stream ends with an error");
        assert!(
            error["error"]["message"]
                .as_str()
                .unwrap()
                .contains("cannot be continued"),
            "{error}"
        );
        eventually("all load is freed", || idle(&router)).await;
    });
}

#[test]
fn greed_sampling_asks_every_engine_for_greedy_decoding() {
    run(async {
        let fleet = Fleet::start(1).await;
        let router = fleet.router(Policy::Kv).await;
        let server = Server::start(router.clone(), test_config()).await;
        let mut body = prompt(Behaviour::Complete);
        body["temperature"] = json!(0.9);
        body["nvext"]["greed_sampling"] = json!(true);
        let (status, resp) = server.json("/v1/completions", &body).await;
        assert_eq!(status, 200, "{resp}");
        let received = fleet.worker(1).engine.requests.lock().clone();
        let sampling = &received.last().unwrap().sampling_options;
        assert_eq!(sampling.temperature, Some(0.0));
        assert_eq!(sampling.top_k, Some(1));
        eventually("all load is freed", || idle(&router)).await;
    });
}

#[test]
fn unknown_paths_methods_pins_and_unreadable_numbers_get_clear_openai_errors() {
    run(async {
        let fleet = Fleet::start(1).await;
        let router = fleet.router(Policy::Kv).await;
        let server = Server::start(router.clone(), test_config()).await;

        let (status, body) = server.get("/v1/embeddings").await;
        assert_eq!(status, 404);
        let body: Value = serde_json::from_str(&body).expect("a JSON body");
        assert_eq!(body["error"]["code"], "not_found", "{body}");
        assert!(
            body["error"]["message"]
                .as_str()
                .unwrap()
                .contains("/v1/embeddings"),
            "{body}"
        );

        let (status, body) = server.get("/v1/completions").await;
        assert_eq!(status, 405);
        let body: Value = serde_json::from_str(&body).expect("a JSON body");
        assert_eq!(body["error"]["code"], "method_not_allowed", "{body}");
        assert!(
            body["error"]["message"]
                .as_str()
                .unwrap()
                .contains("expected POST"),
            "{body}"
        );

        // A pin by header to a worker nobody registered names the header, not the body field.
        let resp = server
            .post("/v1/completions", &prompt(Behaviour::Complete))
            .header("x-worker-instance-id", "999")
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 400);
        let body: Value = resp.json().await.unwrap();
        assert_eq!(body["error"]["param"], "x-worker-instance-id", "{body}");

        let mut huge = prompt(Behaviour::Complete);
        huge["temperature"] = json!(1e308);
        let (status, body) = server.json("/v1/completions", &huge).await;
        assert_eq!(status, 400, "{body}");
        let message = body["error"]["message"].as_str().unwrap();
        assert!(
            message.contains("temperature must be between 0 and 2") && !message.contains("inf"),
            "{message}"
        );
        eventually("all load is freed", || idle(&router)).await;
    });
}
