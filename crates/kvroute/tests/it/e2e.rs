//! End to end over loopback: `kvroute serve` and three `kvroute worker --mock` processes, driven
//! through the HTTP API. Every child is killed when its test ends (pass or fail), and every wait
//! is bounded, so a bug fails a test instead of hanging CI.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use futures::StreamExt;
use serde_json::{Value, json};

use crate::support::scratch;

/// The longest any single step may take.
pub(crate) const BOUND: Duration = Duration::from_secs(30);

/// A child process that is killed when dropped.
pub(crate) struct Proc {
    pub(crate) child: Child,
    /// The fields of its readiness line (`key=value` words).
    ready: Vec<(String, String)>,
}

impl Proc {
    /// Starts `kvroute args...`, logging stderr to `log`, and waits for its readiness line.
    pub(crate) fn start(args: &[&str], log: &std::path::Path) -> Proc {
        let mut child = Command::new(env!("CARGO_BIN_EXE_kvroute"))
            .args(args)
            .env("RUST_LOG", "info")
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(log).expect("create log"))
            .spawn()
            .expect("spawn kvroute");
        let stdout = child.stdout.take().expect("stdout piped");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            if let Some(Ok(line)) = lines.next() {
                let _ = tx.send(line);
            }
            // Keep draining so the child never blocks on a full pipe.
            for _ in lines {}
        });
        let mut proc = Proc {
            child,
            ready: Vec::new(),
        };
        let line = rx.recv_timeout(BOUND).unwrap_or_else(|_| {
            let log = std::fs::read_to_string(log).unwrap_or_default();
            panic!("kvroute {args:?} printed no readiness line; log:\n{log}")
        });
        proc.ready = line
            .split_whitespace()
            .filter_map(|w| w.split_once('='))
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect();
        proc
    }

    pub(crate) fn field(&self, key: &str) -> &str {
        self.ready
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
            .unwrap_or_else(|| panic!("no {key}= in the readiness line {:?}", self.ready))
    }

    pub(crate) fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Sends SIGTERM and waits (bounded) for a clean exit.
    fn terminate(&mut self) -> std::process::ExitStatus {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success());
        let deadline = std::time::Instant::now() + BOUND;
        loop {
            if let Some(status) = self.child.try_wait().expect("wait") {
                return status;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "no exit after SIGTERM"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A router and three workers (ids 1, 2, 3).
pub(crate) struct Fleet {
    pub(crate) serve: Proc,
    pub(crate) workers: Vec<Proc>,
    pub(crate) http: reqwest::Client,
    pub(crate) base: String,
}

impl Fleet {
    /// Starts the fleet; `serve_flags` are added to `kvroute serve`, `speedup` to each worker.
    pub(crate) async fn start(test: &str, serve_flags: &[&str], speedup: &str) -> Fleet {
        Self::start_roles(test, serve_flags, speedup, &["aggregated"; 3]).await
    }

    /// Starts the router and one worker per entry of `roles` (ids 1, 2, ...).
    pub(crate) async fn start_roles(
        test: &str,
        serve_flags: &[&str],
        speedup: &str,
        roles: &[&str],
    ) -> Fleet {
        let dir = scratch(&format!("e2e-{test}"));
        let mut args = vec![
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--registry-listen",
            "127.0.0.1:0",
        ];
        args.extend_from_slice(serve_flags);
        let serve = Proc::start(&args, &dir.join("serve.log"));
        let registry = serve.field("registry").to_owned();
        let base = format!("http://{}", serve.field("http"));
        let workers = roles
            .iter()
            .enumerate()
            .map(|(i, role)| {
                let id = (i + 1).to_string();
                Proc::start(
                    &[
                        "worker",
                        "--mock",
                        "--id",
                        &id,
                        "--role",
                        role,
                        "--router",
                        &registry,
                        "--speedup",
                        speedup,
                        "--metrics-listen",
                        "127.0.0.1:0",
                    ],
                    &dir.join(format!("worker-{id}.log")),
                )
            })
            .collect();
        let fleet = Fleet {
            serve,
            workers,
            http: reqwest::Client::builder()
                .timeout(BOUND)
                .build()
                .expect("http client"),
            base,
        };
        let n = roles.len() as u64;
        fleet
            .eventually("the router to list every worker", |m| {
                (1..=n).all(|w| active_requests(m, w).is_some())
            })
            .await;
        fleet
    }

    pub(crate) async fn router_metrics(&self) -> String {
        self.get(&format!("{}/metrics", self.base)).await
    }

    /// The `/metrics` of worker `id` (1-based).
    async fn worker_metrics(&self, id: u64) -> String {
        let addr = self.workers[id as usize - 1].field("metrics");
        self.get(&format!("http://{addr}/metrics")).await
    }

    pub(crate) async fn get(&self, url: &str) -> String {
        let response = self.http.get(url).send().await.expect("GET");
        response.text().await.expect("body")
    }

    /// Polls the router's `/metrics` until `condition` holds (bounded).
    pub(crate) async fn eventually(&self, what: &str, condition: impl Fn(&str) -> bool) {
        let deadline = tokio::time::Instant::now() + BOUND;
        loop {
            let metrics = self.router_metrics().await;
            if condition(&metrics) {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{what} did not happen; router metrics:\n{metrics}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Asserts that, once everything has ended, the router holds no load on any worker, and
    /// every worker's own report (its engine's queue, sent every second) agrees.
    pub(crate) async fn assert_idle(&self, workers: &[u64]) {
        self.eventually("zero active and reported load on every worker", |m| {
            workers.iter().all(|&w| {
                active_requests(m, w) == Some(0)
                    && gauge(m, "worker_prefill_tokens", w) == Some(0.0)
                    && gauge(m, "worker_reported_requests", w) == Some(0.0)
            })
        })
        .await;
    }

    /// Sends a non-streaming chat completion; returns the status and the JSON body.
    pub(crate) async fn chat(&self, body: &Value, pin: Option<u64>) -> (u16, Value) {
        let mut request = self
            .http
            .post(format!("{}/v1/chat/completions", self.base))
            .json(body);
        if let Some(pin) = pin {
            request = request.header("x-worker-instance-id", pin.to_string());
        }
        let response = request.send().await.expect("POST");
        let status = response.status().as_u16();
        (status, response.json().await.unwrap_or(Value::Null))
    }
}

/// A metric's value for `worker` (dp rank 0) in Prometheus text, whatever other labels the
/// sample has (`router` when serving disaggregated).
pub(crate) fn gauge(metrics: &str, name: &str, worker: u64) -> Option<f64> {
    let prefix = format!("kvroute_router_{name}{{");
    let worker = format!("worker=\"{worker}\"");
    metrics.lines().find_map(|l| {
        let (labels, value) = l.strip_prefix(&prefix)?.split_once("} ")?;
        let labels: Vec<&str> = labels.split(',').collect();
        if labels.contains(&worker.as_str()) && labels.contains(&"dp_rank=\"0\"") {
            value.trim().parse().ok()
        } else {
            None
        }
    })
}

pub(crate) fn active_requests(metrics: &str, worker: u64) -> Option<u64> {
    gauge(metrics, "worker_active_requests", worker).map(|v| v as u64)
}

/// A plain counter or gauge of a worker's own `/metrics`.
pub(crate) fn worker_value(metrics: &str, name: &str) -> u64 {
    let prefix = format!("kvroute_worker_{name} ");
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {name} in worker metrics:\n{metrics}"))
}

pub(crate) fn decode_worker(body: &Value) -> u64 {
    body["nvext"]["worker_id"]["decode_worker_id"]
        .as_u64()
        .unwrap_or_else(|| panic!("no nvext.worker_id in {body}"))
}

/// A long system prompt shared by every conversation, so that only the conversation's own turns
/// tell them apart, plus a per-conversation opening long enough to fill several KV blocks.
pub(crate) fn conversation(c: usize, turns: usize) -> Vec<Value> {
    let system = "You are a careful assistant. ".repeat(20);
    let mut messages = vec![json!({"role": "system", "content": system})];
    for t in 0..turns {
        let user = format!("conversation {c} turn {t}: ").repeat(12);
        messages.push(json!({"role": "user", "content": user}));
        if t + 1 < turns {
            messages.push(
                json!({"role": "assistant", "content": format!("answer {c} {t} ").repeat(6)}),
            );
        }
    }
    messages
}

pub(crate) fn chat_body(messages: Vec<Value>, max_tokens: u32, nvext: Value) -> Value {
    json!({"model": "mock", "messages": messages, "max_tokens": max_tokens, "nvext": nvext})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn later_turns_follow_the_prefix_and_the_worker_header_pins() {
    let fleet = Fleet::start("prefix", &[], "50").await;
    let want = json!({"extra_fields": ["worker_id"]});
    for c in 0..3 {
        let (status, first) = fleet
            .chat(&chat_body(conversation(c, 1), 4, want.clone()), None)
            .await;
        assert_eq!(status, 200, "{first}");
        let home = decode_worker(&first);
        // The worker's KV events travel to the router over the request plane; give them a moment.
        tokio::time::sleep(Duration::from_millis(200)).await;
        for turns in 2..=4 {
            let (status, later) = fleet
                .chat(&chat_body(conversation(c, turns), 4, want.clone()), None)
                .await;
            assert_eq!(status, 200, "{later}");
            assert_eq!(
                decode_worker(&later),
                home,
                "conversation {c} turn {turns} left the worker holding its prefix"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        // A pin to another worker wins over the cache.
        let other = home % 3 + 1;
        let (status, pinned) = fleet
            .chat(&chat_body(conversation(c, 4), 4, want.clone()), Some(other))
            .await;
        assert_eq!(status, 200, "{pinned}");
        assert_eq!(decode_worker(&pinned), other);
    }
    fleet.assert_idle(&[1, 2, 3]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_open_and_close_reach_the_worker() {
    let fleet = Fleet::start("sessions", &[], "50").await;
    let open = json!({
        "extra_fields": ["worker_id"],
        "session_control": {"session_id": "conv-1", "action": "open", "timeout": 60}
    });
    let (status, body) = fleet
        .chat(&chat_body(conversation(0, 1), 4, open), None)
        .await;
    assert_eq!(status, 200, "{body}");
    let worker = decode_worker(&body);
    let metrics = fleet.worker_metrics(worker).await;
    assert_eq!(
        worker_value(&metrics, "session_opens_total"),
        1,
        "{metrics}"
    );
    assert_eq!(worker_value(&metrics, "sessions_open"), 1, "{metrics}");

    // An intermediate turn stays on the session's worker.
    let next = json!({"extra_fields": ["worker_id"], "session_control": {"session_id": "conv-1"}});
    let (status, body) = fleet
        .chat(&chat_body(conversation(0, 2), 4, next), None)
        .await;
    assert_eq!((status, decode_worker(&body)), (200, worker), "{body}");

    // The close runs on the worker once the closing request has finished.
    let close = json!({"extra_fields": ["worker_id"], "session_control": {"session_id": "conv-1", "action": "close"}});
    let (status, body) = fleet
        .chat(&chat_body(conversation(0, 3), 4, close), None)
        .await;
    assert_eq!((status, decode_worker(&body)), (200, worker), "{body}");
    let deadline = tokio::time::Instant::now() + BOUND;
    loop {
        let metrics = fleet.worker_metrics(worker).await;
        if worker_value(&metrics, "session_closes_total") == 1 {
            assert_eq!(worker_value(&metrics, "sessions_open"), 0, "{metrics}");
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no session close on worker {worker}:\n{metrics}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for other in (1..=3).filter(|&w| w != worker) {
        let metrics = fleet.worker_metrics(other).await;
        assert_eq!(
            worker_value(&metrics, "session_opens_total"),
            0,
            "worker {other}: {metrics}"
        );
    }
    fleet.assert_idle(&[1, 2, 3]).await;
}

/// Reads one SSE `data:` payload at a time from a streaming response.
pub(crate) struct Sse {
    body: futures::stream::BoxStream<'static, reqwest::Result<Vec<u8>>>,
    buffer: String,
}

impl Sse {
    pub(crate) fn new(response: reqwest::Response) -> Sse {
        Sse {
            body: response
                .bytes_stream()
                .map(|r| r.map(|b| b.to_vec()))
                .boxed(),
            buffer: String::new(),
        }
    }

    /// The next `data:` payload, or `None` at the end of the body (bounded).
    pub(crate) async fn next(&mut self) -> Option<String> {
        loop {
            if let Some(end) = self.buffer.find("\n\n") {
                let event: String = self.buffer.drain(..end + 2).collect();
                let data: Vec<&str> = event
                    .lines()
                    .filter_map(|l| l.strip_prefix("data:"))
                    .map(str::trim_start)
                    .collect();
                if data.is_empty() {
                    continue; // a keep-alive comment
                }
                return Some(data.join("\n"));
            }
            let chunk = tokio::time::timeout(BOUND, self.body.next())
                .await
                .expect("the stream stalled")?;
            self.buffer
                .push_str(&String::from_utf8_lossy(&chunk.expect("body chunk")));
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_a_worker_mid_stream_still_completes_the_stream() {
    // Real-time engines (speedup 1) so that the stream is long enough to kill its worker in.
    let mut fleet = Fleet::start("migration", &[], "1").await;
    let max_tokens = 300;
    let mut body = chat_body(
        conversation(0, 1),
        max_tokens,
        json!({"extra_fields": ["worker_id"]}),
    );
    body["stream"] = json!(true);
    let response = fleet
        .http
        .post(format!("{}/v1/chat/completions", fleet.base))
        .json(&body)
        .send()
        .await
        .expect("POST");
    assert_eq!(response.status().as_u16(), 200);
    let mut sse = Sse::new(response);
    let opening: Value = serde_json::from_str(&sse.next().await.expect("opening chunk")).unwrap();
    let first_worker = decode_worker(&opening);
    let mut content_chunks = 0;
    let mut last = Value::Null;
    let mut killed = false;
    while let Some(data) = sse.next().await {
        if data == "[DONE]" {
            break;
        }
        let chunk: Value = serde_json::from_str(&data).unwrap_or_else(|e| panic!("{e}: {data}"));
        assert!(
            chunk.get("error").is_none(),
            "the client saw an error: {chunk}"
        );
        if chunk["choices"][0]["delta"]["content"]
            .as_str()
            .is_some_and(|c| !c.is_empty())
        {
            content_chunks += 1;
        }
        if content_chunks == 10 && !killed {
            fleet.workers[first_worker as usize - 1].kill();
            killed = true;
        }
        last = chunk;
    }
    assert!(killed, "the stream ended before its worker could be killed");
    assert_eq!(last["choices"][0]["finish_reason"], "length", "{last}");
    let final_worker = decode_worker(&last);
    assert_ne!(final_worker, first_worker, "the request should have moved");
    assert_eq!(content_chunks, max_tokens, "one stream with every token");
    let survivors: Vec<u64> = (1..=3).filter(|&w| w != first_worker).collect();
    fleet.assert_idle(&survivors).await;
    // The killed worker's registration ended with its process.
    fleet
        .eventually("the dead worker to leave", |m| {
            active_requests(m, first_worker).is_none()
        })
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_beyond_capacity_gets_429_or_503_never_a_hang() {
    let mut fleet = Fleet::start(
        "burst",
        &[
            "--max-in-flight",
            "2",
            "--max-queued",
            "2",
            "--queue-timeout",
            "300ms",
        ],
        "1",
    )
    .await;
    let requests = (0..16).map(|i| {
        let fleet = &fleet;
        async move {
            let body = chat_body(conversation(i, 1), 40, json!({}));
            let response = fleet
                .http
                .post(format!("{}/v1/chat/completions", fleet.base))
                .json(&body)
                .send()
                .await
                .expect("every request is answered within the bound");
            let status = response.status().as_u16();
            let retry_after = response.headers().get("retry-after").is_some();
            let _ = response.text().await;
            (status, retry_after)
        }
    });
    let answers = tokio::time::timeout(BOUND * 2, futures::future::join_all(requests))
        .await
        .expect("the burst hung");
    let ok = answers.iter().filter(|(s, _)| *s == 200).count();
    let refused: Vec<_> = answers
        .iter()
        .filter(|(s, _)| *s == 429 || *s == 503)
        .collect();
    assert!(ok >= 2, "{answers:?}");
    assert!(!refused.is_empty(), "nothing was refused: {answers:?}");
    assert_eq!(
        ok + refused.len(),
        answers.len(),
        "only 200, 429 or 503: {answers:?}"
    );
    assert!(
        refused.iter().all(|(_, retry)| *retry),
        "every refusal advises Retry-After: {answers:?}"
    );
    fleet.assert_idle(&[1, 2, 3]).await;

    // Graceful shutdown: both kinds of process exit cleanly on SIGTERM, the worker deregistering.
    let status = fleet.workers[0].terminate();
    assert!(status.success(), "worker exit: {status}");
    fleet
        .eventually("the stopped worker to deregister", |m| {
            active_requests(m, 1).is_none()
        })
        .await;
    let status = fleet.serve.terminate();
    assert!(status.success(), "serve exit: {status}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_and_decode_workers_serve_disaggregated_and_both_loads_drain() {
    // Worker 1 prefills, worker 2 decodes; the router lists both (one per phase's router).
    let fleet = Fleet::start_roles("disagg", &[], "50", &["prefill", "decode"]).await;
    for turn in 0..2 {
        let body = chat_body(
            conversation(turn, 2),
            6,
            json!({"extra_fields": ["worker_id"]}),
        );
        let (status, reply) = fleet.chat(&body, None).await;
        assert_eq!(status, 200, "{reply}");
        assert!(
            reply["usage"]["completion_tokens"]
                .as_u64()
                .is_some_and(|n| n > 0),
            "the decode worker produced tokens: {reply}"
        );
        let workers = &reply["nvext"]["worker_id"];
        assert_eq!(workers["prefill_worker_id"], 1, "{reply}");
        assert_eq!(decode_worker(&reply), 2, "{reply}");
    }
    fleet.assert_idle(&[1, 2]).await;
}

/// Runs `kvroute worker ...` expecting it to fail: its exit status (bounded wait) and stderr.
fn failing_worker(args: &[&str], log: &std::path::Path) -> (std::process::ExitStatus, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(args)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).expect("create log"))
        .spawn()
        .expect("spawn kvroute");
    let started = std::time::Instant::now();
    loop {
        if let Some(status) = child.try_wait().expect("wait") {
            return (status, std::fs::read_to_string(log).unwrap_or_default());
        }
        if started.elapsed() > BOUND {
            let _ = child.kill();
            panic!("kvroute {args:?} kept running; it should have exited");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_taken_id_or_a_foreign_block_size_makes_the_worker_exit_with_the_reason() {
    let fleet = Fleet::start("refused", &[], "100").await;
    let dir = scratch("e2e-refused-workers");
    let registry = fleet.serve.field("registry").to_owned();
    let (status, log) = failing_worker(
        &["worker", "--mock", "--id", "2", "--router", &registry],
        &dir.join("duplicate.log"),
    );
    assert!(!status.success());
    assert!(
        log.contains("the router refused") && log.contains("instance id 2 is already registered"),
        "{log}"
    );
    let config = dir.join("mocker.toml");
    std::fs::write(&config, "block_size = 32\n").expect("write mocker config");
    let (status, log) = failing_worker(
        &[
            "worker",
            "--mock",
            "--id",
            "9",
            "--router",
            &registry,
            "--mocker-config",
            config.to_str().unwrap(),
        ],
        &dir.join("block-size.log"),
    );
    assert!(!status.success());
    assert!(
        log.contains("kv_block_size 32 differs from the router's block size 16"),
        "{log}"
    );
    // Neither took the fleet's place: the three workers serve on.
    let metrics = fleet.router_metrics().await;
    assert!(active_requests(&metrics, 9).is_none(), "{metrics}");
    fleet.assert_idle(&[1, 2, 3]).await;
}
