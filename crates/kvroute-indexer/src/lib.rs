//! The KV cache index of kvroute: which worker holds which prefix of which prompt.
//!
//! [`hash`] computes block and sequence hashes exactly as the reference router does. [`KvIndex`]
//! applies workers' KV cache events (`Stored`, `Removed`, `Cleared`, per worker, dp rank and
//! storage tier) and answers overlap queries ([`KvIndex::find_matches`] -> [`OverlapScores`]);
//! it counts bad events instead of panicking, detects lost events ([`GapTracker`]), accounts its
//! memory and dumps itself as events to rebuild from. [`ConcurrentIndex`] lets many threads query
//! while events are applied, split between shards of workers whose events [`IndexWriters`]
//! apply on background threads that share the shards out between them; [`ApproxIndex`] serves workers that publish no events by recording
//! routing decisions with a TTL.
//!
//! This crate is a synchronous, deterministic core: it must not depend on tokio, the network or
//! the scheduler. Time comes in as arguments.

mod approx;
mod concurrent;
mod error;
mod fasthash;
mod gap;
pub mod hash;
mod index;
mod scores;
mod sync;
mod table;

pub use approx::{ApproxConfig, ApproxIndex, Learnt, Retention};
pub use concurrent::{ConcurrentIndex, Frozen, IndexWriters, MAX_SHARDS};
pub use error::{ErrorCounts, IndexError};
pub use fasthash::{FastBuildHasher, FastHasher, FastMap};
pub use gap::{EventGap, EventOrder, GapTracker};
pub use index::{ApplyOutcome, KvIndex, LaneDump, MemoryStats};
pub use scores::{OverlapScores, TierScore, WorkerMap};
