//! Fake engines, a push-router-based `PhaseRouter`, and a small fleet.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use futures::future::BoxFuture;
use kvroute_prefill::{PhaseRouteError, PhaseRouter, PrefillSite, Routed};
use kvroute_protocols::{
    Annotated, BOOTSTRAP_HOST_KEY, BOOTSTRAP_PORT_KEY, CompletionUsage, LLMEngineOutput,
    PreprocessedRequest, PromptTokensDetails, RequestPhase, WorkerId, WorkerWithDpRank,
};
use kvroute_runtime::{
    Discovery, Engine, EngineError, InProcessDiscovery, InstanceInfo, Lease, LlmPushRouter,
    LlmResponse, PushRouterConfig, RequestContext, ResponseStream, RouteError, RouteMode,
    WorkerRole, WorkerServer, WorkerServerConfig,
};
use parking_lot::Mutex;
use serde_json::json;
use tokio::sync::Notify;

/// Bootstrap rooms posted by fake prefill workers, which fake decode workers wait for. Both
/// sides live in this process, so the rendezvous is a shared map rather than a socket.
#[derive(Default)]
pub(crate) struct Rooms {
    posted: Mutex<HashMap<u64, WorkerId>>,
    changed: Notify,
}

impl Rooms {
    fn post(&self, room: u64, worker: WorkerId) {
        self.posted.lock().insert(room, worker);
        self.changed.notify_waiters();
    }

    async fn wait(&self, room: u64) -> Option<WorkerId> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        loop {
            let notified = self.changed.notified();
            if let Some(w) = self.posted.lock().get(&room) {
                return Some(*w);
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return None;
            }
        }
    }
}

/// The prompt token details a fake prefill worker reports on its last item.
pub(crate) const PREFILL_DETAILS: PromptTokensDetails = PromptTokensDetails {
    audio_tokens: None,
    cached_tokens: Some(24),
};

/// What a fake engine does.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Behaviour {
    /// Prefill: one token with `disaggregated_params`, then usage with [`PREFILL_DETAILS`];
    /// posts the bootstrap room.
    Prefill,
    /// Prefill that answers with an error item.
    FailingPrefill,
    /// Decode: waits for the bootstrap room if given, then `max_tokens` tokens.
    Decode,
    /// Prefill or decode that answers one token (with `disaggregated_params`) and then nothing
    /// until its worker goes away.
    Stall,
}

/// A fake engine that records every request it gets.
pub(crate) struct FakeEngine {
    id: WorkerId,
    behaviour: Behaviour,
    rooms: Arc<Rooms>,
    pub(crate) seen: Mutex<Vec<PreprocessedRequest>>,
}

impl Engine for FakeEngine {
    type Request = PreprocessedRequest;
    type Response = LlmResponse;

    fn generate(
        &self,
        request: PreprocessedRequest,
        _context: RequestContext,
    ) -> Result<ResponseStream<LlmResponse>, EngineError> {
        self.seen.lock().push(request.clone());
        let id = self.id;
        let prompt = request.token_ids.len() as u32;
        match self.behaviour {
            Behaviour::FailingPrefill => {
                Ok(Box::pin(futures::stream::iter([Annotated::from_error(
                    "prefill engine out of memory",
                )])))
            }
            Behaviour::Prefill => {
                if let Some(info) = &request.bootstrap_info {
                    self.rooms.post(info.bootstrap_room, id);
                }
                let first = LLMEngineOutput {
                    token_ids: vec![7],
                    disaggregated_params: Some(json!({
                        "worker_id": {"prefill_worker_id": id},
                        "prompt_tokens": prompt,
                    })),
                    ..LLMEngineOutput::default()
                };
                let mut last = LLMEngineOutput::length();
                last.completion_usage = Some(CompletionUsage {
                    prompt_tokens: prompt,
                    completion_tokens: 1,
                    total_tokens: prompt + 1,
                    prompt_tokens_details: Some(PREFILL_DETAILS),
                });
                Ok(Box::pin(futures::stream::iter([
                    Annotated::from_data(first),
                    Annotated::from_data(last),
                ])))
            }
            Behaviour::Stall => {
                let first = LLMEngineOutput {
                    token_ids: vec![7],
                    disaggregated_params: Some(json!({"prefill_worker_id": id})),
                    ..LLMEngineOutput::default()
                };
                Ok(Box::pin(
                    futures::stream::iter([Annotated::from_data(first)])
                        .chain(futures::stream::pending()),
                ))
            }
            Behaviour::Decode => {
                let rooms = Arc::clone(&self.rooms);
                let n = request.stop_conditions.max_tokens.unwrap_or(4);
                let room = request.bootstrap_info.as_ref().map(|i| i.bootstrap_room);
                Ok(Box::pin(async_stream(async move {
                    if let Some(room) = room
                        && rooms.wait(room).await.is_none()
                    {
                        return vec![Annotated::from_error("bootstrap room never filled")];
                    }
                    let mut items: Vec<LlmResponse> = (0..n)
                        .map(|t| {
                            Annotated::from_data(LLMEngineOutput {
                                token_ids: vec![100 + t],
                                ..LLMEngineOutput::default()
                            })
                        })
                        .collect();
                    items.push(Annotated::from_data(LLMEngineOutput::length()));
                    items
                })))
            }
        }
    }
}

/// A stream of the items a future produces.
fn async_stream(
    items: impl Future<Output = Vec<LlmResponse>> + Send + 'static,
) -> impl futures::Stream<Item = LlmResponse> + Send + 'static {
    futures::stream::once(items).flat_map(futures::stream::iter)
}

/// A `PhaseRouter` over kvroute-runtime push routers: prefill workers for the prefill phase,
/// decode workers for decode and for the aggregated fallback; pins become direct routes.
pub(crate) struct PushPhases {
    pub(crate) prefill: LlmPushRouter,
    decode: LlmPushRouter,
    instances: tokio::sync::watch::Receiver<kvroute_runtime::InstanceSet>,
    /// Phases whose routing is saturated (refused with resource-exhausted).
    pub(crate) saturated: Mutex<BTreeSet<&'static str>>,
    /// Conditional disaggregation places prompts of at most this many tokens locally.
    pub(crate) local_up_to: Mutex<usize>,
}

impl PushPhases {
    pub(crate) fn new(discovery: &InProcessDiscovery) -> Self {
        let with_role = |role| PushRouterConfig {
            role: Some(role),
            ..PushRouterConfig::default()
        };
        Self {
            prefill: LlmPushRouter::new(discovery.watch(), with_role(WorkerRole::Prefill)),
            decode: LlmPushRouter::new(discovery.watch(), with_role(WorkerRole::Decode)),
            instances: discovery.watch(),
            saturated: Mutex::new(BTreeSet::new()),
            local_up_to: Mutex::new(0),
        }
    }

    fn check(&self, phase: RequestPhase) -> Result<(), PhaseRouteError> {
        if self.saturated.lock().contains(phase_name(phase)) {
            return Err(PhaseRouteError::ResourceExhausted {
                phase,
                message: "admission queue is full (64 of 64)".into(),
            });
        }
        Ok(())
    }

    fn role(phase: RequestPhase) -> WorkerRole {
        match phase {
            RequestPhase::Prefill => WorkerRole::Prefill,
            _ => WorkerRole::Decode,
        }
    }
}

pub(crate) fn phase_name(phase: RequestPhase) -> &'static str {
    match phase {
        RequestPhase::Prefill => "prefill",
        RequestPhase::Decode => "decode",
        RequestPhase::Aggregated => "aggregated",
    }
}

impl PhaseRouter for PushPhases {
    fn route<'a>(
        &'a self,
        request_id: &'a str,
        request: PreprocessedRequest,
        phase: RequestPhase,
    ) -> BoxFuture<'a, Result<Routed, PhaseRouteError>> {
        Box::pin(async move {
            self.check(phase)?;
            let router = match phase {
                RequestPhase::Prefill => &self.prefill,
                _ => &self.decode,
            };
            let pinned = request
                .routing
                .as_ref()
                .and_then(|r| r.pinned_worker(phase));
            let rank = request
                .routing
                .as_ref()
                .and_then(|r| r.pinned_dp_rank(phase));
            let mode = pinned.map_or(RouteMode::RoundRobin, RouteMode::Direct);
            let routed =
                router
                    .generate(request_id, &request, mode)
                    .await
                    .map_err(|e| match e {
                        RouteError::NoWorkers { .. } => PhaseRouteError::NoWorkers { phase },
                        RouteError::UnknownWorker { id } => PhaseRouteError::UnknownWorker {
                            phase,
                            worker_id: id,
                        },
                        RouteError::Request { worker_id, source }
                            if source.is_worker_unavailable() =>
                        {
                            PhaseRouteError::WorkerLost {
                                phase,
                                worker_id,
                                message: source.to_string(),
                            }
                        }
                        other => PhaseRouteError::Failed {
                            phase,
                            worker_id: None,
                            message: other.to_string(),
                        },
                    })?;
            let worker = WorkerWithDpRank::new(routed.worker_id(), rank.unwrap_or(0));
            Ok(Routed {
                worker,
                stream: Box::pin(routed),
            })
        })
    }

    fn select<'a>(
        &'a self,
        request: &'a PreprocessedRequest,
        phase: RequestPhase,
    ) -> BoxFuture<'a, Result<WorkerWithDpRank, PhaseRouteError>> {
        Box::pin(async move {
            self.check(phase)?;
            if let Some(pinned) = request
                .routing
                .as_ref()
                .and_then(|r| r.pinned_worker(phase))
            {
                return Ok(WorkerWithDpRank::from_worker_id(pinned));
            }
            // The lowest id of the phase's role: deterministic, and enough for these tests.
            let role = Self::role(phase);
            self.instances
                .borrow()
                .values()
                .find(|i| i.role == role)
                .map(|i| WorkerWithDpRank::from_worker_id(i.id))
                .ok_or(PhaseRouteError::NoWorkers { phase })
        })
    }

    fn place<'a>(
        &'a self,
        request: &'a PreprocessedRequest,
    ) -> BoxFuture<'a, Result<PrefillSite, PhaseRouteError>> {
        Box::pin(async move {
            self.check(RequestPhase::Aggregated)?;
            Ok(if request.token_ids.len() <= *self.local_up_to.lock() {
                PrefillSite::Local
            } else {
                PrefillSite::Remote
            })
        })
    }
}

/// One worker of the test fleet.
pub(crate) struct Worker {
    pub(crate) engine: Arc<FakeEngine>,
    pub(crate) lease: Option<Lease>,
    server: WorkerServer,
}

impl Worker {
    pub(crate) fn seen(&self) -> Vec<PreprocessedRequest> {
        self.engine.seen.lock().clone()
    }

    /// Kills the worker: its connections drop, then discovery forgets it.
    pub(crate) fn kill(&mut self) {
        self.server.abort();
        self.lease.take();
    }
}

/// A discovery service plus the shared bootstrap rooms.
pub(crate) struct Fleet {
    pub(crate) discovery: InProcessDiscovery,
    rooms: Arc<Rooms>,
}

impl Fleet {
    pub(crate) fn new() -> Self {
        Self {
            discovery: InProcessDiscovery::new(Duration::from_secs(30)),
            rooms: Arc::default(),
        }
    }

    /// Serves a fake engine on loopback and registers it with `role` and `metadata`.
    pub(crate) async fn spawn(
        &self,
        id: WorkerId,
        role: WorkerRole,
        behaviour: Behaviour,
        metadata: &[(&str, &str)],
    ) -> Worker {
        let engine = Arc::new(FakeEngine {
            id,
            behaviour,
            rooms: Arc::clone(&self.rooms),
            seen: Mutex::new(Vec::new()),
        });
        let server = WorkerServer::bind(
            "127.0.0.1:0",
            Arc::clone(&engine),
            WorkerServerConfig::new(id),
        )
        .await
        .expect("bind loopback");
        let mut info = InstanceInfo::new(id, server.local_addr().to_string(), 16).with_role(role);
        info.metadata = metadata
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect::<BTreeMap<_, _>>();
        let lease = self.discovery.register(info).await.expect("registered");
        Worker {
            engine,
            lease: Some(lease),
            server,
        }
    }
}

/// Metadata advertising a bootstrap endpoint.
pub(crate) fn bootstrap_meta(port: &'static str) -> [(&'static str, &'static str); 2] {
    [
        (BOOTSTRAP_HOST_KEY, "127.0.0.1"),
        (BOOTSTRAP_PORT_KEY, port),
    ]
}
