//! Where the requests come from, and the recorded stream the simulated fleet makes of them.
//!
//! Requests come from a Mooncake trace or a seeded [`kvroute_workloads::synth`] workload.
//! [`Recorded::simulate`] (kvroute-workloads' `fleet`, which `cargo xtask bench indexer` replays
//! too) turns them into one stream of events and queries with the expected answer of every query.

use anyhow::Context;
pub use kvroute_workloads::fleet::{Fleet, Op, Recorded};
use kvroute_workloads::synth::Workload as Synth;
use kvroute_workloads::trace::MOONCAKE_BLOCK_TOKENS;

/// Where the requests come from.
#[derive(Debug, Clone)]
pub enum Source {
    /// A Mooncake JSONL trace whose ids stand for `block_tokens`-token blocks.
    Trace {
        /// The trace file.
        path: String,
        /// Tokens per hash id.
        block_tokens: usize,
    },
    /// A generated workload (its ids stand for [`MOONCAKE_BLOCK_TOKENS`]-token blocks).
    Synth {
        /// Which workload.
        name: String,
        /// Its seed.
        seed: u64,
    },
}

impl Source {
    /// How to name this source in a report.
    pub fn label(&self) -> String {
        match self {
            Self::Trace { path, .. } => {
                let file = path.rsplit('/').next().unwrap_or(path);
                format!("trace {file}")
            }
            Self::Synth { name, seed } => format!("{name} (seed {seed})"),
        }
    }

    /// Tokens per hash id.
    pub fn block_tokens(&self) -> usize {
        match self {
            Self::Trace { block_tokens, .. } => *block_tokens,
            Self::Synth { .. } => MOONCAKE_BLOCK_TOKENS,
        }
    }

    /// The first `limit` requests as `(input_length, hash_ids)`.
    pub fn load(&self, limit: usize) -> anyhow::Result<Vec<(usize, Vec<u64>)>> {
        let records = match self {
            Self::Trace { path, .. } => {
                let text = std::fs::read_to_string(path)
                    .with_context(|| format!("reading trace {path}"))?;
                kvroute_workloads::trace::parse_jsonl(&text).with_context(|| path.clone())?
            }
            Self::Synth { name, seed } => Synth::from_name(name)?
                .generate(*seed)
                .into_iter()
                .map(|r| r.record)
                .collect(),
        };
        Ok(records
            .into_iter()
            .take(limit)
            .map(|r| (r.input_length as usize, r.hash_ids))
            .collect())
    }
}
