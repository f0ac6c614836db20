//! The trace as the simulation sees it: records read from the file with errors that name the file
//! and line, and arrivals with synthetic prompts.
//!
//! Prompts come from the mocker's [`kvroute_mocker::trace::synthesize_prompt_with`] at `T` tokens
//! per hash id, so replay and the mocker's own benches see the same prompts at `T = 512`.

use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use kvroute_mocker::Request;
use kvroute_mocker::sim::Arrival;
use kvroute_mocker::trace::{self, TraceRecord};

/// Reads and parses a Mooncake JSONL trace; errors name the file (and the line, for bad lines).
pub(crate) fn load(path: &Path) -> anyhow::Result<Vec<TraceRecord>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read trace {}", path.display()))?;
    // The mocker's error already says "trace line N: what was expected"; prefix the file.
    let records =
        trace::parse_jsonl(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    if records.is_empty() {
        anyhow::bail!(
            "{}: the trace has no requests; expected one JSON object per line",
            path.display()
        );
    }
    Ok(records)
}

/// How records become arrivals.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Synthesis {
    /// Tokens per hash id (T).
    pub(crate) trace_block_tokens: usize,
    /// Arrival times are divided by this (2.0 replays twice as fast).
    pub(crate) speed: f64,
}

/// The arrivals of `records` in time order, with request ids `0..` in file order. Records are
/// sorted by timestamp first (stable, so equal timestamps keep file order): the simulation needs
/// arrivals in time order and real traces are not always sorted.
pub(crate) fn arrivals(
    records: &[TraceRecord],
    synthesis: Synthesis,
) -> impl Iterator<Item = Arrival> + '_ {
    let mut order: Vec<usize> = (0..records.len()).collect();
    order.sort_by(|&a, &b| records[a].timestamp.total_cmp(&records[b].timestamp));
    order.into_iter().map(move |i| {
        let record = &records[i];
        let id = i as u64;
        let mut tokens = Vec::new();
        trace::synthesize_prompt_with(record, id, synthesis.trace_block_tokens, &mut tokens);
        Arrival {
            at: arrival_time(record.timestamp, synthesis.speed),
            request: Request {
                id,
                tokens,
                max_output_tokens: record.output_length.max(1),
                session: None,
            },
        }
    })
}

/// `timestamp` ms scaled by `1 / speed`, rounded to the microsecond.
pub(crate) fn arrival_time(timestamp_ms: f64, speed: f64) -> Duration {
    Duration::from_micros((timestamp_ms * 1000.0 / speed).round() as u64)
}

#[cfg(test)]
mod tests;
