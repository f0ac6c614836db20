//! The scheduler's configuration, validated once at construction.

use std::time::Duration;

use kvroute_protocols::RouterConfigOverride;

/// Default time after which a request nobody freed is expired (the reference's guard is one hour;
/// the issue asks for five minutes, which also bounds how long a leaked request skews routing).
pub const DEFAULT_REQUEST_EXPIRY: Duration = Duration::from_secs(300);

/// Everything the scheduler needs to know up front.
#[derive(Debug, Clone, PartialEq)]
pub struct SchedulerConfig {
    /// Tokens per KV block (the engines' page size).
    pub block_size: u32,
    /// The cost model's weights, overridable per request.
    pub cost: CostWeights,
    /// Softmax temperature of selection; 0.0 picks the cheapest worker.
    pub temperature: f64,
    /// A request nobody freed is dropped from the load after this long.
    pub request_expiry: Duration,
    /// Above these a worker is not eligible at all.
    pub busy: LoadThresholds,
    /// Above these a worker is "full": when every eligible worker is full, requests wait.
    pub queue_threshold: LoadThresholds,
}

impl SchedulerConfig {
    /// The reference's defaults for `block_size`.
    pub fn new(block_size: u32) -> Self {
        Self {
            block_size,
            cost: CostWeights::default(),
            temperature: 0.0,
            request_expiry: DEFAULT_REQUEST_EXPIRY,
            busy: LoadThresholds::default(),
            queue_threshold: LoadThresholds::default(),
        }
    }

    /// Checks every field, saying what was wrong and what was expected.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.block_size == 0 {
            return Err(ConfigError::invalid("block_size", "at least 1", 0));
        }
        self.cost.validate()?;
        check_temperature(self.temperature)?;
        if self.request_expiry.is_zero() {
            return Err(ConfigError::invalid(
                "request_expiry",
                "a positive duration",
                "0s",
            ));
        }
        self.busy.validate("busy")?;
        self.queue_threshold.validate("queue_threshold")?;
        Ok(())
    }
}

/// Weights of the default cost
/// `prefill_load_scale * max(prefill_blocks - overlap_credit * overlap_blocks, 0) + decode_blocks`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CostWeights {
    /// Multiplies the prefill term (the reference's `prefill_load_scale`, default 1.0).
    pub prefill_load_scale: f64,
    /// Blocks of prefill credited per cached block (the reference's `overlap_score_credit`,
    /// default 1.0; 0.0 ignores the cache).
    pub overlap_credit: f64,
    /// Whether the prefill term counts at all (the reference's `track_prefill_tokens`).
    pub track_prefill_tokens: bool,
    /// Whether prompt blocks already active on a worker are counted once (the reference's
    /// `assume_kv_reuse`); when false every prompt block adds to the decode term.
    pub assume_kv_reuse: bool,
}

impl Default for CostWeights {
    fn default() -> Self {
        Self {
            prefill_load_scale: 1.0,
            overlap_credit: 1.0,
            track_prefill_tokens: true,
            assume_kv_reuse: true,
        }
    }
}

impl CostWeights {
    /// These weights with the request's overrides applied (`None` keeps the configured value).
    pub fn with_override(mut self, o: &RouterConfigOverride) -> Self {
        if let Some(v) = o.prefill_load_scale {
            self.prefill_load_scale = v;
        }
        if let Some(v) = o.overlap_score_credit {
            self.overlap_credit = v;
        }
        if let Some(v) = o.track_prefill_tokens {
            self.track_prefill_tokens = v;
        }
        if let Some(v) = o.assume_kv_reuse {
            self.assume_kv_reuse = v;
        }
        self
    }

    /// Checks that both weights are finite and non-negative.
    pub fn validate(&self) -> Result<(), ConfigError> {
        check_weight("prefill_load_scale", self.prefill_load_scale)?;
        check_weight("overlap_score_credit", self.overlap_credit)
    }
}

/// When a worker counts as loaded; `None` disables a check. Used both for the busy filter and
/// for the queue threshold.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LoadThresholds {
    /// Active decode blocks as a fraction of the worker's KV capacity (workers with unknown
    /// capacity never trip this).
    pub decode_blocks_fraction: Option<f64>,
    /// Active prefill tokens, absolute or relative to the worker's batch budget.
    pub prefill_tokens: Option<PrefillThreshold>,
}

/// A limit on a worker's active (not yet prefilled) prompt tokens.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum PrefillThreshold {
    /// More than this many tokens.
    Absolute(u64),
    /// More than this fraction of the worker's `max_num_batched_tokens` (workers with unknown
    /// budget never trip this).
    FractionOfBatch(f64),
}

impl LoadThresholds {
    fn validate(&self, name: &'static str) -> Result<(), ConfigError> {
        if let Some(f) = self.decode_blocks_fraction
            && !(f.is_finite() && f > 0.0)
        {
            return Err(ConfigError::invalid(name, "decode_blocks_fraction > 0", f));
        }
        if let Some(PrefillThreshold::FractionOfBatch(f)) = self.prefill_tokens
            && !(f.is_finite() && f > 0.0)
        {
            return Err(ConfigError::invalid(
                name,
                "prefill fraction of batch > 0",
                f,
            ));
        }
        Ok(())
    }
}

/// Temperature from the request's override if any, else `configured`; validated.
pub(crate) fn effective_temperature(
    configured: f64,
    o: Option<&RouterConfigOverride>,
) -> Result<f64, ConfigError> {
    let t = o.and_then(|o| o.router_temperature).unwrap_or(configured);
    check_temperature(t)?;
    Ok(t)
}

fn check_temperature(t: f64) -> Result<(), ConfigError> {
    if t.is_finite() && t >= 0.0 {
        Ok(())
    } else {
        Err(ConfigError::invalid(
            "router_temperature",
            "a finite number >= 0",
            t,
        ))
    }
}

fn check_weight(field: &'static str, v: f64) -> Result<(), ConfigError> {
    if v.is_finite() && v >= 0.0 {
        Ok(())
    } else {
        Err(ConfigError::invalid(field, "a finite number >= 0", v))
    }
}

/// A configuration value (from the config file or a per-request override) out of range.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// `field` must be `expected`, got `got`.
    #[error("{field} must be {expected}, got {got}")]
    Invalid {
        /// The offending field.
        field: &'static str,
        /// What the field must be.
        expected: &'static str,
        /// What it was.
        got: String,
    },
}

impl ConfigError {
    fn invalid(field: &'static str, expected: &'static str, got: impl ToString) -> Self {
        Self::Invalid {
            field,
            expected,
            got: got.to_string(),
        }
    }
}
