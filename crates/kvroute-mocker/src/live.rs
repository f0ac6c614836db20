//! The real-time adapter: the engine core served as a kvroute-runtime worker.
//!
//! A driver task maps tokio time onto the core's virtual time (the core's `Duration` is the time
//! since the adapter started), calls `advance_to(now)`, streams each generated token to its
//! request the moment its step ends, publishes the KV events through a [`KvEventPublisher`], and
//! sleeps until the core's next wake-up or until a request, cancellation or session call arrives.
//! Under tokio's paused test clock the tokens therefore arrive exactly at the modelled times.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use kvroute_protocols::kv_events::{
    ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheStoreData,
    KvCacheStoredBlockData, LocalBlockHash,
};
use kvroute_protocols::{
    Annotated, CompletionUsage, DpRank, FinishReason as WireFinish, LLMEngineOutput,
    PreprocessedRequest, PromptTokensDetails, SessionAction, SessionControl,
};
use kvroute_runtime::{EngineError, KvEventPublisher, RequestContext, ResponseStream};
use parking_lot::Mutex;
use tokio::sync::{Notify, mpsc, oneshot};
use tokio::time::Instant;

use crate::config::{ConfigError, MockerConfig};
use crate::engine::Engine;
use crate::request::{FinishReason, Request, RequestId, StepOutput};

/// Output budget of a request that states no `max_tokens`.
pub const DEFAULT_MAX_TOKENS: u32 = 256;

/// One response item of an LLM stream.
type LlmResponse = Annotated<LLMEngineOutput>;

/// A simulated engine served in real time. Implements [`kvroute_runtime::Engine`], so
/// `WorkerServer::serve(listener, Arc::new(mocker), config)` turns it into a worker.
///
/// Dropping the last handle stops the driver task.
pub struct LiveMocker {
    shared: Arc<Shared>,
}

struct Shared {
    state: Mutex<State>,
    wake: Notify,
    publisher: KvEventPublisher,
    dp_rank: DpRank,
    start: Instant,
}

struct State {
    engine: Engine,
    next_id: RequestId,
    active: HashMap<RequestId, Active>,
    shutdown: bool,
}

struct Active {
    tx: mpsc::UnboundedSender<LlmResponse>,
    context: RequestContext,
    prompt_tokens: u32,
    /// Dropped when the request ends, which ends its cancellation watcher.
    _done: oneshot::Sender<()>,
}

impl LiveMocker {
    /// Starts an engine whose KV events go to `publisher` (which numbers them); must be called
    /// inside a tokio runtime, which runs the driver task.
    pub fn spawn(
        config: MockerConfig,
        dp_rank: DpRank,
        publisher: KvEventPublisher,
    ) -> Result<Self, ConfigError> {
        let engine = Engine::new(config, dp_rank)?;
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                engine,
                next_id: 0,
                active: HashMap::new(),
                shutdown: false,
            }),
            wake: Notify::new(),
            publisher,
            dp_rank,
            start: Instant::now(),
        });
        tokio::spawn(drive(Arc::clone(&shared)));
        Ok(Self { shared })
    }

    /// The publisher the engine's KV events go to.
    pub fn publisher(&self) -> &KvEventPublisher {
        &self.shared.publisher
    }

    fn now(&self) -> Duration {
        self.shared.start.elapsed()
    }
}

impl Drop for LiveMocker {
    fn drop(&mut self) {
        self.shared.state.lock().shutdown = true;
        self.shared.wake.notify_one();
    }
}

impl kvroute_runtime::Engine for LiveMocker {
    type Request = PreprocessedRequest;
    type Response = LlmResponse;

    fn generate(
        &self,
        request: PreprocessedRequest,
        context: RequestContext,
    ) -> Result<ResponseStream<LlmResponse>, EngineError> {
        let now = self.now();
        let control = request
            .routing
            .as_ref()
            .and_then(|r| r.session_control.clone());
        let prompt_tokens = request.token_ids.len() as u32;
        let max_output_tokens = request
            .stop_conditions
            .max_tokens
            .unwrap_or(DEFAULT_MAX_TOKENS);
        let (tx, mut rx) = mpsc::unbounded_channel();
        let (done_tx, done_rx) = oneshot::channel();
        {
            let mut state = self.shared.state.lock();
            let session = match control {
                Some(control) => apply_session_control(&mut state.engine, now, &control),
                None => None,
            };
            let id = state.next_id;
            state.next_id += 1;
            let request = Request {
                id,
                tokens: request.token_ids,
                max_output_tokens,
                session,
            };
            state
                .engine
                .add_request(now, request)
                .map_err(|e| EngineError::Rejected {
                    message: e.to_string(),
                })?;
            state.active.insert(
                id,
                Active {
                    tx,
                    context: context.clone(),
                    prompt_tokens,
                    _done: done_tx,
                },
            );
        }
        let shared = Arc::clone(&self.shared);
        tokio::spawn(async move {
            // A stop must reach the driver even while it sleeps until a far wake-up.
            tokio::select! {
                () = context.stopped() => shared.wake.notify_one(),
                _ = done_rx => {}
            }
        });
        self.shared.wake.notify_one();
        Ok(Box::pin(futures::stream::poll_fn(move |cx| {
            rx.poll_recv(cx)
        })))
    }

    fn session_control(&self, control: SessionControl) -> Result<(), EngineError> {
        let now = self.now();
        apply_session_control(&mut self.shared.state.lock().engine, now, &control);
        self.shared.wake.notify_one();
        Ok(())
    }

    fn kv_dump(&self) -> Vec<KvCacheEvent> {
        let state = self.shared.state.lock();
        // kvroute's snapshot format: one parentless block per event whose tokens hash carries the
        // sequence hash, which an index takes as the block's sequence hash unchanged.
        state
            .engine
            .cached_block_hashes()
            .into_iter()
            .map(|h| KvCacheEvent {
                event_id: 0,
                data: KvCacheEventData::Stored(KvCacheStoreData {
                    parent_hash: None,
                    blocks: vec![KvCacheStoredBlockData {
                        block_hash: ExternalSequenceBlockHash(h),
                        tokens_hash: LocalBlockHash(h),
                    }],
                }),
                dp_rank: self.shared.dp_rank,
            })
            .collect()
    }
}

/// Applies an open, bind or close; returns the session a request carrying `control` joins.
///
/// A close frees the session at once: the blocks it held stay cached (only evictable), so the
/// closing turn still finds its prefix, and the turn itself is not retained.
fn apply_session_control(
    engine: &mut Engine,
    now: Duration,
    control: &SessionControl,
) -> Option<String> {
    let name = control.session_id.as_str();
    match control.action {
        Some(SessionAction::Open) => {
            engine.open_session(now, name, Some(Duration::from_secs(control.timeout)));
            Some(name.to_owned())
        }
        Some(SessionAction::Close) => {
            engine.close_session(now, name);
            None
        }
        // An unknown session on a bind or a later turn (it timed out) serves the request
        // without retention rather than refusing it.
        _ => engine.has_session(name).then(|| name.to_owned()),
    }
}

async fn drive(shared: Arc<Shared>) {
    let mut out = StepOutput::default();
    loop {
        let next = {
            let mut state = shared.state.lock();
            if state.shutdown {
                return;
            }
            let now = shared.start.elapsed();
            state.cancel_abandoned(now, &mut out);
            state.engine.advance_into(now, &mut out);
            state.deliver(&out, &shared);
            out.clear();
            state.engine.next_wakeup()
        };
        // `notify_one` stores a permit when nobody waits, so a wake between unlocking and
        // awaiting here is not lost.
        match next {
            Some(at) => {
                tokio::select! {
                    () = tokio::time::sleep_until(shared.start + at) => {}
                    () = shared.wake.notified() => {}
                }
            }
            None => shared.wake.notified().await,
        }
    }
}

impl State {
    /// Cancels requests whose caller stopped them or dropped the stream.
    fn cancel_abandoned(&mut self, now: Duration, out: &mut StepOutput) {
        let gone: Vec<RequestId> = self
            .active
            .iter()
            .filter(|(_, a)| a.context.is_stopped() || a.tx.is_closed())
            .map(|(&id, _)| id)
            .collect();
        for id in gone {
            self.engine.cancel(now, id, out);
        }
    }

    fn deliver(&mut self, out: &StepOutput, shared: &Shared) {
        for token in &out.tokens {
            if let Some(active) = self.active.get(&token.request_id) {
                let item = LLMEngineOutput {
                    token_ids: vec![token.token],
                    ..LLMEngineOutput::default()
                };
                // A closed stream is noticed and cancelled at the next wake-up.
                let _ = active.tx.send(Annotated::from_data(item));
            }
        }
        for finished in &out.finished {
            let Some(active) = self.active.remove(&finished.request_id) else {
                continue;
            };
            let last = match finished.reason {
                FinishReason::Length => LLMEngineOutput {
                    finish_reason: Some(WireFinish::Length),
                    completion_usage: Some(CompletionUsage {
                        prompt_tokens: active.prompt_tokens,
                        completion_tokens: finished.output_tokens,
                        total_tokens: active.prompt_tokens + finished.output_tokens,
                        prompt_tokens_details: Some(PromptTokensDetails {
                            audio_tokens: None,
                            cached_tokens: Some(finished.cached_prompt_tokens),
                        }),
                    }),
                    ..LLMEngineOutput::default()
                },
                _ if active.context.is_killed() => continue,
                _ => LLMEngineOutput::cancelled(),
            };
            let _ = active.tx.send(Annotated::from_data(last));
        }
        for event in &out.events {
            shared.publisher.publish(shared.dp_rank, event.data.clone());
        }
    }
}
