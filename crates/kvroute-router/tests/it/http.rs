//! The HTTP frontend against an in-process server on loopback and a fake fleet.

use std::sync::atomic::Ordering;
use std::time::Duration;

use futures::StreamExt;
use kvroute_router::http::{AdmissionConfig, AppState, HttpConfig, serve};
use kvroute_router::{KvPushRouter, ModelRegistry, Policy};
use serde_json::{Value, json};
use tokio::sync::oneshot;

use crate::support::{Fleet, eventually, idle, run};

mod auth;
mod conformance;
mod engines;
mod faults;
mod limits;
mod metrics;
mod robust;
mod usage;

struct Server {
    base: String,
    state: AppState,
    client: reqwest::Client,
    _stop: oneshot::Sender<()>,
}

impl Server {
    async fn start(router: KvPushRouter, config: HttpConfig) -> Server {
        Server::serve(AppState::new(router, ModelRegistry::mock("mock"), config)).await
    }

    /// Serves `state` on an ephemeral loopback port until the server is dropped.
    async fn serve(state: AppState) -> Server {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let (stop, stopped) = oneshot::channel::<()>();
        tokio::spawn(serve(listener, state.clone(), async move {
            let _ = stopped.await;
        }));
        Server {
            base,
            state,
            client: reqwest::Client::builder()
                .timeout(Duration::from_secs(20))
                .build()
                .unwrap(),
            _stop: stop,
        }
    }

    fn post(&self, path: &str, body: &Value) -> reqwest::RequestBuilder {
        self.client
            .post(format!("{}{path}", self.base))
            .header("content-type", "application/json")
            .body(body.to_string())
    }

    async fn json(&self, path: &str, body: &Value) -> (u16, Value) {
        let resp = self.post(path, body).send().await.unwrap();
        let status = resp.status().as_u16();
        (status, resp.json().await.unwrap())
    }

    /// GETs `path` with the `Accept` header Prometheus scrapes with (so `/metrics` answers
    /// OpenMetrics).
    async fn get(&self, path: &str) -> (u16, String) {
        let (status, _, body) = self.get_accept(path, PROMETHEUS_ACCEPT).await;
        (status, body)
    }

    /// GETs `path` with `accept` (none when empty): the status, the content type, the body.
    async fn get_accept(&self, path: &str, accept: &str) -> (u16, String, String) {
        let mut req = self.client.get(format!("{}{path}", self.base));
        if !accept.is_empty() {
            req = req.header("accept", accept);
        }
        let resp = req.send().await.unwrap();
        let content_type = resp
            .headers()
            .get("content-type")
            .map(|v| v.to_str().unwrap().to_owned())
            .unwrap_or_default();
        (
            resp.status().as_u16(),
            content_type,
            resp.text().await.unwrap(),
        )
    }
}

/// The `Accept` header of a Prometheus scrape.
const PROMETHEUS_ACCEPT: &str = "application/openmetrics-text;version=1.0.0,\
    application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";

fn test_config() -> HttpConfig {
    HttpConfig {
        keep_alive: Duration::from_millis(100),
        ..HttpConfig::default()
    }
}

fn chat(content: &str) -> Value {
    json!({"model": "mock", "messages": [
        {"role": "system", "content": "you are a test"},
        {"role": "user", "content": content}
    ]})
}

/// Reads the `data:` payloads of a server-sent event stream.
struct Sse {
    body: std::pin::Pin<Box<dyn futures::Stream<Item = reqwest::Result<bytes::Bytes>> + Send>>,
    buf: String,
}

impl Sse {
    fn new(resp: reqwest::Response) -> Sse {
        assert_eq!(resp.status(), 200);
        assert!(
            resp.headers()["content-type"]
                .to_str()
                .unwrap()
                .starts_with("text/event-stream")
        );
        Sse {
            body: Box::pin(resp.bytes_stream()),
            buf: String::new(),
        }
    }

    /// The next `data:` payload (comments and keep-alives skipped), or None at the end.
    async fn next(&mut self) -> Option<String> {
        loop {
            if let Some(end) = self.buf.find("\n\n") {
                let event: String = self.buf.drain(..end + 2).collect();
                let data: Vec<&str> = event
                    .lines()
                    .filter_map(|l| l.strip_prefix("data:"))
                    .map(str::trim_start)
                    .collect();
                if data.is_empty() {
                    continue;
                }
                return Some(data.join("\n"));
            }
            let chunk = self.body.next().await?.unwrap();
            self.buf.push_str(std::str::from_utf8(&chunk).unwrap());
        }
    }

    /// Every remaining payload, `[DONE]` included.
    async fn rest(&mut self) -> Vec<String> {
        let mut out = Vec::new();
        while let Some(d) = self.next().await {
            out.push(d);
        }
        out
    }
}

fn content_of(chunks: &[Value]) -> String {
    chunks
        .iter()
        .filter_map(|c| {
            let choice = c["choices"].get(0)?;
            choice["delta"]["content"]
                .as_str()
                .or(choice["text"].as_str())
                .map(str::to_owned)
        })
        .collect()
}

#[test]
fn chat_completion_whole_has_the_openai_shape_and_nvext_worker_and_timing() {
    run(async {
        let fleet = Fleet::start(3).await;
        let router = fleet.router(Policy::Kv).await;
        let server = Server::start(router.clone(), test_config()).await;
        let mut body = chat("hello there");
        body["max_tokens"] = json!(4);
        body["nvext"] = json!({"extra_fields": ["worker_id", "timing"]});
        let (status, resp) = server.json("/v1/chat/completions", &body).await;
        assert_eq!(status, 200, "{resp}");
        assert_eq!(resp["object"], "chat.completion");
        assert_eq!(resp["model"], "mock");
        assert!(resp["id"].as_str().unwrap().starts_with("chatcmpl-"));
        let choice = &resp["choices"][0];
        assert_eq!(choice["message"]["role"], "assistant");
        let text = choice["message"]["content"].as_str().unwrap();
        assert_eq!(text.split(' ').count(), 4, "{text:?}");
        assert_eq!(choice["finish_reason"], "stop");
        // The mock template renders "<|system|> you are a test\n<|user|> hello there\n<|assistant|>".
        assert_eq!(resp["usage"]["prompt_tokens"], 9);
        assert_eq!(resp["usage"]["completion_tokens"], 4);
        assert_eq!(resp["usage"]["total_tokens"], 13);
        let worker = resp["nvext"]["worker_id"]["decode_worker_id"]
            .as_u64()
            .unwrap();
        assert!((1..=3).contains(&worker));
        assert_eq!(resp["nvext"]["worker_id"]["prefill_worker_id"], worker);
        let timing = &resp["nvext"]["timing"];
        assert!(timing["ttft_ms"].as_f64().unwrap() >= 0.0, "{timing}");
        assert!(timing["total_time_ms"].as_f64().unwrap() >= timing["ttft_ms"].as_f64().unwrap());
        assert!(timing["request_received_ms"].as_u64().unwrap() > 0);
        assert_eq!(timing["kv_hit_rate"], 0.0);
        // Without extra_fields there is no nvext at all.
        let (_, plain) = server.json("/v1/chat/completions", &chat("again")).await;
        assert!(plain.get("nvext").is_none(), "{plain}");
        eventually("all load is freed", || idle(&router)).await;
    });
}

#[test]
fn chat_completion_streams_sse_chunks_then_done() {
    run(async {
        let fleet = Fleet::start(2).await;
        let router = fleet.router(Policy::Kv).await;
        let server = Server::start(router.clone(), test_config()).await;
        let mut body = chat("stream please");
        body["stream"] = json!(true);
        body["stream_options"] = json!({"include_usage": true});
        body["nvext"] = json!({"extra_fields": ["worker_id", "timing"]});
        let resp = server
            .post("/v1/chat/completions", &body)
            .send()
            .await
            .unwrap();
        let payloads = Sse::new(resp).rest().await;
        assert_eq!(payloads.last().unwrap(), "[DONE]");
        let chunks: Vec<Value> = payloads[..payloads.len() - 1]
            .iter()
            .map(|p| serde_json::from_str(p).unwrap())
            .collect();
        assert!(
            chunks
                .iter()
                .all(|c| c["object"] == "chat.completion.chunk")
        );
        assert!(chunks.iter().all(|c| c["id"] == chunks[0]["id"]));
        assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
        assert!(chunks[0]["nvext"]["worker_id"]["decode_worker_id"].is_u64());
        let text = content_of(&chunks);
        assert_eq!(text.split(' ').count(), 5, "{text:?}");
        let finals: Vec<&Value> = chunks
            .iter()
            .filter(|c| !c["choices"][0]["finish_reason"].is_null())
            .collect();
        assert_eq!(finals.len(), 1);
        assert_eq!(finals[0]["choices"][0]["finish_reason"], "stop");
        assert!(finals[0]["nvext"]["timing"]["ttft_ms"].is_f64());
        let usage = &chunks.last().unwrap()["usage"];
        assert_eq!(usage["completion_tokens"], 5, "{usage}");
        assert_eq!(chunks.last().unwrap()["choices"], json!([]));
        eventually("all load is freed", || idle(&router)).await;
    });
}

#[test]
fn completions_take_text_or_token_prompts_streaming_or_whole() {
    run(async {
        let fleet = Fleet::start(2).await;
        let router = fleet.router(Policy::Kv).await;
        let server = Server::start(router.clone(), test_config()).await;
        let (status, resp) = server
            .json(
                "/v1/completions",
                &json!({"model": "mock", "prompt": "one two three", "max_tokens": 3}),
            )
            .await;
        assert_eq!(status, 200, "{resp}");
        assert_eq!(resp["object"], "text_completion");
        assert_eq!(resp["usage"]["prompt_tokens"], 3);
        assert_eq!(
            resp["choices"][0]["text"]
                .as_str()
                .unwrap()
                .split(' ')
                .count(),
            3
        );
        let body = json!({"model": "mock", "prompt": [500, 501, 502, 503], "stream": true});
        let resp = server.post("/v1/completions", &body).send().await.unwrap();
        let payloads = Sse::new(resp).rest().await;
        assert_eq!(payloads.last().unwrap(), "[DONE]");
        let chunks: Vec<Value> = payloads[..payloads.len() - 1]
            .iter()
            .map(|p| serde_json::from_str(p).unwrap())
            .collect();
        assert!(chunks.iter().all(|c| c["object"] == "text_completion"));
        assert_eq!(content_of(&chunks).split(' ').count(), 5);
        // The engine saw exactly the given tokens.
        let seen: Vec<Vec<u32>> = fleet
            .workers
            .iter()
            .flat_map(|w| w.engine.requests.lock().clone())
            .map(|r| r.token_ids)
            .collect();
        assert!(seen.contains(&vec![500, 501, 502, 503]), "{seen:?}");
        eventually("all load is freed", || idle(&router)).await;
    });
}

#[test]
fn header_pin_and_token_data_are_honoured() {
    run(async {
        let fleet = Fleet::start(3).await;
        let router = fleet.router(Policy::Kv).await;
        let server = Server::start(router.clone(), test_config()).await;
        for _ in 0..3 {
            let mut body = chat("pin me");
            body["nvext"] = json!({"extra_fields": ["worker_id"], "backend_instance_id": 1});
            let resp = server
                .post("/v1/chat/completions", &body)
                .header("x-worker-instance-id", "2")
                .send()
                .await
                .unwrap();
            assert_eq!(resp.status(), 200);
            let resp: Value = resp.json().await.unwrap();
            assert_eq!(
                resp["nvext"]["worker_id"]["decode_worker_id"], 2,
                "headers win"
            );
        }
        assert_eq!(fleet.worker(2).engine.started.load(Ordering::SeqCst), 3);
        let mut body = chat("ignored text");
        body["nvext"] = json!({"token_data": [7, 8, 9]});
        let (status, resp) = server.json("/v1/chat/completions", &body).await;
        assert_eq!(status, 200, "{resp}");
        assert_eq!(resp["usage"]["prompt_tokens"], 3);
        eventually("all load is freed", || idle(&router)).await;
    });
}

#[test]
fn query_only_answers_the_worker_and_tokens_without_sending() {
    run(async {
        let fleet = Fleet::start(2).await;
        let router = fleet.router(Policy::Kv).await;
        let server = Server::start(router.clone(), test_config()).await;
        let mut body = chat("where would this go");
        body["nvext"] = json!({"annotations": ["query_instance_id:"]});
        let (status, resp) = server.json("/v1/chat/completions", &body).await;
        assert_eq!(status, 200, "{resp}");
        assert!(resp["nvext"]["worker_id"]["decode_worker_id"].is_u64());
        assert_eq!(resp["nvext"]["token_ids"].as_array().unwrap().len(), 11);
        let started: usize = fleet
            .workers
            .iter()
            .map(|w| w.engine.started.load(Ordering::SeqCst))
            .sum();
        assert_eq!(started, 0);
        assert!(idle(&router));
    });
}

/// One bad request: its name, raw body, extra headers, and the expected status and `param`.
type Case<'a> = (
    &'a str,
    String,
    Vec<(&'a str, &'a str)>,
    (u16, Option<&'a str>),
);

/// Sends `body` (raw) with `headers`; checks the status, the error JSON and `param`.
async fn check_error(
    server: &Server,
    path: &str,
    body: String,
    headers: &[(&str, &str)],
    expect: (u16, Option<&str>),
) {
    let mut req = server
        .client
        .post(format!("{}{path}", server.base))
        .header("content-type", "application/json")
        .body(body.clone());
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = req.send().await.unwrap();
    let status = resp.status().as_u16();
    let json: Value = resp.json().await.unwrap();
    let short: String = body.chars().take(80).collect();
    assert_eq!(status, expect.0, "{short}: {json}");
    let error = &json["error"];
    assert!(
        error["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{json}"
    );
    assert!(error["type"].is_string(), "{json}");
    assert!(error.get("code").is_some(), "{json}");
    assert_eq!(error["param"].as_str(), expect.1, "{short}: {json}");
}

#[test]
fn bad_input_gets_the_right_status_and_openai_error_json() {
    run(async {
        let fleet = Fleet::start(2).await;
        let router = fleet.router(Policy::Kv).await;
        let config = HttpConfig {
            max_body_bytes: 64 * 1024,
            max_prompt_tokens: 1000,
            ..test_config()
        };
        let server = Server::start(router.clone(), config).await;
        let with_nvext = |nvext: Value| {
            let mut b = chat("hi");
            b["nvext"] = nvext;
            b.to_string()
        };
        let chat_path = "/v1/chat/completions";
        let cases: Vec<Case<'_>> = vec![
            ("malformed", "{\"model\": ".to_owned(), vec![], (400, None)),
            (
                "wrong type",
                json!({"model": "mock", "messages": "hi"}).to_string(),
                vec![],
                (400, Some("messages")),
            ),
            (
                "missing field",
                json!({"model": "mock"}).to_string(),
                vec![],
                (400, None),
            ),
            (
                "nvext wrong type",
                with_nvext(json!({"backend_instance_id": "two"})),
                vec![],
                (400, Some("nvext.backend_instance_id")),
            ),
            (
                "invalid session timeout",
                with_nvext(json!({"session_control": {"session_id": "s", "timeout": 0}})),
                vec![],
                (400, Some("nvext.session_control.timeout")),
            ),
            (
                "unknown model",
                json!({"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]})
                    .to_string(),
                vec![],
                (404, Some("model")),
            ),
            (
                "body too large",
                with_nvext(json!({"annotations": ["x".repeat(100 * 1024)]})),
                vec![],
                (413, None),
            ),
            (
                "prompt too long",
                with_nvext(json!({"token_data": vec![5; 2000]})),
                vec![],
                (413, None),
            ),
            (
                "unparsable header",
                chat("hi").to_string(),
                vec![("x-worker-instance-id", "abc")],
                (400, Some("x-worker-instance-id")),
            ),
            (
                "n above one",
                {
                    let mut b = chat("hi");
                    b["n"] = json!(2);
                    b.to_string()
                },
                vec![],
                (400, Some("n")),
            ),
        ];
        for (name, body, headers, expect) in cases {
            eprintln!("case: {name}");
            check_error(&server, chat_path, body, &headers, expect).await;
        }
        check_error(
            &server,
            "/v1/completions",
            json!({"model": "mock", "prompt": ["a", "b"]}).to_string(),
            &[],
            (400, Some("prompt")),
        )
        .await;
        let started: usize = fleet
            .workers
            .iter()
            .map(|w| w.engine.started.load(Ordering::SeqCst))
            .sum();
        assert_eq!(started, 0, "nothing bad reached a worker");
        assert!(idle(&router));
    });
}

#[test]
fn no_workers_is_503_with_retry_after() {
    run(async {
        let fleet = Fleet::start(0).await;
        let router = fleet.router(Policy::Kv).await;
        let server = Server::start(router, test_config()).await;
        let resp = server
            .post("/v1/chat/completions", &chat("anyone?"))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 503);
        assert!(resp.headers().contains_key("retry-after"));
        let (status, body) = server.get("/health").await;
        assert_eq!(status, 503, "{body}");
    });
}

#[test]
fn burst_beyond_capacity_gets_429_or_503_quickly_and_client_disconnect_frees_load() {
    run(async {
        let fleet = Fleet::start(2).await;
        let router = fleet.router(Policy::Kv).await;
        let config = HttpConfig {
            admission: AdmissionConfig {
                max_in_flight: 2,
                max_queued: 1,
                queue_timeout: Duration::from_millis(200),
                retry_after: Duration::from_secs(2),
            },
            ..test_config()
        };
        let server = Server::start(router.clone(), config).await;
        // Two streams that stall after their first token hold both slots.
        let mut held = Vec::new();
        for i in 0..2 {
            let mut body = chat(&format!("STALL number {i}"));
            body["stream"] = json!(true);
            let resp = server
                .post("/v1/chat/completions", &body)
                .send()
                .await
                .unwrap();
            let mut sse = Sse::new(resp);
            let first: Value = serde_json::from_str(&sse.next().await.unwrap()).unwrap();
            assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
            let token: Value = serde_json::from_str(&sse.next().await.unwrap()).unwrap();
            assert!(token["choices"][0]["delta"]["content"].is_string());
            held.push(sse);
        }
        assert_eq!(server.state.in_flight(), 2);
        let burst = (0..6).map(|_| server.post("/v1/chat/completions", &chat("burst")).send());
        let answers =
            tokio::time::timeout(Duration::from_secs(10), futures::future::join_all(burst))
                .await
                .expect("a burst beyond capacity never hangs");
        for answer in answers {
            let resp = answer.unwrap();
            let status = resp.status().as_u16();
            assert!(status == 429 || status == 503, "{status}");
            assert_eq!(resp.headers()["retry-after"], "2");
            let body: Value = resp.json().await.unwrap();
            assert!(body["error"]["message"].is_string());
        }
        // The clients go away mid-stream: their requests are cancelled and their load freed.
        drop(held);
        eventually("the disconnected streams free their load", || {
            idle(&router) && server.state.in_flight() == 0
        })
        .await;
        let (_, metrics) = server.get("/metrics").await;
        assert!(
            metrics.contains("kvroute_router_requests_finished_total{outcome=\"cancelled\"} 2"),
            "{metrics}"
        );
        for line in metrics.lines().filter(|l| {
            l.starts_with("kvroute_router_worker_active_requests{")
                || l.starts_with("kvroute_router_worker_prefill_tokens{")
        }) {
            assert!(line.ends_with(" 0"), "{line}");
        }
        let (status, _) = server.json("/v1/chat/completions", &chat("after")).await;
        assert_eq!(status, 200);
    });
}

#[test]
fn models_health_live_and_metrics_endpoints() {
    run(async {
        let fleet = Fleet::start(2).await;
        let router = fleet.router(Policy::Kv).await;
        let server = Server::start(router, test_config()).await;
        let (status, models) = server.get("/v1/models").await;
        assert_eq!(status, 200);
        let models: Value = serde_json::from_str(&models).unwrap();
        assert_eq!(models["object"], "list");
        assert_eq!(models["data"][0]["id"], "mock");
        let (status, health) = server.get("/health").await;
        assert_eq!(status, 200, "{health}");
        assert!(health.contains("\"workers\":2"), "{health}");
        assert_eq!(server.get("/live").await.0, 200);
        server.json("/v1/chat/completions", &chat("count me")).await;
        let (status, metrics) = server.get("/metrics").await;
        assert_eq!(status, 200);
        assert!(
            metrics.contains("kvroute_router_requests_total 1"),
            "{metrics}"
        );
        assert!(
            metrics
                .contains("kvroute_router_routing_overhead_seconds_count{phase=\"tokenizing\"} 1"),
            "the chat's template and tokenizer are timed: {metrics}"
        );
        assert!(
            metrics
                .contains("kvroute_router_tokenizer_encoder{model=\"mock\",encoder=\"builtin\"} 1"),
            "the mock model's encoder is named: {metrics}"
        );
        assert!(metrics.contains("# EOF"));
        // A prompt of token ids is not tokenized, so it adds no `tokenizing` sample.
        let ids = json!({"model": "mock", "prompt": [1, 2, 3], "max_tokens": 2});
        assert_eq!(server.json("/v1/completions", &ids).await.0, 200);
        let (_, metrics) = server.get("/metrics").await;
        assert!(
            metrics.contains("kvroute_router_requests_total 2"),
            "{metrics}"
        );
        assert!(
            metrics
                .contains("kvroute_router_routing_overhead_seconds_count{phase=\"tokenizing\"} 1"),
            "{metrics}"
        );
    });
}

#[test]
fn killed_worker_mid_stream_still_completes_the_clients_single_stream() {
    run(async {
        let mut fleet = Fleet::start(3).await;
        let router = fleet.router(Policy::Kv).await;
        let server = Server::start(router.clone(), test_config()).await;
        let mut body = chat("SLOWLY please");
        body["stream"] = json!(true);
        body["max_tokens"] = json!(12);
        body["nvext"] = json!({"extra_fields": ["worker_id"]});
        let resp = server
            .post("/v1/chat/completions", &body)
            .send()
            .await
            .unwrap();
        let mut sse = Sse::new(resp);
        let mut chunks: Vec<Value> = Vec::new();
        for _ in 0..4 {
            chunks.push(serde_json::from_str(&sse.next().await.unwrap()).unwrap());
        }
        let first_worker = chunks[0]["nvext"]["worker_id"]["decode_worker_id"]
            .as_u64()
            .unwrap();
        fleet.worker_mut(first_worker).kill();
        let rest = sse.rest().await;
        assert_eq!(rest.last().unwrap(), "[DONE]");
        chunks.extend(
            rest[..rest.len() - 1]
                .iter()
                .map(|p| serde_json::from_str(p).unwrap()),
        );
        assert!(
            chunks.iter().all(|c| c.get("error").is_none()),
            "{chunks:?}"
        );
        let text = content_of(&chunks);
        assert_eq!(text.split(' ').count(), 12, "{text:?}");
        let last = chunks.last().unwrap();
        assert_eq!(last["choices"][0]["finish_reason"], "length");
        let final_worker = last["nvext"]["worker_id"]["decode_worker_id"]
            .as_u64()
            .unwrap();
        assert_ne!(final_worker, first_worker);
        eventually("all load is freed", || idle(&router)).await;
    });
}
