//! The answer to an overlap query.

use kvroute_protocols::WorkerWithDpRank;
use kvroute_protocols::kv_events::StorageTier;

use crate::fasthash::FastMap;

/// For each worker, how much of a request's prefix it already holds, tier by tier.
///
/// Only workers that hold at least the first block (in some tier) appear. Device-tier (GPU)
/// matches, the ones that save prefill outright, are in `scores`. As in the reference, a worker's
/// match goes on in the slower tiers where its device match ends: the host tier holds the next
/// run of blocks, the disk tier the run after that, then the external tier; each run is reported
/// separately in `lower_tiers` so a cost model can weigh the tiers differently. A block held only
/// in a tier the walk has already left (on the host after a disk run, say) does not count.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OverlapScores {
    /// Leading blocks held in device memory, per worker and rank.
    pub scores: FastMap<WorkerWithDpRank, u32>,
    /// Per worker and slower tier (host, disk, external), the run of blocks held there that
    /// continues the worker's match in the faster tiers; only runs of at least one block.
    pub lower_tiers: Vec<TierScore>,
    /// Total device blocks held by each worker that appears in `scores`.
    pub tree_sizes: FastMap<WorkerWithDpRank, usize>,
}

/// A worker's run of blocks in one storage tier other than the device, continuing its match in
/// the faster tiers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TierScore {
    /// The worker and rank.
    pub worker: WorkerWithDpRank,
    /// The tier.
    pub tier: StorageTier,
    /// Blocks of the request held in that tier, right after the faster tiers' match.
    pub blocks: u32,
}

impl OverlapScores {
    /// Device-tier leading blocks held by `worker` (0 when absent).
    pub fn score(&self, worker: WorkerWithDpRank) -> u32 {
        self.scores.get(&worker).copied().unwrap_or(0)
    }

    /// Blocks `worker` is credited in `tier` (0 when absent): its leading device blocks, or its
    /// run in a slower tier continuing the faster tiers' match.
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
