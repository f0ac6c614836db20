//! KV cache events as the router consumes them.
//!
//! An engine tells the router which blocks it cached (`Stored`, chained to a parent block), which it
//! evicted (`Removed`), or that it dropped everything (`Cleared`). Block hashes chosen by the engine
//! are opaque ([`ExternalSequenceBlockHash`]); the router recomputes its own content hash of each
//! block's tokens ([`LocalBlockHash`]) so that requests can be matched against the index.
//!
//! The serde shape follows Dynamo's `KvCacheEvent` so that its workers' events decode unchanged.

use serde::{Deserialize, Serialize};

use crate::{DpRank, WorkerId};

/// The router's content hash of one full block of tokens (xxh3-64, seed 1337, see kvroute-indexer).
///
/// Laid out as a bare `u64` (`bytemuck::Pod`), so a run of them can be compared as plain memory.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    Serialize,
    Deserialize,
    bytemuck::Pod,
    bytemuck::Zeroable,
)]
#[serde(transparent)]
#[repr(transparent)]
pub struct LocalBlockHash(pub u64);

/// The engine's own identifier of a cached block; opaque to the router, unique per worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct ExternalSequenceBlockHash(pub u64);

/// Where a cached block lives on the worker.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum StorageTier {
    /// GPU memory (the default: what engines report today).
    #[default]
    Device,
    /// Pinned host memory (offloaded blocks).
    HostPinned,
    /// Local disk.
    Disk,
    /// A remote or shared store.
    External,
}

impl StorageTier {
    /// Every tier, in order from fastest to slowest.
    pub const ALL: [StorageTier; 4] = [
        StorageTier::Device,
        StorageTier::HostPinned,
        StorageTier::Disk,
        StorageTier::External,
    ];

    /// Dense index of this tier in [`StorageTier::ALL`].
    pub const fn index(self) -> usize {
        self as usize
    }
}

/// A KV cache event attributed to the worker that emitted it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RouterEvent {
    /// The worker that emitted the event.
    pub worker_id: WorkerId,
    /// The storage tier the event is about.
    #[serde(default)]
    pub storage_tier: StorageTier,
    /// The event itself.
    pub event: KvCacheEvent,
}

/// One event from one worker (and data-parallel rank).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvCacheEvent {
    /// Monotonically increasing per worker; a jump reveals lost events.
    pub event_id: u64,
    /// What happened.
    pub data: KvCacheEventData,
    /// The data-parallel rank inside the worker.
    #[serde(default)]
    pub dp_rank: DpRank,
}

/// What happened to the worker's cache.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KvCacheEventData {
    /// Blocks became cached, as a chain continuing `parent_hash` (or starting a sequence).
    Stored(KvCacheStoreData),
    /// Blocks were evicted.
    Removed(KvCacheRemoveData),
    /// Every block was dropped.
    Cleared,
}

/// A chain of newly cached blocks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvCacheStoreData {
    /// The block this chain continues; `None` when the first block starts a sequence.
    pub parent_hash: Option<ExternalSequenceBlockHash>,
    /// The blocks, in sequence order.
    pub blocks: Vec<KvCacheStoredBlockData>,
}

/// One newly cached block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvCacheStoredBlockData {
    /// The engine's identifier of the block.
    pub block_hash: ExternalSequenceBlockHash,
    /// The router's content hash of the block's tokens.
    pub tokens_hash: LocalBlockHash,
}

/// Evicted blocks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvCacheRemoveData {
    /// The engine's identifiers of the evicted blocks.
    pub block_hashes: Vec<ExternalSequenceBlockHash>,
}
