//! Mooncake-format traces: one JSON object a line with `timestamp` (ms), `input_length`,
//! `output_length` and `hash_ids`, each hash id standing for one 512-token block of a prompt (and,
//! through the ids before it, for the whole prefix up to that block).
//!
//! Tokens are synthesized deterministically: hash id `h` always expands to the same 512 tokens,
//! so two requests sharing leading hash ids share those prompt blocks exactly, whatever the
//! engine's block size (as long as it divides 512).

use std::time::Duration;

use serde::Deserialize;

use crate::engine::splitmix64;
use crate::request::{Request, RequestId};
use crate::sim::Arrival;

/// Tokens per hash id in Mooncake traces.
pub const MOONCAKE_BLOCK_TOKENS: usize = 512;

/// Token ids synthesized for traces stay below this (Llama 3's vocabulary size).
const SYNTH_VOCAB: u64 = 128_256;

/// One request of a trace.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct TraceRecord {
    /// Arrival time in milliseconds since the start of the trace.
    pub timestamp: f64,
    /// Prompt length in tokens.
    pub input_length: u32,
    /// Output length in tokens.
    pub output_length: u32,
    /// One id per 512-token prompt block.
    pub hash_ids: Vec<u64>,
}

/// A trace line that could not be read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TraceError {
    /// The line is not a valid record.
    #[error(
        "trace line {line}: expected a JSON object with timestamp, input_length, output_length and hash_ids: {source}"
    )]
    Json {
        /// 1-based line number.
        line: usize,
        /// The parse error.
        source: serde_json::Error,
    },
    /// The timestamp is negative or not finite.
    #[error("trace line {line}: timestamp must be a finite number >= 0, got {got}")]
    BadTimestamp {
        /// 1-based line number.
        line: usize,
        /// The value found.
        got: f64,
    },
}

/// Parses a JSONL trace, skipping blank lines.
pub fn parse_jsonl(text: &str) -> Result<Vec<TraceRecord>, TraceError> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let record: TraceRecord =
            serde_json::from_str(line).map_err(|source| TraceError::Json {
                line: i + 1,
                source,
            })?;
        if !(record.timestamp.is_finite() && record.timestamp >= 0.0) {
            return Err(TraceError::BadTimestamp {
                line: i + 1,
                got: record.timestamp,
            });
        }
        out.push(record);
    }
    Ok(out)
}

/// Writes the prompt of `record` into `out`: each hash id's 512 tokens in order, cut at
/// `input_length`; a prompt longer than its hash ids is padded with tokens unique to `id`.
pub fn synthesize_prompt(record: &TraceRecord, id: RequestId, out: &mut Vec<u32>) {
    synthesize_prompt_with(record, id, MOONCAKE_BLOCK_TOKENS, out);
}

/// [`synthesize_prompt`] with `block_tokens` tokens per hash id instead of 512: hash id `h`
/// always expands to the same tokens, so requests that share leading hash ids share those prompt
/// tokens exactly, at any block size.
pub fn synthesize_prompt_with(
    record: &TraceRecord,
    id: RequestId,
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

/// The arrivals of a trace, in file order, with request ids `0..`; timestamps are rounded to the
/// microsecond and a zero output length is raised to one token.
pub fn arrivals(records: &[TraceRecord]) -> impl Iterator<Item = Arrival> + '_ {
    records.iter().enumerate().map(|(i, record)| {
        let id = i as RequestId;
        let mut tokens = Vec::new();
        synthesize_prompt(record, id, &mut tokens);
        Arrival {
            at: Duration::from_micros((record.timestamp * 1000.0).round() as u64),
            request: Request {
                id,
                tokens,
                max_output_tokens: record.output_length.max(1),
                session: None,
            },
        }
    })
}
