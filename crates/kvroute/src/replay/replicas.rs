//! Several router replicas over one simulated fleet (`--routers R`): what sharing the fleet
//! through an event plane costs in routing quality.
//!
//! Arrivals go to the replicas in turn. The replica that routes a request records its load at
//! once and sees its tokens and end at once (it is on the response path); every other replica
//! learns of the request, of its first token and of its end `delay` later, as load sync carries
//! them, and every replica (the routing one included) indexes each worker's KV events `delay`
//! after the engine emits them, as the event plane carries them. With `delay` zero and one replica
//! this is the single router.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::time::Duration;

use kvroute_mocker::sim::Dispatcher;
use kvroute_mocker::{Engine, Request, RequestError, StepOutput};
use kvroute_protocols::kv_events::{RouterEvent, StorageTier};
use kvroute_router_core::{KvRouterCore, RequestId, RequestLoad};

use crate::replay::dispatch::RunState;

/// What a replica learns late.
enum Update {
    Event(RouterEvent),
    Added(RequestId, RequestLoad),
    FirstToken(RequestId),
    Ended(RequestId),
}

/// The id under which a replica tracks a request another replica routed (local ids are the
/// trace's request ids, far below the top bit).
fn remote(id: u64) -> RequestId {
    RequestId((1 << 63) | id)
}

/// Drives `R` router cores from one simulation.
pub(crate) struct ReplicaDispatcher {
    cores: Vec<KvRouterCore>,
    run: RunState,
    delay: Duration,
    next: usize,
    /// Which replica routed each request in flight.
    owner: HashMap<u64, usize>,
    /// Updates not yet delivered: (due, sequence, replica), with the update in `updates`.
    queue: BinaryHeap<Reverse<(Duration, u64, usize)>>,
    updates: HashMap<u64, Update>,
    seq: u64,
    clock: Duration,
    /// When each worker's last KV event was sent: its events must arrive in order.
    last_event_at: HashMap<usize, Duration>,
}

impl ReplicaDispatcher {
    /// `cores` are the replicas, each over the simulation's engines `0..` in order.
    pub(crate) fn new(cores: Vec<KvRouterCore>, delay: Duration, run: RunState) -> Self {
        Self {
            cores,
            run,
            delay,
            next: 0,
            owner: HashMap::new(),
            queue: BinaryHeap::new(),
            updates: HashMap::new(),
            seq: 0,
            clock: Duration::ZERO,
            last_event_at: HashMap::new(),
        }
    }

    /// Every replica, named for the drain check, after delivering what is still on its way.
    pub(crate) fn into_parts(mut self) -> (Vec<(&'static str, KvRouterCore)>, RunState) {
        self.deliver(Duration::MAX);
        let names: Vec<&'static str> = (0..self.cores.len())
            .map(|i| &*Box::leak(format!("replica {i}").into_boxed_str()))
            .collect();
        (names.into_iter().zip(self.cores).collect(), self.run)
    }

    fn send(&mut self, at: Duration, replica: usize, update: Update) {
        self.seq += 1;
        self.queue
            .push(Reverse((at.saturating_add(self.delay), self.seq, replica)));
        self.updates.insert(self.seq, update);
    }

    /// Sends `update` (made by `make`) to every replica but `except`.
    fn broadcast(&mut self, at: Duration, except: Option<usize>, make: impl Fn() -> Update) {
        for replica in 0..self.cores.len() {
            if Some(replica) != except {
                self.send(at, replica, make());
            }
        }
    }

    /// Delivers every update due by `now`, in order.
    fn deliver(&mut self, now: Duration) {
        while let Some(Reverse((due, seq, replica))) = self.queue.peek().copied() {
            if due > now {
                break;
            }
            self.queue.pop();
            let Some(update) = self.updates.remove(&seq) else {
                continue;
            };
            let core = &mut self.cores[replica];
            match update {
                Update::Event(event) => {
                    if core.apply_event(&event).is_some() {
                        self.run.gaps += 1;
                    }
                }
                // A request that already ended here (its end overtook it) adds nothing.
                Update::Added(id, load) => {
                    let _ = core.add_remote_request(id, &load, due);
                }
                Update::FirstToken(id) => {
                    let _ = core.on_first_token(id);
                }
                Update::Ended(id) => {
                    let _ = core.on_finished(id);
                }
            }
        }
    }

    /// The time of `output`: its latest token or end, else the last arrival's.
    fn time_of(&self, output: &StepOutput) -> Duration {
        let tokens = output.tokens.iter().map(|t| t.at);
        let ends = output.finished.iter().map(|f| f.at);
        tokens
            .chain(ends)
            .max()
            .unwrap_or(self.clock)
            .max(self.clock)
    }

    fn end(&mut self, id: u64, at: Duration, failed: bool) {
        let Some(owner) = self.owner.remove(&id) else {
            return;
        };
        let core = &mut self.cores[owner];
        if failed {
            let _ = core.on_failed(RequestId(id));
        } else {
            let _ = core.on_finished(RequestId(id));
        }
        self.broadcast(at, Some(owner), || Update::Ended(remote(id)));
    }
}

impl Dispatcher for ReplicaDispatcher {
    fn pick(&mut self, now: Duration, request: &Request, engines: &[Engine]) -> usize {
        self.clock = self.clock.max(now);
        self.deliver(now);
        if self.run.pacer.arrival(now) {
            for core in &mut self.cores {
                self.run.expired += core.expire(now).requests.len() as u64;
            }
        }
        let replica = self.next;
        self.next = (self.next + 1) % self.cores.len();
        let Some(worker) = self
            .run
            .route_arrival(&mut self.cores[replica], request, now)
        else {
            return engines.len();
        };
        self.run.recorder.arrived(request.id, worker, now);
        self.owner.insert(request.id, replica);
        if let Some(load) = self.cores[replica].request_load(RequestId(request.id)) {
            let id = remote(request.id);
            self.broadcast(now, Some(replica), || Update::Added(id, load.clone()));
        }
        worker
    }

    fn observe(&mut self, worker: usize, output: &StepOutput) {
        let at = self.time_of(output);
        let last = self.last_event_at.entry(worker).or_default();
        let events_at = at.max(*last);
        *last = events_at;
        for event in &output.events {
            let event = RouterEvent {
                worker_id: worker as u64,
                storage_tier: StorageTier::default(),
                event: event.clone(),
            };
            self.broadcast(events_at, None, || Update::Event(event.clone()));
        }
        for token in &output.tokens {
            self.run.recorder.token(token);
            let Some(&owner) = self.owner.get(&token.request_id) else {
                continue;
            };
            let id = RequestId(token.request_id);
            if token.index == 0 {
                let _ = self.cores[owner].on_first_token(id);
                self.broadcast(token.at, Some(owner), || {
                    Update::FirstToken(remote(token.request_id))
                });
            }
            let _ = self.cores[owner].on_output_tokens(id, 1);
        }
        for finished in &output.finished {
            self.end(finished.request_id, finished.at, false);
            self.run
                .recorder
                .left(finished.request_id, finished.at, true);
        }
    }

    fn rejected(&mut self, now: Duration, _worker: usize, id: u64, _error: &RequestError) {
        self.end(id, now, true);
        self.run.recorder.left(id, now, false);
    }
}
