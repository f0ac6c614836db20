//! The answer to an overlap query.

use kvroute_protocols::WorkerWithDpRank;
use kvroute_protocols::kv_events::StorageTier;

use crate::fasthash::FastMap;

/// For each worker, how many leading blocks of a request it already holds.
///
/// Only workers that hold at least the first block appear. Device-tier (GPU) matches, the ones
/// that save prefill, are in `scores`; matches in slower tiers are reported separately so a
/// cost model can weigh them differently.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OverlapScores {
    /// Leading blocks held in device memory, per worker and rank.
    pub scores: FastMap<WorkerWithDpRank, u32>,
    /// Leading blocks held in each slower tier (host, disk, external), per worker and rank.
    pub lower_tiers: Vec<TierScore>,
    /// Total device blocks held by each worker that appears in `scores`.
    pub tree_sizes: FastMap<WorkerWithDpRank, usize>,
}

/// A worker's leading-block match in one storage tier other than the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TierScore {
    /// The worker and rank.
    pub worker: WorkerWithDpRank,
    /// The tier.
    pub tier: StorageTier,
    /// Leading blocks of the request held in that tier.
    pub blocks: u32,
}

impl OverlapScores {
    /// Device-tier leading blocks held by `worker` (0 when absent).
    pub fn score(&self, worker: WorkerWithDpRank) -> u32 {
        self.scores.get(&worker).copied().unwrap_or(0)
    }

    /// Leading blocks held by `worker` in `tier` (0 when absent).
    pub fn tier_score(&self, worker: WorkerWithDpRank, tier: StorageTier) -> u32 {
        if tier == StorageTier::Device {
            return self.score(worker);
        }
        self.lower_tiers
            .iter()
            .find(|t| t.worker == worker && t.tier == tier)
            .map_or(0, |t| t.blocks)
    }

    /// The longest device-tier match of any worker.
    pub fn max_score(&self) -> u32 {
        self.scores.values().copied().max().unwrap_or(0)
    }
}
