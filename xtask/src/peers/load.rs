//! The load: a workload trace (what `kvroute replay --workload NAME --write-trace` writes) turned
//! into text completions and replayed open-loop in real time, and the figures of one run.
//!
//! A trace line's `hash_ids` stand for 512-token prompt blocks whose ids name the whole prefix up
//! to them; each becomes `block_words` words of the bench's vocabulary, drawn from the id and the
//! position, so two prompts share exactly the leading words their blocks share and every router
//! (text-based or token-based) sees the same prefix structure. One word is one token (the bench's
//! byte-level BPE has a token for every word, spaced and alone), so prompt tokens are known
//! exactly.
//!
//! Each request is sent at its trace time divided by the speed-up, streamed with
//! `stream_options.include_usage`, and measured from its scheduled send time (a stalled router
//! cannot hide its queueing): TTFT at the first chunk with a choice, end to end at `[DONE]`, and
//! the usage's `prompt_tokens_details.cached_tokens` the engine reported.

use std::collections::HashSet;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};

pub(crate) use crate::http_load::{SseScan, percentile};
use serde_json::{Value, json};
use tokio::task::JoinSet;
use tokio::time::Instant;

/// Tokens of one hash id in the trace.
const TRACE_BLOCK_TOKENS: f64 = 512.0;
/// An open-loop run refuses to hold more requests in flight than this.
const MAX_IN_FLIGHT: usize = 4096;
/// The longest one request may take.
pub(crate) const REQUEST_TIMEOUT: Duration = Duration::from_secs(120);

/// One request of the replay.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Request {
    /// When to send it, from the start of the run (real time).
    pub(crate) at: Duration,
    /// The prompt text.
    pub(crate) prompt: String,
    /// Its tokens (one a word).
    pub(crate) prompt_tokens: u64,
    /// Tokens to generate.
    pub(crate) max_tokens: u64,
    /// Tokens of its prompt that an earlier request of the run sent too (its longest prefix of
    /// trace blocks seen before, in whole blocks): what a fleet-wide cache that kept everything
    /// could serve it, whoever routed it.
    pub(crate) reusable_tokens: u64,
}

/// How a trace becomes requests.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Shape {
    /// Prompt and output tokens are the trace's times this.
    pub(crate) token_scale: f64,
    /// Arrival times are the trace's divided by this (the engines run this much faster).
    pub(crate) speedup: f64,
    /// Requests arriving later than this (real time) are left out.
    pub(crate) max_duration: Duration,
    /// Words of the vocabulary prompts are made of.
    pub(crate) vocabulary: u32,
}

/// The word a prompt block `hash_id` has at `position`: the same for every prompt holding that
/// block.
pub(crate) fn word_index(hash_id: u64, position: u64, vocabulary: u32) -> u32 {
    // splitmix64 of the pair: consecutive positions and ids give unrelated words.
    let mut z = hash_id
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(position.wrapping_mul(0xBF58_476D_1CE4_E5B9))
        .wrapping_add(0x94D0_49BB_1331_11EB);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z % u64::from(vocabulary)) as u32
}

/// The word for vocabulary index `i` (what the bench's tokenizer file lists): `w` and three
/// letters, `i` in base 26 (`waaa`, `waab`, ...), letters only so that a byte-level
/// pre-tokenizer keeps each word, with the space before it, in one piece.
pub(crate) fn word(i: u32) -> String {
    let letter = |k: u32| char::from(b'a' + (i / 26u32.pow(k) % 26) as u8);
    ['w', letter(2), letter(1), letter(0)].iter().collect()
}

/// Reads a trace (JSON lines with `timestamp` in ms, `input_length`, `output_length`,
/// `hash_ids`) into the requests of one run.
pub(crate) fn requests(trace: &str, shape: Shape) -> Result<Vec<Request>> {
    let block_words = ((TRACE_BLOCK_TOKENS * shape.token_scale).round() as u64).max(1);
    let mut out = Vec::new();
    // Every prefix of trace blocks sent so far, each as a hash of its block ids.
    let mut seen: HashSet<u64> = HashSet::new();
    for (n, line) in trace.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let record: Value = serde_json::from_str(line)
            .with_context(|| format!("trace line {}: not JSON", n + 1))?;
        let field = |name: &str| {
            record[name].as_f64().with_context(|| {
                format!("trace line {}: expected a number `{name}`: {line}", n + 1)
            })
        };
        let at_ms = field("timestamp")?;
        let input = field("input_length")?;
        let output = field("output_length")?;
        let hash_ids: Vec<u64> = record["hash_ids"]
            .as_array()
            .with_context(|| format!("trace line {}: expected an array `hash_ids`", n + 1))?
            .iter()
            .map(|v| {
                v.as_u64()
                    .with_context(|| format!("trace line {}: a hash id is not a u64", n + 1))
            })
            .collect::<Result<_>>()?;
        let at = Duration::from_secs_f64(at_ms / 1000.0 / shape.speedup);
        if at > shape.max_duration {
            break;
        }
        let prompt_tokens = ((input * shape.token_scale).round() as u64).max(1);
        let mut prefix = 0u64;
        let mut reused_blocks = 0u64;
        let mut all_seen = true;
        for &id in &hash_ids {
            let mut hasher = DefaultHasher::new();
            (prefix, id).hash(&mut hasher);
            prefix = hasher.finish();
            all_seen &= !seen.insert(prefix);
            if all_seen {
                reused_blocks += 1;
            }
        }
        let reusable_tokens = (reused_blocks * block_words).min(prompt_tokens);
        let mut words = Vec::with_capacity(prompt_tokens as usize);
        'blocks: for &id in &hash_ids {
            for position in 0..block_words {
                if words.len() as u64 == prompt_tokens {
                    break 'blocks;
                }
                words.push(word(word_index(id, position, shape.vocabulary)));
            }
        }
        // A prompt longer than its hash ids cover (not in well-formed traces) gets fresh words.
        let mut fill = 0u64;
        while (words.len() as u64) < prompt_tokens {
            words.push(word(word_index(
                u64::MAX - n as u64,
                fill,
                shape.vocabulary,
            )));
            fill += 1;
        }
        out.push(Request {
            at,
            prompt: words.join(" "),
            prompt_tokens,
            max_tokens: ((output * shape.token_scale).round() as u64).max(1),
            reusable_tokens,
        });
    }
    if out.is_empty() {
        bail!("the trace has no request within the run's duration");
    }
    Ok(out)
}

/// The ceiling of a run's hit rate: the served requests' tokens that earlier requests of the run
/// sent too, over their prompt tokens as the engines counted them (`usage`, the same denominator
/// as the hit rate's): what a router that always found a prompt's longest cached prefix would
/// read on engines that evicted nothing. `samples` are `requests`' in order.
pub(crate) fn ceiling_hit_rate(requests: &[Request], samples: &[Sample]) -> Option<f64> {
    let (reusable, prompt) = requests
        .iter()
        .zip(samples)
        .filter(|(_, s)| s.error.is_none())
        .fold((0u64, 0u64), |(r, p), (request, sample)| {
            (r + request.reusable_tokens, p + sample.prompt_tokens)
        });
    (prompt > 0).then(|| reusable as f64 / prompt as f64)
}

/// What one request gave.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Sample {
    pub(crate) error: Option<String>,
    pub(crate) ttft: Option<Duration>,
    pub(crate) e2e: Option<Duration>,
    pub(crate) prompt_tokens: u64,
    pub(crate) cached_tokens: u64,
    pub(crate) completion_tokens: u64,
}

/// The HTTP client of every run.
pub(crate) fn client() -> Result<reqwest::Client> {
    crate::http_load::client(REQUEST_TIMEOUT)
}

/// Replays `requests` against `url` (a `/v1/completions` address) open-loop; returns each
/// request's sample, in the requests' order, and the run's wall time.
pub(crate) async fn replay(
    http: &reqwest::Client,
    url: &str,
    model: &str,
    requests: &Arc<Vec<Request>>,
) -> (Vec<Sample>, Duration) {
    let start = Instant::now();
    let mut tasks = JoinSet::new();
    let mut samples = vec![Sample::default(); requests.len()];
    for (i, request) in requests.iter().enumerate() {
        let due = start + request.at;
        tokio::time::sleep_until(due).await;
        if tasks.len() >= MAX_IN_FLIGHT {
            samples[i].error = Some(format!("more than {MAX_IN_FLIGHT} requests in flight"));
            continue;
        }
        let http = http.clone();
        let url = url.to_owned();
        let body = json!({
            "model": model,
            "prompt": request.prompt,
            "max_tokens": request.max_tokens,
            "stream": true,
            "stream_options": {"include_usage": true},
            "ignore_eos": true,
        });
        tasks.spawn(async move { (i, send(&http, &url, body, due).await) });
        // Reap what finished, so the in-flight count stays true.
        while let Some(done) = tasks.try_join_next() {
            if let Ok((i, sample)) = done {
                samples[i] = sample;
            }
        }
    }
    while let Some(done) = tasks.join_next().await {
        if let Ok((i, sample)) = done {
            samples[i] = sample;
        }
    }
    (samples, start.elapsed())
}

async fn send(http: &reqwest::Client, url: &str, body: Value, since: Instant) -> Sample {
    match stream(http, url, body, since, SseScan::skimming()).await {
        Ok((sample, _)) => sample,
        Err(e) => Sample {
            error: Some(format!("{e:#}")),
            ..Sample::default()
        },
    }
}

/// Sends one streamed request and reads its answer to the end with `scan` (a skimming one when the
/// reply's text is not wanted); its sample, and the scan (the reply's text, usage and timings)
/// for a caller that wants more.
pub(crate) async fn stream(
    http: &reqwest::Client,
    url: &str,
    body: Value,
    since: Instant,
    mut scan: SseScan,
) -> Result<(Sample, SseScan)> {
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
    let mut ttft = None;
    while let Some(chunk) = response.chunk().await.context("reading the stream")? {
        scan.feed(&chunk)?;
        if ttft.is_none() && scan.first_choice {
            ttft = Some(since.elapsed());
        }
    }
    let e2e = since.elapsed();
    if !scan.done {
        bail!("the stream ended without `data: [DONE]`");
    }
    let usage = scan
        .usage
        .as_ref()
        .context("the stream carried no usage (stream_options.include_usage was asked)")?;
    let sample = Sample {
        error: None,
        ttft: Some(ttft.context("the stream carried no choice")?),
        e2e: Some(e2e),
        prompt_tokens: usage["prompt_tokens"].as_u64().unwrap_or(0),
        cached_tokens: usage["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0),
        completion_tokens: usage["completion_tokens"].as_u64().unwrap_or(0),
    };
    Ok((sample, scan))
}

/// The figures of one run.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Figures {
    pub(crate) requests: usize,
    pub(crate) ok: usize,
    pub(crate) errors: usize,
    pub(crate) first_error: Option<String>,
    /// Cached over prompt tokens, from the responses' usage.
    pub(crate) hit_rate_usage: Option<f64>,
    /// The engines' own prefix-cache hits over queries, from their counters.
    pub(crate) hit_rate_engines: Option<f64>,
    /// The hit rate's ceiling ([`ceiling_hit_rate`]); traces only.
    pub(crate) ceiling: Option<f64>,
    /// The clients' mean time to first token.
    pub(crate) ttft_mean_ms: Option<f64>,
    /// The engines' own mean time to first token (from arrival at the engine), where they
    /// publish it (`vllm:time_to_first_token_seconds`): the client's mean less this is what the
    /// router and the network took.
    pub(crate) engine_ttft_mean_ms: Option<f64>,
    pub(crate) ttft_p50_ms: Option<f64>,
    pub(crate) ttft_p99_ms: Option<f64>,
    pub(crate) e2e_p99_ms: Option<f64>,
    pub(crate) output_tokens_per_s: f64,
    /// The router's CPU seconds (every process of it) per 1,000 requests.
    pub(crate) cpu_s_per_1k: Option<f64>,
    /// The router's peak resident memory, MiB.
    pub(crate) peak_rss_mib: Option<f64>,
}

/// The client-side figures of a run's samples.
pub(crate) fn figures(samples: &[Sample], wall: Duration) -> Figures {
    let ok: Vec<&Sample> = samples.iter().filter(|s| s.error.is_none()).collect();
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    let mut ttft: Vec<f64> = ok.iter().filter_map(|s| s.ttft.map(ms)).collect();
    let mut e2e: Vec<f64> = ok.iter().filter_map(|s| s.e2e.map(ms)).collect();
    ttft.sort_by(f64::total_cmp);
    e2e.sort_by(f64::total_cmp);
    let prompt: u64 = ok.iter().map(|s| s.prompt_tokens).sum();
    let cached: u64 = ok.iter().map(|s| s.cached_tokens).sum();
    let output: u64 = ok.iter().map(|s| s.completion_tokens).sum();
    Figures {
        requests: samples.len(),
        ok: ok.len(),
        errors: samples.len() - ok.len(),
        first_error: samples.iter().find_map(|s| s.error.clone()),
        hit_rate_usage: (prompt > 0).then(|| cached as f64 / prompt as f64),
        hit_rate_engines: None,
        ceiling: None,
        ttft_mean_ms: (!ttft.is_empty()).then(|| ttft.iter().sum::<f64>() / ttft.len() as f64),
        engine_ttft_mean_ms: None,
        ttft_p50_ms: percentile(&ttft, 50.0),
        ttft_p99_ms: percentile(&ttft, 99.0),
        e2e_p99_ms: percentile(&e2e, 99.0),
        output_tokens_per_s: output as f64 / wall.as_secs_f64().max(1e-9),
        cpu_s_per_1k: None,
        peak_rss_mib: None,
    }
}
