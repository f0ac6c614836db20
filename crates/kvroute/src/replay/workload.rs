//! The trace as the simulation sees it: records read from the file with errors that name the file
//! and line, and arrivals with synthetic prompts.
//!
//! Prompts come from the mocker's [`kvroute_mocker::trace::synthesize_prompt_with`] at `T` tokens
//! per hash id, so replay and the mocker's own benches see the same prompts at `T = 512`.

use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use kvroute_mocker::Request;
use kvroute_mocker::sim::Arrival;
use kvroute_mocker::trace::{self, TraceRecord};
use kvroute_workloads::synth::SynthRequest;
use kvroute_workloads::trace::SessionId;

/// The requests to replay and the session of each (request id = index).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Trace {
    pub(crate) records: Vec<TraceRecord>,
    /// `sessions[i]`: the session request `i` belongs to, numbered densely from 0 in order of
    /// first appearance; `None` for a line without `session_id`.
    pub(crate) sessions: Vec<Option<u64>>,
}

impl Trace {
    /// Whether any request names a session.
    pub(crate) fn has_sessions(&self) -> bool {
        self.sessions.iter().any(Option::is_some)
    }
}

/// Reads and parses a Mooncake JSONL trace with its optional `session_id`s; errors name the
/// file (and the line, for bad lines).
pub(crate) fn load(path: &Path) -> anyhow::Result<Trace> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read trace {}", path.display()))?;
    // The parser's error already says "trace line N: what was expected"; prefix the file.
    let lines = kvroute_workloads::trace::parse_jsonl_with_sessions(&text)
        .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    if lines.is_empty() {
        anyhow::bail!(
            "{}: the trace has no requests; expected one JSON object per line",
            path.display()
        );
    }
    let mut numbers: HashMap<SessionId, u64> = HashMap::new();
    let mut records = Vec::with_capacity(lines.len());
    let mut sessions = Vec::with_capacity(lines.len());
    for line in lines {
        sessions.push(line.session_id.map(|id| {
            let next = numbers.len() as u64;
            *numbers.entry(id).or_insert(next)
        }));
        records.push(line.record);
    }
    Ok(Trace { records, sessions })
}

/// The requests of a generated workload, with their sessions, in timestamp order.
pub(crate) fn generated(requests: Vec<SynthRequest>) -> Trace {
    let sessions = requests.iter().map(|r| Some(r.session_id)).collect();
    let records = requests.into_iter().map(|r| r.record).collect();
    Trace { records, sessions }
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
