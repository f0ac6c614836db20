//! Router overhead: what putting kvroute in front of a fleet costs, on this machine.
//!
//! The fleet is 64 zero-latency workers (an engine that answers every request with one token at
//! once) over the TCP request plane on loopback, with in-process discovery and event plane. The
//! router is the real service path: HTTP (axum) → JSON and `nvext` → chat template and the mock
//! tokenizer → admission → the KV router (policy `kv`: hashing, overlap lookup, cost over 64
//! workers) → the request plane → the response as OpenAI JSON. Requests are non-streaming chat
//! completions of a ~100-token prompt, sent with reqwest over keep-alive connections.
//!
//! Three figures:
//!
//! - throughput: `--concurrency` clients (default 64) in a closed loop for `--seconds`; requests
//!   per second counted only when the whole response arrived with status 200;
//! - router latency: an open loop at `--rate` requests per second (default 1,000) for
//!   `--seconds`; each latency is measured from the request's *scheduled* send time to its
//!   response, so a stall counts against every request it delays (no coordinated omission);
//! - direct latency: the same open loop, the same prompt tokens, sent straight to one worker
//!   over the request plane (no HTTP, no router).
//!
//! The latency the router adds is the router percentile minus the direct one, per trial; router
//! and direct trials alternate (`--trials`, default 3) and the median trial is the figure, so
//! that background load on a shared machine weighs on both paths alike. The difference is
//! conservative: it includes the HTTP client's own cost (reqwest's request building and parsing
//! share the cores with the server). The router's own routing span (hashing, matching,
//! scheduling, from its Prometheus histogram) is printed too, for scale.
//!
//! Run with `cargo xtask bench router-overhead` or
//! `cargo bench -p kvroute --bench router_overhead -- [--seconds N] [--rate R] [--concurrency C]
//! [--trials T]`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures::StreamExt;
use kvroute_protocols::{Annotated, LLMEngineOutput, PreprocessedRequest};
use kvroute_router::http::{AppState, HttpConfig, serve};
use kvroute_router::{KvPushRouter, KvPushRouterConfig, ModelRegistry, Policy};
use kvroute_runtime::{
    ClientConfig, Discovery, Engine, EngineError, EventPlane, InProcessDiscovery,
    InProcessEventPlane, InstanceInfo, Lease, LlmClient, LlmResponse, RequestContext,
    ResponseStream, WorkerServer, WorkerServerConfig,
};
use tokio::task::JoinSet;

const WORKERS: u64 = 64;
const BLOCK_SIZE: u32 = 16;

/// Answers every request at once with one token and a stop.
struct Zero;

impl Engine for Zero {
    type Request = PreprocessedRequest;
    type Response = LlmResponse;

    fn generate(
        &self,
        _request: PreprocessedRequest,
        _context: RequestContext,
    ) -> Result<ResponseStream<LlmResponse>, EngineError> {
        let mut output = LLMEngineOutput::stop();
        output.token_ids = vec![100];
        Ok(Box::pin(futures::stream::iter([Annotated::from_data(
            output,
        )])))
    }
}

struct Args {
    seconds: f64,
    rate: f64,
    concurrency: usize,
    trials: usize,
}

fn args() -> Args {
    let mut args = Args {
        seconds: 5.0,
        rate: 1000.0,
        concurrency: 64,
        trials: 3,
    };
    let argv: Vec<String> = std::env::args().collect();
    for pair in argv.windows(2) {
        match pair[0].as_str() {
            "--seconds" => args.seconds = pair[1].parse().unwrap_or(args.seconds),
            "--rate" => args.rate = pair[1].parse().unwrap_or(args.rate),
            "--concurrency" => args.concurrency = pair[1].parse().unwrap_or(args.concurrency),
            "--trials" => args.trials = pair[1].parse().unwrap_or(args.trials).max(1),
            _ => {}
        }
    }
    args
}

/// The prompt of request `i`: a shared 64-word system prompt and a short user message that
/// differs per request (so the index sees both shared and fresh blocks).
fn messages(i: u64) -> serde_json::Value {
    let system: Vec<String> = (0..64).map(|w| format!("sys{w}")).collect();
    let user: Vec<String> = (0..32).map(|w| format!("u{i}w{w}")).collect();
    serde_json::json!([
        {"role": "system", "content": system.join(" ")},
        {"role": "user", "content": user.join(" ")},
    ])
}

fn body(i: u64) -> String {
    serde_json::json!({"model": "mock", "messages": messages(i), "max_tokens": 1}).to_string()
}

struct Bench {
    url: String,
    live: String,
    client: reqwest::Client,
    state: AppState,
    direct: LlmClient,
    _workers: Vec<(WorkerServer, Lease)>,
}

async fn setup() -> Bench {
    let discovery = InProcessDiscovery::new(Duration::from_secs(60));
    let plane: Arc<dyn EventPlane> = Arc::new(InProcessEventPlane::new(4096));
    let mut workers = Vec::new();
    for id in 1..=WORKERS {
        let server = WorkerServer::bind("127.0.0.1:0", Arc::new(Zero), WorkerServerConfig::new(id))
            .await
            .expect("bind a worker");
        let info = InstanceInfo::new(id, server.local_addr().to_string(), BLOCK_SIZE);
        let lease = discovery.register(info).await.expect("register");
        workers.push((server, lease));
    }
    let direct = LlmClient::connect(
        &workers[0].0.local_addr().to_string(),
        ClientConfig::default(),
    )
    .await
    .expect("connect to a worker");
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
        url: format!("{base}/v1/chat/completions"),
        live: format!("{base}/live"),
        client: reqwest::Client::builder()
            .pool_max_idle_per_host(1024)
            .build()
            .expect("HTTP client"),
        state,
        direct,
        _workers: workers,
    }
}

impl Bench {
    /// One request through the router; panics unless it succeeds.
    async fn via_router(&self, i: u64) {
        let resp = self
            .client
            .post(&self.url)
            .header("content-type", "application/json")
            .body(body(i))
            .send()
            .await
            .expect("send");
        assert_eq!(resp.status(), 200, "{:?}", resp.text().await);
        let bytes = resp.bytes().await.expect("body");
        assert!(!bytes.is_empty());
    }

    /// `GET /live`: the HTTP client and server with nothing behind them.
    async fn live(&self) {
        let resp = self.client.get(&self.live).send().await.expect("send");
        assert_eq!(resp.status(), 200);
        resp.bytes().await.expect("body");
    }

    /// The same prompt tokens straight to one worker over the request plane.
    async fn direct(&self, request: &PreprocessedRequest) {
        let mut stream = self.direct.generate("direct", request).await.expect("send");
        while let Some(item) = stream.next().await {
            item.expect("item");
        }
    }
}

/// The tokens the router sends for `messages(i)` (what the mock template and tokenizer make).
fn direct_request(i: u64) -> PreprocessedRequest {
    let model = kvroute_router::Model::mock("mock");
    let msgs: Vec<kvroute_router::tokenizer::TemplateMessage> = messages(i)
        .as_array()
        .unwrap()
        .iter()
        .map(|m| kvroute_router::tokenizer::TemplateMessage {
            role: m["role"].as_str().unwrap().to_owned(),
            content: m["content"].as_str().unwrap().to_owned(),
        })
        .collect();
    let text = model.template.render(&msgs, true).expect("render");
    let tokens = model.tokenizer.encode(&text).expect("encode");
    let mut request = PreprocessedRequest::new("mock", tokens);
    request.stop_conditions.max_tokens = Some(1);
    request.eos_token_ids = model.eos_token_ids.clone();
    request
}

async fn throughput(bench: &Arc<Bench>, concurrency: usize, seconds: f64) -> f64 {
    let done = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + Duration::from_secs_f64(seconds);
    let start = Instant::now();
    let mut tasks = JoinSet::new();
    for c in 0..concurrency as u64 {
        let (bench, done) = (bench.clone(), done.clone());
        tasks.spawn(async move {
            let mut i = c << 32;
            while Instant::now() < deadline {
                bench.via_router(i).await;
                done.fetch_add(1, Ordering::Relaxed);
                i += 1;
            }
        });
    }
    while tasks.join_next().await.is_some() {}
    done.load(Ordering::Relaxed) as f64 / start.elapsed().as_secs_f64()
}

/// Sends `rate` requests per second for `seconds` without waiting for answers; returns each
/// request's latency from its scheduled send time, sorted.
///
/// The pacing runs on a blocking thread with the OS sleep (tens of microseconds late at worst),
/// not tokio's timer, whose millisecond ticks would add up to a millisecond to every latency.
async fn open_loop<F, Fut>(rate: f64, seconds: f64, send: F) -> Vec<Duration>
where
    F: Fn(u64) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let n = (rate * seconds) as u64;
    let period = Duration::from_secs_f64(1.0 / rate);
    let handle = tokio::runtime::Handle::current();
    let tasks = tokio::task::spawn_blocking(move || {
        let start = Instant::now() + Duration::from_millis(10);
        let mut tasks = Vec::with_capacity(n as usize);
        for i in 0..n {
            let scheduled = start + period.mul_f64(i as f64);
            if let Some(wait) = scheduled.checked_duration_since(Instant::now()) {
                std::thread::sleep(wait);
            }
            let fut = send(i);
            tasks.push(handle.spawn(async move {
                fut.await;
                scheduled.elapsed()
            }));
        }
        tasks
    })
    .await
    .expect("pacing thread");
    let mut latencies = Vec::with_capacity(tasks.len());
    for task in tasks {
        latencies.push(task.await.expect("request task"));
    }
    latencies.sort();
    latencies
}

fn pct(sorted: &[Duration], q: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// The mean of the router's routing-overhead histogram per phase, from its Prometheus text.
fn routing_span(state: &AppState) -> Vec<(String, f64)> {
    let text = state.router().metrics_text();
    let mut out = Vec::new();
    for phase in ["tokenizing", "hashing", "find_matches", "scheduling"] {
        let value = |suffix: &str| {
            text.lines()
                .find(|l| {
                    l.starts_with(&format!("kvroute_router_routing_overhead_seconds_{suffix}"))
                        && l.contains(&format!("phase=\"{phase}\""))
                })
                .and_then(|l| l.rsplit(' ').next())
                .and_then(|v| v.parse::<f64>().ok())
        };
        if let (Some(sum), Some(count)) = (value("sum"), value("count"))
            && count > 0.0
        {
            out.push((phase.to_owned(), sum / count * 1e6));
        }
    }
    out
}

/// One open-loop trial of each path, in µs: router p50 and p99, direct p50 and p99, and the
/// HTTP floor (`GET /live`: reqwest and axum with no routing) p50 and p99.
async fn trial(
    bench: &Arc<Bench>,
    args: &Args,
    direct: &Arc<Vec<PreprocessedRequest>>,
) -> [f64; 6] {
    let routed = {
        let bench = bench.clone();
        open_loop(args.rate, args.seconds, move |i| {
            let bench = bench.clone();
            async move { bench.via_router((1 << 40) | i).await }
        })
        .await
    };
    let direct = {
        let (bench, requests) = (bench.clone(), direct.clone());
        open_loop(args.rate, args.seconds, move |i| {
            let (bench, requests) = (bench.clone(), requests.clone());
            async move { bench.direct(&requests[i as usize % requests.len()]).await }
        })
        .await
    };
    let live = {
        let bench = bench.clone();
        open_loop(args.rate, args.seconds, move |_| {
            let bench = bench.clone();
            async move { bench.live().await }
        })
        .await
    };
    [
        us(pct(&routed, 0.5)),
        us(pct(&routed, 0.99)),
        us(pct(&direct, 0.5)),
        us(pct(&direct, 0.99)),
        us(pct(&live, 0.5)),
        us(pct(&live, 0.99)),
    ]
}

fn cells(row: &[f64]) -> String {
    let widths = [11, 11, 11, 11, 11, 11, 10, 10];
    row.iter()
        .zip(widths)
        .map(|(v, w)| format!("{v:>w$.0}"))
        .collect::<Vec<_>>()
        .join(" ")
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn main() {
    let args = args();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let bench = Arc::new(setup().await);
        // Warm up: connections to every worker, the HTTP pool, the allocator.
        throughput(&bench, args.concurrency, 1.0).await;

        let rps = throughput(&bench, args.concurrency, args.seconds).await;
        println!(
            "throughput: {rps:.0} requests/s through HTTP -> router -> {WORKERS} workers \
             ({} concurrent clients, {} s)",
            args.concurrency, args.seconds
        );

        // Router and direct trials alternate, so background load on a shared machine hits both
        // paths alike; the median trial is the figure.
        let direct: Arc<Vec<PreprocessedRequest>> =
            Arc::new((0..64).map(|i| direct_request((1 << 40) | i)).collect());
        println!(
            "open loop at {:.0} requests/s, {} trials of {} s per path (latency from the \
             scheduled send time, in us):",
            args.rate, args.trials, args.seconds
        );
        println!(
            "{:>7} {:>11} {:>11} {:>11} {:>11} {:>11} {:>11} {:>10} {:>10}",
            "trial",
            "router p50",
            "router p99",
            "direct p50",
            "direct p99",
            "added p50",
            "added p99",
            "/live p50",
            "/live p99"
        );
        let mut rows = Vec::new();
        for t in 0..args.trials {
            let [rp50, rp99, dp50, dp99, lp50, lp99] = trial(&bench, &args, &direct).await;
            let row = [rp50, rp99, dp50, dp99, rp50 - dp50, rp99 - dp99, lp50, lp99];
            println!("{:>7} {}", t + 1, cells(&row));
            rows.push(row);
        }
        let medians: Vec<f64> = (0..8)
            .map(|i| median(rows.iter().map(|r| r[i]).collect()))
            .collect();
        println!("{:>7} {}", "median", cells(&medians));
        let span: Vec<String> = routing_span(&bench.state)
            .iter()
            .map(|(phase, mean)| format!("{phase} {mean:.1}us"))
            .collect();
        println!("routing span (mean per request): {}", span.join(", "));
    });
}
