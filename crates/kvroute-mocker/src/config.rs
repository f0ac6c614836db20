//! Engine configuration: a serde struct that mirrors the config file (JSON or TOML), with
//! defaults that model an 8B dense model (Llama-3.1-8B shape) served by vLLM on one H100 SXM 80 GB.
//!
//! Where the default numbers come from (all rounded; the point is the shape, not the third digit):
//!
//! - Model shape: 32 layers, hidden 4096, 32 query heads, 8 KV heads of dim 128, BF16, ~8.0e9
//!   parameters, so ~16 GB of weights and `2 * 32 * 8 * 128 * 2 B = 128 KiB` of KV per token.
//! - KV capacity: 80 GB at vLLM's default `gpu_memory_utilization = 0.9` is 72 GB, minus 16 GB of
//!   weights and ~4 GB of activations and CUDA graphs leaves ~52 GB, i.e. ~400k tokens: 25,000
//!   blocks of vLLM's default 16 tokens.
//! - Batching: vLLM V1's defaults `max_num_seqs = 256`, `max_num_batched_tokens = 8192` (the
//!   OpenAI server's value on H100-class GPUs), chunked prefill on.
//! - Compute: a forward pass costs `2 * 8.0e9 = 16 GFLOP` per token; at ~530 TFLOP/s (about 55 % of
//!   the H100's 989 TFLOP/s dense BF16 peak) that is 0.03 ms per token. Attention adds
//!   `4 * layers * heads * head_dim = 524,288 FLOP` per (query, key) pair, ~1.05e-6 ms at ~500
//!   TFLOP/s; a prefill chunk of `n` new tokens after `c` cached ones has `n * c + n * (n + 1) / 2`
//!   pairs, which is the quadratic term in context length.
//! - Memory: a step reads all weights once (16 GB at ~2.8 TB/s effective of 3.35 TB/s peak is
//!   5.7 ms) and, for each decoding sequence, its whole KV (128 KiB per token at 2.8 TB/s is
//!   4.7e-5 ms per token). A step costs the larger of weight reads and token compute (a roofline),
//!   plus attention, KV reads, a per-sequence sampling cost and a fixed scheduling overhead.
//! - Cross-check: Dynamo's mocker fits prefill as `16.5 + 0.0152 t + 4.2e-7 t^2` ms and decode as
//!   5.7 ms to ~34 ms from an empty to a full cache; these defaults give 8192 fresh tokens in
//!   ~282 ms and a decode step from ~6.7 ms (one short sequence) to ~29 ms (256 sequences over a
//!   full cache), the same order of magnitude with a more conservative compute rate.

use std::path::Path;

use serde::{Deserialize, Serialize};

/// Everything that shapes one simulated engine. Field names are the config file's keys; every field
/// has a default, so a config file only states what it changes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MockerConfig {
    /// Tokens per KV block (vLLM's `--block-size`).
    pub block_size: u32,
    /// KV cache capacity in blocks (vLLM's `num_gpu_blocks`).
    pub num_blocks: u32,
    /// The most sequences in one batch (vLLM's `--max-num-seqs`).
    pub max_num_seqs: u32,
    /// The most tokens computed in one step; longer prompts are prefilled in chunks.
    pub max_num_batched_tokens: u32,
    /// Vocabulary size for the pseudo-random generated tokens.
    pub vocab_size: u32,
    /// Seed of the generated tokens; the same seed and prompt give the same output.
    pub seed: u64,
    /// Divides every modelled duration: 10.0 runs ten times faster than the modelled GPU.
    pub speedup: f64,
    /// Session idle timeout used when an open does not state one, in seconds.
    pub default_session_timeout_secs: u64,
    /// The step cost model.
    pub timing: TimingConfig,
}

impl Default for MockerConfig {
    fn default() -> Self {
        Self {
            block_size: 16,
            num_blocks: 25_000,
            max_num_seqs: 256,
            max_num_batched_tokens: 8192,
            vocab_size: 128_256,
            seed: 0,
            speedup: 1.0,
            default_session_timeout_secs: 300,
            timing: TimingConfig::default(),
        }
    }
}

/// Cost of one engine step in milliseconds (see the module documentation for the derivation):
///
/// `overhead + max(weights_read, tokens * token_compute) + attention_pair * pairs
///  + kv_read_per_token * decode_kv_tokens + per_sequence * sequences`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TimingConfig {
    /// Fixed per-step cost: scheduling, kernel launches, sampling setup.
    pub overhead_ms: f64,
    /// Reading every weight once, the floor of any step (memory bound).
    pub weights_read_ms: f64,
    /// Dense compute per token in the batch (prefill or decode).
    pub token_compute_ms: f64,
    /// Attention compute per (query token, key token) pair in prefill chunks.
    pub attention_pair_ms: f64,
    /// Reading one token's KV during a decode step.
    pub kv_read_ms_per_token: f64,
    /// Per-sequence cost of a step (sampling, detokenizer bookkeeping).
    pub per_sequence_ms: f64,
}

impl Default for TimingConfig {
    fn default() -> Self {
        Self {
            overhead_ms: 1.0,
            weights_read_ms: 5.7,
            token_compute_ms: 0.03,
            attention_pair_ms: 1.05e-6,
            kv_read_ms_per_token: 4.7e-5,
            per_sequence_ms: 0.005,
        }
    }
}

/// A config that cannot be used, saying which value was wrong and what was expected.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A numeric field is outside its allowed range.
    #[error("mocker config: {field} must be {expected}, got {got}")]
    OutOfRange {
        /// The config key.
        field: &'static str,
        /// The allowed range, in words.
        expected: &'static str,
        /// The value found.
        got: String,
    },
    /// The file is not valid JSON for this struct.
    #[error("mocker config: invalid JSON: {0}")]
    Json(#[from] serde_json::Error),
    /// The file is not valid TOML for this struct.
    #[error("mocker config: invalid TOML: {0}")]
    Toml(#[from] toml::de::Error),
    /// The file could not be read.
    #[error("mocker config: cannot read {path}: {source}")]
    Io {
        /// The path given.
        path: String,
        /// The underlying error.
        source: std::io::Error,
    },
}

impl MockerConfig {
    /// Parses and validates a JSON config; missing keys take their defaults.
    pub fn from_json_str(text: &str) -> Result<Self, ConfigError> {
        let config: Self = serde_json::from_str(text)?;
        config.validate()?;
        Ok(config)
    }

    /// Parses and validates a TOML config; missing keys take their defaults.
    pub fn from_toml_str(text: &str) -> Result<Self, ConfigError> {
        let config: Self = toml::from_str(text)?;
        config.validate()?;
        Ok(config)
    }

    /// Reads, parses and validates a config file: TOML when its name ends in `.toml`, JSON
    /// otherwise.
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
            path: path.display().to_string(),
            source,
        })?;
        if path.extension().is_some_and(|e| e == "toml") {
            Self::from_toml_str(&text)
        } else {
            Self::from_json_str(&text)
        }
    }

    /// Checks every range; [`crate::Engine::new`] calls this too.
    pub fn validate(&self) -> Result<(), ConfigError> {
        positive("block_size", self.block_size)?;
        positive("num_blocks", self.num_blocks)?;
        positive("max_num_seqs", self.max_num_seqs)?;
        positive("max_num_batched_tokens", self.max_num_batched_tokens)?;
        positive("vocab_size", self.vocab_size)?;
        if !(self.speedup.is_finite() && self.speedup > 0.0) {
            return Err(ConfigError::OutOfRange {
                field: "speedup",
                expected: "a finite number > 0",
                got: self.speedup.to_string(),
            });
        }
        let t = &self.timing;
        for (field, value) in [
            ("timing.overhead_ms", t.overhead_ms),
            ("timing.weights_read_ms", t.weights_read_ms),
            ("timing.token_compute_ms", t.token_compute_ms),
            ("timing.attention_pair_ms", t.attention_pair_ms),
            ("timing.kv_read_ms_per_token", t.kv_read_ms_per_token),
            ("timing.per_sequence_ms", t.per_sequence_ms),
        ] {
            if !(value.is_finite() && value >= 0.0) {
                return Err(ConfigError::OutOfRange {
                    field,
                    expected: "a finite number >= 0",
                    got: value.to_string(),
                });
            }
        }
        Ok(())
    }
}

fn positive(field: &'static str, value: u32) -> Result<(), ConfigError> {
    if value == 0 {
        return Err(ConfigError::OutOfRange {
            field,
            expected: "at least 1",
            got: "0".to_owned(),
        });
    }
    Ok(())
}
