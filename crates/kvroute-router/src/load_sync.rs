//! Active load shared between router replicas over the event plane.
//!
//! Each replica publishes, on `load.<scope>.<its router id>`, every request it routes (the load it puts
//! on its worker: prefill tokens, prompt block hashes), the end of each request's prefill, and
//! each request's end; every second it also says which of its requests are still active. Every
//! other replica adds those requests to its own scheduler as remote load, so two replicas see
//! the same busy workers and do not both pick the same idle one. Replicas share load only
//! within their scope ([`LoadSyncConfig::scope`]): the prefill and decode routers of one process
//! serve different workers, so each talks only to the other processes' router of its phase.
//!
//! Consistency: eventual. A replica sees another's request one event-plane hop after it was
//! routed (sub-millisecond on a local NATS), so requests routed in that window by two replicas
//! do not see each other. Lost `Added` messages are not repaired (the request's load is missing
//! until it ends); lost `Freed` messages are: the next heartbeat's list of active requests frees
//! every remote request it no longer names, and a replica silent for [`LoadSyncConfig::silence`]
//! (killed, or cut off from NATS) has all its requests freed. So load never leaks: once every
//! replica's traffic drains, every replica's load reads zero.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::StreamExt;
use kvroute_protocols::WorkerWithDpRank;
use kvroute_protocols::kv_events::LocalBlockHash;
use kvroute_runtime::{EventPlane, Subscription};
use kvroute_scheduler::{RequestId, RequestLoad};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

use crate::state::State;

/// The subject prefix of load messages (`load.<scope>.<router id>`).
pub const LOAD_SUBJECT_PREFIX: &str = "load";

/// How a replica shares its load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoadSyncConfig {
    /// This replica's id, unique among the replicas (a random one is fine).
    pub router_id: u64,
    /// How often this replica lists its active requests.
    pub heartbeat: Duration,
    /// A replica not heard from for this long has all its requests freed here.
    pub silence: Duration,
    /// Which routers share load: only those with the same scope (one subject token: letters,
    /// digits, `-` and `_`). A process serving disaggregated runs a prefill and a decode router,
    /// each with its own scope; [`DEFAULT_LOAD_SCOPE`] otherwise.
    pub scope: &'static str,
}

/// The scope of routers serving every request whole (see [`LoadSyncConfig::scope`]).
pub const DEFAULT_LOAD_SCOPE: &str = "aggregated";

impl LoadSyncConfig {
    /// Defaults (heartbeat 1 s, silence 5 s, [`DEFAULT_LOAD_SCOPE`]) for the replica
    /// `router_id`.
    pub fn new(router_id: u64) -> Self {
        Self {
            router_id,
            heartbeat: Duration::from_secs(1),
            silence: Duration::from_secs(5),
            scope: DEFAULT_LOAD_SCOPE,
        }
    }

    /// This configuration, sharing load only with replicas of `scope`.
    #[must_use]
    pub fn with_scope(self, scope: &'static str) -> Self {
        Self { scope, ..self }
    }

    /// The subject this replica publishes on.
    pub(crate) fn subject(&self) -> String {
        format!("{LOAD_SUBJECT_PREFIX}.{}.{}", self.scope, self.router_id)
    }

    /// The subjects of every replica in this one's scope.
    pub(crate) fn subscription(&self) -> String {
        format!("{LOAD_SUBJECT_PREFIX}.{}.*", self.scope)
    }
}

/// One load message, as JSON.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct LoadMessage {
    router: u64,
    #[serde(flatten)]
    kind: Kind,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
enum Kind {
    Added {
        request: u64,
        worker_id: u64,
        dp_rank: u32,
        prefill_tokens: u64,
        block_hashes: Vec<u64>,
        expected_output_tokens: Option<u32>,
        /// For a worker in approximate mode, the prompt's local block hashes the sender now
        /// predicts cached there; the receiver records the same prediction. Absent from
        /// messages of workers that publish events (and of older routers).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        predicted_blocks: Option<Vec<u64>>,
    },
    PrefillDone {
        request: u64,
    },
    Freed {
        request: u64,
    },
    Alive {
        active: Vec<u64>,
    },
}

/// A change of this replica's own load, to publish.
#[derive(Debug)]
pub(crate) enum Local {
    /// A request routed here: its load, and (approximate mode) the blocks predicted cached.
    Added(RequestId, RequestLoad, Option<Vec<u64>>),
    PrefillDone(RequestId),
    Freed(RequestId),
}

/// The load-sync state of one replica, with what it updates: the routing state it adds other
/// replicas' requests to, and the router's clock.
#[derive(Debug)]
pub(crate) struct LoadSync {
    config: LoadSyncConfig,
    state: Arc<Mutex<State>>,
    /// When the router started: [`Self::now`] is the `now` its core sees.
    epoch: Instant,
    tx: mpsc::UnboundedSender<Local>,
    rx: Mutex<Option<mpsc::UnboundedReceiver<Local>>>,
    remote: Mutex<HashMap<u64, RemoteRouter>>,
    remote_freed: AtomicU64,
    undecodable: AtomicU64,
    remote_predictions: AtomicU64,
}

#[derive(Debug)]
struct RemoteRouter {
    last_seen: Instant,
    /// Their request id -> its id here.
    requests: HashMap<u64, RequestId>,
}

impl LoadSync {
    /// Load sync of the router whose routing state is `state` and which started at `epoch`.
    pub(crate) fn new(config: LoadSyncConfig, state: Arc<Mutex<State>>, epoch: Instant) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        Self {
            config,
            state,
            epoch,
            tx,
            rx: Mutex::new(Some(rx)),
            remote: Mutex::new(HashMap::new()),
            remote_freed: AtomicU64::new(0),
            undecodable: AtomicU64::new(0),
            remote_predictions: AtomicU64::new(0),
        }
    }

    /// Time since the router started: the `now` its core sees.
    fn now(&self) -> Duration {
        self.epoch.elapsed()
    }

    /// Queues a change of this replica's load for publishing (in order).
    pub(crate) fn local(&self, change: Local) {
        let _ = self.tx.send(change);
    }

    /// Remote requests freed because their replica fell silent or stopped listing them.
    pub(crate) fn remote_freed(&self) -> u64 {
        self.remote_freed.load(Ordering::Relaxed)
    }

    /// Remote requests held now.
    pub(crate) fn remote_requests(&self) -> usize {
        self.remote.lock().values().map(|r| r.requests.len()).sum()
    }

    /// Other replicas' approximate-mode predictions recorded here.
    pub(crate) fn remote_predictions(&self) -> u64 {
        self.remote_predictions.load(Ordering::Relaxed)
    }

    /// Load messages that could not be decoded (counted and dropped).
    pub(crate) fn undecodable(&self) -> u64 {
        self.undecodable.load(Ordering::Relaxed)
    }

    /// Frees the requests of replicas silent for longer than the configured silence.
    pub(crate) fn expire_silent(&self) {
        let now = Instant::now();
        let mut dropped = Vec::new();
        self.remote.lock().retain(|router, remote| {
            let alive = now.duration_since(remote.last_seen) <= self.config.silence;
            if !alive {
                tracing::warn!(
                    router,
                    requests = remote.requests.len(),
                    "a router replica fell silent; freeing its requests here"
                );
                dropped.extend(remote.requests.values().copied());
            }
            alive
        });
        self.free(&dropped);
    }

    /// Stops tracking remote requests already freed elsewhere (by a worker's load report), so
    /// that `remote_requests` counts only live ones and a late `Freed` finds nothing.
    pub(crate) fn forget(&self, ids: &[RequestId]) {
        if ids.is_empty() {
            return;
        }
        let ids: HashSet<RequestId> = ids.iter().copied().collect();
        for remote in self.remote.lock().values_mut() {
            remote.requests.retain(|_, id| !ids.contains(id));
        }
    }

    fn free(&self, ids: &[RequestId]) {
        if ids.is_empty() {
            return;
        }
        self.remote_freed
            .fetch_add(ids.len() as u64, Ordering::Relaxed);
        let mut state = self.state.lock();
        for id in ids {
            let _ = state.core.on_finished(*id);
        }
    }

    fn apply(&self, message: LoadMessage) {
        let router = message.router;
        if router == self.config.router_id {
            return;
        }
        let now = Instant::now();
        let mut remote = self.remote.lock();
        let entry = remote.entry(router).or_insert_with(|| {
            tracing::info!(
                router,
                scope = self.config.scope,
                "a router replica shares its load"
            );
            RemoteRouter {
                last_seen: now,
                requests: HashMap::new(),
            }
        });
        entry.last_seen = now;
        match message.kind {
            Kind::Added {
                request,
                worker_id,
                dp_rank,
                prefill_tokens,
                block_hashes,
                expected_output_tokens,
                predicted_blocks,
            } => {
                let id = remote_id(router, request);
                entry.requests.insert(request, id);
                drop(remote);
                let load = RequestLoad {
                    worker: WorkerWithDpRank::new(worker_id, dp_rank),
                    prefill_tokens,
                    block_hashes,
                    expected_output_tokens,
                };
                let now = self.now();
                let mut state = self.state.lock();
                // A worker this replica does not know (yet) carries no load here.
                let _ = state.core.add_remote_request(id, &load, now);
                if let Some(blocks) = predicted_blocks {
                    let blocks: Vec<LocalBlockHash> =
                        blocks.into_iter().map(LocalBlockHash).collect();
                    if state
                        .core
                        .record_remote_prediction(load.worker, &blocks, now)
                    {
                        self.remote_predictions.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            Kind::PrefillDone { request } => {
                let id = entry.requests.get(&request).copied();
                drop(remote);
                if let Some(id) = id {
                    let _ = self.state.lock().core.on_first_token(id);
                }
            }
            Kind::Freed { request } => {
                let id = entry.requests.remove(&request);
                drop(remote);
                if let Some(id) = id {
                    let _ = self.state.lock().core.on_finished(id);
                }
            }
            Kind::Alive { active } => {
                let active: HashSet<u64> = active.into_iter().collect();
                let mut gone = Vec::new();
                entry.requests.retain(|request, id| {
                    let live = active.contains(request);
                    if !live {
                        gone.push(*id);
                    }
                    live
                });
                drop(remote);
                self.free(&gone);
            }
        }
    }
}

/// The id under which another replica's request is tracked here: the top bit set (local ids
/// count up from 1 and never reach it), the rest a mix of the replica and its request id.
fn remote_id(router: u64, request: u64) -> RequestId {
    let mixed = splitmix(router ^ splitmix(request));
    RequestId((1 << 63) | (mixed >> 1))
}

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Publishes this replica's load changes in order, and its active list every heartbeat.
pub(crate) async fn publish_loop(sync: Arc<LoadSync>, plane: Arc<dyn EventPlane>) {
    let Some(mut rx) = sync.rx.lock().take() else {
        return;
    };
    let router = sync.config.router_id;
    let subject = sync.config.subject();
    let mut active: HashSet<u64> = HashSet::new();
    let mut tick = tokio::time::interval(sync.config.heartbeat);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let kind = tokio::select! {
            change = rx.recv() => match change {
                None => return,
                Some(Local::Added(id, load, predicted_blocks)) => {
                    active.insert(id.0);
                    Kind::Added {
                        request: id.0,
                        worker_id: load.worker.worker_id,
                        dp_rank: load.worker.dp_rank,
                        prefill_tokens: load.prefill_tokens,
                        block_hashes: load.block_hashes,
                        expected_output_tokens: load.expected_output_tokens,
                        predicted_blocks,
                    }
                }
                Some(Local::PrefillDone(id)) => Kind::PrefillDone { request: id.0 },
                Some(Local::Freed(id)) => {
                    active.remove(&id.0);
                    Kind::Freed { request: id.0 }
                }
            },
            _ = tick.tick() => Kind::Alive { active: active.iter().copied().collect() },
        };
        let payload = serde_json::to_vec(&LoadMessage { router, kind }).unwrap_or_default();
        if let Err(error) = plane.publish(&subject, Bytes::from(payload)).await {
            tracing::debug!(%error, "a load message was not published; the next heartbeat repairs frees");
        }
    }
}

/// Applies other replicas' load messages.
pub(crate) async fn receive_loop(sync: Arc<LoadSync>, mut subscription: Subscription) {
    while let Some(message) = subscription.next().await {
        match serde_json::from_slice::<LoadMessage>(&message.payload) {
            Ok(decoded) => sync.apply(decoded),
            Err(error) => {
                sync.undecodable.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(subject = %message.subject, %error, "dropping an undecodable load message");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remote_ids_never_collide_with_local_ones_and_differ_per_replica() {
        for request in [1, 2, 1000, u64::MAX >> 2] {
            let a = remote_id(7, request);
            let b = remote_id(8, request);
            assert!(a.0 >= 1 << 63 && b.0 >= 1 << 63);
            assert_ne!(a, b);
        }
        assert_eq!(remote_id(7, 3), remote_id(7, 3));
    }

    #[test]
    fn messages_round_trip_as_tagged_json() {
        let message = LoadMessage {
            router: 9,
            kind: Kind::Added {
                request: 4,
                worker_id: 2,
                dp_rank: 0,
                prefill_tokens: 640,
                block_hashes: vec![11, 12],
                expected_output_tokens: Some(32),
                predicted_blocks: Some(vec![5, 6]),
            },
        };
        let json = serde_json::to_string(&message).unwrap();
        assert!(json.contains("\"kind\":\"added\""), "{json}");
        assert_eq!(serde_json::from_str::<LoadMessage>(&json).unwrap(), message);
        let alive: LoadMessage =
            serde_json::from_str(r#"{"router":9,"kind":"alive","active":[1,2]}"#).unwrap();
        assert_eq!(alive.kind, Kind::Alive { active: vec![1, 2] });
        // A router without shared predictions sends (and expects) no `predicted_blocks`.
        let old: LoadMessage = serde_json::from_str(
            r#"{"router":9,"kind":"added","request":4,"worker_id":2,"dp_rank":0,"prefill_tokens":640,"block_hashes":[11,12],"expected_output_tokens":null}"#,
        )
        .unwrap();
        assert!(matches!(
            old.kind,
            Kind::Added {
                predicted_blocks: None,
                ..
            }
        ));
        let exact = LoadMessage {
            router: 9,
            kind: Kind::Added {
                request: 4,
                worker_id: 2,
                dp_rank: 0,
                prefill_tokens: 640,
                block_hashes: vec![11],
                expected_output_tokens: None,
                predicted_blocks: None,
            },
        };
        assert!(!serde_json::to_string(&exact).unwrap().contains("predicted"));
    }
}
