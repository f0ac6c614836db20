//! The registered workers: one slot per (worker, dp rank), with capacity and taints.

use kvroute_protocols::{DpRank, WorkerId, WorkerWithDpRank};

use crate::fxhash::FxHashMap;
use crate::slot_load::SlotLoad;

/// Most distinct taint names the scheduler tracks; taints are kept as a bitmask per worker so the
/// required-taint filter costs one AND per candidate.
pub const MAX_TAINTS: usize = 64;

/// A worker as discovery describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerSpec {
    /// The worker instance.
    pub worker_id: WorkerId,
    /// First data-parallel rank the worker serves.
    pub dp_start: DpRank,
    /// Number of data-parallel ranks (at least 1).
    pub dp_size: u32,
    /// KV cache capacity of one rank, in blocks, if the worker reported it.
    pub kv_capacity_blocks: Option<u64>,
    /// Prefill batch budget of one rank (`max_num_batched_tokens`), if reported.
    pub max_batched_tokens: Option<u64>,
    /// Labels that requests may require or prefer (`routing_constraints`).
    pub taints: Vec<String>,
}

impl WorkerSpec {
    /// A worker with one rank (0), unknown capacity and no taints.
    pub fn new(worker_id: WorkerId) -> Self {
        Self {
            worker_id,
            dp_start: 0,
            dp_size: 1,
            kv_capacity_blocks: None,
            max_batched_tokens: None,
            taints: Vec::new(),
        }
    }

    /// The same worker serving ranks `start .. start + size`.
    pub fn with_dp_ranks(mut self, start: DpRank, size: u32) -> Self {
        self.dp_start = start;
        self.dp_size = size;
        self
    }

    /// The same worker with a KV capacity of `blocks` per rank.
    pub fn with_kv_capacity(mut self, blocks: u64) -> Self {
        self.kv_capacity_blocks = Some(blocks);
        self
    }

    /// The same worker with a prefill batch budget of `tokens` per rank.
    pub fn with_max_batched_tokens(mut self, tokens: u64) -> Self {
        self.max_batched_tokens = Some(tokens);
        self
    }

    /// The same worker carrying `taint`.
    pub fn with_taint(mut self, taint: impl Into<String>) -> Self {
        self.taints.push(taint.into());
        self
    }
}

/// Why a worker could not be registered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WorkerError {
    /// The worker id is already registered; remove it first to change its shape.
    #[error("worker {0} is already registered; remove it before registering it again")]
    AlreadyRegistered(WorkerId),
    /// `dp_size` was 0 or the rank range overflows.
    #[error(
        "worker {worker_id}: dp ranks must be start..start+size with size >= 1 and no overflow, got start {start} size {size}"
    )]
    InvalidDpRanks {
        /// The worker.
        worker_id: WorkerId,
        /// The first rank given.
        start: DpRank,
        /// The size given.
        size: u32,
    },
    /// More than [`MAX_TAINTS`] distinct taint names across the fleet.
    #[error("at most {MAX_TAINTS} distinct taint names are supported, {0:?} would be one more")]
    TooManyTaints(String),
}

/// One schedulable unit's static description and live load.
#[derive(Debug, Clone)]
pub(crate) struct Slot {
    pub(crate) key: WorkerWithDpRank,
    pub(crate) taints: u64,
    pub(crate) kv_capacity_blocks: Option<u64>,
    pub(crate) max_batched_tokens: Option<u64>,
    pub(crate) load: SlotLoad,
    /// New blocks routed here lately ([`Workers::churn`]), decayed to [`Self::churn_clock`].
    pub(crate) churn: f64,
    /// [`Workers::allocated`] when `churn` was last brought up to date.
    pub(crate) churn_clock: u64,
}

/// Maps taint names to bit positions.
#[derive(Debug, Default, Clone)]
pub(crate) struct TaintInterner {
    bits: std::collections::HashMap<String, u32>,
}

impl TaintInterner {
    pub(crate) fn intern(&mut self, name: &str) -> Result<u64, WorkerError> {
        if let Some(&bit) = self.bits.get(name) {
            return Ok(1 << bit);
        }
        let bit = self.bits.len();
        if bit >= MAX_TAINTS {
            return Err(WorkerError::TooManyTaints(name.to_owned()));
        }
        self.bits.insert(name.to_owned(), bit as u32);
        Ok(1 << bit)
    }

    /// The bit of a known taint; `None` when no worker ever carried it.
    pub(crate) fn get(&self, name: &str) -> Option<u64> {
        self.bits.get(name).map(|&bit| 1 << bit)
    }
}

/// The slot table: stable slot indices (so block bookkeeping can key on them) plus a dense list
/// of live slots for the selection loop.
#[derive(Debug, Default)]
pub(crate) struct Workers {
    pub(crate) slots: Vec<Option<Slot>>,
    pub(crate) live: Vec<u32>,
    pub(crate) slot_of: FxHashMap<WorkerWithDpRank, u32>,
    pub(crate) ranks_of: FxHashMap<WorkerId, Vec<u32>>,
    free: Vec<u32>,
    pub(crate) taints: TaintInterner,
    /// New blocks routed to any slot since the table was made: the clock by which each slot's
    /// churn decays, so that it is deterministic and needs no time source.
    pub(crate) allocated: u64,
    /// The KV capacity of every live slot whose capacity is known, kept as slots come, go and
    /// report their capacity ([`Self::churn_half_life`]).
    capacity: u64,
}

impl Workers {
    pub(crate) fn add(&mut self, spec: &WorkerSpec) -> Result<(), WorkerError> {
        if self.ranks_of.contains_key(&spec.worker_id) {
            return Err(WorkerError::AlreadyRegistered(spec.worker_id));
        }
        let end = spec.dp_start.checked_add(spec.dp_size);
        if spec.dp_size == 0 || end.is_none() {
            return Err(WorkerError::InvalidDpRanks {
                worker_id: spec.worker_id,
                start: spec.dp_start,
                size: spec.dp_size,
            });
        }
        let mut mask = 0;
        for t in &spec.taints {
            mask |= self.taints.intern(t)?;
        }
        let mut ranks = Vec::with_capacity(spec.dp_size as usize);
        for rank in spec.dp_start..end.unwrap_or(spec.dp_start) {
            let key = WorkerWithDpRank::new(spec.worker_id, rank);
            let slot = Slot {
                key,
                taints: mask,
                kv_capacity_blocks: spec.kv_capacity_blocks,
                max_batched_tokens: spec.max_batched_tokens,
                load: SlotLoad::default(),
                churn: 0.0,
                churn_clock: self.allocated,
            };
            let idx = match self.free.pop() {
                Some(i) => {
                    self.slots[i as usize] = Some(slot);
                    i
                }
                None => {
                    self.slots.push(Some(slot));
                    (self.slots.len() - 1) as u32
                }
            };
            self.slot_of.insert(key, idx);
            self.live.push(idx);
            self.capacity = self
                .capacity
                .wrapping_add(spec.kv_capacity_blocks.unwrap_or(0));
            ranks.push(idx);
        }
        self.ranks_of.insert(spec.worker_id, ranks);
        Ok(())
    }

    /// Unregisters a worker whose load has already been drained; returns whether it existed.
    pub(crate) fn remove(&mut self, worker_id: WorkerId) -> bool {
        let Some(ranks) = self.ranks_of.remove(&worker_id) else {
            return false;
        };
        for idx in ranks {
            if let Some(slot) = self.slots[idx as usize].take() {
                self.slot_of.remove(&slot.key);
                self.capacity = self
                    .capacity
                    .wrapping_sub(slot.kv_capacity_blocks.unwrap_or(0));
            }
            self.live.retain(|&i| i != idx);
            self.free.push(idx);
        }
        true
    }

    #[inline]
    pub(crate) fn slot(&self, idx: u32) -> Option<&Slot> {
        self.slots.get(idx as usize).and_then(Option::as_ref)
    }

    #[inline]
    pub(crate) fn slot_mut(&mut self, idx: u32) -> Option<&mut Slot> {
        self.slots.get_mut(idx as usize).and_then(Option::as_mut)
    }

    /// The half-life of churn, in blocks allocated over the fleet: the KV capacity of every
    /// live slot whose capacity is known, so that a slot's churn counts the new blocks routed
    /// to it over about one lifetime of the fleet's caches. 0 when no capacity is known.
    #[inline]
    pub(crate) fn churn_half_life(&self) -> u64 {
        self.capacity
    }

    /// Sets (or, with `None`, forgets) slot `idx`'s KV capacity; returns whether it exists.
    pub(crate) fn set_kv_capacity(&mut self, idx: u32, blocks: Option<u64>) -> bool {
        let Some(slot) = self.slots.get_mut(idx as usize).and_then(Option::as_mut) else {
            return false;
        };
        // Wrapping, so that an absurd reported capacity cannot panic: the sum stays exact as
        // slots come and go.
        self.capacity = self
            .capacity
            .wrapping_sub(slot.kv_capacity_blocks.unwrap_or(0))
            .wrapping_add(blocks.unwrap_or(0));
        slot.kv_capacity_blocks = blocks;
        true
    }

    /// Records `blocks` new blocks (a routed prompt's blocks not cached there) allocated on
    /// slot `idx`.
    pub(crate) fn record_allocation(&mut self, idx: u32, blocks: u64) {
        let half_life = self.churn_half_life();
        self.allocated = self.allocated.saturating_add(blocks);
        let clock = self.allocated;
        if let Some(slot) = self.slot_mut(idx) {
            slot.churn = decayed(slot.churn, clock - slot.churn_clock, half_life) + blocks as f64;
            slot.churn_clock = clock;
        }
    }

    /// How many new blocks have been routed to `slot` lately: each block weighs half as much
    /// once `half_life` ([`Self::churn_half_life`]) more have been allocated over the fleet.
    /// A worker whose cache is full evicts one block of what it holds for each new one, so
    /// the higher its churn, the more recently used the least recently used of its blocks are.
    #[inline]
    pub(crate) fn churn(&self, slot: &Slot, half_life: u64) -> f64 {
        decayed(slot.churn, self.allocated - slot.churn_clock, half_life)
    }
}

/// `value` after `elapsed` blocks of a `half_life` (no decay when the half-life is 0).
#[inline]
fn decayed(value: f64, elapsed: u64, half_life: u64) -> f64 {
    if half_life == 0 || elapsed == 0 || value == 0.0 {
        return value;
    }
    value * (-(elapsed as f64 / half_life as f64) * std::f64::consts::LN_2).exp()
}
