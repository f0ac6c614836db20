//! Mooncake-format traces: one JSON object a line with `timestamp` (ms), `input_length`,
//! `output_length` and `hash_ids`, each hash id standing for one 512-token block of a prompt (and,
//! through the ids before it, for the whole prefix up to that block).
//!
//! Tokens are synthesized deterministically: hash id `h` always expands to the same 512 tokens,
//! so two requests sharing leading hash ids share those prompt blocks exactly, whatever the
//! engine's block size (as long as it divides 512).

use std::time::Duration;

pub use kvroute_workloads::trace::{MOONCAKE_BLOCK_TOKENS, TraceError, TraceRecord, parse_jsonl};

use crate::engine::splitmix64;
use crate::request::{Request, RequestId};
use crate::sim::Arrival;

/// Token ids synthesized for traces stay below this (Llama 3's vocabulary size).
const SYNTH_VOCAB: u64 = 128_256;

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
