//! The real-time adapter: the engine core served as a kvroute-runtime worker.
//!
//! A driver task maps tokio time onto the core's virtual time (the core's `Duration` is the time
//! since the adapter started), calls `advance_to(now)`, streams each generated token to its
//! request the moment its step ends, publishes the KV events through a [`KvEventPublisher`], and
//! sleeps until the core's next wake-up or until a request, cancellation or session call arrives.
//! Under tokio's paused test clock the tokens therefore arrive exactly at the modelled times.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use kvroute_protocols::kv_events::{
    ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheStoreData,
    KvCacheStoredBlockData, LocalBlockHash,
};
use kvroute_protocols::{
    Annotated, CompletionUsage, DpRank, FinishReason as WireFinish, LLMEngineOutput,
    PreprocessedRequest, PromptTokensDetails, SessionAction, SessionControl, WorkerLoadReport,
};
use kvroute_runtime::{EngineError, KvEventPublisher, RequestContext, ResponseStream};
use parking_lot::Mutex;
use tokio::sync::{Notify, mpsc, oneshot};
use tokio::time::Instant;

use crate::config::{ConfigError, MockerConfig};
use crate::disagg::{self, KvSource, Role};
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
    /// The disaggregated-serving role; `None` serves every request whole.
    role: Option<Role>,
    block_size: u32,
    speedup: f64,
    /// Decode requests fetching their prompt's KV, not yet in the engine.
    fetching: AtomicUsize,
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
    /// Set on a prefill worker: the params its token carries and the room it fills.
    prefill: Option<PrefillTag>,
    /// Set on a decode worker given a prefill result with prompt token details: the details it
    /// reports instead of its own (see [`prefill_details`]).
    prefill_details: Option<PromptTokensDetails>,
    /// Dropped when the request ends, which ends its cancellation watcher.
    _done: oneshot::Sender<()>,
}

struct PrefillTag {
    params: serde_json::Value,
    room: Option<u64>,
}

/// A request ready to enter the engine.
struct Admission {
    request: PreprocessedRequest,
    max_output_tokens: u32,
    prefilled: bool,
    prefill: Option<PrefillTag>,
    tx: mpsc::UnboundedSender<LlmResponse>,
    context: RequestContext,
    done: oneshot::Sender<()>,
}

impl LiveMocker {
    /// Starts an engine whose KV events go to `publisher` (which numbers them); must be called
    /// inside a tokio runtime, which runs the driver task.
    pub fn spawn(
        config: MockerConfig,
        dp_rank: DpRank,
        publisher: KvEventPublisher,
    ) -> Result<Self, ConfigError> {
        Self::spawn_inner(config, dp_rank, publisher, None)
    }

    /// Like [`Self::spawn`], with a disaggregated-serving `role` (see [`crate::disagg`]).
    pub fn spawn_with_role(
        config: MockerConfig,
        dp_rank: DpRank,
        publisher: KvEventPublisher,
        role: Role,
    ) -> Result<Self, ConfigError> {
        Self::spawn_inner(config, dp_rank, publisher, Some(role))
    }

    fn spawn_inner(
        config: MockerConfig,
        dp_rank: DpRank,
        publisher: KvEventPublisher,
        role: Option<Role>,
    ) -> Result<Self, ConfigError> {
        let block_size = config.block_size;
        let speedup = config.speedup;
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
            role,
            block_size,
            speedup,
            fetching: AtomicUsize::new(0),
        });
        tokio::spawn(drive(Arc::clone(&shared)));
        Ok(Self { shared })
    }

    /// The publisher the engine's KV events go to.
    pub fn publisher(&self) -> &KvEventPublisher {
        &self.shared.publisher
    }

    /// The engine's own load now, as its worker reports it: requests in the running batch,
    /// requests waiting (queued, preempted, or fetching their prompt's KV from a prefill
    /// worker), KV blocks referenced by a sequence or a session, and the blocks it has in all.
    pub fn load_report(&self) -> WorkerLoadReport {
        let shared = &self.shared;
        let (running, waiting, usage) = {
            let state = shared.state.lock();
            (
                state.engine.num_running(),
                state.engine.num_waiting(),
                state.engine.kv_usage(),
            )
        };
        let waiting = waiting + shared.fetching.load(Ordering::Relaxed);
        WorkerLoadReport::new(shared.publisher.worker_id())
            .with_dp_rank(shared.dp_rank)
            .with_requests(running as u64, waiting as u64)
            .with_kv_used_blocks(usage.used as u64)
            .with_kv_total_blocks(usage.capacity as u64)
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
        let shared = &self.shared;
        let mut max_output_tokens = request
            .stop_conditions
            .max_tokens
            .unwrap_or(DEFAULT_MAX_TOKENS);
        let mut prefill = None;
        if let Some(Role::Prefill { worker_id, rooms }) = &shared.role {
            // A prefill worker only prefills: one token, whatever the budget says.
            max_output_tokens = 1;
            let params = disagg::prefill_params(
                *worker_id,
                shared.dp_rank,
                &request.token_ids,
                shared.block_size,
            );
            let room = request.bootstrap_info.as_ref().map(|i| i.bootstrap_room);
            if room.is_some() && rooms.is_none() {
                return Err(EngineError::Rejected {
                    message: "bootstrap_info given, but this prefill worker runs no bootstrap \
                              server; expected a request without bootstrap_info"
                        .to_owned(),
                });
            }
            prefill = Some(PrefillTag { params, room });
        }
        let source = disagg::kv_source(shared.role.as_ref(), &request);
        if let KvSource::Result(params) = &source {
            disagg::check_params(params, &request.token_ids, shared.block_size)
                .map_err(|message| EngineError::Rejected { message })?;
        }
        let (tx, mut rx) = mpsc::unbounded_channel();
        let (done_tx, done_rx) = oneshot::channel();
        let admission = Admission {
            request,
            max_output_tokens,
            prefilled: source != KvSource::Local,
            prefill,
            tx,
            context: context.clone(),
            done: done_tx,
        };
        match source {
            KvSource::Local => admit(shared, admission)?,
            remote => {
                tokio::spawn(fetch_then_admit(Arc::clone(shared), remote, admission));
            }
        }
        let shared = Arc::clone(shared);
        tokio::spawn(async move {
            // A stop must reach the driver even while it sleeps until a far wake-up.
            tokio::select! {
                () = context.stopped() => shared.wake.notify_one(),
                _ = done_rx => {}
            }
        });
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

/// Puts a request into the engine and registers its stream.
fn admit(shared: &Shared, admission: Admission) -> Result<(), EngineError> {
    let Admission {
        request,
        max_output_tokens,
        prefilled,
        prefill,
        tx,
        context,
        done,
    } = admission;
    let now = shared.start.elapsed();
    let control = request
        .routing
        .as_ref()
        .and_then(|r| r.session_control.clone());
    let prompt_tokens = request.token_ids.len() as u32;
    let prefill_details = prefill_details(shared.role.as_ref(), &request);
    let mut state = shared.state.lock();
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
    let added = if prefilled {
        state.engine.add_prefilled_request(now, request)
    } else {
        state.engine.add_request(now, request)
    };
    added.map_err(|e| EngineError::Rejected {
        message: e.to_string(),
    })?;
    state.active.insert(
        id,
        Active {
            tx,
            context,
            prompt_tokens,
            prefill,
            prefill_details,
            _done: done,
        },
    );
    drop(state);
    shared.wake.notify_one();
    Ok(())
}

/// The prompt token details a decode worker reports for `request`: those of the prefill
/// result, when it carries any. Like Dynamo's decode handlers, which copy
/// `prefill_result.prompt_tokens_details` into their usage: the prompt was computed, and its
/// cache hits found, on the prefill worker, while the decode worker's own cache only received
/// the transferred KV.
fn prefill_details(
    role: Option<&Role>,
    request: &PreprocessedRequest,
) -> Option<PromptTokensDetails> {
    if !matches!(role, Some(Role::Decode(_))) {
        return None;
    }
    request.prefill_result.as_ref()?.prompt_tokens_details
}

/// Fetches a decode request's prompt KV (bootstrap pull, then the modelled transfer) and admits
/// it; a failure or a cancellation while fetching ends the stream with an error item.
async fn fetch_then_admit(shared: Arc<Shared>, source: KvSource, admission: Admission) {
    let Some(Role::Decode(config)) = &shared.role else {
        return;
    };
    let tokens = admission.request.token_ids.len();
    let transfer = disagg::transfer_time(config, tokens, shared.block_size, shared.speedup);
    shared.fetching.fetch_add(1, Ordering::Relaxed);
    let fetching = Fetching(&shared.fetching);
    let fetch = async {
        if let KvSource::Bootstrap(info) = &source {
            let params = disagg::pull(info, config.pull_timeout).await?;
            disagg::check_params(&params, &admission.request.token_ids, shared.block_size)?;
        }
        tokio::time::sleep(transfer).await;
        Ok::<(), String>(())
    };
    let fetched = tokio::select! {
        fetched = fetch => fetched,
        () = admission.context.stopped() => return,
        () = admission.tx.closed() => return,
    };
    // Counted in the engine's queue from here on.
    drop(fetching);
    let tx = admission.tx.clone();
    let result = fetched.and_then(|()| admit(&shared, admission).map_err(|e| e.to_string()));
    if let Err(message) = result {
        let _ = tx.send(Annotated::from_error(format!(
            "cannot fetch the prefilled KV: {message}"
        )));
    }
}

/// Counts a request out of [`Shared::fetching`] however its fetch ends.
struct Fetching<'a>(&'a AtomicUsize);

impl Drop for Fetching<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
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
                let disaggregated_params = active
                    .prefill
                    .as_ref()
                    .filter(|_| token.index == 0)
                    .map(|p| p.params.clone());
                let item = LLMEngineOutput {
                    token_ids: vec![token.token],
                    disaggregated_params,
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
            if let (
                Some(Role::Prefill {
                    rooms: Some(rooms), ..
                }),
                Some(tag),
            ) = (&shared.role, &active.prefill)
                && let Some(room) = tag.room
            {
                let outcome = match finished.reason {
                    FinishReason::Length => Ok(tag.params.clone()),
                    _ => Err("the prefill was cancelled".to_owned()),
                };
                rooms.post(room, outcome);
            }
            let last = match finished.reason {
                FinishReason::Length => LLMEngineOutput {
                    finish_reason: Some(WireFinish::Length),
                    completion_usage: Some(CompletionUsage {
                        prompt_tokens: active.prompt_tokens,
                        completion_tokens: finished.output_tokens,
                        total_tokens: active.prompt_tokens + finished.output_tokens,
                        prompt_tokens_details: Some(active.prefill_details.unwrap_or(
                            PromptTokensDetails {
                                audio_tokens: None,
                                cached_tokens: Some(finished.cached_prompt_tokens),
                            },
                        )),
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
