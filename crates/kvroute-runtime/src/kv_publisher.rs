//! The worker's KV event publisher: numbers events, keeps the last N for gap recovery, and
//! forwards them to the event plane.

use std::collections::VecDeque;
use std::sync::{Arc, OnceLock};

use kvroute_protocols::DpRank;
use kvroute_protocols::WorkerId;
use kvroute_protocols::kv_events::{KvCacheEvent, KvCacheEventData, RouterEvent, StorageTier};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use tokio::sync::{broadcast, mpsc};

use crate::event_plane::EventPlane;

mod blocks;

use blocks::BlockState;

/// How many recent events a worker keeps for gap recovery unless told otherwise.
pub const DEFAULT_RING_CAPACITY: usize = 1024;

/// The event-plane subject workers publish their KV events on.
pub const KV_EVENT_SUBJECT: &str = "kv_events";

/// The discovery metadata key under which a worker states the id of its publisher's first event
/// ([`KvEventPublisher::starting_at`]). A restarted worker keeps its id but starts from a larger
/// base, so its events never collide with its previous life's (JetStream de-duplicates by worker
/// and event id), and a router reading a durable stream knows where this life's events begin
/// without asking the worker for a dump.
pub const KV_EVENT_BASE_METADATA: &str = "kv_event_base";

/// A first event id for a worker process starting at `now`: microseconds since the Unix epoch.
/// Each restart starts above every id its previous life used, as long as that life published
/// fewer than a million events per second on average (no engine comes near).
pub fn incarnation_event_base(now: std::time::SystemTime) -> u64 {
    now.duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

/// A worker's KV event publisher. Cheap to clone; every clone numbers events from one counter.
///
/// Event ids start at 0 and increase by one per event, so a subscriber that sees a jump knows how
/// many events it lost and can ask the worker for exactly that range.
#[derive(Clone)]
pub struct KvEventPublisher {
    worker_id: WorkerId,
    state: Arc<Mutex<Ring>>,
    /// Where events are forwarded, shared by every clone (set once, see
    /// [`KvEventPublisher::forward_to`]).
    sink: Arc<OnceLock<mpsc::UnboundedSender<RouterEvent>>>,
    /// The live feed of request-plane subscribers (`subscribe_kv_events`); a subscriber that
    /// falls more than the ring's capacity behind loses events and recovers them by id.
    live: broadcast::Sender<RouterEvent>,
}

struct Ring {
    /// The id of the first event this publisher numbers (0 unless
    /// [`KvEventPublisher::starting_at`] said otherwise).
    first_id: u64,
    next_id: u64,
    capacity: usize,
    events: VecDeque<RouterEvent>,
    /// The held blocks, for publishers that answer dumps themselves
    /// ([`KvEventPublisher::tracking_blocks`]).
    blocks: Option<BlockState>,
}

impl Ring {
    fn last_id(&self) -> Option<u64> {
        (self.next_id > self.first_id).then(|| self.next_id - 1)
    }
}

/// The requested range of events is not held.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RangeError {
    /// The first requested event was already dropped from the ring.
    #[error("events from {from} were dropped; this worker holds events {oldest}..={newest}")]
    Evicted {
        /// The first requested id.
        from: u64,
        /// The oldest id held.
        oldest: u64,
        /// The newest id held.
        newest: u64,
    },
    /// The range is empty or reversed.
    #[error("event range {from}..={to} is empty; expected from <= to")]
    Empty {
        /// The first requested id.
        from: u64,
        /// The last requested id.
        to: u64,
    },
}

/// A worker's answer to "dump everything you hold".
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvDump {
    /// Every event published up to and including this id is reflected in `events` (later ones
    /// may be too); apply the dump, then the events after this id. `None` when nothing was
    /// published yet.
    pub last_event_id: Option<u64>,
    /// The worker's cached blocks as `Stored` events, each carrying `last_event_id` (or 0).
    pub events: Vec<RouterEvent>,
}

impl KvEventPublisher {
    /// A publisher for `worker_id` that keeps the last `capacity` events and publishes nowhere
    /// else (gap recovery and dumps still work).
    pub fn new(worker_id: WorkerId, capacity: usize) -> Self {
        Self {
            worker_id,
            state: Arc::new(Mutex::new(Ring {
                first_id: 0,
                next_id: 0,
                capacity: capacity.max(1),
                events: VecDeque::with_capacity(capacity.clamp(1, 4096)),
                blocks: None,
            })),
            sink: Arc::default(),
            live: broadcast::channel(capacity.clamp(1, 65_536)).0,
        }
    }

    /// A publisher that also keeps the blocks its events say are held, so that it answers dumps
    /// itself ([`KvEventPublisher::dump_with`] then ignores the engine): for an engine that only
    /// streams events (vLLM, SGLang behind an adapter), a router that joins later still learns
    /// every block cached since this publisher started. Memory follows the engine's live set.
    pub fn tracking_blocks(worker_id: WorkerId, capacity: usize) -> Self {
        let publisher = Self::new(worker_id, capacity);
        publisher.state.lock().blocks = Some(BlockState::default());
        publisher
    }

    /// Numbers events from `first` instead of 0 (see [`incarnation_event_base`] and
    /// [`KV_EVENT_BASE_METADATA`]). Only before the first event: a publisher that has numbered
    /// events keeps its numbering (and a debug build panics).
    pub fn starting_at(self, first: u64) -> Self {
        {
            let mut ring = self.state.lock();
            debug_assert_eq!(ring.next_id, ring.first_id, "events were already published");
            if ring.next_id == ring.first_id {
                ring.first_id = first;
                ring.next_id = first;
            }
        }
        self
    }

    /// The id of the first event this publisher numbers.
    pub fn first_event_id(&self) -> u64 {
        self.state.lock().first_id
    }

    /// How many blocks a [`KvEventPublisher::tracking_blocks`] publisher holds (`None` for one
    /// that does not track them).
    pub fn tracked_blocks(&self) -> Option<usize> {
        self.state.lock().blocks.as_ref().map(BlockState::len)
    }

    /// A publisher that also forwards every event, in id order, to `plane` on
    /// [`KV_EVENT_SUBJECT`]. Must be called inside a tokio runtime (it spawns the forwarder).
    pub fn with_event_plane(
        worker_id: WorkerId,
        capacity: usize,
        plane: Arc<dyn EventPlane>,
    ) -> Self {
        let publisher = Self::new(worker_id, capacity);
        let forwarding = publisher.forward_to(plane);
        debug_assert!(forwarding, "a new publisher forwards nowhere yet");
        publisher
    }

    /// Forwards every event published from now on, by this publisher and all its clones, in id
    /// order, to `plane` on [`KV_EVENT_SUBJECT`] (a subscriber that sees the first forwarded id
    /// past 0 recovers the earlier ones from the ring, as after any gap). Returns false, and
    /// changes nothing, when the publisher already forwards somewhere. Must be called inside a
    /// tokio runtime (it spawns the forwarder).
    pub fn forward_to(&self, plane: Arc<dyn EventPlane>) -> bool {
        let (tx, mut rx) = mpsc::unbounded_channel::<RouterEvent>();
        if self.sink.set(tx).is_err() {
            return false;
        }
        tokio::spawn(async move {
            // While the broker is down every event fails: one line per window says so.
            let throttle = crate::WarnThrottle::default();
            while let Some(event) = rx.recv().await {
                match plane.publish_router_event(event).await {
                    Ok(()) => {
                        if let Some(more) = throttle.flush(std::time::Instant::now()) {
                            tracing::warn!("dropped KV events the event plane refused{more}");
                        }
                    }
                    Err(error) => {
                        if let Some(more) = throttle.check(std::time::Instant::now()) {
                            tracing::warn!(%error, "dropping a KV event the event plane refused{more}");
                        }
                    }
                }
            }
        });
        true
    }

    /// The worker these events are attributed to.
    pub fn worker_id(&self) -> WorkerId {
        self.worker_id
    }

    /// Numbers `data` with the next event id, keeps it, forwards it, and returns it.
    pub fn publish(&self, dp_rank: DpRank, data: KvCacheEventData) -> RouterEvent {
        self.publish_tier(dp_rank, StorageTier::Device, data)
    }

    /// Like [`KvEventPublisher::publish`] for a block tier other than device memory.
    pub fn publish_tier(
        &self,
        dp_rank: DpRank,
        storage_tier: StorageTier,
        data: KvCacheEventData,
    ) -> RouterEvent {
        let mut ring = self.state.lock();
        let event = RouterEvent {
            worker_id: self.worker_id,
            storage_tier,
            event: KvCacheEvent {
                event_id: ring.next_id,
                data,
                dp_rank,
            },
        };
        ring.next_id += 1;
        if let Some(blocks) = &mut ring.blocks {
            blocks.apply(storage_tier, &event.event);
        }
        if ring.events.len() == ring.capacity {
            ring.events.pop_front();
        }
        ring.events.push_back(event.clone());
        // Sending under the lock keeps the forwarded order equal to the id order.
        if let Some(sink) = self.sink.get() {
            let _ = sink.send(event.clone());
        }
        if self.live.receiver_count() > 0 {
            let _ = self.live.send(event.clone());
        }
        event
    }

    /// A consistent cut for a live subscriber: the held events from `from` on (none for `None`),
    /// and a receiver of every event published after them. Taken under the ring's lock, so no
    /// event falls between the backlog and the feed.
    pub(crate) fn subscribe(
        &self,
        from: Option<u64>,
    ) -> Result<(Vec<RouterEvent>, broadcast::Receiver<RouterEvent>), RangeError> {
        let ring = self.state.lock();
        let receiver = self.live.subscribe();
        let backlog = match from {
            Some(from) if from < ring.next_id => {
                let oldest = ring
                    .events
                    .front()
                    .map_or(ring.next_id, |e| e.event.event_id);
                if from < oldest {
                    return Err(RangeError::Evicted {
                        from,
                        oldest,
                        newest: ring.next_id - 1,
                    });
                }
                ring.events
                    .range((from - oldest) as usize..)
                    .cloned()
                    .collect()
            }
            _ => Vec::new(),
        };
        Ok((backlog, receiver))
    }

    /// The id of the newest event, or `None` before the first.
    pub fn last_event_id(&self) -> Option<u64> {
        self.state.lock().last_id()
    }

    /// The held events with ids in `from..=to` (clipped to the newest published event).
    pub fn range(&self, from: u64, to: u64) -> Result<Vec<RouterEvent>, RangeError> {
        if from > to {
            return Err(RangeError::Empty { from, to });
        }
        let ring = self.state.lock();
        let Some(oldest) = ring.events.front().map(|e| e.event.event_id) else {
            return Ok(Vec::new());
        };
        let newest = ring.next_id - 1;
        if from < oldest {
            return Err(RangeError::Evicted {
                from,
                oldest,
                newest,
            });
        }
        if from > newest {
            return Ok(Vec::new());
        }
        let start = (from - oldest) as usize;
        let end = (to.min(newest) - oldest) as usize;
        Ok(ring.events.range(start..=end).cloned().collect())
    }

    /// Builds a dump from the engine's current blocks: the last event id is read *before* the
    /// engine is asked, so every event up to it is reflected in the blocks. A
    /// [`KvEventPublisher::tracking_blocks`] publisher dumps its own blocks instead, read under
    /// the same lock as the last event id (an exact cut).
    pub fn dump_with(&self, engine_dump: impl FnOnce() -> Vec<KvCacheEvent>) -> KvDump {
        {
            let ring = self.state.lock();
            if let Some(blocks) = &ring.blocks {
                let last_event_id = ring.last_id();
                let events = blocks
                    .dump()
                    .into_iter()
                    .map(|(storage_tier, mut event)| {
                        event.event_id = last_event_id.unwrap_or(0);
                        RouterEvent {
                            worker_id: self.worker_id,
                            storage_tier,
                            event,
                        }
                    })
                    .collect();
                return KvDump {
                    last_event_id,
                    events,
                };
            }
        }
        let last_event_id = self.last_event_id();
        let events = engine_dump()
            .into_iter()
            .map(|mut event| {
                event.event_id = last_event_id.unwrap_or(0);
                RouterEvent {
                    worker_id: self.worker_id,
                    storage_tier: StorageTier::Device,
                    event,
                }
            })
            .collect();
        KvDump {
            last_event_id,
            events,
        }
    }
}

impl std::fmt::Debug for KvEventPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvEventPublisher")
            .field("worker_id", &self.worker_id)
            .field("last_event_id", &self.last_event_id())
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests;
