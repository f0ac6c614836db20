//! The step cost model: what one engine iteration costs given what it computes.

use std::time::Duration;

use crate::config::{PolynomialTiming, RooflineTiming, TimingConfig};

/// What one step computes, summed over its batch: the figures both timing models read.
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
    /// Sequences with a chunk of their original prompt in the step.
    pub prompt_chunks: u64,
    /// Over those, the sum of prompt tokens computed once the step is done.
    pub prompt_chunk_ends: u64,
    /// Over those, the sum of prompt tokens computed (or cached) before the step.
    pub prompt_chunk_starts: u64,
    /// Sequences that sample a token in the step after a previous one: every decoding sequence,
    /// and a recomputed (preempted) sequence finishing its recompute.
    pub decoding: u64,
    /// Context tokens of the sequences counted in `decoding`.
    pub decoding_context: u64,
}

/// One sequence's work in a step, as [`StepShape::add`] takes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeqWork {
    /// Tokens of the original prompt (a preempted sequence's output is not prompt).
    pub prompt_len: u64,
    /// Tokens of the sequence so far (prompt and output).
    pub len: u64,
    /// Tokens already computed or cached before the step.
    pub computed: u64,
    /// Tokens computed in the step.
    pub new_tokens: u64,
    /// Output tokens sampled before the step.
    pub generated: u64,
}

impl StepShape {
    /// Adds a chunk of `new_tokens` prompt tokens after `cached` already computed ones.
    pub fn add_prefill(&mut self, cached: u64, new_tokens: u64) {
        self.sequences += 1;
        self.tokens += new_tokens;
        self.prefill_attention_pairs += new_tokens * cached + new_tokens * (new_tokens + 1) / 2;
        self.prompt_chunks += 1;
        self.prompt_chunk_ends += cached + new_tokens;
        self.prompt_chunk_starts += cached;
    }

    /// Adds one decoding sequence whose context (including the new token) is `context` tokens.
    pub fn add_decode(&mut self, context: u64) {
        self.sequences += 1;
        self.tokens += 1;
        self.decode_kv_tokens += context;
        self.decoding += 1;
        self.decoding_context += context;
    }

    /// Adds one sequence's work, telling prefill from decode as the engine schedules it.
    pub fn add(&mut self, work: SeqWork) {
        let finishes = work.computed + work.new_tokens == work.len;
        if work.generated > 0 && work.new_tokens == 1 && finishes {
            self.add_decode(work.len);
            return;
        }
        // A prefill chunk for the roofline; the polynomial counts only its original-prompt part
        // and, for a recomputed sequence finishing, one decoding sequence.
        self.sequences += 1;
        self.tokens += work.new_tokens;
        self.prefill_attention_pairs +=
            work.new_tokens * work.computed + work.new_tokens * (work.new_tokens + 1) / 2;
        let before = work.computed.min(work.prompt_len);
        let after = (work.computed + work.new_tokens).min(work.prompt_len);
        if after > before {
            self.prompt_chunks += 1;
            self.prompt_chunk_ends += after;
            self.prompt_chunk_starts += before;
        }
        if finishes && work.generated > 0 {
            self.decoding += 1;
            self.decoding_context += work.len;
        }
    }
}

/// A validated [`TimingConfig`] with the speed-up factor and the engine's KV capacity applied.
#[derive(Debug, Clone)]
pub struct TimingModel {
    config: TimingConfig,
    speedup: f64,
    kv_capacity_tokens: u64,
}

impl TimingModel {
    /// A model from validated parameters (see [`crate::MockerConfig::validate`]) for an engine
    /// holding `kv_capacity_tokens` tokens of KV (the polynomial's decode cost reads it).
    pub fn new(config: TimingConfig, speedup: f64, kv_capacity_tokens: u64) -> Self {
        Self {
            config,
            speedup,
            kv_capacity_tokens,
        }
    }

    /// The model of an engine configured by `config`.
    pub fn for_engine(config: &crate::MockerConfig) -> Self {
        Self::new(
            config.timing.clone(),
            config.speedup,
            u64::from(config.num_blocks) * u64::from(config.block_size),
        )
    }

    /// The modelled cost of one step in milliseconds, before the speed-up.
    pub fn step_ms(&self, shape: &StepShape) -> f64 {
        match &self.config {
            TimingConfig::Roofline(c) => roofline_ms(c, shape),
            TimingConfig::Polynomial(p) => {
                polynomial_prefill_ms(p, shape) + self.polynomial_decode_ms(p, shape)
            }
        }
    }

    /// The duration of one step after the speed-up; never zero, so virtual time always advances.
    pub fn step_duration(&self, shape: &StepShape) -> Duration {
        let nanos = (self.step_ms(shape) * 1e6 / self.speedup).round();
        Duration::from_nanos((nanos as u64).max(1))
    }

    fn polynomial_decode_ms(&self, p: &PolynomialTiming, shape: &StepShape) -> f64 {
        if shape.decoding == 0 {
            return 0.0;
        }
        // The reference divides by its capacity and warns on zero; a validated config has none.
        let capacity = self.kv_capacity_tokens.max(1) as f64;
        let used = (shape.decoding_context as f64 / capacity).min(1.0);
        (p.decode_c2 * used * used + p.decode_c1 * used + p.decode_c0).max(p.decode_floor_ms)
    }
}

fn roofline_ms(c: &RooflineTiming, shape: &StepShape) -> f64 {
    c.overhead_ms
        + c.weights_read_ms
            .max(shape.tokens as f64 * c.token_compute_ms)
        + c.attention_pair_ms * shape.prefill_attention_pairs as f64
        + c.kv_read_ms_per_token * shape.decode_kv_tokens as f64
        + c.per_sequence_ms * shape.sequences as f64
}

/// The reference reduces a prefill batch to its mean input and mean prefix (integer means) and
/// costs `count * (mean_isl - mean_prefix)` tokens.
fn polynomial_prefill_ms(p: &PolynomialTiming, shape: &StepShape) -> f64 {
    let n = shape.prompt_chunks;
    if n == 0 {
        return 0.0;
    }
    let per_request = (shape.prompt_chunk_ends / n).saturating_sub(shape.prompt_chunk_starts / n);
    if per_request == 0 {
        return 0.0;
    }
    let t = (n * per_request) as f64;
    (p.prefill_c2 * t * t + p.prefill_c1 * t + p.prefill_c0).max(0.0)
}
