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
//!
//! That roofline is [`TimingConfig::Roofline`], the default. [`TimingConfig::Polynomial`] is the
//! reference's own step cost instead (Dynamo 1.6.1's mocker, whose scheduler and timing live in
//! the `aisimulate-core` 0.13.0 crate it depends on), so that a replay can be compared with the
//! reference's replay figure for figure; [`PolynomialTiming`] says where each constant comes from.

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
    /// What must be free for a waiting request to be admitted.
    pub admission: Admission,
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
            admission: Admission::FirstChunk,
            vocab_size: 128_256,
            seed: 0,
            speedup: 1.0,
            default_session_timeout_secs: 300,
            timing: TimingConfig::default(),
        }
    }
}

/// What a waiting request needs free (unreferenced blocks, cached or not) to be admitted. Either
/// way, prefix hits already referenced by a running request need nothing, and a step allocates
/// only the blocks of the tokens it computes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub enum Admission {
    /// Blocks for the tokens of its first step (its first chunk): vLLM V1's scheduler, which
    /// allocates per scheduled chunk.
    #[default]
    FirstChunk,
    /// Blocks for its whole sequence, although it is prefilled chunk by chunk: the reference's
    /// mocker (`decide_waiting_admission_with_cost` in `src/engine/scheduler/vllm/policy.rs`
    /// and `admission_requirement` in `src/engine/kv_manager/vllm_backend.rs` of
    /// `aisimulate-core` 0.13.0: `ceil(len / block_size)` minus the active cached blocks, against
    /// the capacity minus the active blocks). It admits a long prompt later under KV pressure.
    WholePrompt,
}

/// How long one engine step takes: which model, and its parameters.
///
/// In a config file the `timing` table names the model in `model` (`"roofline"` or
/// `"polynomial"`) next to that model's parameters; without `model` it is the roofline, so
/// `{"timing": {"overhead_ms": 2.5}}` changes one roofline parameter.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "model", rename_all = "kebab-case")]
#[non_exhaustive]
pub enum TimingConfig {
    /// kvroute's own model of an 8B model on one H100 (see the module documentation): a
    /// roofline over the step's tokens plus attention and KV reads.
    Roofline(RooflineTiming),
    /// The reference's polynomial fits of a prefill pass and a decode pass, summed.
    Polynomial(PolynomialTiming),
}

impl Default for TimingConfig {
    fn default() -> Self {
        Self::Roofline(RooflineTiming::default())
    }
}

impl<'de> Deserialize<'de> for TimingConfig {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        // The tag is optional (an untagged table is the roofline), which serde's internally
        // tagged enums cannot express; read the table, take the tag off, parse the rest.
        let mut table = serde_json::Map::<String, serde_json::Value>::deserialize(deserializer)?;
        let model = match table.remove("model") {
            None => "roofline".to_owned(),
            Some(serde_json::Value::String(name)) => name,
            Some(other) => {
                return Err(D::Error::custom(format!(
                    "timing.model must be \"roofline\" or \"polynomial\", got {other}"
                )));
            }
        };
        let rest = serde_json::Value::Object(table);
        match model.as_str() {
            "roofline" => serde_json::from_value(rest)
                .map(Self::Roofline)
                .map_err(|e| D::Error::custom(format!("timing (roofline): {e}"))),
            "polynomial" => serde_json::from_value(rest)
                .map(Self::Polynomial)
                .map_err(|e| D::Error::custom(format!("timing (polynomial): {e}"))),
            other => Err(D::Error::custom(format!(
                "timing.model must be \"roofline\" or \"polynomial\", got \"{other}\""
            ))),
        }
    }
}

/// Cost of one engine step in milliseconds (see the module documentation for the derivation):
///
/// `overhead + max(weights_read, tokens * token_compute) + attention_pair * pairs
///  + kv_read_per_token * decode_kv_tokens + per_sequence * sequences`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RooflineTiming {
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

impl Default for RooflineTiming {
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

/// The reference's step cost: a step's prefill pass plus, when it has decoding sequences, its
/// decode pass, each a polynomial fit (milliseconds):
///
/// - prefill: `prefill_c2 * t^2 + prefill_c1 * t + prefill_c0`, where `t` is the step's new prompt
///   tokens computed the reference's way: `n * (total_isl / n - total_prefix / n)` in integer
///   arithmetic over the `n` sequences with a prompt chunk in the step, `total_isl` the sum of
///   (tokens before the chunk + chunk) and `total_prefix` the sum of tokens before it; zero
///   without prompt chunks;
/// - decode: `max(decode_floor, decode_c2 * u^2 + decode_c1 * u + decode_c0)` with `u` the
///   decoding sequences' context tokens (prompt and output so far) over the engine's KV capacity
///   in tokens, capped at 1; zero without decoding sequences. A sequence whose prompt finishes
///   in the step samples its first token from the prefill pass and adds no decode.
///
/// Every default is the reference's: `polynomial_prefill_time` and `polynomial_decode_time` in
/// `src/engine/common/perf_model.rs` of `aisimulate-core` 0.13.0 (the engine crate
/// `dynamo-mocker` 1.6.1 runs; its `PerfModel::Polynomial`, the default `TimingModelConfig`
/// of `src/engine/timing.rs`). The prefill-then-decode sum and the batch means are
/// `predict_prefill_duration` and `emit_ready_tokens` in that crate's
/// `src/engine/scheduler/vllm/core.rs`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PolynomialTiming {
    /// Constant term of the prefill fit (`1.650142e+01` ms).
    pub prefill_c0: f64,
    /// Linear term of the prefill fit, per new token (`1.518344e-02` ms).
    pub prefill_c1: f64,
    /// Quadratic term of the prefill fit, per new token squared (`4.209989e-07` ms).
    pub prefill_c2: f64,
    /// Constant term of the decode fit (`5.74` ms).
    pub decode_c0: f64,
    /// Linear term of the decode fit, per unit of KV utilisation (`54.01` ms).
    pub decode_c1: f64,
    /// Quadratic term of the decode fit (`-25.74` ms).
    pub decode_c2: f64,
    /// The least a decode pass costs (`1.0` ms, the fit's `.max(1.0)`).
    pub decode_floor_ms: f64,
}

impl Default for PolynomialTiming {
    fn default() -> Self {
        Self {
            prefill_c0: 1.650142e+01,
            prefill_c1: 1.518344e-02,
            prefill_c2: 4.209989e-07,
            decode_c0: 5.74,
            decode_c1: 54.01,
            decode_c2: -25.74,
            decode_floor_ms: 1.0,
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
    /// The reference's simulated engine: what Dynamo 1.6.1's mocker (`aisimulate-core` 0.13.0,
    /// `src/engine/config.rs`) runs when a replay names only the engine's cache, so that a
    /// replay here reproduces the reference's replay. From that file: `default_block_size()` 64
    /// (vLLM backend), `default_num_gpu_blocks()` 16,384, `default_max_num_seqs()` 256,
    /// `default_max_num_batched_tokens()` 8,192, chunked prefill on, `speedup_ratio` 1.0; its
    /// default `TimingModelConfig::Polynomial` ([`PolynomialTiming`]); and its vLLM admission
    /// rule ([`Admission::WholePrompt`]).
    pub fn reference() -> Self {
        Self {
            block_size: 64,
            num_blocks: 16_384,
            max_num_seqs: 256,
            max_num_batched_tokens: 8192,
            admission: Admission::WholePrompt,
            timing: TimingConfig::Polynomial(PolynomialTiming::default()),
            ..Self::default()
        }
    }

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
        let fields: Vec<(&'static str, f64, bool)> = match &self.timing {
            TimingConfig::Roofline(t) => vec![
                ("timing.overhead_ms", t.overhead_ms, false),
                ("timing.weights_read_ms", t.weights_read_ms, false),
                ("timing.token_compute_ms", t.token_compute_ms, false),
                ("timing.attention_pair_ms", t.attention_pair_ms, false),
                ("timing.kv_read_ms_per_token", t.kv_read_ms_per_token, false),
                ("timing.per_sequence_ms", t.per_sequence_ms, false),
            ],
            // The decode fit bends down (its quadratic term is negative in the reference), so
            // only the floor and the constant terms must be non-negative.
            TimingConfig::Polynomial(p) => vec![
                ("timing.prefill_c0", p.prefill_c0, false),
                ("timing.prefill_c1", p.prefill_c1, true),
                ("timing.prefill_c2", p.prefill_c2, true),
                ("timing.decode_c0", p.decode_c0, false),
                ("timing.decode_c1", p.decode_c1, true),
                ("timing.decode_c2", p.decode_c2, true),
                ("timing.decode_floor_ms", p.decode_floor_ms, false),
            ],
        };
        for (field, value, signed) in fields {
            if !(value.is_finite() && (signed || value >= 0.0)) {
                return Err(ConfigError::OutOfRange {
                    field,
                    expected: if signed {
                        "a finite number"
                    } else {
                        "a finite number >= 0"
                    },
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
