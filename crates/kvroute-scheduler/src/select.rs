//! Eligibility, the cost model and worker selection.
//!
//! Filters run in a fixed order, each with its own error when it leaves nobody:
//! `allowed_worker_ids`, the exact pin (worker, optional dp rank), dp rank ranges, required
//! taints, then the busy thresholds. Every survivor gets the cost
//! `scale * max(prefill_blocks - (credit * overlap_blocks + host * host_blocks + disk *
//! disk_blocks), 0) + decode_cost(decode_blocks)`
//! times its preferred-taint multiplier, where, as in the reference, `prefill_blocks` counts the
//! worker's outstanding prefill (requests not yet past their first token) plus this whole prompt,
//! and `decode_blocks` counts the worker's active blocks plus this prompt's blocks not already
//! active there. `scale` is `prefill_load_scale` for the reference's cost and rises with the
//! eligible workers' prefill backlog for the load-adaptive one ([`CostWeights::prefill_scale_at`]);
//! `credit` is `overlap_credit`, optionally falling with the share of the prompt that is cached
//! ([`CostWeights::credit`]) and with the worker's prefill backlog above the eligible workers'
//! least ([`CostWeights::credit_decay_at`]); `host_blocks` and `disk_blocks` are the worker's runs of prompt
//! blocks in slower tiers continuing its device prefix, credited by the
//! [`CacheHitWeights`](crate::CacheHitWeights) (0.75 and 0.25 by default); `decode_cost` weighs
//! decode blocks lightly while the worker's decode load is within a tolerance of the eligible
//! workers' mean, when the weights ask for it ([`CostWeights::decode_cost`]). With
//! [`CostWeights::capacity_credit`], `overlap_blocks` counts only the cached blocks the worker can
//! keep until it admits the prompt, given its KV capacity and the blocks its active requests hold
//! (`unkept_blocks`). With [`CostWeights::eviction_weight`], `scale * eviction_weight *
//! evicted_blocks` is added, where `evicted_blocks` is how many more blocks of other prompts' idle
//! cache the prompt's uncached blocks would evict there than on the eligible worker with the most
//! free KV capacity (`evicted_blocks`). With [`CostWeights::churn_eviction_weight`], `scale *
//! churn_eviction_weight * churn_share * churn_evicted_blocks` is added too, where
//! `churn_evicted_blocks` is how many blocks of idle cache the prompt's uncached blocks would
//! evict there at all, and `churn_share` how far the worker's churn (new blocks routed to it
//! lately) is above the eligible workers' least, over their mean, capped at 1. With
//! [`CostWeights::occupancy_weight`], `scale * occupancy_weight * occupancy_share * new_blocks *
//! (new_blocks / prompt_blocks)^2` is added too, where `new_blocks` are the prompt's blocks not
//! cached there and `occupancy_share` how much fuller the worker's KV cache is than the
//! emptiest eligible worker's, as fractions of their capacities.

use std::fmt;
use std::sync::atomic::Ordering;

use kvroute_protocols::kv_events::StorageTier;
use kvroute_protocols::{DpRank, RoutingConstraints, WorkerId};
use rand::Rng;

use crate::config::{
    CacheHitWeights, CostWeights, DEFAULT_BATCH_BUDGET_TOKENS, LoadThresholds, PrefillThreshold,
    effective_temperature,
};
use crate::decision::{CandidateCost, Decision, FilterStage, SelectError, SelectRequest};
use crate::fxhash::FxHashMap;
use crate::scheduler::Scheduler;
use crate::scratch::Mark;
use crate::workers::{Slot, Workers};

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
                    "selected worker: cost = prefill_load_scale * max(prefill - (credit * overlap + host_weight * host + disk_weight * disk), 0) + weighted decode, credit = overlap_credit * share^exponent"
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
        let generation = self.mark(req, w);
        let workers = &self.workers;
        let s = &mut self.scratch;
        let has_preferences = req
            .constraints
            .is_some_and(|c| !c.preferred_taints.is_empty());
        let scale = fleet_prefill_scale(workers, &s.eligible, w);
        s.prefill_load_scale = scale;
        let terms = CostTerms {
            req,
            workers,
            w,
            preferred: &s.preferred,
            has_preferences,
            block_size: f64::from(self.config.block_size),
            tiers: self.config.cache_hit_weights,
            prompt_blocks: req.block_hashes.len() as f64,
            scale,
            floor_prefill: floor_prefill(workers, &s.eligible, w),
            mean_decode: mean_decode(workers, &s.eligible, w),
            max_room: max_room(workers, &s.eligible, &s.marks, generation, w),
            floor_fill: floor_fill(workers, &s.eligible, &s.marks, generation, w),
            churn: ChurnTerms::of(workers, &s.eligible, w),
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
            s.candidates.push(terms.cost(slot, mark));
        }
    }

    /// Stamps, per slot, this request's overlap, lower-tier and already-active blocks with a new
    /// generation (returned), and collects the preferred taints some worker carries.
    #[inline]
    fn mark(&mut self, req: &SelectRequest<'_>, w: &CostWeights) -> u32 {
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
        if w.charges_evictions() {
            for (worker, blocks) in req.resident_blocks {
                if let Some(&idx) = workers.slot_of.get(worker) {
                    marks[idx as usize].current(generation).resident = *blocks;
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
        if let Some(c) = req.constraints {
            for (name, &weight) in &c.preferred_taints {
                // A preferred taint that no worker carries matches nobody.
                if let Some(bit) = workers.taints.get(name) {
                    s.preferred.push((bit, f64::from(weight)));
                }
            }
        }
        generation
    }
}

/// The prefill scale: the fleet's prefill backlog (of the eligible slots) is read only when the
/// scale depends on it.
#[inline]
fn fleet_prefill_scale(workers: &Workers, eligible: &[u32], w: &CostWeights) -> f64 {
    if w.loaded_prefill_load_scale == w.prefill_load_scale {
        return w.prefill_load_scale;
    }
    let (outstanding, budget) =
        eligible
            .iter()
            .filter_map(|&i| workers.slot(i))
            .fold((0u64, 0u64), |(p, b), slot| {
                let budget = slot
                    .max_batched_tokens
                    .unwrap_or(DEFAULT_BATCH_BUDGET_TOKENS);
                (p + slot.load.prefill_tokens, b + budget)
            });
    w.prefill_scale_at(outstanding as f64 / budget.max(1) as f64)
}

/// The eligible workers' mean decode blocks, without this prompt's, only when the decode cost
/// depends on it ([`CostWeights::decode_cost`]).
#[inline]
fn mean_decode(workers: &Workers, eligible: &[u32], w: &CostWeights) -> f64 {
    if w.balanced_decode_weight >= 1.0 {
        return 0.0;
    }
    let (n, sum) = eligible
        .iter()
        .filter_map(|&i| workers.slot(i))
        .fold((0u32, 0.0f64), |(n, d), slot| {
            (n + 1, d + slot.load.decode_blocks())
        });
    sum / f64::from(n.max(1))
}

/// The most free KV capacity of an eligible worker whose capacity is known (`None` when none
/// is), only when the weights charge for evictions ([`CostWeights::eviction_weight`]).
#[inline]
fn max_room(
    workers: &Workers,
    eligible: &[u32],
    marks: &[Mark],
    generation: u32,
    w: &CostWeights,
) -> Option<u64> {
    if w.eviction_weight == 0.0 {
        return None;
    }
    resident(workers, eligible, marks, generation)
        .filter_map(|(slot, blocks)| room(slot, blocks))
        .max()
}

/// The least fill of an eligible worker whose capacity is known (`None` when none is), only
/// when the weights charge for occupancy ([`CostWeights::occupancy_weight`]).
#[inline]
fn floor_fill(
    workers: &Workers,
    eligible: &[u32],
    marks: &[Mark],
    generation: u32,
    w: &CostWeights,
) -> Option<f64> {
    if w.occupancy_weight == 0.0 {
        return None;
    }
    resident(workers, eligible, marks, generation)
        .filter_map(|(slot, blocks)| fill(slot, blocks))
        .min_by(f64::total_cmp)
}

/// Each eligible slot with the blocks it holds, as this request's marks (`generation`) count
/// them (0 where unmarked).
#[inline]
fn resident<'a>(
    workers: &'a Workers,
    eligible: &'a [u32],
    marks: &'a [Mark],
    generation: u32,
) -> impl Iterator<Item = (&'a Slot, u64)> + 'a {
    eligible.iter().filter_map(move |&i| {
        let slot = workers.slot(i)?;
        let mark = marks.get(i as usize).filter(|m| m.generation == generation);
        Some((slot, mark.map_or(0, |m| m.resident)))
    })
}

/// The share of `slot`'s KV capacity taken (0 to 1; see [`room`]), `None` when the capacity is
/// unknown or zero.
#[inline]
fn fill(slot: &Slot, resident: u64) -> Option<f64> {
    let capacity = slot.kv_capacity_blocks.filter(|&c| c > 0)?;
    let free = room(slot, resident)?;
    Some((capacity - free) as f64 / capacity as f64)
}

/// The KV capacity `slot` has free: its capacity less the blocks it holds, `resident` as the
/// indexer counts them or the blocks of its active requests where those are more (requests
/// routed there whose blocks the engine has not stored yet). `None` when the capacity is
/// unknown.
#[inline]
fn room(slot: &Slot, resident: u64) -> Option<u64> {
    let capacity = slot.kv_capacity_blocks?;
    Some(capacity.saturating_sub(resident.max(slot.load.held_blocks)))
}

/// The eligible workers' churn, for [`CostWeights::churn_eviction_weight`].
#[derive(Debug, Clone, Copy)]
struct ChurnTerms {
    half_life: u64,
    /// The least churn of an eligible worker of known capacity.
    floor: f64,
    /// Their mean churn (positive).
    mean: f64,
}

impl ChurnTerms {
    /// The eligible workers' churn, only when the weights charge for it and some eligible
    /// worker of known capacity has had new blocks routed to it lately.
    #[inline]
    fn of(workers: &Workers, eligible: &[u32], w: &CostWeights) -> Option<Self> {
        if w.churn_eviction_weight == 0.0 {
            return None;
        }
        let half_life = workers.churn_half_life();
        let (n, sum, floor) = eligible
            .iter()
            .filter_map(|&i| workers.slot(i))
            .filter(|slot| slot.kv_capacity_blocks.is_some())
            .map(|slot| workers.churn(slot, half_life))
            .fold((0u32, 0.0f64, f64::INFINITY), |(n, sum, floor), c| {
                (n + 1, sum + c, floor.min(c))
            });
        let mean = sum / f64::from(n.max(1));
        (mean > 0.0).then_some(Self {
            half_life,
            floor,
            mean,
        })
    }

    /// How far `slot`'s churn is above the floor, over the mean, capped at 1.
    #[inline]
    fn share(&self, workers: &Workers, slot: &Slot) -> f64 {
        ((workers.churn(slot, self.half_life) - self.floor) / self.mean).clamp(0.0, 1.0)
    }
}

/// The eligible workers' least outstanding prefill, only when the credit decays with it.
#[inline]
fn floor_prefill(workers: &Workers, eligible: &[u32], w: &CostWeights) -> u64 {
    if w.overlap_credit_decay > 0.0 && w.track_prefill_tokens {
        eligible
            .iter()
            .filter_map(|&i| workers.slot(i))
            .map(|slot| slot.load.prefill_tokens)
            .min()
            .unwrap_or(0)
    } else {
        0
    }
}

/// What every candidate's cost in one selection shares.
struct CostTerms<'a> {
    req: &'a SelectRequest<'a>,
    workers: &'a Workers,
    w: &'a CostWeights,
    /// Preferred taints some worker carries, as (bit, weight).
    preferred: &'a [(u64, f64)],
    has_preferences: bool,
    block_size: f64,
    tiers: CacheHitWeights,
    prompt_blocks: f64,
    scale: f64,
    floor_prefill: u64,
    mean_decode: f64,
    /// The most free KV capacity of an eligible worker, when evictions are charged.
    max_room: Option<u64>,
    /// The least fill of an eligible worker, when occupancy is charged.
    floor_fill: Option<f64>,
    /// The eligible workers' churn, when evictions on full workers are charged by it.
    churn: Option<ChurnTerms>,
}

impl CostTerms<'_> {
    /// The cost of `slot`, given its marks for this request.
    #[inline]
    fn cost(&self, slot: &Slot, mark: Mark) -> CandidateCost {
        let (req, w) = (self.req, self.w);
        let (block_size, tiers, prompt_blocks) = (self.block_size, self.tiers, self.prompt_blocks);
        let (overlap_blocks, active) = (mark.overlap, mark.active);
        let prefill_blocks = if w.track_prefill_tokens {
            (slot.load.prefill_tokens + req.isl_tokens) as f64 / block_size
        } else {
            0.0
        };
        let excess =
            slot.load.prefill_tokens.saturating_sub(self.floor_prefill) as f64 / block_size;
        let unkept = if w.capacity_credit {
            unkept_blocks(slot, req.block_hashes.len() as u64, overlap_blocks, active)
        } else {
            0
        };
        let kept = overlap_blocks - unkept;
        let credit = w.credit(kept, req.block_hashes.len())
            * w.credit_decay_at(excess, req.block_hashes.len());
        // Exactly 0.0 without lower-tier blocks (or with zero weights), so the cost is then
        // bit for bit the device-only one.
        let lower_credit = tiers.host * f64::from(mark.host) + tiers.disk * f64::from(mark.disk);
        let credited_prefill_blocks =
            (prefill_blocks - (credit * f64::from(kept) + lower_credit)).max(0.0);
        let already_active = f64::from(active).min(prompt_blocks);
        let decode_blocks = slot.load.decode_blocks() + (prompt_blocks - already_active);
        let taint_multiplier = if self.has_preferences {
            let bias: f64 = self
                .preferred
                .iter()
                .filter(|(bit, _)| slot.taints & bit != 0)
                .map(|(_, w)| w)
                .sum();
            (-bias.tanh()).exp()
        } else {
            1.0
        };
        let weighted_decode_blocks = w.decode_cost(decode_blocks, self.mean_decode);
        // Without a charge (`max_room` and `churn` are `None`) no candidate's room is read.
        let new_blocks = (req.block_hashes.len() as u64).saturating_sub(overlap_blocks.into());
        let here = if self.max_room.is_some() || self.churn.is_some() {
            room(slot, mark.resident)
        } else {
            None
        };
        let evicted = match (self.max_room, here) {
            (Some(best), Some(here)) => evicted_blocks(new_blocks, here, best),
            _ => 0,
        };
        let (churn_share, churn_evicted) = match (&self.churn, here) {
            (Some(churn), Some(here)) => (
                churn.share(self.workers, slot),
                new_blocks.saturating_sub(here),
            ),
            _ => (0.0, 0),
        };
        // How much fuller than the emptiest, and the new blocks weighed by the square of the
        // prompt's new share; read only when occupancy is charged.
        let (occupancy_share, occupied_blocks) = match self.floor_fill {
            Some(floor) => {
                let share = fill(slot, mark.resident).map_or(0.0, |f| (f - floor).max(0.0));
                let new = new_blocks as f64;
                let new_share = if prompt_blocks > 0.0 {
                    new / prompt_blocks
                } else {
                    0.0
                };
                (share, share * new * new_share * new_share)
            }
            None => (0.0, 0.0),
        };
        // Exactly 0.0 without a charge, so the cost is then bit for bit the one before it.
        let eviction = w.eviction_weight * evicted as f64
            + w.churn_eviction_weight * churn_share * churn_evicted as f64
            + w.occupancy_weight * occupied_blocks;
        let cost = (self.scale * (credited_prefill_blocks + eviction) + weighted_decode_blocks)
            * taint_multiplier;
        CandidateCost {
            worker: slot.key,
            overlap_blocks,
            unkept_blocks: unkept,
            host_blocks: mark.host,
            disk_blocks: mark.disk,
            weighted_overlap_blocks: f64::from(overlap_blocks) + lower_credit,
            credit,
            prefill_blocks,
            credited_prefill_blocks,
            decode_blocks,
            weighted_decode_blocks,
            evicted_blocks: evicted,
            churn_evicted_blocks: churn_evicted,
            churn_share,
            new_blocks,
            occupancy_share,
            taint_multiplier,
            cost,
        }
    }
}

/// How many more blocks of idle cache allocating `new_blocks` evicts on a worker with `room` free
/// blocks than on one with `best_room` (at least `room`): what does not fit evicts, up to the
/// whole allocation.
#[inline]
fn evicted_blocks(new_blocks: u64, room: u64, best_room: u64) -> u64 {
    let evicts = |free: u64| new_blocks.saturating_sub(free);
    evicts(room).saturating_sub(evicts(best_room))
}

/// How many of a prompt's `overlap` cached blocks on `slot` the engine cannot keep until it
/// admits the prompt, judged against the worker's KV capacity (0 when it is unknown).
///
/// Admitting the prompt, the engine holds every block of it that its active requests do not
/// already hold (`prompt - active`): the cached ones it reuses and the new ones it computes.
/// What its active requests leave of the capacity (`room`, counting the requests routed there
/// but not yet admitted, whose blocks the engine will hold by then) must take all of them; the
/// blocks short of that are found by evicting idle cached blocks, or by waiting until running
/// requests finish while their decodes and other admissions evict. Either way this prompt's
/// own idle cached prefix (`overlap - active`) is what stands to go, up to the shortfall.
#[inline]
fn unkept_blocks(slot: &Slot, prompt: u64, overlap: u32, active: u32) -> u32 {
    let Some(capacity) = slot.kv_capacity_blocks else {
        return 0;
    };
    let active = active.min(overlap);
    let need = prompt.saturating_sub(u64::from(active));
    let room = capacity.saturating_sub(slot.load.held_blocks);
    let shortfall = need.saturating_sub(room);
    // At most `overlap - active`, a u32.
    shortfall.min(u64::from(overlap - active)) as u32
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
