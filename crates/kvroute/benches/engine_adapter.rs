//! Engine adapter overhead: what kvroute adds in front of a real engine's HTTP API.
//!
//! The engine is a stand-in for llama.cpp's server that answers `POST /completion` at once, in
//! llama.cpp's own streamed shape (one `data:` chunk per token with its id, then a final chunk
//! with `stop_type` and `timings`, as recorded from the real server in
//! `crates/kvroute-engines/tests/fixtures/llamacpp/`), so that only the path is measured, not a
//! model. Three paths carry the same streamed request of `--tokens` output tokens for a
//! ~200-token prompt given as token ids:
//!
//! - engine: straight to the engine over HTTP (reqwest), as a client without kvroute would;
//! - adapter: over kvroute's TCP request plane to a worker serving the engine through
//!   kvroute-engines' `HttpEngine` (the sidecar's path without the router);
//! - kvroute: the whole service: HTTP frontend → KV router (policy `kv`) → request plane →
//!   adapter → engine, and the OpenAI SSE back (`/v1/completions` with a token-id prompt).
//!
//! One request at a time (`--requests` per trial, default 1,000), TTFT (first token) and E2E (the
//! whole stream), p50 and p99; the three paths alternate over `--trials` (default 3) and the
//! median trial is reported, so that background load weighs on all alike. The client shares the
//! machine's cores with the server side.
//!
//! Run with `cargo xtask bench engine-adapter` or
//! `cargo bench -p kvroute --bench engine_adapter -- [--requests N] [--tokens T] [--trials K]`.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::response::sse::{Event, Sse};
use axum::routing::{get, post};
use axum::serve::ListenerExt as _;
use futures::StreamExt;
use kvroute_engines::{EngineKind, HttpEngine, HttpEngineConfig};
use kvroute_protocols::PreprocessedRequest;
use kvroute_router::http::{AppState, HttpConfig, serve};
use kvroute_router::{KvPushRouter, KvPushRouterConfig, ModelRegistry, Policy};
use kvroute_runtime::{
    ClientConfig, Discovery, EventPlane, InProcessDiscovery, InProcessEventPlane, InstanceInfo,
    Lease, LlmClient, WorkerServer, WorkerServerConfig,
};
use serde_json::{Value, json};

const BLOCK_SIZE: u32 = 16;
const PROMPT_TOKENS: u32 = 200;

struct Args {
    requests: usize,
    tokens: u32,
    trials: usize,
}

fn args() -> Args {
    let mut args = Args {
        requests: 1000,
        tokens: 16,
        trials: 3,
    };
    let argv: Vec<String> = std::env::args().collect();
    for pair in argv.windows(2) {
        match pair[0].as_str() {
            "--requests" => args.requests = pair[1].parse().unwrap_or(args.requests).max(1),
            "--tokens" => args.tokens = pair[1].parse().unwrap_or(args.tokens).max(1),
            "--trials" => args.trials = pair[1].parse().unwrap_or(args.trials).max(1),
            _ => {}
        }
    }
    args
}

/// llama.cpp's streamed `/completion` for `n_predict` tokens, at once.
async fn completion(
    body: axum::Json<Value>,
) -> Sse<impl futures::Stream<Item = Result<Event, Infallible>>> {
    let n = body["n_predict"].as_u64().unwrap_or(16);
    let prompt = body["prompt"].as_array().map_or(0, Vec::len);
    let chunks = (0..n)
        .map(|i| {
            json!({"index": 0, "content": "x", "tokens": [300 + i], "stop": false,
                   "id_slot": -1, "tokens_predicted": i + 1, "tokens_evaluated": prompt})
        })
        .chain(std::iter::once(json!({
            "index": 0, "content": "", "tokens": [], "stop": true, "id_slot": 0,
            "tokens_predicted": n, "tokens_evaluated": prompt, "stop_type": "limit",
            "stopping_word": "", "tokens_cached": prompt as u64 + n, "truncated": false,
            "timings": {"cache_n": 0, "prompt_n": prompt, "predicted_n": n},
        })))
        .map(|chunk| Ok(Event::default().data(chunk.to_string())))
        .collect::<Vec<_>>();
    Sse::new(futures::stream::iter(chunks))
}

struct Bench {
    client: reqwest::Client,
    engine_url: String,
    kvroute_url: String,
    adapter: LlmClient,
    _worker: (WorkerServer, Lease),
    _state: AppState,
}

async fn setup() -> Bench {
    let engine = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind the engine");
    let engine_base = format!("http://{}", engine.local_addr().unwrap());
    let app = axum::Router::new()
        .route("/completion", post(completion))
        .route(
            "/health",
            get(|| async { axum::Json(json!({"status": "ok"})) }),
        );
    // As a real server would, the engine writes its small SSE chunks without Nagle's delay.
    let engine = engine.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    tokio::spawn(async move { axum::serve(engine, app).await });

    let http_engine = HttpEngine::new(HttpEngineConfig::new(
        EngineKind::Llamacpp,
        engine_base.clone(),
    ))
    .expect("engine config");
    http_engine.health().await.expect("the engine answers");
    let server = WorkerServer::bind(
        "127.0.0.1:0",
        Arc::new(http_engine),
        WorkerServerConfig::new(1),
    )
    .await
    .expect("bind the worker");
    let discovery = InProcessDiscovery::new(Duration::from_secs(60));
    let mut info = InstanceInfo::new(1, server.local_addr().to_string(), BLOCK_SIZE);
    info.metadata
        .insert("kv_events".to_owned(), "false".to_owned());
    let lease = discovery.register(info).await.expect("register");
    let adapter = LlmClient::connect(&server.local_addr().to_string(), ClientConfig::default())
        .await
        .expect("connect to the worker");
    let plane: Arc<dyn EventPlane> = Arc::new(InProcessEventPlane::new(4096));
    let mut config = KvPushRouterConfig::new(BLOCK_SIZE);
    config.core.policy = Policy::Kv;
    let router = KvPushRouter::start(config, discovery.watch(), plane)
        .await
        .expect("start the router");
    let state = AppState::new(router, ModelRegistry::mock("mock"), HttpConfig::default());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind the frontend");
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(serve(listener, state.clone(), std::future::pending()));
    Bench {
        client: reqwest::Client::builder()
            .tcp_nodelay(true)
            .build()
            .expect("HTTP client"),
        engine_url: format!("{engine_base}/completion"),
        kvroute_url: format!("{base}/v1/completions"),
        adapter,
        _worker: (server, lease),
        _state: state,
    }
}

fn prompt(i: usize) -> Vec<u32> {
    // A shared head and a per-request tail, like a chat turn.
    (0..PROMPT_TOKENS)
        .map(|t| {
            if t < 150 {
                1000 + t
            } else {
                5000 + (i as u32 * 64 + t) % 20_000
            }
        })
        .collect()
}

/// TTFT and E2E of one request.
type Sample = (Duration, Duration);

impl Bench {
    /// Reads an SSE body until `done` says a payload ended the stream; returns TTFT and E2E.
    async fn sse(
        &self,
        start: Instant,
        resp: reqwest::Response,
        first: impl Fn(&str) -> bool,
        done: impl Fn(&str) -> bool,
    ) -> Sample {
        assert_eq!(resp.status(), 200);
        let mut body = resp.bytes_stream();
        let mut buf = String::new();
        let mut ttft = None;
        while let Some(chunk) = body.next().await {
            buf.push_str(std::str::from_utf8(&chunk.expect("body")).expect("utf-8"));
            while let Some(end) = buf.find("\n\n") {
                let event: String = buf.drain(..end + 2).collect();
                let Some(payload) = event.trim().strip_prefix("data: ") else {
                    continue;
                };
                if ttft.is_none() && first(payload) {
                    ttft = Some(start.elapsed());
                }
                if done(payload) {
                    return (ttft.expect("a token before the end"), start.elapsed());
                }
            }
        }
        panic!("the stream ended without its last event");
    }

    async fn engine(&self, i: usize, tokens: u32) -> Sample {
        let start = Instant::now();
        let body = json!({"prompt": prompt(i), "n_predict": tokens, "stream": true,
                          "return_tokens": true, "cache_prompt": true});
        let resp = self
            .client
            .post(&self.engine_url)
            .json(&body)
            .send()
            .await
            .expect("send");
        self.sse(
            start,
            resp,
            |p| p.contains("\"tokens\":[3"),
            |p| p.contains("\"stop\":true"),
        )
        .await
    }

    async fn adapter(&self, i: usize, tokens: u32) -> Sample {
        let start = Instant::now();
        let mut request = PreprocessedRequest::new("mock", prompt(i));
        request.stop_conditions.max_tokens = Some(tokens);
        let mut stream = self
            .adapter
            .generate(&format!("r{i}"), &request)
            .await
            .expect("send");
        let mut ttft = None;
        while let Some(item) = stream.next().await {
            let item = item.expect("item");
            if ttft.is_none() && item.data.as_ref().is_some_and(|d| !d.token_ids.is_empty()) {
                ttft = Some(start.elapsed());
            }
        }
        (ttft.expect("a token"), start.elapsed())
    }

    async fn kvroute(&self, i: usize, tokens: u32) -> Sample {
        let start = Instant::now();
        let body = json!({"model": "mock", "prompt": prompt(i), "max_tokens": tokens,
                          "stream": true});
        let resp = self
            .client
            .post(&self.kvroute_url)
            .json(&body)
            .send()
            .await
            .expect("send");
        // The router detokenizes the ids itself: the first chunk with text is the first token.
        let first = |p: &str| p.contains("\"text\":\"") && !p.contains("\"text\":\"\"");
        self.sse(start, resp, first, |p| p == "[DONE]").await
    }
}

#[derive(Clone, Copy)]
enum Path {
    Engine,
    Adapter,
    Kvroute,
}

const PATHS: [(Path, &str); 3] = [
    (Path::Engine, "engine (direct HTTP)"),
    (Path::Adapter, "adapter (request plane)"),
    (Path::Kvroute, "kvroute (HTTP + router)"),
];

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let rank = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[rank.min(sorted.len() - 1)]
}

/// p50 and p99 of TTFT and of E2E, in µs.
fn summary(samples: &mut [Sample]) -> [f64; 4] {
    let mut ttft: Vec<Duration> = samples.iter().map(|s| s.0).collect();
    let mut e2e: Vec<Duration> = samples.iter().map(|s| s.1).collect();
    ttft.sort_unstable();
    e2e.sort_unstable();
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    [
        us(percentile(&ttft, 0.5)),
        us(percentile(&ttft, 0.99)),
        us(percentile(&e2e, 0.5)),
        us(percentile(&e2e, 0.99)),
    ]
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn main() {
    let args = args();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    runtime.block_on(async {
        let bench = setup().await;
        // Warm every path (connections, allocator, the router's index).
        for i in 0..50 {
            bench.engine(i, args.tokens).await;
            bench.adapter(i, args.tokens).await;
            bench.kvroute(i, args.tokens).await;
        }
        let mut trials: Vec<Vec<[f64; 4]>> = vec![Vec::new(); PATHS.len()];
        for trial in 0..args.trials {
            for (p, (path, name)) in PATHS.iter().enumerate() {
                let mut samples = Vec::with_capacity(args.requests);
                for i in 0..args.requests {
                    let sample = match path {
                        Path::Engine => bench.engine(i, args.tokens).await,
                        Path::Adapter => bench.adapter(i, args.tokens).await,
                        Path::Kvroute => bench.kvroute(i, args.tokens).await,
                    };
                    samples.push(sample);
                }
                let s = summary(&mut samples);
                eprintln!(
                    "trial {}/{}: {name:<26} TTFT p50 {:>7.0} µs p99 {:>7.0} µs | E2E p50 {:>7.0} µs p99 {:>7.0} µs",
                    trial + 1,
                    args.trials,
                    s[0],
                    s[1],
                    s[2],
                    s[3]
                );
                trials[p].push(s);
            }
        }
        println!(
            "\nengine adapter overhead: {} streamed requests x {} trials, {} output tokens, {}-token prompts, one at a time (median trial)",
            args.requests, args.trials, args.tokens, PROMPT_TOKENS
        );
        println!(
            "{:<26} {:>14} {:>14} {:>14} {:>14}",
            "path", "TTFT p50 µs", "TTFT p99 µs", "E2E p50 µs", "E2E p99 µs"
        );
        let mut medians = Vec::new();
        for (p, (_, name)) in PATHS.iter().enumerate() {
            let m: Vec<f64> = (0..4)
                .map(|k| median(&mut trials[p].iter().map(|t| t[k]).collect::<Vec<_>>()))
                .collect();
            println!(
                "{name:<26} {:>14.0} {:>14.0} {:>14.0} {:>14.0}",
                m[0], m[1], m[2], m[3]
            );
            medians.push(m);
        }
        let added = |p: usize| -> Vec<f64> { (0..4).map(|k| medians[p][k] - medians[0][k]).collect() };
        for (p, label) in [(1, "added by the adapter"), (2, "added by kvroute")] {
            let a = added(p);
            println!(
                "{label:<26} {:>14.0} {:>14.0} {:>14.0} {:>14.0}",
                a[0], a[1], a[2], a[3]
            );
        }
    });
}
