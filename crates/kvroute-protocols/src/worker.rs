//! Worker identities.

use serde::{Deserialize, Serialize};

/// A worker instance id, as assigned by discovery (Dynamo's `instance_id`).
pub type WorkerId = u64;

/// A data-parallel rank inside one worker. `u32::MAX` on the wire (headers) means "unset".
pub type DpRank = u32;

/// One schedulable unit: a worker and one of its data-parallel ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct WorkerWithDpRank {
    /// The worker instance.
    pub worker_id: WorkerId,
    /// The data-parallel rank inside that worker (0 for workers without data parallelism).
    #[serde(default)]
    pub dp_rank: DpRank,
}

impl WorkerWithDpRank {
    /// A worker and rank.
    pub const fn new(worker_id: WorkerId, dp_rank: DpRank) -> Self {
        Self { worker_id, dp_rank }
    }

    /// A worker without data parallelism (rank 0).
    pub const fn from_worker_id(worker_id: WorkerId) -> Self {
        Self {
            worker_id,
            dp_rank: 0,
        }
    }
}

impl std::fmt::Display for WorkerWithDpRank {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/dp{}", self.worker_id, self.dp_rank)
    }
}
