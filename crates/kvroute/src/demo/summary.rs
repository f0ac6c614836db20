//! One run's figures, and the side-by-side table and JSON of all runs.

use std::fmt::Write as _;
use std::sync::atomic::Ordering;
use std::time::Duration;

use serde::Serialize;

use crate::demo::drive::TurnResult;
use crate::demo::fleet::Fleet;

/// The figures of one policy's run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub(crate) struct RunReport {
    /// The routing policy.
    pub(crate) policy: String,
    /// Requests sent.
    pub(crate) requests: usize,
    /// Requests whose stream completed.
    pub(crate) ok: usize,
    /// Requests that failed.
    pub(crate) failed: usize,
    /// The first failures' messages (at most five).
    pub(crate) errors: Vec<String>,
    /// Prompt tokens the engines finished.
    pub(crate) prompt_tokens: u64,
    /// Of those, the tokens the engines found in their prefix caches.
    pub(crate) cached_tokens: u64,
    /// `cached_tokens / prompt_tokens`: the engines' actual prefix-cache hit rate.
    pub(crate) hit_rate: f64,
    /// The router's predicted hit rate (`nvext.timing.kv_hit_rate`), averaged over requests.
    pub(crate) predicted_hit_rate: f64,
    /// Time to first token, median, in milliseconds.
    pub(crate) ttft_p50_ms: f64,
    /// Time to first token, 99th percentile, in milliseconds.
    pub(crate) ttft_p99_ms: f64,
    /// Request latency (send to end of stream), median, in milliseconds.
    pub(crate) latency_p50_ms: f64,
    /// Completed requests per second of the run's wall time.
    pub(crate) requests_per_s: f64,
    /// Generated text chunks (one per token) per second of wall time.
    pub(crate) tokens_per_s: f64,
    /// The run's wall time, in seconds.
    pub(crate) wall_s: f64,
    /// Of the turns after a conversation's first, the share routed to the worker that served
    /// the conversation's previous turn (where its history is cached).
    pub(crate) same_worker_share: f64,
    /// Requests each worker received, by worker id.
    pub(crate) per_worker_requests: Vec<u64>,
}

impl RunReport {
    /// Summarises one run: the client's `results`, the engines' counters in `fleet`, and the
    /// run's `wall` time.
    pub(crate) fn new(policy: &str, results: &[TurnResult], fleet: &Fleet, wall: Duration) -> Self {
        let ok: Vec<&TurnResult> = results.iter().filter(|r| r.error.is_none()).collect();
        let mut ttft: Vec<f64> = ok.iter().filter_map(|r| r.ttft).map(ms).collect();
        let mut latency: Vec<f64> = ok.iter().map(|r| ms(r.latency)).collect();
        let predicted: Vec<f64> = ok.iter().filter_map(|r| r.predicted_hit_rate).collect();
        let (mut prompt_tokens, mut cached_tokens) = (0, 0);
        let mut per_worker_requests = Vec::new();
        for (_, stats) in fleet.stats() {
            prompt_tokens += stats.prompt_tokens.load(Ordering::Relaxed);
            cached_tokens += stats.cached_tokens.load(Ordering::Relaxed);
            per_worker_requests.push(stats.requests.load(Ordering::Relaxed));
        }
        let wall_s = wall.as_secs_f64().max(1e-9);
        Self {
            policy: policy.to_owned(),
            requests: results.len(),
            ok: ok.len(),
            failed: results.len() - ok.len(),
            errors: results
                .iter()
                .filter_map(|r| r.error.clone())
                .take(5)
                .collect(),
            prompt_tokens,
            cached_tokens,
            hit_rate: ratio(cached_tokens as f64, prompt_tokens as f64),
            predicted_hit_rate: ratio(predicted.iter().sum(), predicted.len() as f64),
            ttft_p50_ms: percentile(&mut ttft, 0.50),
            ttft_p99_ms: percentile(&mut ttft, 0.99),
            latency_p50_ms: percentile(&mut latency, 0.50),
            requests_per_s: ok.len() as f64 / wall_s,
            tokens_per_s: ok.iter().map(|r| r.chunks).sum::<usize>() as f64 / wall_s,
            wall_s,
            same_worker_share: same_worker_share(results),
            per_worker_requests,
        }
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn ratio(num: f64, den: f64) -> f64 {
    if den > 0.0 { num / den } else { 0.0 }
}

/// The nearest-rank `q` quantile of `values` (sorted in place); 0 when empty.
pub(crate) fn percentile(values: &mut [f64], q: f64) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    values.sort_by(f64::total_cmp);
    let rank = (q * values.len() as f64).ceil() as usize;
    values[rank.clamp(1, values.len()) - 1]
}

/// Of the later turns whose worker and previous turn's worker are known, the share that went to
/// the same worker. `results` must be in conversation and turn order.
pub(crate) fn same_worker_share(results: &[TurnResult]) -> f64 {
    let (mut same, mut total) = (0usize, 0usize);
    for pair in results.windows(2) {
        let (prev, next) = (&pair[0], &pair[1]);
        if prev.conversation != next.conversation || next.turn != prev.turn + 1 {
            continue;
        }
        if let (Some(a), Some(b)) = (prev.worker, next.worker) {
            total += 1;
            same += usize::from(a == b);
        }
    }
    ratio(same as f64, total as f64)
}

/// The side-by-side table of `runs`.
pub(crate) fn table(runs: &[RunReport]) -> String {
    type Cell = fn(&RunReport) -> String;
    let rows: [(&str, Cell); 10] = [
        ("requests ok / failed", |r| {
            format!("{} / {}", r.ok, r.failed)
        }),
        ("KV hit rate (engines)", |r| pct(r.hit_rate)),
        ("KV hit rate (router predicted)", |r| {
            pct(r.predicted_hit_rate)
        }),
        ("TTFT p50", |r| format!("{:.1} ms", r.ttft_p50_ms)),
        ("TTFT p99", |r| format!("{:.1} ms", r.ttft_p99_ms)),
        ("latency p50", |r| format!("{:.1} ms", r.latency_p50_ms)),
        ("throughput", |r| format!("{:.1} req/s", r.requests_per_s)),
        ("tokens out", |r| format!("{:.0} tok/s", r.tokens_per_s)),
        ("next turn on same worker", |r| pct(r.same_worker_share)),
        ("requests per worker", |r| {
            r.per_worker_requests
                .iter()
                .map(u64::to_string)
                .collect::<Vec<_>>()
                .join(" ")
        }),
    ];
    let label_width = rows.iter().map(|(l, _)| l.len()).max().unwrap_or(0);
    let cells: Vec<Vec<String>> = runs
        .iter()
        .map(|r| rows.iter().map(|(_, f)| f(r)).collect())
        .collect();
    let widths: Vec<usize> = runs
        .iter()
        .zip(&cells)
        .map(|(r, col)| {
            col.iter()
                .map(String::len)
                .chain([r.policy.len()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    let _ = write!(out, "{:label_width$}", "");
    for (r, w) in runs.iter().zip(&widths) {
        let _ = write!(out, "  {:>w$}", r.policy);
    }
    out.push('\n');
    for (i, (label, _)) in rows.iter().enumerate() {
        let _ = write!(out, "{label:label_width$}");
        for (col, w) in cells.iter().zip(&widths) {
            let _ = write!(out, "  {:>w$}", col[i]);
        }
        out.push('\n');
    }
    out
}

fn pct(x: f64) -> String {
    format!("{:.1}%", x * 100.0)
}

#[cfg(test)]
mod tests;
