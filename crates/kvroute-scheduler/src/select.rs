//! Eligibility, the cost model and worker selection.
//!
//! Filters run in a fixed order, each with its own error when it leaves nobody:
//! `allowed_worker_ids`, the exact pin (worker, optional dp rank), dp rank ranges, required
//! taints, then the busy thresholds. Every survivor gets the cost
//! `scale * max(prefill_blocks - (credit * overlap_blocks + host * host_blocks + disk *
//! disk_blocks), 0) + decode_blocks`
//! times its preferred-taint multiplier, where, as in the reference, `prefill_blocks` counts the
//! worker's outstanding prefill (requests not yet past their first token) plus this whole prompt,
//! and `decode_blocks` counts the worker's active blocks plus this prompt's blocks not already
//! active there. `scale` is `prefill_load_scale` for the reference's cost and rises with the
//! eligible workers' prefill backlog for the load-adaptive one ([`CostWeights::prefill_scale_at`]);
//! `credit` is `overlap_credit`, optionally falling with the share of the prompt that is cached
//! ([`CostWeights::credit`]) and with the worker's prefill backlog above the eligible workers'
//! least ([`CostWeights::credit_decay_at`]); `host_blocks` and `disk_blocks` are the worker's runs of prompt
//! blocks in slower tiers continuing its device prefix, credited by the
//! [`CacheHitWeights`](crate::CacheHitWeights) (0.75 and 0.25 by default).

use std::fmt;
use std::sync::atomic::Ordering;

use kvroute_protocols::kv_events::StorageTier;
use kvroute_protocols::{
    DpRank, RequestPhase, RouterConfigOverride, RoutingConstraints, RoutingHints, WorkerId,
    WorkerWithDpRank,
};
use rand::Rng;

use crate::config::{
    ConfigError, CostWeights, DEFAULT_BATCH_BUDGET_TOKENS, LoadThresholds, PrefillThreshold,
    effective_temperature,
};
use crate::fxhash::FxHashMap;
use crate::load::RequestId;
use crate::scheduler::Scheduler;
use crate::workers::Slot;

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
    /// `max(prefill_blocks - (credit * overlap_blocks + weighted_overlap_blocks -
    /// overlap_blocks), 0)`: the device blocks credited at `credit`, the slower tiers' at their
    /// weights.
    pub credited_prefill_blocks: f64,
    /// Active decode blocks plus this prompt's blocks not already active there.
    pub decode_blocks: f64,
    /// Preferred-taint multiplier (1.0 without preferences).
    pub taint_multiplier: f64,
    /// `(scale * credited_prefill_blocks + decode_blocks) * taint_multiplier`, `scale` being
    /// [`Decision::prefill_load_scale`].
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
        if self.host_blocks > 0 || self.disk_blocks > 0 {
            write!(
                f,
                " + host {} + disk {}, weighted {:.3}",
                self.host_blocks, self.disk_blocks, self.weighted_overlap_blocks
            )?;
        }
        write!(
            f,
            ") decode={:.3} x{:.3}",
            self.decode_blocks, self.taint_multiplier
        )
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

/// Reusable buffers so that a selection allocates nothing in the steady state.
#[derive(Debug, Default)]
pub(crate) struct Scratch {
    eligible: Vec<u32>,
    /// Eligible slots of avoided workers, used only when no other slot is eligible.
    avoided: Vec<u32>,
    candidates: Vec<CandidateCost>,
    /// Per slot: this request's overlap and already-active blocks, valid when stamped with the
    /// current generation (so nothing has to be cleared between selections).
    marks: Vec<Mark>,
    generation: u32,
    weights: Vec<f64>,
    preferred: Vec<(u64, f64)>,
    /// The prefill scale of the last scoring pass.
    prefill_load_scale: f64,
}

#[derive(Debug, Clone, Copy, Default)]
struct Mark {
    generation: u32,
    overlap: u32,
    host: u32,
    disk: u32,
    active: u32,
}

impl Mark {
    #[inline]
    fn current(&mut self, generation: u32) -> &mut Self {
        if self.generation != generation {
            *self = Mark {
                generation,
                ..Mark::default()
            };
        }
        self
    }
}

/// Required-taint mask of a request; `None` when a required taint is unknown to every worker.
fn required_mask(
    constraints: Option<&RoutingConstraints>,
    taints: &crate::workers::TaintInterner,
) -> Option<u64> {
    let mut mask = 0;
    for t in constraints
        .map(|c| c.required_taints.as_slice())
        .unwrap_or_default()
    {
        mask |= taints.get(t)?;
    }
    Some(mask)
}

#[inline]
pub(crate) fn above(slot: &Slot, t: &LoadThresholds) -> bool {
    if let (Some(frac), Some(cap)) = (t.decode_blocks_fraction, slot.kv_capacity_blocks)
        && cap > 0
        && slot.load.decode_blocks() > frac * cap as f64
    {
        return true;
    }
    match t.prefill_tokens {
        Some(PrefillThreshold::Absolute(n)) => slot.load.prefill_tokens > n,
        Some(PrefillThreshold::FractionOfBatch(frac)) => slot
            .max_batched_tokens
            .is_some_and(|b| slot.load.prefill_tokens as f64 > frac * b as f64),
        None => false,
    }
}

impl Scheduler {
    /// Fills `scratch.eligible` with the slots that pass every filter, or says which filter
    /// left none.
    fn collect_eligible(&mut self, req: &SelectRequest<'_>) -> Result<(), SelectError> {
        let workers = &self.workers;
        let mut out = std::mem::take(&mut self.scratch.eligible);
        out.clear();
        if workers.live.is_empty() {
            self.scratch.eligible = out;
            return Err(SelectError::NoEndpoints {
                stage: FilterStage::Registered,
            });
        }
        let allowed = req.allowed_worker_ids;
        let allowed_set: Option<FxHashMap<WorkerId, ()>> = allowed
            .filter(|a| a.len() > 16)
            .map(|a| a.iter().map(|&w| (w, ())).collect());
        let is_allowed = |w: WorkerId| match (&allowed_set, allowed) {
            (Some(set), _) => set.contains_key(&w),
            (None, Some(list)) => list.contains(&w),
            (None, None) => true,
        };

        let source: &[u32] = match req.pinned_worker {
            Some(w) => {
                if !is_allowed(w) {
                    self.scratch.eligible = out;
                    return Err(SelectError::PinnedWorkerNotAllowed { worker_id: w });
                }
                let Some(ranks) = workers.ranks_of.get(&w) else {
                    self.scratch.eligible = out;
                    return Err(SelectError::PinnedWorkerUnknown { worker_id: w });
                };
                if let Some(r) = req.pinned_dp_rank {
                    let keys = ranks
                        .iter()
                        .filter_map(|&i| workers.slot(i))
                        .map(|s| s.key.dp_rank);
                    let (start, end) =
                        keys.fold((DpRank::MAX, 0), |(lo, hi), r| (lo.min(r), hi.max(r + 1)));
                    if !(start..end).contains(&r) {
                        self.scratch.eligible = out;
                        return Err(SelectError::DpRankOutOfRange {
                            worker_id: w,
                            dp_rank: r,
                            start,
                            end,
                        });
                    }
                }
                ranks
            }
            None => &workers.live,
        };

        let required = required_mask(req.constraints, &workers.taints);
        let avoided = match req.pinned_worker {
            Some(_) => &[][..],
            None => req.avoided_worker_ids,
        };
        let mut fallback = std::mem::take(&mut self.scratch.avoided);
        fallback.clear();
        let (mut passed_allowed, mut passed_rank, mut passed_taints) = (0usize, 0usize, 0usize);
        for &idx in source {
            let Some(slot) = workers.slot(idx) else {
                continue;
            };
            if !is_allowed(slot.key.worker_id) {
                continue;
            }
            passed_allowed += 1;
            if req.pinned_dp_rank.is_some_and(|r| r != slot.key.dp_rank) {
                continue;
            }
            passed_rank += 1;
            match required {
                Some(mask) if slot.taints & mask == mask => {}
                _ => continue,
            }
            passed_taints += 1;
            if above(slot, &self.config.busy) {
                continue;
            }
            if avoided.contains(&slot.key.worker_id) {
                fallback.push(idx);
                continue;
            }
            out.push(idx);
        }
        if out.is_empty() {
            // Every worker left is one to avoid: a failing worker beats no worker.
            std::mem::swap(&mut out, &mut fallback);
        }
        self.scratch.avoided = fallback;
        let empty = out.is_empty();
        self.scratch.eligible = out;
        if !empty {
            return Ok(());
        }
        Err(if passed_allowed == 0 {
            SelectError::NoEndpoints {
                stage: FilterStage::AllowedWorkerIds,
            }
        } else if passed_rank == 0 {
            SelectError::NoEndpoints {
                stage: FilterStage::DpRank,
            }
        } else if passed_taints == 0 {
            SelectError::NoEndpoints {
                stage: FilterStage::RequiredTaints,
            }
        } else if let Some(worker_id) = req.pinned_worker {
            SelectError::PinnedWorkerOverloaded {
                worker_id,
                dp_rank: req.pinned_dp_rank,
            }
        } else {
            SelectError::AllEligibleWorkersOverloaded {
                eligible: passed_taints,
            }
        })
    }

    /// Whether the request should wait in the admission queue rather than be routed now: every
    /// eligible worker is above the queue threshold, or above the busy thresholds. Other
    /// eligibility errors are returned as they would be by [`Scheduler::select`].
    pub fn should_queue(&mut self, req: &SelectRequest<'_>) -> Result<bool, SelectError> {
        match self.collect_eligible(req) {
            Ok(()) => {}
            Err(
                SelectError::AllEligibleWorkersOverloaded { .. }
                | SelectError::PinnedWorkerOverloaded { .. },
            ) => return Ok(true),
            Err(e) => return Err(e),
        }
        let t = &self.config.queue_threshold;
        if t.decode_blocks_fraction.is_none() && t.prefill_tokens.is_none() {
            return Ok(false);
        }
        let workers = &self.workers;
        Ok(self
            .scratch
            .eligible
            .iter()
            .filter_map(|&i| workers.slot(i))
            .all(|s| above(s, t)))
    }

    /// Chooses a worker for `req`. Temperature 0 takes the cheapest candidate, breaking ties
    /// uniformly at random; temperature `T > 0` samples with probability proportional to
    /// `exp(-(c - c_min) / ((c_max - c_min) * T))` (uniform when all costs are equal).
    ///
    /// Selection does not record load: call [`Scheduler::add_request`] once the request is
    /// actually sent.
    pub fn select<R: Rng + ?Sized>(
        &mut self,
        req: &SelectRequest<'_>,
        rng: &mut R,
    ) -> Result<Decision<'_>, SelectError> {
        match self.select_inner(req, rng) {
            Ok(i) => {
                self.metrics_ref().decisions.fetch_add(1, Ordering::Relaxed);
                let candidates = &self.scratch.candidates;
                let chosen = candidates[i];
                let temperature =
                    effective_temperature(self.config.temperature, req.overrides).unwrap_or(0.0);
                tracing::debug!(
                    request = ?req.request_id,
                    chosen = %chosen,
                    candidates = %CandidateList(candidates),
                    temperature,
                    prefill_load_scale = self.scratch.prefill_load_scale,
                    "selected worker: cost = prefill_load_scale * max(prefill - (credit * overlap + host_weight * host + disk_weight * disk), 0) + decode, credit = overlap_credit * share^exponent"
                );
                Ok(Decision {
                    chosen,
                    candidates,
                    temperature,
                    prefill_load_scale: self.scratch.prefill_load_scale,
                })
            }
            Err(e) => {
                self.metrics_ref()
                    .selection_errors
                    .fetch_add(1, Ordering::Relaxed);
                tracing::debug!(request = ?req.request_id, error = %e, "worker selection failed");
                Err(e)
            }
        }
    }

    fn select_inner<R: Rng + ?Sized>(
        &mut self,
        req: &SelectRequest<'_>,
        rng: &mut R,
    ) -> Result<usize, SelectError> {
        let mut weights = req.weights.unwrap_or(self.config.cost);
        if let Some(o) = req.overrides {
            weights = weights.with_override(o);
        }
        if req.weights.is_some() || req.overrides.is_some() {
            weights.validate()?;
        }
        let temperature = effective_temperature(self.config.temperature, req.overrides)?;
        self.collect_eligible(req)?;
        self.score(req, &weights);
        let costs = &self.scratch.candidates;
        Ok(if temperature == 0.0 {
            pick_min(costs, rng)
        } else {
            pick_softmax(costs, temperature, &mut self.scratch.weights, rng)
        })
    }

    /// Fills `scratch.candidates` with the cost of every eligible slot.
    fn score(&mut self, req: &SelectRequest<'_>, w: &CostWeights) {
        let workers = &self.workers;
        let s = &mut self.scratch;
        let n_slots = workers.slots.len();
        if s.marks.len() < n_slots {
            s.marks.resize(n_slots, Mark::default());
        }
        s.generation = s.generation.wrapping_add(1);
        if s.generation == 0 {
            // After 2^32 selections the stamps wrap: clear them once.
            s.marks.fill(Mark::default());
            s.generation = 1;
        }
        let generation = s.generation;
        let marks = &mut s.marks[..];
        for (worker, blocks) in req.overlaps {
            if let Some(&idx) = workers.slot_of.get(worker) {
                marks[idx as usize].current(generation).overlap = *blocks;
            }
        }
        for t in req.lower_tiers {
            if let Some(&idx) = workers.slot_of.get(&t.worker) {
                let mark = marks[idx as usize].current(generation);
                match t.tier {
                    StorageTier::HostPinned => mark.host = mark.host.saturating_add(t.blocks),
                    StorageTier::Disk | StorageTier::External => {
                        mark.disk = mark.disk.saturating_add(t.blocks);
                    }
                    StorageTier::Device => {}
                }
            }
        }
        if w.assume_kv_reuse {
            for h in req.block_hashes {
                if let Some(holders) = self.requests.holders.get(h) {
                    for held in holders {
                        marks[held.slot as usize].current(generation).active += 1;
                    }
                }
            }
        }
        s.preferred.clear();
        let has_preferences = req
            .constraints
            .is_some_and(|c| !c.preferred_taints.is_empty());
        if let Some(c) = req.constraints {
            for (name, &weight) in &c.preferred_taints {
                // A preferred taint that no worker carries matches nobody.
                if let Some(bit) = workers.taints.get(name) {
                    s.preferred.push((bit, f64::from(weight)));
                }
            }
        }

        let block_size = f64::from(self.config.block_size);
        let tiers = self.config.cache_hit_weights;
        let prompt_blocks = req.block_hashes.len() as f64;
        // The fleet's prefill backlog, only when the scale depends on it.
        let scale = if w.loaded_prefill_load_scale == w.prefill_load_scale {
            w.prefill_load_scale
        } else {
            let (outstanding, budget) = s.eligible.iter().filter_map(|&i| workers.slot(i)).fold(
                (0u64, 0u64),
                |(p, b), slot| {
                    let budget = slot
                        .max_batched_tokens
                        .unwrap_or(DEFAULT_BATCH_BUDGET_TOKENS);
                    (p + slot.load.prefill_tokens, b + budget)
                },
            );
            w.prefill_scale_at(outstanding as f64 / budget.max(1) as f64)
        };
        s.prefill_load_scale = scale;
        // The eligible workers' least outstanding prefill, only when the credit decays with it.
        let floor_prefill = if w.overlap_credit_decay > 0.0 && w.track_prefill_tokens {
            s.eligible
                .iter()
                .filter_map(|&i| workers.slot(i))
                .map(|slot| slot.load.prefill_tokens)
                .min()
                .unwrap_or(0)
        } else {
            0
        };
        s.candidates.clear();
        for &idx in &s.eligible {
            let Some(slot) = workers.slot(idx) else {
                continue;
            };
            let mark = s.marks[idx as usize];
            let mark = if mark.generation == generation {
                mark
            } else {
                Mark::default()
            };
            let (overlap_blocks, active) = (mark.overlap, mark.active);
            let prefill_blocks = if w.track_prefill_tokens {
                (slot.load.prefill_tokens + req.isl_tokens) as f64 / block_size
            } else {
                0.0
            };
            let excess = slot.load.prefill_tokens.saturating_sub(floor_prefill) as f64 / block_size;
            let credit = w.credit(overlap_blocks, req.block_hashes.len())
                * w.credit_decay_at(excess, req.block_hashes.len());
            // Exactly 0.0 without lower-tier blocks (or with zero weights), so the cost is then
            // bit for bit the device-only one.
            let lower_credit =
                tiers.host * f64::from(mark.host) + tiers.disk * f64::from(mark.disk);
            let credited_prefill_blocks =
                (prefill_blocks - (credit * f64::from(overlap_blocks) + lower_credit)).max(0.0);
            let already_active = f64::from(active).min(prompt_blocks);
            let decode_blocks = slot.load.decode_blocks() + (prompt_blocks - already_active);
            let taint_multiplier = if has_preferences {
                let bias: f64 = s
                    .preferred
                    .iter()
                    .filter(|(bit, _)| slot.taints & bit != 0)
                    .map(|(_, w)| w)
                    .sum();
                (-bias.tanh()).exp()
            } else {
                1.0
            };
            let cost = (scale * credited_prefill_blocks + decode_blocks) * taint_multiplier;
            s.candidates.push(CandidateCost {
                worker: slot.key,
                overlap_blocks,
                host_blocks: mark.host,
                disk_blocks: mark.disk,
                weighted_overlap_blocks: f64::from(overlap_blocks) + lower_credit,
                credit,
                prefill_blocks,
                credited_prefill_blocks,
                decode_blocks,
                taint_multiplier,
                cost,
            });
        }
    }
}

/// Index of the cheapest candidate; ties broken uniformly (reservoir sampling over the ties).
pub(crate) fn pick_min<R: Rng + ?Sized>(costs: &[CandidateCost], rng: &mut R) -> usize {
    let mut best = 0;
    let mut best_cost = f64::INFINITY;
    let mut ties = 0u32;
    for (i, c) in costs.iter().enumerate() {
        if c.cost < best_cost {
            best = i;
            best_cost = c.cost;
            ties = 1;
        } else if c.cost == best_cost {
            ties += 1;
            if rng.gen_range(0..ties) == 0 {
                best = i;
            }
        }
    }
    best
}

/// Index sampled with probability `exp(-(c - c_min) / ((c_max - c_min) * t))`, normalised.
pub(crate) fn pick_softmax<R: Rng + ?Sized>(
    costs: &[CandidateCost],
    t: f64,
    weights: &mut Vec<f64>,
    rng: &mut R,
) -> usize {
    let (lo, hi) = costs
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), c| {
            (lo.min(c.cost), hi.max(c.cost))
        });
    let spread = hi - lo;
    // Equal costs (or a NaN/infinite spread) carry no preference: sample uniformly.
    if !(spread.is_finite() && spread > 0.0) {
        return rng.gen_range(0..costs.len());
    }
    let scale = 1.0 / (spread * t);
    weights.clear();
    weights.extend(costs.iter().map(|c| (-(c.cost - lo) * scale).exp()));
    let total: f64 = weights.iter().sum();
    let mut target = rng.gen_range(0.0..total);
    for (i, &p) in weights.iter().enumerate() {
        if target < p {
            return i;
        }
        target -= p;
    }
    costs.len() - 1
}

/// Formats a candidate list on one line (only evaluated when debug logging is on).
struct CandidateList<'a>(&'a [CandidateCost]);

impl fmt::Display for CandidateList<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, c) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            write!(f, "{c}")?;
        }
        Ok(())
    }
}
