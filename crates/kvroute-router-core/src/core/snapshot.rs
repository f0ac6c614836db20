//! Index snapshots: the core's exact KV index and event positions at one point of a durable event
//! stream, so that a router that starts or restarts loads them and reads only the events after
//! that point instead of asking every worker for a dump.

use kvroute_indexer::{EventGap, Frozen, KvIndex};
use kvroute_protocols::kv_events::StorageTier;
use kvroute_protocols::{WorkerId, WorkerWithDpRank};
use kvroute_sessions::AffinityStore;
use serde::{Deserialize, Serialize};

use super::KvRouterCore;
use crate::config::KvMode;

/// What a snapshot's bytes start with: the format and its version. Version 1 listed each block
/// without its local hash, and a router restored from it held every block in a segment of its own
/// (queries looked up every block of a prompt): it is refused, and the stream replayed instead.
const MAGIC: &[u8; 8] = b"KVRSNAP2";

/// The exact KV index of a router's event-mode workers and the next event id expected from each,
/// as of the KV event at position `sequence` of the event plane's history.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IndexSnapshot {
    /// Tokens per KV block of the index: a router with another block size refuses it.
    pub block_size: u32,
    /// The event-plane position (kvroute-runtime's `Message::sequence`) of the last KV event
    /// reflected: the events after it are read from the plane.
    pub sequence: u64,
    /// Each registered worker that publishes KV events.
    pub workers: Vec<WorkerSnapshot>,
}

/// One worker in an [`IndexSnapshot`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerSnapshot {
    /// The worker.
    pub worker_id: WorkerId,
    /// The id of the next event expected from it; `None` when none was seen yet.
    pub next_event_id: Option<u64>,
    /// Its blocks, per dp rank and tier.
    pub lanes: Vec<LaneSnapshot>,
}

/// The blocks one dp rank of a worker holds in one tier.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LaneSnapshot {
    /// The dp rank.
    pub dp_rank: u32,
    /// The tier.
    pub tier: StorageTier,
    /// `(engine block hash, sequence hash, local hash)` of each block, in the index's layout
    /// order (see `KvIndex::dump_lanes`).
    pub blocks: Vec<(u64, u64, u64)>,
}

/// Why a snapshot was refused (the core is unchanged).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SnapshotError {
    /// The bytes are not a snapshot of this format.
    #[error("not a kvroute index snapshot (expected bytes starting with {expected:?})")]
    Format {
        /// The expected header.
        expected: &'static str,
    },
    /// The bytes are truncated or corrupt.
    #[error("corrupt index snapshot: {0}")]
    Corrupt(String),
    /// It was taken by a router with another block size.
    #[error(
        "the index snapshot is of {snapshot} tokens per block; this router uses {router} (ignore \
         or delete it, or run the router with its block size)"
    )]
    BlockSize {
        /// The snapshot's block size.
        snapshot: u32,
        /// This router's.
        router: u32,
    },
}

impl IndexSnapshot {
    /// The snapshot as bytes ([`Self::decode`] reads them back).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = MAGIC.to_vec();
        // Serializing plain integers and vectors into memory cannot fail.
        bincode::serialize_into(&mut out, self).expect("an index snapshot serializes");
        out
    }

    /// Reads [`Self::encode`]'s bytes.
    pub fn decode(bytes: &[u8]) -> Result<Self, SnapshotError> {
        let body = bytes.strip_prefix(MAGIC).ok_or(SnapshotError::Format {
            expected: "KVRSNAP2",
        })?;
        bincode::deserialize(body).map_err(|e| SnapshotError::Corrupt(e.to_string()))
    }

    /// Blocks in the snapshot, over all workers, ranks and tiers.
    pub fn blocks(&self) -> usize {
        self.workers
            .iter()
            .flat_map(|w| &w.lanes)
            .map(|l| l.blocks.len())
            .sum()
    }
}

/// An [`IndexSnapshot`] cut at one point and not yet read (see [`KvRouterCore::snapshot_cut`]):
/// the index stays at the cut while this lives, with queries going on and events queueing.
#[derive(Debug)]
#[must_use = "the index applies no event until the cut is finished or dropped"]
pub struct SnapshotCut {
    /// The workers and their event positions, without their blocks yet.
    snapshot: IndexSnapshot,
    frozen: Frozen,
}

impl SnapshotCut {
    /// Reads the blocks of every worker in the cut, then lets the index apply the events queued
    /// since.
    pub fn finish(mut self) -> IndexSnapshot {
        let workers = &mut self.snapshot.workers;
        for shard in 0..self.frozen.shards() {
            self.frozen
                .read_shard(shard, |index| add_lanes(workers, index));
        }
        self.snapshot
    }
}

/// Adds the blocks `index` holds for each of `workers` (sorted by id) to its lanes.
fn add_lanes(workers: &mut [WorkerSnapshot], index: &KvIndex) {
    for lane in index.dump_lanes() {
        let Ok(at) = workers.binary_search_by_key(&lane.worker.worker_id, |w| w.worker_id) else {
            continue;
        };
        workers[at].lanes.push(LaneSnapshot {
            dp_rank: lane.worker.dp_rank,
            tier: lane.tier,
            blocks: lane.blocks,
        });
    }
}

impl<S: AffinityStore> KvRouterCore<S> {
    /// A snapshot of the exact index of every registered worker that publishes KV events, with
    /// the next event id expected from each, reflecting the events up to position `sequence` of
    /// the event plane (the caller passes the position of the last event it applied, and takes
    /// no snapshot while a gap is being repaired). [`Self::snapshot_cut`] then
    /// [`SnapshotCut::finish`].
    pub fn snapshot(&self, sequence: u64) -> IndexSnapshot {
        self.snapshot_cut(sequence).finish()
    }

    /// The cut of [`Self::snapshot`]: the event positions, and the index held at the same point
    /// (every event queued so far applied, later ones waiting), without reading its blocks. A
    /// router takes the cut under its routing lock and [`SnapshotCut::finish`]es it after letting
    /// go, so routing goes on while the blocks are read (65 ns a block: most of a second for
    /// ten million blocks). Events queued meanwhile are applied when the cut is finished or
    /// dropped; until then a change to the index through this core waits for it, so do not make
    /// one on the thread holding it.
    pub fn snapshot_cut(&self, sequence: u64) -> SnapshotCut {
        let mut workers: Vec<WorkerSnapshot> = self
            .modes
            .iter()
            .filter(|(_, mode)| **mode == KvMode::Events)
            .map(|(&worker_id, _)| WorkerSnapshot {
                worker_id,
                next_event_id: self
                    .gaps
                    .expected(WorkerWithDpRank::from_worker_id(worker_id)),
                lanes: Vec::new(),
            })
            .collect();
        workers.sort_by_key(|w| w.worker_id);
        SnapshotCut {
            snapshot: IndexSnapshot {
                block_size: self.block_size(),
                sequence,
                workers,
            },
            // Every event queued before the cut is in it, none queued after.
            frozen: self.index.freeze(),
        }
    }

    /// Replaces what is known of each worker in `snapshot` with its content (blocks and the next
    /// event id expected). Workers need not be registered yet: discovery adds them later (see
    /// [`Self::expect_events_from`]), and [`Self::forget_unregistered`] drops the ones that are
    /// gone. Returns the blocks restored; a snapshot of another block size is refused whole.
    pub fn restore(&mut self, snapshot: &IndexSnapshot) -> Result<usize, SnapshotError> {
        if snapshot.block_size != self.block_size() {
            return Err(SnapshotError::BlockSize {
                snapshot: snapshot.block_size,
                router: self.block_size(),
            });
        }
        // Every worker's blocks in one pass, so chains shared between workers come back along
        // one segment (the index's own layout, see `KvIndex::restore_lanes`).
        let restored = self.index_mut(|index| {
            for worker in &snapshot.workers {
                index.remove_worker(worker.worker_id);
            }
            index.restore_lanes(snapshot.workers.iter().flat_map(|worker| {
                worker.lanes.iter().map(|lane| {
                    let rank = WorkerWithDpRank::new(worker.worker_id, lane.dp_rank);
                    (rank, lane.tier, &lane.blocks[..])
                })
            }))
        });
        for worker in &snapshot.workers {
            self.gaps.forget_worker(worker.worker_id);
            if let Some(next) = worker.next_event_id {
                self.gaps
                    .expect(WorkerWithDpRank::from_worker_id(worker.worker_id), next);
            }
            self.origin.insert(worker.worker_id, 0);
        }
        self.stats.events_recovered += restored as u64;
        Ok(restored)
    }

    /// Forgets the blocks and event ids of every worker that is not registered (after a
    /// [`Self::restore`] and discovery's first listing: the workers that left meanwhile).
    /// Returns how many workers were dropped.
    pub fn forget_unregistered(&mut self) -> usize {
        let mut gone: Vec<WorkerId> = self
            .with_index(|index| index.workers().map(|w| w.worker_id).collect::<Vec<_>>())
            .into_iter()
            .chain(self.origin.keys().copied())
            .filter(|id| !self.modes.contains_key(id))
            .collect();
        gone.sort_unstable();
        gone.dedup();
        for &id in &gone {
            self.index_mut(|index| index.remove_worker(id));
            self.gaps.forget_worker(id);
            self.origin.remove(&id);
        }
        gone.len()
    }

    /// A worker announced that this life of it numbers its KV events from `base` (see
    /// `kvroute_runtime::KV_EVENT_BASE_METADATA`), and the event plane keeps history, so its
    /// events from `base` on will be (or were) delivered: no dump is needed.
    ///
    /// - Nothing known of it, or only an earlier life (next id expected below `base`): its
    ///   blocks are forgotten and `base` is expected next.
    /// - Events of this life already applied from `base` on (or restored from a snapshot): kept.
    /// - Events of this life applied, but starting after `base` (the stream no longer held the
    ///   first ones): the missing ids are returned, to be recovered like any gap.
    pub fn expect_events_from(&mut self, worker_id: WorkerId, base: u64) -> Option<EventGap> {
        let key = WorkerWithDpRank::from_worker_id(worker_id);
        match self.gaps.expected(key) {
            Some(next) if next >= base => {
                let origin = self.origin.get(&worker_id).copied().unwrap_or(0);
                self.origin.insert(worker_id, base.min(origin));
                (origin > base).then(|| {
                    self.stats.gaps_detected += 1;
                    EventGap {
                        worker: key,
                        missing: base..origin,
                    }
                })
            }
            earlier => {
                if earlier.is_some() {
                    self.index_mut(|index| index.remove_worker(worker_id));
                }
                self.gaps.expect(key, base);
                self.origin.insert(worker_id, base);
                None
            }
        }
    }
}

#[cfg(test)]
mod tests;
