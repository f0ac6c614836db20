//! The step cost model: what one engine iteration costs given what it computes.

use std::time::Duration;

use crate::config::TimingConfig;

/// What one step computes, summed over its batch.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepShape {
    /// Sequences in the batch (prefilling and decoding).
    pub sequences: u64,
    /// New tokens computed (prefill chunks plus one per decoding sequence).
    pub tokens: u64,
    /// Attention (query, key) pairs of the prefill chunks.
    pub prefill_attention_pairs: u64,
    /// Context tokens whose KV the decoding sequences read.
    pub decode_kv_tokens: u64,
}

impl StepShape {
    /// Adds a prefill chunk of `new_tokens` after `cached` already computed tokens.
    pub fn add_prefill(&mut self, cached: u64, new_tokens: u64) {
        self.sequences += 1;
        self.tokens += new_tokens;
        self.prefill_attention_pairs += new_tokens * cached + new_tokens * (new_tokens + 1) / 2;
    }

    /// Adds one decoding sequence whose context (including the new token) is `context` tokens.
    pub fn add_decode(&mut self, context: u64) {
        self.sequences += 1;
        self.tokens += 1;
        self.decode_kv_tokens += context;
    }
}

/// A validated [`TimingConfig`] with the speed-up factor applied.
#[derive(Debug, Clone)]
pub struct TimingModel {
    config: TimingConfig,
    speedup: f64,
}

impl TimingModel {
    /// A model from validated parameters (see [`crate::MockerConfig::validate`]).
    pub fn new(config: TimingConfig, speedup: f64) -> Self {
        Self { config, speedup }
    }

    /// The modelled cost of one step in milliseconds, before the speed-up.
    pub fn step_ms(&self, shape: &StepShape) -> f64 {
        let c = &self.config;
        c.overhead_ms
            + c.weights_read_ms
                .max(shape.tokens as f64 * c.token_compute_ms)
            + c.attention_pair_ms * shape.prefill_attention_pairs as f64
            + c.kv_read_ms_per_token * shape.decode_kv_tokens as f64
            + c.per_sequence_ms * shape.sequences as f64
    }

    /// The duration of one step after the speed-up; never zero, so virtual time always advances.
    pub fn step_duration(&self, shape: &StepShape) -> Duration {
        let nanos = (self.step_ms(shape) * 1e6 / self.speedup).round();
        Duration::from_nanos((nanos as u64).max(1))
    }
}
