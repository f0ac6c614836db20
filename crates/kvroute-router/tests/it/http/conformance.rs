//! OpenAI conformance: out-of-range and unsupported parameters are 400s naming the parameter
//! (before anything is routed), `GET /v1/models/{id}` serves the model object, a pin to a dp rank
//! no worker has is a 400, request outcomes are counted by what ended them, and `/metrics` speaks
//! the format the scraper asks for.

use std::sync::atomic::Ordering;

use kvroute_router::Policy;
use serde_json::{Value, json};

use super::{Server, Sse, chat, check_error, test_config};
use crate::support::{Behaviour, Fleet, eventually, idle, run};

const CHAT: &str = "/v1/chat/completions";
const COMPLETIONS: &str = "/v1/completions";

/// `chat("hi")` with `extra` merged in.
fn chat_with(extra: Value) -> Value {
    let mut body = chat("hi");
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

/// A completion of "hi" with `extra` merged in.
fn completion_with(extra: Value) -> Value {
    let mut body = json!({"model": "mock", "prompt": "hi"});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

fn started(fleet: &Fleet) -> usize {
    fleet
        .workers
        .iter()
        .map(|w| w.engine.started.load(Ordering::SeqCst))
        .sum()
}

/// The value of the `requests_finished_total` sample of `outcome`, 0 when absent.
fn finished(metrics: &str, outcome: &str) -> u64 {
    let prefix = format!("kvroute_router_requests_finished_total{{outcome=\"{outcome}\"}} ");
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .map_or(0, |v| v.parse().unwrap())
}

/// The error message of a 400 answer to `body` on `path`.
async fn message_of(server: &Server, path: &str, body: &Value) -> String {
    let (status, resp) = server.json(path, body).await;
    assert_eq!(status, 400, "{resp}");
    resp["error"]["message"].as_str().unwrap().to_owned()
}

#[test]
fn max_tokens_zero_or_beyond_the_limit_is_a_400_naming_the_parameter() {
    run(async {
        let fleet = Fleet::start(2).await;
        let router = fleet.router(Policy::Kv).await;
        let config = kvroute_router::http::HttpConfig {
            max_prompt_tokens: 1000,
            ..test_config()
        };
        let server = Server::start(router.clone(), config).await;
        for stream in [false, true] {
            let cases = [
                (CHAT, chat_with(json!({"max_tokens": 0})), "max_tokens"),
                (
                    CHAT,
                    chat_with(json!({"max_completion_tokens": 0})),
                    "max_completion_tokens",
                ),
                (
                    CHAT,
                    chat_with(json!({"max_tokens": 1_000_000_000u32})),
                    "max_tokens",
                ),
                (
                    CHAT,
                    chat_with(json!({"max_completion_tokens": 1001})),
                    "max_completion_tokens",
                ),
                (
                    COMPLETIONS,
                    completion_with(json!({"max_tokens": 0})),
                    "max_tokens",
                ),
                (
                    COMPLETIONS,
                    completion_with(json!({"max_tokens": 1_000_000_000u32})),
                    "max_tokens",
                ),
            ];
            for (path, mut body, param) in cases {
                body["stream"] = json!(stream);
                check_error(&server, path, body.to_string(), &[], (400, Some(param))).await;
            }
        }
        let message = message_of(&server, CHAT, &chat_with(json!({"max_tokens": 0}))).await;
        assert_eq!(message, "max_tokens must be between 1 and 1000, got 0");
        assert_eq!(started(&fleet), 0, "nothing invalid reached a worker");
        // The bounds themselves are served.
        for max_tokens in [1, 1000] {
            let (status, resp) = server
                .json(CHAT, &chat_with(json!({"max_tokens": max_tokens})))
                .await;
            assert_eq!(status, 200, "{resp}");
        }
        eventually("all load is freed", || idle(&router)).await;
    });
}

#[test]
fn out_of_range_sampling_values_and_unknown_roles_are_400s_naming_the_parameter() {
    run(async {
        let fleet = Fleet::start(1).await;
        let router = fleet.router(Policy::Kv).await;
        let server = Server::start(router.clone(), test_config()).await;
        let cases = [
            (json!({"temperature": -1}), "temperature"),
            (json!({"temperature": 2.5}), "temperature"),
            (json!({"top_p": 0}), "top_p"),
            (json!({"top_p": 1.5}), "top_p"),
            (json!({"top_k": -2}), "top_k"),
            (json!({"presence_penalty": 2.5}), "presence_penalty"),
            (json!({"presence_penalty": -3}), "presence_penalty"),
            (json!({"frequency_penalty": 3}), "frequency_penalty"),
            (json!({"repetition_penalty": 0}), "repetition_penalty"),
            (json!({"repetition_penalty": -1}), "repetition_penalty"),
        ];
        for (extra, param) in cases {
            check_error(
                &server,
                CHAT,
                chat_with(extra.clone()).to_string(),
                &[],
                (400, Some(param)),
            )
            .await;
            check_error(
                &server,
                COMPLETIONS,
                completion_with(extra).to_string(),
                &[],
                (400, Some(param)),
            )
            .await;
        }
        let message = message_of(&server, CHAT, &chat_with(json!({"top_p": 1.5}))).await;
        assert!(message.contains("(0, 1]"), "{message}");
        let wizard = json!({"model": "mock", "messages": [
            {"role": "user", "content": "hi"},
            {"role": "wizard", "content": "abracadabra"}
        ]});
        check_error(
            &server,
            CHAT,
            wizard.to_string(),
            &[],
            (400, Some("messages[1].role")),
        )
        .await;
        assert_eq!(started(&fleet), 0, "nothing invalid reached a worker");
        // The edges of every range, and every role, are served.
        let edges = json!({
            "temperature": 0, "top_p": 1, "top_k": -1, "presence_penalty": -2,
            "frequency_penalty": 2, "repetition_penalty": 0.5,
            "messages": [
                {"role": "system", "content": "a"}, {"role": "developer", "content": "b"},
                {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"},
                {"role": "tool", "content": "e"}, {"role": "user", "content": "f"}
            ]
        });
        let (status, resp) = server.json(CHAT, &chat_with(edges)).await;
        assert_eq!(status, 200, "{resp}");
        let (status, resp) = server
            .json(COMPLETIONS, &completion_with(json!({"temperature": 2})))
            .await;
        assert_eq!(status, 200, "{resp}");
        eventually("all load is freed", || idle(&router)).await;
    });
}

#[test]
fn unsupported_parameters_are_refused_but_their_client_defaults_pass() {
    run(async {
        let fleet = Fleet::start(1).await;
        let router = fleet.router(Policy::Kv).await;
        let server = Server::start(router.clone(), test_config()).await;
        let tool = json!([{"type": "function", "function": {"name": "f", "parameters": {}}}]);
        let cases = [
            ("logprobs", json!(true)),
            ("logprobs", json!(3)),
            ("top_logprobs", json!(2)),
            ("tools", tool.clone()),
            ("tool_choice", json!("auto")),
            ("functions", json!([{"name": "f"}])),
            ("function_call", json!("auto")),
            ("response_format", json!({"type": "json_object"})),
            ("echo", json!(true)),
            ("best_of", json!(2)),
            ("suffix", json!("the end")),
            ("logit_bias", json!({"50256": -100})),
        ];
        for (param, value) in cases {
            let mut extra = json!({});
            extra[param] = value;
            for (path, body) in [
                (CHAT, chat_with(extra.clone())),
                (COMPLETIONS, completion_with(extra.clone())),
            ] {
                check_error(&server, path, body.to_string(), &[], (400, Some(param))).await;
            }
        }
        let message = message_of(&server, CHAT, &chat_with(json!({"tools": tool}))).await;
        assert_eq!(message, "`tools` is not supported by this router");
        assert_eq!(started(&fleet), 0, "nothing refused reached a worker");
        // What OpenAI clients send by default is no request for any of them.
        let defaults = json!({
            "logprobs": false, "top_logprobs": null, "tools": [], "tool_choice": "none",
            "functions": null, "function_call": null, "response_format": {"type": "text"},
            "echo": false, "best_of": 1, "suffix": null, "logit_bias": {},
        });
        let (status, resp) = server.json(CHAT, &chat_with(defaults.clone())).await;
        assert_eq!(status, 200, "{resp}");
        let (status, resp) = server.json(COMPLETIONS, &completion_with(defaults)).await;
        assert_eq!(status, 200, "{resp}");
        eventually("all load is freed", || idle(&router)).await;
    });
}

#[test]
fn an_engine_failure_counts_as_outcome_rejected_and_a_client_leaving_as_cancelled() {
    run(async {
        let fleet = Fleet::start(1).await;
        let router = fleet.router(Policy::Kv).await;
        let server = Server::start(router.clone(), test_config()).await;
        let explode = chat(Behaviour::Error.magic_word());
        // Whole: the engine's error item ends the request; an engine failing without an HTTP
        // status of its own is the upstream's failure, a 502.
        let (status, resp) = server.json(CHAT, &explode).await;
        assert_eq!(status, 502, "{resp}");
        assert_eq!(resp["error"]["code"], "upstream_error", "{resp}");
        // Streaming: the error arrives in the stream, which the handler then ends.
        let mut body = explode.clone();
        body["stream"] = json!(true);
        let resp = server.post(CHAT, &body).send().await.unwrap();
        let chunks = Sse::new(resp).rest().await;
        assert!(
            chunks.last().is_some_and(|c| c.contains("\"error\"")),
            "{chunks:?}"
        );
        eventually("the failed requests free their load", || idle(&router)).await;
        let (_, metrics) = server.get("/metrics").await;
        assert_eq!(finished(&metrics, "rejected"), 2, "{metrics}");
        assert_eq!(finished(&metrics, "error"), 0, "{metrics}");
        assert_eq!(finished(&metrics, "cancelled"), 0, "{metrics}");
        // A client that disconnects mid-stream cancels its request.
        let mut body = chat(Behaviour::Stall.magic_word());
        body["stream"] = json!(true);
        let resp = server.post(CHAT, &body).send().await.unwrap();
        let mut sse = Sse::new(resp);
        sse.next().await.expect("the opening chunk");
        sse.next().await.expect("the first token");
        drop(sse);
        eventually("the disconnected stream frees its load", || {
            idle(&router) && server.state.in_flight() == 0
        })
        .await;
        let (_, metrics) = server.get("/metrics").await;
        assert_eq!(finished(&metrics, "cancelled"), 1, "{metrics}");
        assert_eq!(finished(&metrics, "rejected"), 2, "{metrics}");
        assert_eq!(finished(&metrics, "ok"), 0, "{metrics}");
    });
}

#[test]
fn model_retrieve_serves_the_model_object_and_an_unknown_id_is_a_404_json() {
    run(async {
        let fleet = Fleet::start(1).await;
        let router = fleet.router(Policy::Kv).await;
        let server = Server::start(router, test_config()).await;
        let (status, body) = server.get("/v1/models/mock").await;
        assert_eq!(status, 200, "{body}");
        let model: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(model["id"], "mock");
        assert_eq!(model["object"], "model");
        assert!(model["created"].is_u64(), "{model}");
        assert!(model["owned_by"].is_string(), "{model}");
        let (status, body) = server.get("/v1/models/gpt-9").await;
        assert_eq!(status, 404, "{body}");
        let error: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(error["error"]["code"], "model_not_found", "{error}");
        assert_eq!(error["error"]["type"], "invalid_request_error", "{error}");
    });
}

#[test]
fn a_dp_rank_pin_no_worker_serves_is_a_400_naming_its_source() {
    run(async {
        let fleet = Fleet::start(2).await;
        let router = fleet.router(Policy::Kv).await;
        let server = Server::start(router.clone(), test_config()).await;
        check_error(
            &server,
            CHAT,
            chat("hi").to_string(),
            &[("x-dp-rank", "5")],
            (400, Some("x-dp-rank")),
        )
        .await;
        let body = chat_with(json!({"nvext": {"dp_rank": 5}}));
        check_error(
            &server,
            CHAT,
            body.to_string(),
            &[],
            (400, Some("nvext.dp_rank")),
        )
        .await;
        let resp = server
            .post(CHAT, &chat("hi"))
            .header("x-dp-rank", "5")
            .send()
            .await
            .unwrap();
        assert!(resp.headers().get("retry-after").is_none());
        assert_eq!(started(&fleet), 0);
        // A rank the workers serve is routed.
        let resp = server
            .post(CHAT, &chat("hi"))
            .header("x-dp-rank", "0")
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        eventually("all load is freed", || idle(&router)).await;
    });
}

#[test]
fn metrics_answer_prometheus_text_unless_openmetrics_is_accepted() {
    run(async {
        let fleet = Fleet::start(1).await;
        let router = fleet.router(Policy::Kv).await;
        let server = Server::start(router.clone(), test_config()).await;
        let (status, _) = server.json(CHAT, &chat("count me")).await;
        assert_eq!(status, 200);
        eventually("the request finished", || idle(&router)).await;
        let (status, content_type, open) = server
            .get_accept("/metrics", "application/openmetrics-text; version=1.0.0")
            .await;
        assert_eq!(status, 200);
        assert!(
            content_type.starts_with("application/openmetrics-text"),
            "{content_type}"
        );
        assert_eq!(open.lines().last(), Some("# EOF"));
        for accept in ["text/plain;version=0.0.4", "*/*", ""] {
            let (status, content_type, text) = server.get_accept("/metrics", accept).await;
            assert_eq!(status, 200);
            assert_eq!(
                content_type, "text/plain; version=0.0.4; charset=utf-8",
                "{accept}"
            );
            assert!(!text.contains("# EOF"), "{text}");
            assert!(!text.contains("# UNIT"), "{text}");
            assert!(
                !text
                    .lines()
                    .any(|l| !l.starts_with('#') && l.contains("_created")),
                "{text}"
            );
            // A counter's family lines name its `_total` samples, as 0.0.4 expects.
            assert!(
                text.contains("# TYPE kvroute_router_requests_total counter\n"),
                "{text}"
            );
            assert!(
                text.contains("# HELP kvroute_router_requests_total "),
                "{text}"
            );
            assert!(
                text.contains("\nkvroute_router_requests_total 1\n"),
                "{text}"
            );
            assert!(
                text.contains("# TYPE kvroute_router_time_to_first_token_seconds histogram\n"),
                "{text}"
            );
            // Every sample belongs to the family its `# TYPE` line just named.
            let mut family = "";
            for line in text.lines() {
                if let Some(rest) = line.strip_prefix("# TYPE ") {
                    family = rest.split(' ').next().unwrap();
                } else if !line.starts_with('#') && !line.is_empty() {
                    let name = line.split(['{', ' ']).next().unwrap();
                    let base = ["_bucket", "_sum", "_count"]
                        .iter()
                        .find_map(|s| name.strip_suffix(s))
                        .unwrap_or(name);
                    assert!(
                        name == family || base == family,
                        "{name} under # TYPE {family}"
                    );
                }
            }
        }
    });
}

#[test]
fn a_lost_pinned_worker_counts_as_outcome_error_not_cancelled() {
    run(async {
        let mut fleet = Fleet::start(2).await;
        let router = fleet.router(Policy::Kv).await;
        let server = Server::start(router.clone(), test_config()).await;
        let mut body = chat("SLOWLY please");
        body["stream"] = json!(true);
        body["max_tokens"] = json!(50);
        let resp = server
            .post(CHAT, &body)
            .header("x-worker-instance-id", "1")
            .send()
            .await
            .unwrap();
        let mut sse = Sse::new(resp);
        for _ in 0..3 {
            sse.next().await.expect("a chunk before the worker dies");
        }
        fleet.worker_mut(1).kill();
        let rest = sse.rest().await;
        assert!(
            rest.last().is_some_and(|c| c.contains("\"error\"")),
            "a pinned request is not moved: {rest:?}"
        );
        eventually("the failed request frees its load", || {
            idle(&router) && server.state.in_flight() == 0
        })
        .await;
        let (_, metrics) = server.get("/metrics").await;
        assert_eq!(finished(&metrics, "error"), 1, "{metrics}");
        assert_eq!(finished(&metrics, "cancelled"), 0, "{metrics}");
    });
}

#[test]
fn stop_strings_end_the_text_with_finish_reason_stop_whole_and_streamed() {
    use kvroute_router::tokenizer::MockTokenizer;
    run(async {
        let fleet = Fleet::start(1).await;
        let router = fleet.router(Policy::Kv).await;
        let server = Server::start(router.clone(), test_config()).await;
        // The fake engine streams the words of ids 100, 101, ...; it knows no stop strings.
        let word = |i: u32| MockTokenizer::render_id(crate::support::output_token(i));
        let stop = word(2);
        let expected = format!("{} {} ", word(0), word(1));

        let body = chat_with(json!({"max_tokens": 6, "stop": [stop.clone(), "never"]}));
        let (status, resp) = server.json(CHAT, &body).await;
        assert_eq!(status, 200, "{resp}");
        assert_eq!(resp["choices"][0]["message"]["content"], expected.as_str());
        assert_eq!(resp["choices"][0]["finish_reason"], "stop");
        assert_eq!(resp["usage"]["completion_tokens"], 3, "{resp}");

        // With vLLM's include_stop_str_in_output the stop string stays.
        let body = completion_with(json!({"max_tokens": 6, "stop": stop.clone(),
            "include_stop_str_in_output": true}));
        let (status, resp) = server.json(COMPLETIONS, &body).await;
        assert_eq!(status, 200, "{resp}");
        assert_eq!(resp["choices"][0]["text"], format!("{expected}{stop}"));
        assert_eq!(resp["choices"][0]["finish_reason"], "stop");

        let mut body = chat_with(json!({"max_tokens": 6, "stop": stop.clone()}));
        body["stream"] = json!(true);
        let resp = server.post(CHAT, &body).send().await.unwrap();
        let payloads = Sse::new(resp).rest().await;
        assert_eq!(payloads.last().map(String::as_str), Some("[DONE]"));
        let chunks: Vec<Value> = payloads[..payloads.len() - 1]
            .iter()
            .map(|p| serde_json::from_str(p).unwrap())
            .collect();
        let text: String = chunks
            .iter()
            .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
            .collect();
        assert_eq!(text, expected);
        let finish: Vec<&Value> = chunks
            .iter()
            .map(|c| &c["choices"][0]["finish_reason"])
            .filter(|f| !f.is_null())
            .collect();
        assert_eq!(finish, [&json!("stop")]);
        let (_, metrics) = server.get("/metrics").await;
        assert!(
            !metrics.contains("outcome=\"cancelled\"") && !metrics.contains("outcome=\"error\""),
            "a stop string is a normal end:\n{metrics}"
        );
        eventually("all load is freed", || idle(&router)).await;
    });
}

#[test]
fn a_worker_that_ignores_a_graceful_stop_is_cancelled_after_the_grace() {
    use kvroute_router::tokenizer::MockTokenizer;
    run(async {
        let fleet = Fleet::start(1).await;
        let router = fleet.router(Policy::Kv).await;
        let config = kvroute_router::http::HttpConfig {
            stop_grace: std::time::Duration::from_millis(100),
            ..test_config()
        };
        let server = Server::start(router.clone(), config).await;
        // The slow fake engine streams a token every 20 ms and never heeds a stop: 500 tokens
        // would take 10 s.
        let word = |i: u32| MockTokenizer::render_id(crate::support::output_token(i));
        let expected = format!("{} {} ", word(0), word(1));
        for stream in [false, true] {
            let mut body = chat(Behaviour::Slow.magic_word());
            body["max_tokens"] = json!(500);
            body["stop"] = json!(word(2));
            body["stream"] = json!(stream);
            body["stream_options"] = json!({"include_usage": true});
            if !stream {
                body.as_object_mut().unwrap().remove("stream_options");
            }
            let started = std::time::Instant::now();
            let (text, finish, completion_tokens) = if stream {
                let resp = server.post(CHAT, &body).send().await.unwrap();
                let payloads = Sse::new(resp).rest().await;
                let chunks: Vec<Value> = payloads
                    .iter()
                    .filter(|p| p.as_str() != "[DONE]")
                    .map(|p| serde_json::from_str(p).unwrap())
                    .collect();
                let text: String = chunks
                    .iter()
                    .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
                    .collect();
                let finish = chunks
                    .iter()
                    .find_map(|c| c["choices"][0]["finish_reason"].as_str().map(str::to_owned));
                let usage = chunks
                    .iter()
                    .find_map(|c| c["usage"]["completion_tokens"].as_u64());
                (text, finish, usage)
            } else {
                let (status, resp) = server.json(CHAT, &body).await;
                assert_eq!(status, 200, "{resp}");
                (
                    resp["choices"][0]["message"]["content"]
                        .as_str()
                        .unwrap()
                        .to_owned(),
                    resp["choices"][0]["finish_reason"]
                        .as_str()
                        .map(str::to_owned),
                    resp["usage"]["completion_tokens"].as_u64(),
                )
            };
            assert_eq!(text, expected, "stream {stream}");
            assert_eq!(finish.as_deref(), Some("stop"), "stream {stream}");
            // Only the tokens up to the stop string count, either way.
            assert_eq!(completion_tokens, Some(3), "stream {stream}");
            // The answer does not wait for the 10 s the worker would have taken (a bound far
            // from both the 0.1 s grace and the 10 s, not a speed measurement).
            let took = started.elapsed();
            assert!(
                took < std::time::Duration::from_secs(5),
                "stream {stream}: the router waited {took:?} for a worker that ignored the stop"
            );
        }
        eventually("all load is freed", || idle(&router)).await;
    });
}
