//! The load generator: the shared-prefix chat workload, closed- and open-loop drivers over one
//! `reqwest` client, and the figures of a measured window.
//!
//! Closed loop: `clients` tasks each send a request, wait for its whole answer and send the next;
//! a request counts when it was sent after the warm-up and answered before the window closed.
//! Open loop: requests are sent at fixed intervals whatever the answers, and each one's latency is
//! measured from its scheduled send time (so a stalled server cannot hide its queueing); a
//! request counts when it was scheduled inside the window, however late it finishes.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Context, Result, bail};

pub(crate) use crate::http_load::{SseScan, percentile};
use serde_json::{Value, json};
use tokio::task::JoinSet;
use tokio::time::Instant;

/// Shared-prefix families (one system prompt each).
pub(crate) const FAMILIES: u64 = 8;
/// Words of each family's system prompt: about 480 tokens with the bench's tokenizer (with the
/// question and the template, a request's prompt is about 560).
pub(crate) const SYSTEM_WORDS: usize = 170;
/// Words of each request's own question: about 55 tokens.
pub(crate) const USER_WORDS: usize = 20;
/// Tokens generated per request.
pub(crate) const OUTPUT_TOKENS: u64 = 16;
/// The longest one request may take, streamed or not.
pub(crate) const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// An open-loop run refuses to hold more requests in flight than this (it counts the rest as
/// errors instead of piling up tasks behind a server that stopped answering).
const MAX_OPEN_IN_FLIGHT: usize = 4096;

/// The words prompts are made of: ordinary English from the text the bench's tokenizer learned
/// its merges on (`tests/python/llamacpp/make_model.py`), so they cut into about 2.7 tokens each.
const WORDS: &[&str] = &[
    "the",
    "router",
    "sends",
    "each",
    "request",
    "to",
    "worker",
    "that",
    "holds",
    "longest",
    "prefix",
    "of",
    "its",
    "prompt",
    "in",
    "key",
    "value",
    "cache",
    "so",
    "a",
    "conversation",
    "returns",
    "finds",
    "earlier",
    "turns",
    "already",
    "computed",
    "engine",
    "decides",
    "which",
    "slot",
    "serves",
    "system",
    "shared",
    "by",
    "every",
    "family",
    "user",
    "answers",
    "assistant",
    "set",
    "one",
    "apart",
    "from",
    "another",
    "language",
    "model",
    "reads",
    "computes",
    "attention",
    "over",
    "position",
    "writes",
    "token",
    "after",
    "until",
    "reaches",
    "end",
    "answer",
    "or",
    "limit",
    "on",
    "new",
    "tokens",
    "serving",
    "many",
    "users",
    "at",
    "once",
    "means",
    "batching",
    "their",
    "requests",
    "together",
    "keeping",
    "memory",
    "blocks",
    "evicting",
    "least",
    "recently",
    "used",
    "when",
    "full",
    "scheduler",
    "looks",
    "load",
    "number",
    "waiting",
    "queue",
    "would",
    "have",
    "compute",
    "again",
    "then",
    "picks",
    "cheapest",
    "metrics",
    "show",
    "hit",
    "rate",
    "time",
    "first",
    "latency",
    "between",
    "still",
    "active",
    "streaming",
    "text",
    "as",
    "produced",
    "cancelling",
    "stream",
    "should",
    "free",
];

/// The chat requests of the bench: request `n` belongs to family `n % FAMILIES`, whose system
/// prompt it shares, and asks a question of its own (so only the system prompt is shared).
#[derive(Debug)]
pub(crate) struct Workload {
    model: String,
    systems: Vec<String>,
    next: AtomicU64,
}

impl Workload {
    pub(crate) fn new(model: &str) -> Workload {
        let systems = (0..FAMILIES)
            .map(|f| {
                format!(
                    "You are assistant {f} of a family of {FAMILIES}. {}",
                    words(0x5eed_0000 + f, SYSTEM_WORDS)
                )
            })
            .collect();
        Workload {
            model: model.to_owned(),
            systems,
            next: AtomicU64::new(0),
        }
    }

    /// The system prompt of `family`.
    pub(crate) fn system(&self, family: u64) -> &str {
        &self.systems[(family % FAMILIES) as usize]
    }

    /// The body of request `n`.
    pub(crate) fn body(&self, n: u64, stream: bool) -> Value {
        let question = format!(
            "Question {n}: {}?",
            words(n.wrapping_mul(0x9e37_79b9) ^ 0xa11ce, USER_WORDS)
        );
        json!({
            "model": self.model,
            "messages": [
                {"role": "system", "content": self.system(n % FAMILIES)},
                {"role": "user", "content": question},
            ],
            "max_tokens": OUTPUT_TOKENS,
            "stream": stream,
            // Both mock engines could draw the end-of-sequence id; every answer is 16 tokens.
            // (The vLLM-style top-level field, which both frontends accept.)
            "ignore_eos": true,
        })
    }

    /// The body of the next request (a fresh `n` each time, across every run of the bench).
    fn next_body(&self, stream: bool) -> Value {
        self.body(self.next.fetch_add(1, Ordering::Relaxed), stream)
    }
}

/// `count` words drawn from [`WORDS`] by a generator seeded with `seed`.
pub(crate) fn words(seed: u64, count: usize) -> String {
    let mut state = seed;
    let mut out = String::new();
    for i in 0..count {
        if i > 0 {
            out.push(' ');
        }
        let r = splitmix64(&mut state);
        out.push_str(WORDS[(r % WORDS.len() as u64) as usize]);
    }
    out
}

fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// How requests are sent.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Pacing {
    /// This many clients, each waiting for an answer before its next request.
    Closed { clients: usize },
    /// Requests at this many per second, whatever the answers.
    Open { rate: f64 },
}

/// One measured run's shape.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Scenario {
    pub(crate) pacing: Pacing,
    pub(crate) stream: bool,
}

impl Scenario {
    /// How the table names it: `closed, 32 clients, streamed`.
    pub(crate) fn label(&self) -> String {
        let pacing = match self.pacing {
            Pacing::Closed { clients: 1 } => "closed, 1 client".to_owned(),
            Pacing::Closed { clients } => format!("closed, {clients} clients"),
            Pacing::Open { rate } => format!("open, {rate} req/s"),
        };
        let kind = if self.stream {
            "streamed"
        } else {
            "non-streamed"
        };
        format!("{pacing}, {kind}")
    }
}

/// Warm-up and window lengths of a run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Window {
    pub(crate) warm_up: Duration,
    pub(crate) measure: Duration,
}

/// What one request measured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Sample {
    /// Time to the first streamed event carrying a choice (streamed requests only).
    pub(crate) ttft: Option<Duration>,
    pub(crate) e2e: Duration,
    /// `usage.prompt_tokens` of a non-streamed answer.
    pub(crate) prompt_tokens: Option<u64>,
}

/// The figures of one measured window.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Figures {
    pub(crate) ok: usize,
    pub(crate) errors: usize,
    /// The first error seen, for the report.
    pub(crate) first_error: Option<String>,
    pub(crate) req_per_s: f64,
    pub(crate) ttft_p50_ms: Option<f64>,
    pub(crate) ttft_p99_ms: Option<f64>,
    pub(crate) e2e_p50_ms: Option<f64>,
    pub(crate) e2e_p99_ms: Option<f64>,
    pub(crate) mean_prompt_tokens: Option<f64>,
}

/// The samples and errors of a window, turned into [`Figures`].
#[derive(Debug, Default)]
pub(crate) struct Tally {
    samples: Vec<Sample>,
    errors: usize,
    first_error: Option<String>,
}

impl Tally {
    pub(crate) fn record(&mut self, result: Result<Sample>) {
        match result {
            Ok(sample) => self.samples.push(sample),
            Err(e) => {
                self.errors += 1;
                if self.first_error.is_none() {
                    self.first_error = Some(format!("{e:#}"));
                }
            }
        }
    }

    /// The figures over a window of `seconds`.
    pub(crate) fn figures(&self, seconds: f64) -> Figures {
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let mut e2e: Vec<f64> = self.samples.iter().map(|s| ms(s.e2e)).collect();
        let mut ttft: Vec<f64> = self.samples.iter().filter_map(|s| s.ttft.map(ms)).collect();
        e2e.sort_by(f64::total_cmp);
        ttft.sort_by(f64::total_cmp);
        let prompts: Vec<u64> = self
            .samples
            .iter()
            .filter_map(|s| s.prompt_tokens)
            .collect();
        Figures {
            ok: self.samples.len(),
            errors: self.errors,
            first_error: self.first_error.clone(),
            req_per_s: if seconds > 0.0 {
                self.samples.len() as f64 / seconds
            } else {
                0.0
            },
            ttft_p50_ms: percentile(&ttft, 50.0),
            ttft_p99_ms: percentile(&ttft, 99.0),
            e2e_p50_ms: percentile(&e2e, 50.0),
            e2e_p99_ms: percentile(&e2e, 99.0),
            mean_prompt_tokens: (!prompts.is_empty())
                .then(|| prompts.iter().sum::<u64>() as f64 / prompts.len() as f64),
        }
    }
}

/// The HTTP client of every run: keep-alive connections, no Nagle delay, bounded requests.
pub(crate) fn client() -> Result<reqwest::Client> {
    crate::http_load::client(REQUEST_TIMEOUT)
}

/// Runs `scenario` against `url` (a `/v1/chat/completions` address): a warm-up, then a measured
/// window.
pub(crate) async fn run(
    http: &reqwest::Client,
    url: &str,
    workload: &Arc<Workload>,
    scenario: Scenario,
    window: Window,
) -> Figures {
    let tally = match scenario.pacing {
        Pacing::Closed { clients } => {
            closed(http, url, workload, clients, scenario.stream, window).await
        }
        Pacing::Open { rate } => open(http, url, workload, rate, scenario.stream, window).await,
    };
    tally.figures(window.measure.as_secs_f64())
}

async fn closed(
    http: &reqwest::Client,
    url: &str,
    workload: &Arc<Workload>,
    clients: usize,
    stream: bool,
    window: Window,
) -> Tally {
    let start = Instant::now();
    let (warm_end, end) = (
        start + window.warm_up,
        start + window.warm_up + window.measure,
    );
    let mut tasks = JoinSet::new();
    for _ in 0..clients {
        let (http, url, workload) = (http.clone(), url.to_owned(), Arc::clone(workload));
        tasks.spawn(async move {
            let mut tally = Tally::default();
            loop {
                let sent = Instant::now();
                if sent >= end {
                    return tally;
                }
                let result = one(&http, &url, workload.next_body(stream), stream, sent).await;
                if sent >= warm_end && Instant::now() <= end {
                    tally.record(result);
                }
            }
        });
    }
    let mut all = Tally::default();
    while let Some(done) = tasks.join_next().await {
        match done {
            Ok(t) => {
                all.samples.extend(t.samples);
                all.errors += t.errors;
                if all.first_error.is_none() {
                    all.first_error = t.first_error;
                }
            }
            Err(e) => all.record(Err(anyhow::anyhow!("a client task failed: {e}"))),
        }
    }
    all
}

async fn open(
    http: &reqwest::Client,
    url: &str,
    workload: &Arc<Workload>,
    rate: f64,
    stream: bool,
    window: Window,
) -> Tally {
    let start = Instant::now();
    let (warm_end, end) = (
        start + window.warm_up,
        start + window.warm_up + window.measure,
    );
    let interval = Duration::from_secs_f64(1.0 / rate);
    let mut tasks = JoinSet::new();
    let mut tally = Tally::default();
    let record =
        |tally: &mut Tally, done: Result<(Instant, Result<Sample>), tokio::task::JoinError>| {
            match done {
                Ok((at, result)) => {
                    if at >= warm_end {
                        tally.record(result);
                    }
                }
                Err(e) => tally.record(Err(anyhow::anyhow!("a request task failed: {e}"))),
            }
        };
    for i in 0u64.. {
        let at = start + interval.mul_f64(i as f64);
        if at >= end {
            break;
        }
        tokio::time::sleep_until(at).await;
        while let Some(done) = tasks.try_join_next() {
            record(&mut tally, done);
        }
        if tasks.len() >= MAX_OPEN_IN_FLIGHT {
            if at >= warm_end {
                tally.record(Err(anyhow::anyhow!(
                    "{MAX_OPEN_IN_FLIGHT} requests in flight: the server is not keeping up"
                )));
            }
            continue;
        }
        let (http, url, body) = (http.clone(), url.to_owned(), workload.next_body(stream));
        tasks.spawn(async move { (at, one(&http, &url, body, stream, at).await) });
    }
    // Every request has its own timeout; this bound only guards against a bug.
    let drained = tokio::time::timeout(REQUEST_TIMEOUT + Duration::from_secs(5), async {
        while let Some(done) = tasks.join_next().await {
            record(&mut tally, done);
        }
    })
    .await;
    if drained.is_err() {
        let left = tasks.len();
        tasks.abort_all();
        for _ in 0..left {
            tally.record(Err(anyhow::anyhow!("a request outlived its timeout")));
        }
    }
    tally
}

/// Sends one request and reads its whole answer; latencies count from `since`.
async fn one(
    http: &reqwest::Client,
    url: &str,
    body: Value,
    stream: bool,
    since: Instant,
) -> Result<Sample> {
    let mut response = http
        .post(url)
        .json(&body)
        .send()
        .await
        .context("sending the request")?;
    let status = response.status();
    if !status.is_success() {
        let text = response.text().await.unwrap_or_default();
        bail!(
            "HTTP {status}: {}",
            text.chars().take(300).collect::<String>()
        );
    }
    if !stream {
        let answer: Value = response.json().await.context("reading the JSON answer")?;
        let e2e = since.elapsed();
        check_answer(&answer)?;
        return Ok(Sample {
            ttft: None,
            e2e,
            prompt_tokens: answer["usage"]["prompt_tokens"].as_u64(),
        });
    }
    let mut events = SseScan::default();
    let mut ttft = None;
    while let Some(chunk) = response.chunk().await.context("reading the stream")? {
        events.feed(&chunk)?;
        if ttft.is_none() && events.first_choice {
            ttft = Some(since.elapsed());
        }
    }
    let e2e = since.elapsed();
    if !events.done {
        bail!("the stream ended without `data: [DONE]`");
    }
    let ttft = ttft.context("the stream carried no choice")?;
    Ok(Sample {
        ttft: Some(ttft),
        e2e,
        prompt_tokens: None,
    })
}

/// A non-streamed answer must have finished and, with `ignore_eos`, generated every token.
pub(crate) fn check_answer(answer: &Value) -> Result<()> {
    if answer["choices"][0]["finish_reason"].as_str().is_none() {
        bail!("the answer has no choices[0].finish_reason: {answer}");
    }
    let generated = answer["usage"]["completion_tokens"].as_u64();
    if generated != Some(OUTPUT_TOKENS) {
        bail!("expected usage.completion_tokens = {OUTPUT_TOKENS}, got {generated:?}");
    }
    Ok(())
}
