//! The trace as the simulation sees it: records read from the file with errors that name the file
//! and line, and arrivals with synthetic prompts.
//!
//! Prompt synthesis generalizes the mocker's ([`kvroute_mocker::trace::synthesize_prompt`], fixed
//! at 512 tokens per hash id) to any `T`: hash id `h` always expands to the same `T` tokens, so
//! requests sharing leading hash ids share those prompt tokens exactly. With `T = 512` the tokens
//! are identical to the mocker's (a unit test checks), so replay and the mocker's own benches see
//! the same prompts.

use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use kvroute_mocker::Request;
use kvroute_mocker::sim::Arrival;
use kvroute_mocker::trace::{self, TraceRecord};

/// Token ids stay below this (Llama 3's vocabulary size, as in the mocker).
const SYNTH_VOCAB: u64 = 128_256;

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
        synthesize_prompt(record, id, synthesis.trace_block_tokens, &mut tokens);
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

/// Writes the prompt of `record` into `out`: each hash id's `block_tokens` tokens in order, cut at
/// `input_length`; a prompt longer than its hash ids is padded with tokens unique to `id`.
pub(crate) fn synthesize_prompt(
    record: &TraceRecord,
    id: u64,
    block_tokens: usize,
    out: &mut Vec<u32>,
) {
    out.clear();
    let len = record.input_length as usize;
    out.reserve(len);
    'ids: for &h in &record.hash_ids {
        let base = splitmix64(h);
        for j in 0..block_tokens as u64 {
            if out.len() == len {
                break 'ids;
            }
            out.push((splitmix64(base ^ j) % SYNTH_VOCAB) as u32);
        }
    }
    let pad_base = splitmix64(!id);
    while out.len() < len {
        out.push((splitmix64(pad_base ^ out.len() as u64) % SYNTH_VOCAB) as u32);
    }
}

/// Vigna's splitmix64 finalizer, as the mocker uses it for trace prompts.
fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests;
