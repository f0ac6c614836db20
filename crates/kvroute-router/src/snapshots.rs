//! The index snapshot shared by a fleet's router replicas: restored at start ([`restore`]) and
//! saved as of the last applied KV event ([`Inner::save_snapshot`]).

use std::sync::atomic::Ordering;
use std::time::Instant;

use kvroute_runtime::SnapshotStore;

use crate::shared::{Inner, SnapshotCounters};
use crate::state::SharedAffinityStore;
use kvroute_router_core::{IndexSnapshot, KvRouterCore};

impl Inner {
    /// Saves a snapshot of the index as of the last applied event's position; see
    /// [`KvPushRouter::save_snapshot`](crate::KvPushRouter::save_snapshot).
    pub(crate) async fn save_snapshot(&self) -> bool {
        let Some(store) = &self.snapshots else {
            return false;
        };
        let c = &self.snapshot_counters;
        if self.recovering.load(Ordering::Acquire) > 0 {
            c.skipped_recovering.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        // Read the position before the cut: the cut then reflects at least the events up to it
        // (later ones it may also hold are skipped by id when replayed after a restore).
        let sequence = self.applied_sequence.load(Ordering::Acquire);
        // Only the cut holds the routing lock; the blocks are read and encoded off it, and off
        // the runtime's threads, while routes go on and events queue behind the cut.
        let cut = self.state.lock().core.snapshot_cut(sequence);
        let encoded = tokio::task::spawn_blocking(move || {
            let snapshot = cut.finish();
            (snapshot.blocks(), snapshot.encode())
        })
        .await;
        let (blocks, bytes) = match encoded {
            Ok((blocks, bytes)) => (blocks, bytes::Bytes::from(bytes)),
            Err(error) => {
                c.failures.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(%error, "index snapshot not taken");
                return false;
            }
        };
        let size = bytes.len() as u64;
        match store.save(bytes).await {
            Ok(()) => {
                c.saved.fetch_add(1, Ordering::Relaxed);
                c.last_bytes.store(size, Ordering::Relaxed);
                tracing::debug!(sequence, blocks, bytes = size, "index snapshot saved");
                true
            }
            Err(error) => {
                c.failures.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(%error, "index snapshot not saved");
                false
            }
        }
    }
}

/// Loads and restores the stored snapshot; returns the position to resume after.
pub(crate) async fn restore(
    core: &mut KvRouterCore<SharedAffinityStore>,
    store: &dyn SnapshotStore,
    counters: &SnapshotCounters,
) -> Option<u64> {
    let started = Instant::now();
    let bytes = match store.load().await {
        Ok(Some(bytes)) => bytes,
        Ok(None) => {
            tracing::info!("no index snapshot yet; replaying the retained KV event stream");
            return None;
        }
        Err(error) => {
            counters.failures.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(%error, "cannot load the index snapshot; replaying the retained KV event stream");
            return None;
        }
    };
    let restored = IndexSnapshot::decode(&bytes).and_then(|snapshot| {
        core.restore(&snapshot)
            .map(|blocks| (blocks, snapshot.sequence))
    });
    match restored {
        Ok((blocks, sequence)) => {
            counters
                .restored_blocks
                .store(blocks as u64, Ordering::Relaxed);
            *counters.resumed_after.lock() = Some(sequence);
            tracing::info!(
                blocks,
                after = sequence,
                bytes = bytes.len(),
                took = ?started.elapsed(),
                "index snapshot restored; reading the KV events after it"
            );
            Some(sequence)
        }
        Err(error) => {
            counters.failures.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(%error, "ignoring the index snapshot; replaying the retained KV event stream");
            None
        }
    }
}
