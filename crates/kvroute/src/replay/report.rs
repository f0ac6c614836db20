//! One row per policy: the figures a replay reports, as a markdown table on stdout and as JSON.

use std::fmt::Write as _;
use std::time::Duration;

use serde::Serialize;

use crate::replay::oracle::Oracle;

/// The JSON file: the setup, the oracle and one entry per policy.
#[derive(Debug, Serialize)]
pub(crate) struct ReplayJson<'a> {
    /// Trace file and the replay's settings.
    pub(crate) setup: &'a Setup,
    /// The trace's best possible reuse, on both bases.
    pub(crate) oracle: OracleJson,
    /// One entry per policy, in the order they were asked for.
    pub(crate) policies: &'a [PolicyReport],
}

/// What was replayed, and how.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Setup {
    /// The trace file, or the generated workload with its seed and scale.
    pub(crate) trace: String,
    /// Whether sessions were sent to the router as sticky sessions.
    pub(crate) sticky_sessions: bool,
    pub(crate) requests: u64,
    pub(crate) workers: usize,
    /// The engine sizing asked for (--block-size and --cache-blocks below are what ran).
    pub(crate) engine_profile: super::EngineProfile,
    /// Prefill engines before the `workers` decode engines; 0 for aggregated serving.
    pub(crate) prefill_workers: usize,
    pub(crate) block_size: u32,
    pub(crate) trace_block_size: u32,
    pub(crate) cache_blocks: u32,
    pub(crate) speed: f64,
    pub(crate) seed: u64,
}

/// The oracle with its basis spelled out.
#[derive(Debug, Serialize)]
pub(crate) struct OracleJson {
    /// Reused prompt tokens / prompt tokens (whole engine blocks, never the prompt's last token):
    /// the basis of every `hit_rate`.
    pub(crate) token_hit_rate: f64,
    /// Reused trace blocks (hash ids) / trace blocks: the Mooncake basis.
    pub(crate) block_hit_rate: f64,
    /// The counts behind both.
    pub(crate) counts: Oracle,
}

impl OracleJson {
    pub(crate) fn new(oracle: Oracle) -> Self {
        Self {
            token_hit_rate: oracle.token_hit_rate(),
            block_hit_rate: oracle.block_hit_rate(),
            counts: oracle,
        }
    }
}

/// What one policy did. Latencies are in milliseconds of virtual time.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub(crate) struct PolicyReport {
    pub(crate) policy: String,
    /// Requests that arrived.
    pub(crate) requests: u64,
    /// Requests that generated all their tokens.
    pub(crate) completed: u64,
    /// Requests an engine refused (prompt plus output larger than its whole cache).
    pub(crate) rejected: u64,
    /// Prompt tokens of admitted requests.
    pub(crate) prompt_tokens: u64,
    /// Of those, served from an engine's prefix cache at admission.
    pub(crate) cached_prompt_tokens: u64,
    /// `cached_prompt_tokens / prompt_tokens`.
    pub(crate) hit_rate: f64,
    /// The trace's best possible reuse on the same (token) basis as `hit_rate`.
    pub(crate) oracle_hit_rate: f64,
    /// The trace's best possible reuse by trace blocks (hash ids).
    pub(crate) oracle_block_hit_rate: f64,
    pub(crate) ttft_mean_ms: f64,
    pub(crate) ttft_p50_ms: f64,
    pub(crate) ttft_p99_ms: f64,
    /// Median over requests of each request's mean time between output tokens.
    pub(crate) itl_p50_ms: f64,
    pub(crate) e2e_p50_ms: f64,
    pub(crate) e2e_p99_ms: f64,
    /// Output tokens / simulated seconds (first arrival at 0 to the last engine going idle).
    pub(crate) output_tokens_per_s: f64,
    /// Max over workers of time-averaged requests in flight, divided by the mean over workers
    /// (1.0 is perfect balance).
    pub(crate) max_over_mean_load: f64,
    /// Time-averaged requests in flight per worker.
    pub(crate) mean_load_per_worker: Vec<f64>,
    pub(crate) simulated_s: f64,
    pub(crate) preemptions: u64,
    /// KV events the engines emitted and the router applied.
    pub(crate) kv_events: u64,
    /// Of the turns after a session's first, the share routed to the worker where the session's
    /// previous turn ran (whose cache holds that turn); `null` when the trace names no sessions.
    pub(crate) session_continuity: Option<f64>,
    /// Turns after a session's first (the denominator of `session_continuity`).
    pub(crate) session_later_turns: u64,
}

/// Milliseconds as a float.
pub(crate) fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// A markdown table with one row per policy, ready to paste into docs.
pub(crate) fn table(rows: &[PolicyReport]) -> String {
    let header = [
        "policy",
        "requests",
        "hit rate",
        "oracle",
        "TTFT p50",
        "TTFT p99",
        "ITL p50",
        "E2E p99",
        "out tok/s",
        "max/mean load",
        "continuity",
        "rejected",
    ];
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            vec![
                r.policy.clone(),
                r.requests.to_string(),
                format!("{:.2}%", r.hit_rate * 100.0),
                format!("{:.2}%", r.oracle_hit_rate * 100.0),
                format!("{:.0} ms", r.ttft_p50_ms),
                format!("{:.0} ms", r.ttft_p99_ms),
                format!("{:.1} ms", r.itl_p50_ms),
                format!("{:.2} s", r.e2e_p99_ms / 1000.0),
                format!("{:.0}", r.output_tokens_per_s),
                format!("{:.2}", r.max_over_mean_load),
                r.session_continuity
                    .map_or_else(|| "-".to_owned(), |c| format!("{:.1}%", c * 100.0)),
                r.rejected.to_string(),
            ]
        })
        .collect();
    let widths: Vec<usize> = (0..header.len())
        .map(|c| {
            cells
                .iter()
                .map(|row| row[c].len())
                .chain([header[c].len()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    let line = |out: &mut String, row: &[&str]| {
        out.push('|');
        for (c, cell) in row.iter().enumerate() {
            // The first column is text (left-aligned), the rest are numbers (right-aligned).
            if c == 0 {
                let _ = write!(out, " {cell:<w$} |", w = widths[c]);
            } else {
                let _ = write!(out, " {cell:>w$} |", w = widths[c]);
            }
        }
        out.push('\n');
    };
    line(&mut out, &header);
    out.push('|');
    for (c, w) in widths.iter().enumerate() {
        let dashes = "-".repeat(*w);
        if c == 0 {
            let _ = write!(out, " {dashes} |");
        } else {
            let _ = write!(out, " {}: |", &dashes[1..]);
        }
    }
    out.push('\n');
    for row in &cells {
        let row: Vec<&str> = row.iter().map(String::as_str).collect();
        line(&mut out, &row);
    }
    out
}
