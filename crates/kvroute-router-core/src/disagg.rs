//! Conditional disaggregation: whether one request is prefilled remotely (on a prefill worker,
//! its KV then transferred) or locally (on the decode worker it will decode on, as aggregated
//! serving does), decided per request from the router's own view of caches and queues.
//!
//! The rule is the reference's older disaggregated router (Dynamo's `DisaggregatedRouter`, whose
//! `prefill_remote(prompt_length, prefix_hit_length)` prefills remotely only when the uncached
//! part exceeds `max_local_prefill_length`, 1000 tokens in its vLLM example, and whose Python
//! variant also keeps a prompt local when its decode-side cache hit ratio exceeds
//! `max_remote_prefill_cache_hit_ratio`), plus a comparison of the two prefill queues that the
//! reference made with its prefill queue size. Everything comes in as numbers: no clock, no
//! randomness, no state, so the same inputs always give the same placement.

use crate::request::Routed;

/// Uncached prompt tokens at or below which a prompt is prefilled on its decode worker (the
/// reference's `max_local_prefill_length` default in its vLLM disaggregation example).
pub const DEFAULT_MAX_LOCAL_PREFILL_TOKENS: u64 = 1000;

/// Share of the prompt cached on the decode worker at or above which the prompt is prefilled
/// there (the reference's `max_remote_prefill_cache_hit_ratio` default is 0.5; a higher share is
/// used here because a long prompt that is half cached still prefills thousands of tokens in the
/// middle of the decode worker's batches).
pub const DEFAULT_MIN_LOCAL_CACHED_SHARE: f64 = 0.8;

/// How many times longer (in tokens still to prefill, its own included) the best prefill
/// worker's queue must be than the decode worker's for the prompt to be prefilled locally. Above
/// one because a local prefill also stalls the decode worker's running requests.
pub const DEFAULT_PREFILL_QUEUE_RATIO: f64 = 2.0;

/// The thresholds of conditional disaggregation (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ConditionalDisagg {
    /// Prefill locally when at most this many prompt tokens are uncached on the decode worker.
    pub max_local_prefill_tokens: u64,
    /// Prefill locally when at least this share (0..=1) of the prompt is cached on the decode
    /// worker; above 1 turns the rule off.
    pub min_local_cached_share: f64,
    /// Prefill locally when the remote prefill queue (plus the prompt's uncached part there) is
    /// at least this many times the local one (plus its uncached part there); must be > 0.
    pub prefill_queue_ratio: f64,
}

impl Default for ConditionalDisagg {
    fn default() -> Self {
        Self {
            max_local_prefill_tokens: DEFAULT_MAX_LOCAL_PREFILL_TOKENS,
            min_local_cached_share: DEFAULT_MIN_LOCAL_CACHED_SHARE,
            prefill_queue_ratio: DEFAULT_PREFILL_QUEUE_RATIO,
        }
    }
}

/// Why a [`ConditionalDisagg`] setting was refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ConditionalDisaggError {
    /// The cached share is not a number >= 0.
    #[error("min_local_cached_share must be a number >= 0 (above 1 turns the rule off), got {0}")]
    CachedShare(f64),
    /// The queue ratio is not a finite number > 0.
    #[error("prefill_queue_ratio must be a finite number > 0, got {0}")]
    QueueRatio(f64),
}

/// One side's view of a prompt's prefill: what is left to compute and what waits before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PrefillSide {
    /// Prompt tokens the worker has to compute (the prompt less its cached prefix there).
    pub uncached_tokens: u64,
    /// Prompt tokens of other requests still waiting to be prefilled on the worker.
    pub backlog_tokens: u64,
}

impl PrefillSide {
    /// The side of a routing decision (a [`crate::KvRouterCore::query`] answer): the chosen
    /// worker's uncached prompt and its outstanding prefill before this prompt.
    pub fn of(routed: &Routed, block_size: u32) -> Self {
        let cached = routed.predicted_cached_tokens(block_size);
        // `prefill_blocks` is (outstanding prefill + this prompt) / block size, or zero when the
        // decision does not track prefill.
        let with_prompt = (routed.cost.prefill_blocks * f64::from(block_size)).round() as u64;
        Self {
            uncached_tokens: routed.isl_tokens.saturating_sub(cached),
            backlog_tokens: with_prompt.saturating_sub(routed.isl_tokens),
        }
    }
}

/// Where a request's prefill runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PrefillPlacement {
    /// On its decode worker, aggregated, for the reason given.
    Local(LocalReason),
    /// On a prefill worker, its KV then transferred to the decode worker.
    Remote,
}

/// Why a prompt was prefilled on its decode worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LocalReason {
    /// Its uncached part is short.
    ShortUncached,
    /// Most of it is cached on the decode worker.
    MostlyCached,
    /// The prefill workers' queue is much longer than the decode worker's.
    PrefillQueueLong,
}

impl PrefillPlacement {
    /// Whether the prefill runs on the decode worker.
    pub fn is_local(self) -> bool {
        matches!(self, PrefillPlacement::Local(_))
    }

    /// A short name for logs and metric labels: `remote`, or the local reason
    /// (`short_uncached`, `mostly_cached`, `prefill_queue_long`).
    pub fn name(self) -> &'static str {
        match self {
            PrefillPlacement::Remote => "remote",
            PrefillPlacement::Local(LocalReason::ShortUncached) => "short_uncached",
            PrefillPlacement::Local(LocalReason::MostlyCached) => "mostly_cached",
            PrefillPlacement::Local(LocalReason::PrefillQueueLong) => "prefill_queue_long",
        }
    }
}

impl ConditionalDisagg {
    /// The settings, checked.
    pub fn validated(self) -> Result<Self, ConditionalDisaggError> {
        if self.min_local_cached_share.is_nan() || self.min_local_cached_share < 0.0 {
            return Err(ConditionalDisaggError::CachedShare(
                self.min_local_cached_share,
            ));
        }
        if !self.prefill_queue_ratio.is_finite() || self.prefill_queue_ratio <= 0.0 {
            return Err(ConditionalDisaggError::QueueRatio(self.prefill_queue_ratio));
        }
        Ok(self)
    }

    /// Where a prompt of `isl_tokens` tokens is prefilled, given its `local` side (the decode
    /// worker it would be served on aggregated) and its `remote` side (the prefill worker it
    /// would be prefilled on). The rules are tried in order: short uncached part, mostly cached,
    /// remote queue much longer; otherwise remote.
    pub fn place(
        &self,
        isl_tokens: u64,
        local: PrefillSide,
        remote: PrefillSide,
    ) -> PrefillPlacement {
        if local.uncached_tokens <= self.max_local_prefill_tokens {
            return PrefillPlacement::Local(LocalReason::ShortUncached);
        }
        let cached = isl_tokens.saturating_sub(local.uncached_tokens);
        if isl_tokens > 0 && cached as f64 >= self.min_local_cached_share * isl_tokens as f64 {
            return PrefillPlacement::Local(LocalReason::MostlyCached);
        }
        // Measured and dropped: also holding the two rules above to the decode worker's own
        // prefill queue (local only while it is at most `prefill_queue_ratio` times the remote
        // work) sent bursts to the prefill pool and raised bursty TTFT p99 from 1.36 to 3.21 s
        // in replay (docs/benchmarks-history.md).
        let local_work = (local.backlog_tokens + local.uncached_tokens) as f64;
        let remote_work = (remote.backlog_tokens + remote.uncached_tokens) as f64;
        if remote_work >= self.prefill_queue_ratio * local_work {
            return PrefillPlacement::Local(LocalReason::PrefillQueueLong);
        }
        PrefillPlacement::Remote
    }

    /// [`Self::place`] from two routing decisions for the same prompt: `decode`, the decode
    /// worker's (queried as an aggregated request, with overlap credit), and `prefill`, the
    /// prefill worker's.
    pub fn place_routed(
        &self,
        decode: &Routed,
        prefill: &Routed,
        block_size: u32,
    ) -> PrefillPlacement {
        self.place(
            decode.isl_tokens,
            PrefillSide::of(decode, block_size),
            PrefillSide::of(prefill, block_size),
        )
    }
}

#[cfg(test)]
mod tests;
