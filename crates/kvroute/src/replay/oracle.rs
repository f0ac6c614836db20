//! The trace's best possible prefix reuse: what one engine with an unlimited prefix cache would
//! hit, computed from the trace alone (no routing, no eviction, no timing).
//!
//! A Mooncake hash id stands for the whole prefix up to its block, so a request's reusable prefix
//! is the leading run of its hash ids that some earlier request already had. Two bases are
//! reported because they differ and both get quoted:
//!
//! - **blocks**: reused trace blocks / all trace blocks (the Mooncake paper's basis; 0.3664 on
//!   the conversation trace);
//! - **tokens**: reused prompt tokens / all prompt tokens, where a request reuses
//!   `min(run * T, ((input_length - 1) / B) * B)` tokens: the run's tokens, but only whole engine
//!   blocks and never the prompt's last token, exactly the limit the engine applies to a prefix
//!   hit (it must compute at least one token). This is the basis of the replay's `hit_rate`, so
//!   the two are comparable (about 0.374 on the conversation trace).

use std::collections::HashSet;

use kvroute_mocker::trace::TraceRecord;
use serde::Serialize;

/// Reuse counts of one trace.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub(crate) struct Oracle {
    /// Trace blocks (hash ids) in all requests.
    pub(crate) blocks: u64,
    /// Of those, in the leading run already seen by an earlier request.
    pub(crate) reused_blocks: u64,
    /// Prompt tokens in all requests.
    pub(crate) tokens: u64,
    /// Of those, reusable by an engine with `B`-token blocks.
    pub(crate) reused_tokens: u64,
}

impl Oracle {
    /// Walks `records` in order with one unlimited cache. `trace_block_tokens` is T (tokens per
    /// hash id), `engine_block_tokens` is B; both must be at least 1.
    pub(crate) fn compute(
        records: &[TraceRecord],
        trace_block_tokens: u64,
        engine_block_tokens: u64,
    ) -> Self {
        let t = trace_block_tokens.max(1);
        let b = engine_block_tokens.max(1);
        let mut seen: HashSet<u64> = HashSet::new();
        let mut out = Self::default();
        for record in records {
            let run = record
                .hash_ids
                .iter()
                .take_while(|h| seen.contains(h))
                .count() as u64;
            let n = u64::from(record.input_length);
            out.blocks += record.hash_ids.len() as u64;
            out.reused_blocks += run;
            out.tokens += n;
            out.reused_tokens += (run * t).min(n.saturating_sub(1) / b * b);
            seen.extend(record.hash_ids.iter().copied());
        }
        out
    }

    /// Reused blocks / blocks (0 for an empty trace).
    pub(crate) fn block_hit_rate(&self) -> f64 {
        ratio(self.reused_blocks, self.blocks)
    }

    /// Reused tokens / tokens (0 for an empty trace).
    pub(crate) fn token_hit_rate(&self) -> f64 {
        ratio(self.reused_tokens, self.tokens)
    }
}

/// `num / den`, or 0 when `den` is 0.
pub(crate) fn ratio(num: u64, den: u64) -> f64 {
    if den == 0 {
        0.0
    } else {
        num as f64 / den as f64
    }
}

#[cfg(test)]
mod tests;
