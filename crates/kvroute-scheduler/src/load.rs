//! Active load per (worker, dp rank): which requests run where, their outstanding prefill tokens,
//! and the KV blocks they hold.
//!
//! A prompt block held by several active requests on one worker is counted once. Blocks held by a
//! single request decay with that request's progress (`1 - generated / expected` once the caller
//! gave an expected output length), as in the reference, because a request near its end will soon
//! release them. All block weights are fixed-point integers so that the totals return exactly to
//! zero when the last request leaves, whatever order things happened in.
//!
//! Who holds a block alone is found in O(1) without per-block owner lists: each block entry keeps
//! its reference count and the wrapping sum of its holders' request indices, and when the count is
//! one that sum *is* the holder.

use std::collections::VecDeque;
use std::collections::hash_map::Entry;
use std::time::Duration;

use kvroute_protocols::WorkerWithDpRank;

use smallvec::SmallVec;

use crate::fxhash::FxHashMap;
use crate::slot_load::FRACTION_ONE;
use crate::workers::Workers;

/// The caller's identifier of an in-flight request (the router maps its own ids onto these).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub u64);

impl std::fmt::Display for RequestId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "req-{}", self.0)
    }
}

/// A request that was routed and is about to be sent to its worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NewRequest<'a> {
    /// The request.
    pub id: RequestId,
    /// Where it was routed.
    pub worker: WorkerWithDpRank,
    /// Prompt length in tokens.
    pub isl_tokens: u64,
    /// Sequence hashes of the prompt's full blocks, in order.
    pub block_hashes: &'a [u64],
    /// Prompt blocks already cached on `worker`'s device (they need no prefill; see
    /// [`crate::Scheduler::add_request_with_cached_tokens`] to count slower tiers' blocks too).
    pub overlap_blocks: u32,
    /// Expected output length, which makes the request's exclusive blocks decay as it generates.
    pub expected_output_tokens: Option<u32>,
}

/// What an active request contributes to its worker's load, to replay it elsewhere (another
/// router replica adds it with [`crate::Scheduler::add_request_with_cached_tokens`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestLoad {
    /// Where it runs.
    pub worker: WorkerWithDpRank,
    /// Prompt tokens still to prefill (zero once its prefill completed).
    pub prefill_tokens: u64,
    /// Sequence hashes of its prompt's full blocks.
    pub block_hashes: Vec<u64>,
    /// Its expected output length, if given.
    pub expected_output_tokens: Option<u32>,
}

/// Why a load operation was refused. None of these change any state.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LoadError {
    /// The worker is not registered (or was removed).
    #[error("worker {0} is not registered with the scheduler")]
    UnknownWorker(WorkerWithDpRank),
    /// The id is already active; each request must be added once.
    #[error("request {0} is already active; request ids must be unique among active requests")]
    DuplicateRequest(RequestId),
    /// The id is not active: never added, already freed, or expired.
    #[error("request {0} is not active (never added, already freed, or expired)")]
    UnknownRequest(RequestId),
}

/// One worker slot's holding of an active block.
#[derive(Debug, Clone, Copy)]
pub(crate) struct BlockRef {
    /// The slot holding the block.
    pub(crate) slot: u32,
    refs: u32,
    /// Wrapping sum of the holders' request indices; equals the holder when `refs == 1`.
    owners: u32,
}

#[derive(Debug)]
struct RequestState {
    id: RequestId,
    slot: u32,
    prompt: Box<[u64]>,
    prefill_tokens: u64,
    output_tokens: u64,
    output_blocks: u64,
    expected_output_tokens: Option<u32>,
    fraction: u64,
    exclusive: u64,
    started_at: Duration,
}

/// All active requests and the block bookkeeping behind [`SlotLoad`].
#[derive(Debug, Default)]
pub(crate) struct Requests {
    slab: Vec<Option<RequestState>>,
    free: Vec<u32>,
    by_id: FxHashMap<RequestId, u32>,
    /// For each active block hash, the slots holding it (for the "already active" count) with
    /// their reference counts: one table lookup a block to add or free a request. Inline up to
    /// two slots: a long prompt adds thousands of blocks, nearly all held by one worker, and a
    /// heap list each (or a second table keyed by slot) cost an allocation or a lookup a block.
    pub(crate) holders: FxHashMap<u64, SmallVec<[BlockRef; 2]>>,
    /// Requests in arrival order, for expiry; freed entries are skipped lazily.
    arrivals: VecDeque<(Duration, RequestId, u32)>,
}

impl Requests {
    pub(crate) fn len(&self) -> usize {
        self.by_id.len()
    }

    pub(crate) fn add(
        &mut self,
        workers: &mut Workers,
        req: &NewRequest<'_>,
        cached_tokens: u64,
        now: Duration,
    ) -> Result<(), LoadError> {
        let Some(&slot_idx) = workers.slot_of.get(&req.worker) else {
            return Err(LoadError::UnknownWorker(req.worker));
        };
        if self.by_id.contains_key(&req.id) {
            return Err(LoadError::DuplicateRequest(req.id));
        }
        let Some(slot) = workers.slot_mut(slot_idx) else {
            return Err(LoadError::UnknownWorker(req.worker));
        };
        let ri = match self.free.pop() {
            Some(i) => i,
            None => {
                self.slab.push(None);
                (self.slab.len() - 1) as u32
            }
        };
        let mut state = RequestState {
            id: req.id,
            slot: slot_idx,
            prompt: req.block_hashes.into(),
            prefill_tokens: req.isl_tokens.saturating_sub(cached_tokens),
            output_tokens: 0,
            output_blocks: 0,
            expected_output_tokens: req.expected_output_tokens,
            fraction: FRACTION_ONE,
            exclusive: 0,
            started_at: now,
        };
        let load = &mut slot.load;
        load.active_requests += 1;
        load.prefill_tokens += state.prefill_tokens;
        for &h in req.block_hashes {
            let holders = self.holders.entry(h).or_default();
            let at = match holders.iter().position(|b| b.slot == slot_idx) {
                Some(at) => at,
                None => {
                    holders.push(BlockRef {
                        slot: slot_idx,
                        refs: 0,
                        owners: 0,
                    });
                    holders.len() - 1
                }
            };
            let entry = &mut holders[at];
            match entry.refs {
                0 => {
                    state.exclusive += 1;
                    load.exclusive_weighted += state.fraction;
                    load.held_blocks += 1;
                }
                1 => {
                    // The block stops being exclusive to its single holder.
                    let p = entry.owners;
                    let prev = if p == ri {
                        &mut state
                    } else {
                        self.slab[p as usize]
                            .as_mut()
                            .expect("block owner is an active request")
                    };
                    prev.exclusive -= 1;
                    load.exclusive_weighted -= prev.fraction;
                    load.shared_blocks += 1;
                }
                _ => {}
            }
            entry.refs += 1;
            entry.owners = entry.owners.wrapping_add(ri);
        }
        self.slab[ri as usize] = Some(state);
        self.by_id.insert(req.id, ri);
        self.arrivals.push_back((now, req.id, ri));
        let new_blocks = (req.block_hashes.len() as u64).saturating_sub(req.overlap_blocks.into());
        workers.record_allocation(slot_idx, new_blocks);
        Ok(())
    }

    pub(crate) fn mark_prefill_completed(
        &mut self,
        workers: &mut Workers,
        id: RequestId,
    ) -> Result<(), LoadError> {
        let ri = *self.by_id.get(&id).ok_or(LoadError::UnknownRequest(id))?;
        let state = self.slab[ri as usize]
            .as_mut()
            .expect("indexed request is present");
        if let Some(slot) = workers.slot_mut(state.slot) {
            slot.load.prefill_tokens -= state.prefill_tokens;
        }
        state.prefill_tokens = 0;
        Ok(())
    }

    pub(crate) fn add_output_tokens(
        &mut self,
        workers: &mut Workers,
        block_size: u32,
        id: RequestId,
        tokens: u64,
    ) -> Result<(), LoadError> {
        let ri = *self.by_id.get(&id).ok_or(LoadError::UnknownRequest(id))?;
        let state = self.slab[ri as usize]
            .as_mut()
            .expect("indexed request is present");
        // A request's slot outlives it: removing a worker frees its requests first.
        let Some(slot) = workers.slot_mut(state.slot) else {
            return Ok(());
        };
        let load = &mut slot.load;
        // Output means the prompt has been prefilled.
        load.prefill_tokens -= state.prefill_tokens;
        state.prefill_tokens = 0;

        state.output_tokens = state.output_tokens.saturating_add(tokens);
        let blocks_now = state.output_tokens / u64::from(block_size);
        let new_blocks = blocks_now - state.output_blocks;
        state.output_blocks = blocks_now;
        state.exclusive += new_blocks;
        load.exclusive_weighted += new_blocks * state.fraction;
        load.held_blocks += new_blocks;

        if let Some(expected) = state.expected_output_tokens.filter(|&e| e > 0) {
            let done = u128::from(state.output_tokens.min(u64::from(expected)));
            let spent = (u128::from(FRACTION_ONE) * done / u128::from(expected)) as u64;
            let fraction = FRACTION_ONE - spent;
            load.exclusive_weighted -= state.exclusive * state.fraction;
            load.exclusive_weighted += state.exclusive * fraction;
            state.fraction = fraction;
        }
        Ok(())
    }

    pub(crate) fn load_of(&self, workers: &Workers, id: RequestId) -> Option<RequestLoad> {
        let ri = *self.by_id.get(&id)?;
        let state = self.slab[ri as usize].as_ref()?;
        Some(RequestLoad {
            worker: workers.slot(state.slot)?.key,
            prefill_tokens: state.prefill_tokens,
            block_hashes: state.prompt.to_vec(),
            expected_output_tokens: state.expected_output_tokens,
        })
    }

    /// The worker of active request `id` and its prompt's sequence hashes, borrowed.
    pub(crate) fn prompt_of(
        &self,
        workers: &Workers,
        id: RequestId,
    ) -> Option<(WorkerWithDpRank, &[u64])> {
        let ri = *self.by_id.get(&id)?;
        let state = self.slab[ri as usize].as_ref()?;
        Some((workers.slot(state.slot)?.key, &state.prompt))
    }

    pub(crate) fn free(&mut self, workers: &mut Workers, id: RequestId) -> Result<(), LoadError> {
        let ri = self
            .by_id
            .remove(&id)
            .ok_or(LoadError::UnknownRequest(id))?;
        let mut state = self.slab[ri as usize]
            .take()
            .expect("indexed request is present");
        self.free.push(ri);
        let Some(slot) = workers.slot_mut(state.slot) else {
            return Ok(());
        };
        let load = &mut slot.load;
        load.active_requests -= 1;
        load.prefill_tokens -= state.prefill_tokens;
        load.exclusive_weighted -= state.output_blocks * state.fraction;
        load.held_blocks -= state.output_blocks;
        state.exclusive -= state.output_blocks;
        let prompt = std::mem::take(&mut state.prompt);
        for &h in prompt.iter() {
            // One table lookup a block: the entry both updates the holder and, when the last
            // one goes, removes the block (`get_mut` then `remove` looked it up twice, and a
            // freed prompt's blocks mostly lose their last holder). std's `entry` reserves room
            // for one key first, so a free can grow the table once, as an insert would.
            let Entry::Occupied(mut held) = self.holders.entry(h) else {
                unreachable!("held block is tracked");
            };
            let holders = held.get_mut();
            let at = holders
                .iter()
                .position(|b| b.slot == state.slot)
                .expect("held block is tracked for its slot");
            let entry = &mut holders[at];
            entry.refs -= 1;
            entry.owners = entry.owners.wrapping_sub(ri);
            let (refs, owners) = (entry.refs, entry.owners);
            match refs {
                0 => {
                    state.exclusive -= 1;
                    load.exclusive_weighted -= state.fraction;
                    load.held_blocks -= 1;
                    holders.swap_remove(at);
                    if holders.is_empty() {
                        held.remove();
                    }
                }
                1 => {
                    // The remaining holder now owns the block alone.
                    let q = owners;
                    let next = if q == ri {
                        &mut state
                    } else {
                        self.slab[q as usize]
                            .as_mut()
                            .expect("block owner is an active request")
                    };
                    next.exclusive += 1;
                    load.exclusive_weighted += next.fraction;
                    load.shared_blocks -= 1;
                }
                _ => {}
            }
        }
        debug_assert_eq!(
            state.exclusive, 0,
            "a freed request must leave no exclusive blocks"
        );
        Ok(())
    }

    /// Frees every request that started at or before `now - ttl`; returns their ids.
    /// Frees the requests tracked for `ttl` or longer at `now`, except those `owned` says
    /// someone still owns: their tracking restarts at `now`.
    pub(crate) fn expire(
        &mut self,
        workers: &mut Workers,
        now: Duration,
        ttl: Duration,
        mut owned: impl FnMut(RequestId) -> bool,
    ) -> Vec<RequestId> {
        let mut expired = Vec::new();
        let mut kept = Vec::new();
        while let Some(&(started, id, ri)) = self.arrivals.front() {
            if started.saturating_add(ttl) > now {
                break;
            }
            self.arrivals.pop_front();
            if !self.is_live(started, id, ri) {
                continue;
            }
            if owned(id) {
                if let Some(Some(state)) = self.slab.get_mut(ri as usize) {
                    state.started_at = now;
                }
                kept.push((now, id, ri));
            } else if self.free(workers, id).is_ok() {
                tracing::warn!(request = %id, "expiring a request nobody freed");
                expired.push(id);
            }
        }
        self.arrivals.extend(kept);
        // Freed requests leave their arrival entries behind; drop them once they dominate.
        if self.arrivals.len() > 2 * self.by_id.len() + 1024 {
            let mut arrivals = std::mem::take(&mut self.arrivals);
            arrivals.retain(|&(started, id, ri)| self.is_live(started, id, ri));
            self.arrivals = arrivals;
        }
        expired
    }

    /// Frees, oldest first, at most `excess` requests on slot `slot_idx` that started before
    /// `started_before` and that `owned` says nobody owns; returns their ids.
    pub(crate) fn reconcile(
        &mut self,
        workers: &mut Workers,
        slot_idx: u32,
        excess: u64,
        started_before: Duration,
        mut owned: impl FnMut(RequestId) -> bool,
    ) -> Vec<RequestId> {
        let mut stale: Vec<(Duration, RequestId)> = self
            .slab
            .iter()
            .flatten()
            .filter(|s| s.slot == slot_idx && s.started_at < started_before)
            .map(|s| (s.started_at, s.id))
            .filter(|&(_, id)| !owned(id))
            .collect();
        stale.sort_unstable();
        let mut freed = Vec::new();
        for (_, id) in stale {
            if freed.len() as u64 >= excess {
                break;
            }
            if self.free(workers, id).is_ok() {
                freed.push(id);
            }
        }
        freed
    }

    fn is_live(&self, started: Duration, id: RequestId, ri: u32) -> bool {
        matches!(&self.slab[ri as usize], Some(s) if s.id == id && s.started_at == started)
    }

    /// The active requests routed to slot `slot_idx`.
    pub(crate) fn on_slot(&self, slot_idx: u32) -> Vec<RequestId> {
        self.slab
            .iter()
            .flatten()
            .filter(|s| s.slot == slot_idx)
            .map(|s| s.id)
            .collect()
    }
}
