//! Errors of applying events to the index: values, counted, never panics.

use kvroute_protocols::WorkerWithDpRank;
use kvroute_protocols::kv_events::{ExternalSequenceBlockHash, StorageTier};

/// Why (part of) an event could not be applied. The index stays consistent in every case: the
/// offending block is skipped and the rest of the event is applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum IndexError {
    /// A `Stored` chain continues a parent block the worker does not hold (in that tier; a
    /// slower tier's chain may also continue a parent held in any other tier).
    #[error(
        "stored event of {worker} ({tier:?}) continues parent block {parent:?}, which the worker \
         does not hold; expected a parent stored earlier or none"
    )]
    ParentNotFound {
        /// The worker and rank.
        worker: WorkerWithDpRank,
        /// The storage tier.
        tier: StorageTier,
        /// The unknown parent.
        parent: ExternalSequenceBlockHash,
    },
    /// A `Removed` event names a block the worker does not hold.
    #[error(
        "removed event of {worker} ({tier:?}) names block {block:?}, which the worker does not \
         hold; expected a block stored earlier"
    )]
    BlockNotFound {
        /// The worker and rank.
        worker: WorkerWithDpRank,
        /// The storage tier.
        tier: StorageTier,
        /// The unknown block.
        block: ExternalSequenceBlockHash,
    },
    /// A `Stored` event names a block the worker already holds; the first store is kept.
    #[error(
        "stored event of {worker} ({tier:?}) names block {block:?} again; expected each block id \
         stored once until removed"
    )]
    DuplicateStore {
        /// The worker and rank.
        worker: WorkerWithDpRank,
        /// The storage tier.
        tier: StorageTier,
        /// The block stored twice.
        block: ExternalSequenceBlockHash,
    },
}

/// How many errors of each kind the index has seen since it was created.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ErrorCounts {
    /// Stored chains whose parent was unknown (each dropped whole).
    pub parent_not_found: u64,
    /// Removed blocks that were not held.
    pub block_not_found: u64,
    /// Stored blocks that were already held.
    pub duplicate_store: u64,
}
