//! What each worker holds, for the cost's eviction charge
//! ([`CostWeights::eviction_weight`](kvroute_scheduler::CostWeights::eviction_weight)): the exact
//! index's device blocks for event workers, the predictions for approximate ones.

use kvroute_protocols::WorkerWithDpRank;
use kvroute_sessions::AffinityStore;

use super::KvRouterCore;
use crate::config::KvMode;
use crate::policy::Policy;

impl<S: AffinityStore> KvRouterCore<S> {
    /// Whether the policy's cost charges for evictions, and so reads every worker's block
    /// count ([`kvroute_scheduler::CostWeights::eviction_weight`]).
    pub(super) fn charges_evictions(&self) -> bool {
        let policy = self.config.policy;
        let weights = policy.cost_weights().unwrap_or(self.config.scheduler.cost);
        weights.charges_evictions()
            && !matches!(policy, Policy::RoundRobin | Policy::Random | Policy::Direct)
    }

    /// Fills `scratch.resident` when the policy charges for evictions: every event worker's
    /// device blocks (`prepared`, counted outside the lock, when the request was prepared) and
    /// every approximate worker's predicted ones.
    pub(super) fn count_resident(&mut self, prepared: Option<Vec<(WorkerWithDpRank, u64)>>) {
        self.scratch.resident.clear();
        if !self.charges_evictions() {
            return;
        }
        match prepared {
            Some(counts) => self.scratch.resident = counts,
            None => self.index.device_block_counts(&mut self.scratch.resident),
        }
        let exact = self.scratch.resident.len();
        if self.approx.live_blocks() > 0 {
            self.approx.block_counts(&mut self.scratch.resident);
        }
        // Each worker's count comes from the index of its mode: what the exact index holds of an
        // approximate worker is from before it changed mode, and the reverse.
        let modes = &self.modes;
        let mut i = 0;
        self.scratch.resident.retain(|(w, _)| {
            let predicted = i >= exact;
            i += 1;
            (modes.get(&w.worker_id) == Some(&KvMode::Approximate)) == predicted
        });
    }
}
