//! What a selection is asked ([`SelectRequest`], with the indexer's [`TierOverlap`]s) and what it
//! answers ([`Decision`] with a [`CandidateCost`] per candidate, or a [`SelectError`] naming the
//! [`FilterStage`] that left nobody). The selection itself is in `select.rs`.

use std::fmt;

use kvroute_protocols::kv_events::StorageTier;
use kvroute_protocols::{
    DpRank, RequestPhase, RouterConfigOverride, RoutingConstraints, RoutingHints, WorkerId,
    WorkerWithDpRank,
};

use crate::config::{ConfigError, CostWeights};
use crate::load::RequestId;

/// What selection needs to know about one request.
#[derive(Debug, Clone, Copy, Default)]
pub struct SelectRequest<'a> {
    /// For the debug log line only.
    pub request_id: Option<RequestId>,
    /// Prompt length in tokens.
    pub isl_tokens: u64,
    /// Sequence hashes of the prompt's full blocks.
    pub block_hashes: &'a [u64],
    /// Cached prefix length per worker, in blocks, from the indexer; absent workers have none.
    pub overlaps: &'a [(WorkerWithDpRank, u32)],
    /// Per worker and slower tier, the run of prompt blocks held there that continues the
    /// worker's device prefix (the indexer's lower-tier scores); credited by the configured
    /// [`CacheHitWeights`](crate::CacheHitWeights). Empty by default.
    pub lower_tiers: &'a [TierOverlap],
    /// Blocks each worker holds in device memory (cached and active), from the indexer, for
    /// [`CostWeights::eviction_weight`]; absent workers hold none. Empty by default.
    pub resident_blocks: &'a [(WorkerWithDpRank, u64)],
    /// When set, only these workers are considered.
    pub allowed_worker_ids: Option<&'a [WorkerId]>,
    /// Workers to route around (the router's passive health ejects failing workers): skipped
    /// while any other eligible worker remains, chosen when none does. A pin overrides it.
    pub avoided_worker_ids: &'a [WorkerId],
    /// Exact pin to one worker.
    pub pinned_worker: Option<WorkerId>,
    /// Pin to one dp rank (of the pinned worker, or of any worker).
    pub pinned_dp_rank: Option<DpRank>,
    /// Required and preferred taints.
    pub constraints: Option<&'a RoutingConstraints>,
    /// Base cost weights for this request instead of the configured ones (the router passes
    /// its policy's weights); `overrides` still apply on top.
    pub weights: Option<CostWeights>,
    /// Per-request overrides of the cost weights and temperature.
    pub overrides: Option<&'a RouterConfigOverride>,
}

impl<'a> SelectRequest<'a> {
    /// A request for a prompt of `isl_tokens` with these block hashes and overlap scores.
    pub fn new(
        isl_tokens: u64,
        block_hashes: &'a [u64],
        overlaps: &'a [(WorkerWithDpRank, u32)],
    ) -> Self {
        Self {
            isl_tokens,
            block_hashes,
            overlaps,
            ..Self::default()
        }
    }

    /// The same request constrained by `hints` for `phase` (allowed workers, the phase's pins,
    /// taint constraints).
    pub fn with_hints(mut self, hints: &'a RoutingHints, phase: RequestPhase) -> Self {
        self.allowed_worker_ids = hints.allowed_worker_ids.as_deref();
        self.pinned_worker = hints.pinned_worker(phase);
        self.pinned_dp_rank = hints.pinned_dp_rank(phase);
        self.constraints = hints.routing_constraints.as_ref();
        self
    }
}

/// A worker's run of prompt blocks in one slower storage tier, continuing its device prefix (or
/// the previous slower tier's run).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TierOverlap {
    /// The worker.
    pub worker: WorkerWithDpRank,
    /// The tier: host, disk or external (external counts as disk; device entries are ignored,
    /// device blocks come in [`SelectRequest::overlaps`]).
    pub tier: StorageTier,
    /// Blocks in the run.
    pub blocks: u32,
}

/// One candidate's cost and how it was computed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CandidateCost {
    /// The candidate.
    pub worker: WorkerWithDpRank,
    /// Prompt blocks cached there in device memory.
    pub overlap_blocks: u32,
    /// Of `overlap_blocks`, those the worker cannot keep until it admits the prompt, for want of
    /// KV capacity ([`CostWeights::capacity_credit`]); they earn no credit. 0 when the weights
    /// do not ask, or the worker's capacity is unknown.
    pub unkept_blocks: u32,
    /// Prompt blocks cached in host memory right after the device prefix.
    pub host_blocks: u32,
    /// Prompt blocks cached on disk or external storage right after the host run.
    pub disk_blocks: u32,
    /// The cache hit in blocks, slower tiers weighted: `overlap_blocks + host_weight *
    /// host_blocks + disk_weight * disk_blocks` (the reference's effective overlap); equal to
    /// `overlap_blocks` without lower-tier blocks.
    pub weighted_overlap_blocks: f64,
    /// Prefill blocks credited per device-cached block: `overlap_credit * share ^
    /// cached_share_exponent` (see [`CostWeights::credit`]), divided by the backlog decay when
    /// one is set ([`CostWeights::credit_decay_at`]).
    pub credit: f64,
    /// Outstanding prefill plus this prompt, in blocks (0 when prefill is not tracked).
    pub prefill_blocks: f64,
    /// `max(prefill_blocks - (credit * (overlap_blocks - unkept_blocks) +
    /// weighted_overlap_blocks - overlap_blocks), 0)`: the device blocks the worker keeps
    /// credited at `credit`, the slower tiers' at their weights.
    pub credited_prefill_blocks: f64,
    /// Active decode blocks plus this prompt's blocks not already active there.
    pub decode_blocks: f64,
    /// What the decode blocks weigh in the cost ([`CostWeights::decode_cost`]): `decode_blocks`
    /// itself unless the weights weigh a balanced worker's decode blocks lightly.
    pub weighted_decode_blocks: f64,
    /// Blocks of other prompts' idle cache this placement would evict beyond what the eligible
    /// worker with the most free capacity would ([`CostWeights::eviction_weight`]); 0 when the
    /// weights do not ask, or the worker's capacity is unknown.
    pub evicted_blocks: u64,
    /// Blocks of idle cache this placement would evict at all, when the weights charge for it
    /// by churn ([`CostWeights::churn_eviction_weight`]); 0 when they do not, or the worker's
    /// capacity is unknown.
    pub churn_evicted_blocks: u64,
    /// How far the worker's churn is above the eligible workers' least, over their mean, capped
    /// at 1 ([`CostWeights::churn_eviction_weight`]); 0 when the weights do not ask.
    pub churn_share: f64,
    /// The prompt's blocks not cached on this worker: what placing it there allocates.
    pub new_blocks: u64,
    /// How much fuller the worker's KV cache is than the emptiest eligible worker's, as fractions
    /// of their capacities ([`CostWeights::occupancy_weight`]); 0 when the weights do not ask,
    /// or the worker's capacity is unknown.
    pub occupancy_share: f64,
    /// Preferred-taint multiplier (1.0 without preferences).
    pub taint_multiplier: f64,
    /// `(scale * (credited_prefill_blocks + eviction_weight * evicted_blocks +
    /// churn_eviction_weight * churn_share * churn_evicted_blocks + occupancy_weight *
    /// occupancy_share * new_blocks * (new_blocks / prompt_blocks)^2) + weighted_decode_blocks) *
    /// taint_multiplier`, `scale` being [`Decision::prefill_load_scale`].
    pub cost: f64,
}

impl CandidateCost {
    /// The prompt tokens this worker is expected to find cached, slower tiers weighted:
    /// `round(weighted_overlap_blocks * block_size)`, as the reference estimates cached tokens
    /// (the caller caps it at the prompt length).
    pub fn cached_tokens(&self, block_size: u32) -> u64 {
        // Non-negative and finite: a sum of validated weights times block counts.
        (self.weighted_overlap_blocks * f64::from(block_size)).round() as u64
    }
}

impl fmt::Display for CandidateCost {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} cost={:.3} prefill={:.3}->{:.3} (overlap {} x credit {:.3}",
            self.worker,
            self.cost,
            self.prefill_blocks,
            self.credited_prefill_blocks,
            self.overlap_blocks,
            self.credit,
        )?;
        if self.unkept_blocks > 0 {
            write!(f, ", {} unkept for want of capacity", self.unkept_blocks)?;
        }
        if self.host_blocks > 0 || self.disk_blocks > 0 {
            write!(
                f,
                " + host {} + disk {}, weighted {:.3}",
                self.host_blocks, self.disk_blocks, self.weighted_overlap_blocks
            )?;
        }
        write!(
            f,
            ") decode={:.3}->{:.3}",
            self.decode_blocks, self.weighted_decode_blocks
        )?;
        if self.evicted_blocks > 0 {
            write!(f, " evicts {}", self.evicted_blocks)?;
        }
        if self.churn_share > 0.0 && self.churn_evicted_blocks > 0 {
            write!(
                f,
                " evicts {} at churn {:.3}",
                self.churn_evicted_blocks, self.churn_share
            )?;
        }
        if self.occupancy_share > 0.0 && self.new_blocks > 0 {
            write!(
                f,
                " allocates {} at fill +{:.3}",
                self.new_blocks, self.occupancy_share
            )?;
        }
        write!(f, " x{:.3}", self.taint_multiplier)
    }
}

/// The outcome of a selection: the chosen worker and every candidate's breakdown.
#[derive(Debug, Clone, Copy)]
pub struct Decision<'a> {
    /// The chosen candidate.
    pub chosen: CandidateCost,
    /// Every eligible candidate, in slot order (borrowed from the scheduler's scratch space so a
    /// decision allocates nothing).
    pub candidates: &'a [CandidateCost],
    /// The temperature used.
    pub temperature: f64,
    /// The prefill scale every candidate was scored with (it depends on the fleet's prefill
    /// backlog for the load-adaptive cost).
    pub prefill_load_scale: f64,
}

/// A filter stage that can leave no worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FilterStage {
    /// No worker is registered at all.
    Registered,
    /// None of the registered workers is in `allowed_worker_ids`.
    AllowedWorkerIds,
    /// No allowed worker serves the pinned dp rank.
    DpRank,
    /// No remaining worker carries every required taint.
    RequiredTaints,
}

impl fmt::Display for FilterStage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            FilterStage::Registered => "no worker is registered",
            FilterStage::AllowedWorkerIds => "no registered worker is in allowed_worker_ids",
            FilterStage::DpRank => "no allowed worker serves the pinned dp rank",
            FilterStage::RequiredTaints => "no remaining worker carries every required taint",
        })
    }
}

/// Why no worker was selected.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum SelectError {
    /// A filter left no candidate.
    #[error("no endpoints: {stage}")]
    NoEndpoints {
        /// The filter that removed the last candidates.
        stage: FilterStage,
    },
    /// Candidates exist but every one is above the busy thresholds.
    #[error("all {eligible} eligible workers are overloaded (above the busy thresholds)")]
    AllEligibleWorkersOverloaded {
        /// How many passed every other filter.
        eligible: usize,
    },
    /// The pinned worker is above the busy thresholds.
    #[error("pinned worker {worker_id} (dp rank {dp_rank:?}) is overloaded")]
    PinnedWorkerOverloaded {
        /// The pinned worker.
        worker_id: WorkerId,
        /// The pinned rank, if one was given.
        dp_rank: Option<DpRank>,
    },
    /// The pinned worker is not registered.
    #[error("pinned worker {worker_id} is not registered")]
    PinnedWorkerUnknown {
        /// The pinned worker.
        worker_id: WorkerId,
    },
    /// The pinned worker is excluded by `allowed_worker_ids`.
    #[error("pinned worker {worker_id} is not in allowed_worker_ids")]
    PinnedWorkerNotAllowed {
        /// The pinned worker.
        worker_id: WorkerId,
    },
    /// The pinned dp rank is outside the pinned worker's ranks.
    #[error(
        "worker {worker_id} serves dp ranks {start}..{end}, pinned dp rank {dp_rank} is outside"
    )]
    DpRankOutOfRange {
        /// The pinned worker.
        worker_id: WorkerId,
        /// The pinned rank.
        dp_rank: DpRank,
        /// The worker's first rank.
        start: DpRank,
        /// One past its last rank.
        end: DpRank,
    },
    /// A per-request override is out of range.
    #[error("invalid router_config_override: {0}")]
    InvalidOverride(#[from] ConfigError),
}
