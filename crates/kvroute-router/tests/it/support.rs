//! A fake LLM worker fleet on loopback: engines that stream tokens, publish KV events for the
//! prompts they serve, record session commands, and can fail or stall on request.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use futures::StreamExt;
use kvroute_indexer::hash::{HashSalt, compute_block_hashes};
use kvroute_protocols::kv_events::{
    ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheStoreData,
    KvCacheStoredBlockData, RouterEvent,
};
use kvroute_protocols::{
    Annotated, CompletionUsage, LLMEngineOutput, PreprocessedRequest, PromptTokensDetails,
    SessionControl, WorkerWithDpRank,
};
use kvroute_router::tokenizer::MockTokenizer;
use kvroute_router::{KvMode, KvPushRouter, KvPushRouterConfig, Policy};
use kvroute_runtime::{
    Discovery, Engine, EngineError, EventPlane, InProcessDiscovery, InProcessEventPlane,
    InstanceInfo, KV_EVENT_SUBJECT, KvEventPublisher, Lease, LlmResponse, RequestContext,
    ResponseStream, WorkerRole, WorkerServer, WorkerServerConfig, encode_router_event,
};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

pub(crate) const BLOCK: u32 = 4;

/// What the fake engine does with a request, read from `extra_args`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum Behaviour {
    /// Stream `tokens` tokens, then finish.
    #[default]
    Complete,
    /// Stream one token, then an error item.
    Error,
    /// Stream one token, then nothing until cancelled.
    Stall,
    /// Stream `max_tokens` (default 5) tokens, one every [`SLOW_TOKEN_INTERVAL`].
    Slow,
    /// Refuse at once as an engine answering HTTP 400 for a prompt over its context.
    RefuseTooLong,
    /// Fail at once as a worker whose engine refuses connections (nothing was sent).
    Unreachable,
    /// Fail at once as a worker whose engine sent nothing within its first-byte limit.
    FirstByteTimeout,
    /// Stream text without token ids (as the `openai` dialect does), with the engine's usage.
    TextOnly,
    /// Stream text without token ids, then lose the engine mid-stream.
    TextThenLost,
}

/// The words [`Behaviour::TextOnly`] streams, one per item.
pub(crate) const TEXT_ONLY_WORDS: [&str; 3] = ["alpha ", "beta ", "gamma"];

/// The pause between tokens of [`Behaviour::Slow`].
pub(crate) const SLOW_TOKEN_INTERVAL: Duration = Duration::from_millis(20);

impl Behaviour {
    /// Every behaviour a magic word in the prompt selects (all but the default).
    pub(crate) const STEERED: [Behaviour; 8] = [
        Behaviour::Error,
        Behaviour::Stall,
        Behaviour::Slow,
        Behaviour::RefuseTooLong,
        Behaviour::Unreachable,
        Behaviour::FirstByteTimeout,
        Behaviour::TextOnly,
        Behaviour::TextThenLost,
    ];

    /// The word that selects this behaviour when it appears in a prompt tokenized by the mock
    /// tokenizer (so HTTP tests can steer the fake engine through the prompt text).
    pub(crate) fn magic_word(self) -> &'static str {
        match self {
            Behaviour::Complete => "COMPLETE",
            Behaviour::Error => "EXPLODE",
            Behaviour::Stall => "STALL",
            Behaviour::Slow => "SLOWLY",
            Behaviour::RefuseTooLong => "TOOLONG",
            Behaviour::Unreachable => "UNREACHABLE",
            Behaviour::FirstByteTimeout => "NOFIRSTBYTE",
            Behaviour::TextOnly => "TEXTONLY",
            Behaviour::TextThenLost => "TEXTLOST",
        }
    }

    /// The behaviour a request asks for: `extra_args`, else a magic word in its prompt.
    fn of(request: &PreprocessedRequest) -> Behaviour {
        if let Some(b) = request
            .extra_args
            .clone()
            .and_then(|v| serde_json::from_value(v).ok())
        {
            return b;
        }
        Behaviour::STEERED
            .into_iter()
            .find(|b| {
                let id = MockTokenizer::word_id(b.magic_word());
                request.token_ids.contains(&id)
            })
            .unwrap_or_default()
    }
}

/// The `i`-th token the fake engine generates (above the mock tokenizer's special ids, so it
/// renders as a word).
pub(crate) fn output_token(i: u32) -> u32 {
    100 + i
}

pub(crate) fn request(tokens: Vec<u32>, behaviour: Behaviour) -> PreprocessedRequest {
    let mut req = PreprocessedRequest::new("mock", tokens);
    req.extra_args = Some(serde_json::to_value(behaviour).unwrap());
    req
}

/// A fake engine; every served prompt's full blocks become one `Stored` event.
pub(crate) struct FakeEngine {
    id: u64,
    /// A prefill worker: its tokens carry `disaggregated_params` for the decode worker, and its
    /// last item reports its whole prompt as cached (so that a continuation's prefill, over a
    /// longer prompt, reports a different count).
    prefill: bool,
    publisher: KvEventPublisher,
    forward: mpsc::UnboundedSender<RouterEvent>,
    /// While set, events are kept in the ring but not forwarded (to create gaps).
    pub(crate) muted: AtomicBool,
    pub(crate) started: AtomicUsize,
    pub(crate) sessions: Mutex<Vec<SessionControl>>,
    /// Every request received, in order.
    pub(crate) requests: Mutex<Vec<PreprocessedRequest>>,
    held: Mutex<Vec<KvCacheEvent>>,
    next_block: AtomicUsize,
    /// When set, every request gets this behaviour, whatever it asks for (an engine that is
    /// down, or slow, for every request).
    pub(crate) forced: Mutex<Option<Behaviour>>,
}

impl FakeEngine {
    /// Publishes a `Stored` event for the full blocks of `tokens` (ring, and the plane unless
    /// muted).
    pub(crate) fn store(&self, tokens: &[u32]) {
        let local = compute_block_hashes(tokens, BLOCK as usize, &HashSalt::default());
        if local.is_empty() {
            return;
        }
        let base = self.next_block.fetch_add(local.len(), Ordering::SeqCst) as u64;
        let data = KvCacheEventData::Stored(KvCacheStoreData {
            parent_hash: None,
            blocks: local
                .iter()
                .enumerate()
                .map(|(i, &h)| KvCacheStoredBlockData {
                    block_hash: ExternalSequenceBlockHash(self.id * 1_000_000 + base + i as u64),
                    tokens_hash: h,
                })
                .collect(),
        });
        let event = self.publisher.publish(0, data.clone());
        self.held.lock().push(KvCacheEvent {
            event_id: 0,
            data,
            dp_rank: 0,
        });
        if !self.muted.load(Ordering::SeqCst) {
            let _ = self.forward.send(event);
        }
    }
}

impl Engine for FakeEngine {
    type Request = PreprocessedRequest;
    type Response = LlmResponse;

    fn generate(
        &self,
        request: PreprocessedRequest,
        context: RequestContext,
    ) -> Result<ResponseStream<LlmResponse>, EngineError> {
        self.started.fetch_add(1, Ordering::SeqCst);
        self.requests.lock().push(request.clone());
        let behaviour = self
            .forced
            .lock()
            .unwrap_or_else(|| Behaviour::of(&request));
        let fail = |error: EngineError| -> ResponseStream<LlmResponse> {
            context.fail(error);
            Box::pin(futures::stream::empty())
        };
        match behaviour {
            Behaviour::Unreachable => {
                return Ok(fail(EngineError::Unreachable {
                    message: "connection refused".to_owned(),
                }));
            }
            Behaviour::FirstByteTimeout => {
                return Ok(fail(EngineError::Timeout {
                    message: "nothing within 10ms".to_owned(),
                }));
            }
            Behaviour::RefuseTooLong => {
                return Ok(Box::pin(futures::stream::iter([
                    Annotated::from_engine_error(
                        "the request exceeds the available context size",
                        400,
                        Some("context_length_exceeded"),
                    ),
                ])));
            }
            Behaviour::TextOnly | Behaviour::TextThenLost => {
                let text = |t: &str| {
                    Annotated::from_data(LLMEngineOutput {
                        text: Some(t.to_owned()),
                        ..LLMEngineOutput::default()
                    })
                };
                let mut items: Vec<LlmResponse> = TEXT_ONLY_WORDS.iter().map(|t| text(t)).collect();
                if behaviour == Behaviour::TextThenLost {
                    items.truncate(1);
                    let ctx = context.clone();
                    let lost = futures::stream::iter(items).chain(
                        futures::stream::once(async move {
                            ctx.fail(EngineError::Unavailable {
                                message: "connection reset".to_owned(),
                            });
                        })
                        .filter_map(|()| async { None }),
                    );
                    return Ok(Box::pin(lost));
                }
                items.push(Annotated::from_data(LLMEngineOutput {
                    completion_usage: Some(CompletionUsage {
                        prompt_tokens: request.token_ids.len() as u32,
                        completion_tokens: 7,
                        total_tokens: request.token_ids.len() as u32 + 7,
                        prompt_tokens_details: None,
                    }),
                    ..LLMEngineOutput::stop()
                }));
                return Ok(Box::pin(futures::stream::iter(items)));
            }
            _ => {}
        }
        self.store(&request.token_ids);
        let n = request.stop_conditions.max_tokens.unwrap_or(5);
        let params = self.prefill.then(|| serde_json::json!({"from": self.id}));
        let token = move |i: u32| {
            Annotated::from_data(LLMEngineOutput {
                token_ids: vec![output_token(i)],
                disaggregated_params: params.clone(),
                ..LLMEngineOutput::default()
            })
        };
        let prompt = request.token_ids.len() as u32;
        let usage = self.prefill.then(|| CompletionUsage {
            prompt_tokens: prompt,
            completion_tokens: n,
            total_tokens: prompt + n,
            prompt_tokens_details: Some(PromptTokensDetails {
                audio_tokens: None,
                cached_tokens: Some(prompt),
            }),
        });
        let last = move |end: LLMEngineOutput| {
            Annotated::from_data(LLMEngineOutput {
                completion_usage: usage,
                ..end
            })
        };
        Ok(match behaviour {
            Behaviour::Complete => {
                let mut items: Vec<LlmResponse> = (0..n).map(token).collect();
                items.push(last(LLMEngineOutput::stop()));
                Box::pin(futures::stream::iter(items))
            }
            Behaviour::Slow => {
                let items = futures::stream::iter(0..n).then(move |i| {
                    let item = token(i);
                    async move {
                        tokio::time::sleep(SLOW_TOKEN_INTERVAL).await;
                        item
                    }
                });
                Box::pin(items.chain(futures::stream::iter([last(LLMEngineOutput::length())])))
            }
            Behaviour::Error => Box::pin(futures::stream::iter(vec![
                token(0),
                Annotated::from_error("engine exploded"),
            ])),
            Behaviour::Stall => {
                Box::pin(futures::stream::iter(vec![token(0)]).chain(futures::stream::pending()))
            }
            Behaviour::RefuseTooLong
            | Behaviour::Unreachable
            | Behaviour::FirstByteTimeout
            | Behaviour::TextOnly
            | Behaviour::TextThenLost => unreachable!("answered above"),
        })
    }

    fn session_control(&self, control: SessionControl) -> Result<(), EngineError> {
        self.sessions.lock().push(control);
        Ok(())
    }

    fn kv_dump(&self) -> Vec<KvCacheEvent> {
        self.held.lock().clone()
    }
}

pub(crate) struct Worker {
    pub(crate) id: u64,
    pub(crate) engine: Arc<FakeEngine>,
    pub(crate) server: WorkerServer,
    pub(crate) lease: Option<Lease>,
}

impl Worker {
    /// Kills the worker: connections drop, then discovery forgets it.
    pub(crate) fn kill(&mut self) {
        self.server.abort();
        self.lease.take();
    }
}

pub(crate) struct Fleet {
    pub(crate) discovery: InProcessDiscovery,
    pub(crate) plane: Arc<InProcessEventPlane>,
    pub(crate) workers: Vec<Worker>,
}

impl Fleet {
    /// `n` workers with ids 1..=n.
    pub(crate) async fn start(n: u64) -> Fleet {
        let mut fleet = Fleet {
            discovery: InProcessDiscovery::new(Duration::from_secs(30)),
            plane: Arc::new(InProcessEventPlane::new(4096)),
            workers: Vec::new(),
        };
        for id in 1..=n {
            fleet.add(id, None).await;
        }
        fleet
    }

    /// Starts worker `id`; `kv_events` sets its discovery metadata.
    pub(crate) async fn add(&mut self, id: u64, kv_events: Option<&str>) {
        self.add_role(id, kv_events, WorkerRole::Aggregated).await;
    }

    /// Starts worker `id` with `role` (a prefill worker hands over `disaggregated_params`).
    pub(crate) async fn add_role(&mut self, id: u64, kv_events: Option<&str>, role: WorkerRole) {
        let publisher = KvEventPublisher::new(id, 1024);
        let (tx, mut rx) = mpsc::unbounded_channel::<RouterEvent>();
        let plane = self.plane.clone();
        tokio::spawn(async move {
            while let Some(event) = rx.recv().await {
                let _ = plane
                    .publish(KV_EVENT_SUBJECT, encode_router_event(&event))
                    .await;
            }
        });
        let engine = Arc::new(FakeEngine {
            id,
            prefill: role == WorkerRole::Prefill,
            publisher: publisher.clone(),
            forward: tx,
            muted: AtomicBool::new(false),
            started: AtomicUsize::new(0),
            sessions: Mutex::new(Vec::new()),
            requests: Mutex::new(Vec::new()),
            held: Mutex::new(Vec::new()),
            next_block: AtomicUsize::new(0),
            forced: Mutex::new(None),
        });
        let config = WorkerServerConfig::new(id).with_kv_events(publisher);
        let server = WorkerServer::bind("127.0.0.1:0", engine.clone(), config)
            .await
            .unwrap();
        let mut info = InstanceInfo::new(id, server.local_addr().to_string(), BLOCK);
        info.role = role;
        if let Some(v) = kv_events {
            info.metadata.insert(
                kvroute_router::KV_EVENTS_METADATA_KEY.to_owned(),
                v.to_owned(),
            );
        }
        let lease = self.discovery.register(info).await.unwrap();
        self.workers.push(Worker {
            id,
            engine,
            server,
            lease: Some(lease),
        });
    }

    /// Registers worker `id` with `role` at an address where nothing listens (a port bound
    /// and released): a worker discovery lists but nobody can reach. It stays registered while
    /// the lease lives.
    pub(crate) async fn register_unreachable(&self, id: u64, role: WorkerRole) -> Lease {
        let addr = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .unwrap();
        let info = InstanceInfo::new(id, addr.to_string(), BLOCK).with_role(role);
        self.discovery.register(info).await.unwrap()
    }

    pub(crate) fn worker(&self, id: u64) -> &Worker {
        self.workers.iter().find(|w| w.id == id).unwrap()
    }

    pub(crate) fn worker_mut(&mut self, id: u64) -> &mut Worker {
        self.workers.iter_mut().find(|w| w.id == id).unwrap()
    }

    pub(crate) async fn router(&self, policy: Policy) -> KvPushRouter {
        self.router_on(self.discovery.watch(), policy).await
    }

    /// A router over the instances of `instances` (e.g. one role's).
    pub(crate) async fn router_on(
        &self,
        instances: tokio::sync::watch::Receiver<kvroute_runtime::InstanceSet>,
        policy: Policy,
    ) -> KvPushRouter {
        let mut config = KvPushRouterConfig::new(BLOCK);
        config.core.policy = policy;
        config.default_kv_mode = KvMode::Events;
        KvPushRouter::start(config, instances, self.plane.clone())
            .await
            .unwrap()
    }
}

/// Waits (bounded) until `cond` holds; panics with `what` after 5 s.
pub(crate) async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    for _ in 0..500 {
        if cond() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("timed out waiting until {what}");
}

/// Runs an async test body on a fresh multi-threaded runtime.
pub(crate) fn run<F: Future<Output = ()>>(f: F) {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
        .block_on(f);
}

/// Whether every registered worker's load reads zero and nothing is in flight.
pub(crate) fn idle(router: &KvPushRouter) -> bool {
    router.with_core(|core| {
        let workers: Vec<WorkerWithDpRank> = core.workers().collect();
        core.active_requests() == 0
            && core.scheduler().active_requests() == 0
            && workers.iter().all(|&w| {
                core.worker_load(w).is_some_and(|l| {
                    l.active_requests == 0 && l.prefill_tokens == 0 && l.decode_blocks == 0.0
                })
            })
    })
}

/// Reads a stream to its end; returns (tokens, whether an error arrived).
pub(crate) async fn drain(stream: &mut kvroute_router::KvRoutedStream) -> (usize, bool) {
    let mut tokens = 0;
    let mut failed = false;
    while let Some(item) = stream.next().await {
        match item {
            Ok(item) => {
                failed |= item.error.is_some();
                tokens += item.data.map_or(0, |d| d.token_ids.len());
            }
            Err(_) => failed = true,
        }
    }
    (tokens, failed)
}
