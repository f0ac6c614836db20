//! The load figures of one (worker, dp rank) slot: [`SlotLoad`] is what the worker table keeps per
//! slot and the cost model reads, [`WorkerLoad`] the public snapshot of it. `load.rs` keeps them
//! up to date as requests come and go; `workers.rs` only stores them, so neither file needs the
//! other's internals.

/// Fixed-point one for block weights (a block owned by one request weighs `fraction / ONE`).
pub(crate) const FRACTION_ONE: u64 = 1 << 16;

/// Load figures of one (worker, dp rank), as the cost model sees them.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct WorkerLoad {
    /// Requests added and not yet freed or expired.
    pub active_requests: u64,
    /// Prompt tokens still to prefill (zero for a request once its prefill completed).
    pub prefill_tokens: u64,
    /// Distinct blocks held by two or more active requests.
    pub shared_blocks: u64,
    /// Active decode blocks: shared blocks plus single-owner blocks weighted by their owner's
    /// remaining fraction.
    pub decode_blocks: f64,
    /// KV blocks the active requests hold, unweighted: their distinct prompt blocks plus their
    /// whole output blocks (what the engine must keep in memory for them).
    pub held_blocks: u64,
}

/// What one slot's active requests add up to, kept in the worker table and updated by the active
/// requests' bookkeeping (`load.rs`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct SlotLoad {
    pub(crate) active_requests: u64,
    pub(crate) prefill_tokens: u64,
    pub(crate) shared_blocks: u64,
    /// Sum over requests of `exclusive blocks * fraction`, in units of `1 / FRACTION_ONE`.
    pub(crate) exclusive_weighted: u64,
    /// Distinct prompt blocks held plus whole output blocks, unweighted.
    pub(crate) held_blocks: u64,
}

impl SlotLoad {
    #[inline]
    pub(crate) fn decode_blocks(&self) -> f64 {
        self.shared_blocks as f64 + self.exclusive_weighted as f64 / FRACTION_ONE as f64
    }

    pub(crate) fn snapshot(&self) -> WorkerLoad {
        WorkerLoad {
            active_requests: self.active_requests,
            prefill_tokens: self.prefill_tokens,
            shared_blocks: self.shared_blocks,
            decode_blocks: self.decode_blocks(),
            held_blocks: self.held_blocks,
        }
    }
}
