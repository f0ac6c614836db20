//! Request migration: when a worker dies mid-stream, the request continues on another worker
//! with its prompt plus the tokens generated so far, and the caller sees one stream.
//!
//! [`Migrator`] wraps [`KvPushRouter::generate`] (aggregated serving, [`MigratingStream`]) and,
//! with [`Migrator::generate_disagg`], kvroute-prefill's `PrefillRouter::generate`
//! (disaggregated serving, [`MigratingDisaggStream`]). Both streams are one state machine over
//! a small seam, `Reroute`, that routes a request the way it was first served. The stream passes
//! items through and remembers the generated tokens; when its worker's stream fails with a
//! worker-loss error ([`RequestError::is_worker_unavailable`]) it drops that stream (whose guards
//! free the dead request's load, in both phases' routers when disaggregated), routes a
//! continuation that excludes every worker that failed this request, and carries on, up to
//! `max_migrations` times. A disaggregated continuation is prefilled again on a prefill worker
//! (its prompt is longer now) and decoded on another decode worker. A request whose worker is
//! lost before it streams (a worker that cannot be reached; disaggregated, also a prefill worker
//! gone mid-prefill) is routed again the same way, within the same limit, in both modes.
//!
//! Engine errors (the worker is alive and said no) are never migrated: another worker would most
//! likely say the same. Nor is a request pinned to the worker it lost (`backend_instance_id`, or
//! the phase's own pin): the pin is honoured and the loss reaches the caller.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use futures::future::BoxFuture;
use futures::{FutureExt, Stream};
use kvroute_prefill::{DisaggStream, PrefillError, PrefillRouter, Served};
use kvroute_protocols::{
    PreprocessedRequest, PromptTokensDetails, RequestPhase, WorkerId, WorkerWithDpRank,
};
use kvroute_runtime::{LlmResponse, RequestError};

use crate::error::{KvRouterError, send_lost_worker};
use crate::guard::KvRoutedStream;
use crate::phase::KvPhaseRouter;
use crate::push::{KvPushRouter, KvResponse, QueryAnswer};
use kvroute_router_core::Routed;

/// The default number of migrations per request.
pub const DEFAULT_MAX_MIGRATIONS: u32 = 3;

/// Routes requests through a [`KvPushRouter`] (or a prefill router), migrating them when their
/// worker dies.
#[derive(Debug, Clone)]
pub struct Migrator {
    router: KvPushRouter,
    max_migrations: u32,
}

/// What [`Migrator::generate`] returns.
#[derive(Debug)]
pub enum MigratingResponse {
    /// The request was routed; its items stream back, across migrations.
    Stream(Box<MigratingStream>),
    /// The request was a query (`query_instance_id`): nothing was sent or recorded.
    Query(Box<QueryAnswer>),
}

impl Migrator {
    /// Migrates each request at most `max_migrations` times (0 disables migration).
    pub fn new(router: KvPushRouter, max_migrations: u32) -> Self {
        Self {
            router,
            max_migrations,
        }
    }

    /// The router underneath.
    pub fn router(&self) -> &KvPushRouter {
        &self.router
    }

    /// The migration limit.
    pub fn max_migrations(&self) -> u32 {
        self.max_migrations
    }

    /// Routes and sends `request` (see [`KvPushRouter::generate`]); the stream migrates. A
    /// worker that cannot be reached is replaced at once, like one lost mid-stream; the error
    /// is the last worker loss ([`KvRouterError::Send`]) once the limit is reached or when the
    /// request is pinned to the lost worker.
    pub async fn generate(
        &self,
        request: PreprocessedRequest,
    ) -> Result<MigratingResponse, KvRouterError> {
        let mut budget = Budget::new(self.max_migrations);
        let mut attempt = request.clone();
        loop {
            match self.router.generate(attempt).await {
                Ok(KvResponse::Query(answer)) => {
                    return Ok(MigratingResponse::Query(Box::new(answer)));
                }
                Ok(KvResponse::Stream(stream)) => {
                    let first_decision = stream.decision().clone();
                    let inner = Migration::new(self.router.clone(), request, budget, stream);
                    return Ok(MigratingResponse::Stream(Box::new(MigratingStream {
                        inner,
                        first_decision,
                    })));
                }
                Err(KvRouterError::Send { worker, source })
                    if send_lost_worker(&source)
                        && budget.retry_unstarted(
                            &request,
                            RequestPhase::Aggregated,
                            worker.worker_id,
                        ) =>
                {
                    tracing::warn!(
                        %worker,
                        %source,
                        remaining = budget.remaining,
                        "worker lost before the request streamed; routing it again"
                    );
                    attempt =
                        continuation(&request, &[], self.router.live_workers(), &budget.failed);
                }
                Err(error) => return Err(error),
            }
        }
    }

    /// Serves `request` through `router` (see `PrefillRouter::generate`: prefill on a prefill
    /// worker, then decode), with the same migration limit: the stream migrates when its decode
    /// (or, after a fallback, aggregated) worker dies, and a worker lost before the request
    /// streams is replaced at once. The error is the prefill router's, the last worker loss
    /// once the limit is reached or when the request is pinned to the lost worker.
    pub async fn generate_disagg(
        &self,
        router: &PrefillRouter<KvPhaseRouter>,
        request_id: &str,
        request: PreprocessedRequest,
    ) -> Result<MigratingDisaggStream, PrefillError> {
        let route = DisaggRoute {
            router: router.clone(),
            request_id: request_id.into(),
        };
        let mut budget = Budget::new(self.max_migrations);
        let mut attempt = request.clone();
        loop {
            match router.generate(request_id, attempt).await {
                Ok(stream) => {
                    let inner = Migration::new(route, request, budget, DisaggLeg(stream));
                    return Ok(MigratingDisaggStream { inner });
                }
                Err(error) => {
                    let Some((phase, worker_id)) = error.lost_worker() else {
                        return Err(error);
                    };
                    if !budget.retry_unstarted(&request, phase, worker_id) {
                        return Err(error);
                    }
                    tracing::warn!(
                        request_id,
                        %phase,
                        worker_id,
                        remaining = budget.remaining,
                        "worker lost before the request streamed; routing it again"
                    );
                    attempt = continuation(&request, &[], route.live_workers(), &budget.failed);
                }
            }
        }
    }
}

/// The items of one aggregated request across every worker that served it. Dropping it cancels
/// the request on its current worker and frees its load.
pub struct MigratingStream {
    inner: Migration<KvPushRouter>,
    first_decision: Routed,
}

impl std::fmt::Debug for MigratingStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MigratingStream")
            .field("worker", &self.inner.placement)
            .field("migrations", &self.inner.migrations)
            .field("generated", &self.inner.generated.len())
            .finish_non_exhaustive()
    }
}

impl MigratingStream {
    /// The routing decision of the first worker that streamed the request (its predicted
    /// cache hits are the request's); workers that could not be reached before do not count.
    pub fn first_decision(&self) -> &Routed {
        &self.first_decision
    }

    /// The worker serving the request now.
    pub fn worker(&self) -> WorkerWithDpRank {
        self.inner.placement
    }

    /// How many times the request moved to another worker.
    pub fn migrations(&self) -> u32 {
        self.inner.migrations
    }

    /// The tokens generated so far, across workers.
    pub fn generated(&self) -> &[u32] {
        &self.inner.generated
    }

    /// Asks the worker to finish the request gracefully (a stop string was found in its text):
    /// its last items, usage included, still arrive, and a worker lost from now on ends the
    /// stream instead of moving it.
    pub fn stop_generating(&mut self) {
        self.inner.stop_generating();
    }
}

impl Stream for MigratingStream {
    type Item = Result<LlmResponse, RequestError>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.get_mut().inner.poll_next(cx)
    }
}

/// The items of one disaggregated request across every prefill and decode worker that served
/// it. Dropping it cancels the request on its current workers and frees its load in both
/// phases' routers.
pub struct MigratingDisaggStream {
    inner: Migration<DisaggRoute>,
}

impl std::fmt::Debug for MigratingDisaggStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MigratingDisaggStream")
            .field("placement", &self.inner.placement)
            .field("migrations", &self.inner.migrations)
            .field("generated", &self.inner.generated.len())
            .finish_non_exhaustive()
    }
}

impl MigratingDisaggStream {
    /// How the request is served now.
    pub fn served(&self) -> &Served {
        &self.inner.placement.served
    }

    /// The decode (or aggregated) worker streaming the output now.
    pub fn worker(&self) -> WorkerWithDpRank {
        self.inner.placement.worker
    }

    /// The prefill worker of the current attempt, when prefill ran on one.
    pub fn prefill_worker(&self) -> Option<WorkerWithDpRank> {
        self.inner.placement.served.prefill_worker()
    }

    /// How many times the request moved to other workers.
    pub fn migrations(&self) -> u32 {
        self.inner.migrations
    }

    /// The tokens generated so far, across workers.
    pub fn generated(&self) -> &[u32] {
        &self.inner.generated
    }

    /// The prompt token details of the request's first prefill that reported any (see
    /// `DisaggStream::prefill_tokens_details`; known once the stream has ended). A migration's
    /// fresh prefill reports over the continuation's prompt (the client's prompt plus the
    /// tokens generated before the move) and counts only when no earlier prefill reported.
    pub fn prefill_tokens_details(&self) -> Option<PromptTokensDetails> {
        self.inner.prefill_details()
    }
}

impl Stream for MigratingDisaggStream {
    type Item = Result<LlmResponse, RequestError>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.get_mut().inner.poll_next(cx)
    }
}

/// How a request is routed again after a worker loss: the one seam between the migration state
/// machine and the two ways of serving (the KV push router; the prefill router over both
/// phases' KV routers).
trait Reroute: Send + Sync + 'static {
    /// One routed attempt; dropping it cancels the request on its workers and frees its load.
    type Stream: Stream<Item = Result<LlmResponse, RequestError>> + Unpin + Send + 'static;
    /// Where an attempt runs.
    type Placement: Clone + Send + 'static;

    /// Where `stream` runs.
    fn placement(stream: &Self::Stream) -> Self::Placement;

    /// The prompt token details a prefill worker reported for `stream`, if one did.
    fn prefill_details(_stream: &Self::Stream) -> Option<PromptTokensDetails> {
        None
    }

    /// Asks the worker streaming `stream` to finish gracefully (the default asks nothing: the
    /// stream runs to its end).
    fn stop_generating(_stream: &mut Self::Stream) {}

    /// The worker streaming the output of an attempt, and the phase whose pin would name it.
    fn output(placement: &Self::Placement) -> (WorkerWithDpRank, RequestPhase);

    /// The workers the routers know now: those a continuation may go to, less the failed ones.
    fn live_workers(&self) -> Vec<WorkerId>;

    /// Routes and sends `request`.
    fn route(
        &self,
        request: PreprocessedRequest,
    ) -> BoxFuture<'static, Result<Self::Stream, Refusal>>;
}

/// Why an attempt could not be routed.
enum Refusal {
    /// The worker of `phase` could not be reached: another may take the request.
    Lost {
        phase: RequestPhase,
        worker_id: WorkerId,
    },
    /// Anything else; the migration ends.
    Failed(String),
}

impl Reroute for KvPushRouter {
    type Stream = KvRoutedStream;
    type Placement = WorkerWithDpRank;

    fn placement(stream: &KvRoutedStream) -> WorkerWithDpRank {
        stream.worker()
    }

    fn output(placement: &WorkerWithDpRank) -> (WorkerWithDpRank, RequestPhase) {
        (*placement, RequestPhase::Aggregated)
    }

    fn stop_generating(stream: &mut KvRoutedStream) {
        stream.runtime_stream().stream_mut().stop();
    }

    fn live_workers(&self) -> Vec<WorkerId> {
        self.with_core(|core| worker_ids(core))
    }

    fn route(
        &self,
        request: PreprocessedRequest,
    ) -> BoxFuture<'static, Result<KvRoutedStream, Refusal>> {
        let router = self.clone();
        async move {
            match router.generate(request).await {
                Ok(KvResponse::Stream(stream)) => Ok(stream),
                // A query is answered on the first call; a continuation never is one.
                Ok(KvResponse::Query(_)) => Err(Refusal::Failed(
                    "a continuation was answered as a query".to_owned(),
                )),
                Err(KvRouterError::Send { worker, source }) if send_lost_worker(&source) => {
                    Err(Refusal::Lost {
                        phase: RequestPhase::Aggregated,
                        worker_id: worker.worker_id,
                    })
                }
                Err(error) => Err(Refusal::Failed(error.to_string())),
            }
        }
        .boxed()
    }
}

/// The prefill router, routing one request (by its id) again.
struct DisaggRoute {
    router: PrefillRouter<KvPhaseRouter>,
    request_id: Arc<str>,
}

/// A disaggregated attempt's stream, its transport failures typed.
struct DisaggLeg(DisaggStream);

impl Stream for DisaggLeg {
    type Item = Result<LlmResponse, RequestError>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.get_mut().0.poll_result(cx)
    }
}

/// Where a disaggregated attempt runs.
#[derive(Debug, Clone)]
struct DisaggPlacement {
    /// The decode (or aggregated) worker.
    worker: WorkerWithDpRank,
    served: Served,
}

impl Reroute for DisaggRoute {
    type Stream = DisaggLeg;
    type Placement = DisaggPlacement;

    fn placement(stream: &DisaggLeg) -> DisaggPlacement {
        DisaggPlacement {
            worker: stream.0.worker(),
            served: stream.0.served().clone(),
        }
    }

    fn prefill_details(stream: &DisaggLeg) -> Option<PromptTokensDetails> {
        stream.0.prefill_tokens_details()
    }

    fn output(placement: &DisaggPlacement) -> (WorkerWithDpRank, RequestPhase) {
        let phase = match placement.served {
            Served::Aggregated => RequestPhase::Aggregated,
            _ => RequestPhase::Decode,
        };
        (placement.worker, phase)
    }

    fn live_workers(&self) -> Vec<WorkerId> {
        let phases = self.router.phases();
        let mut ids = phases
            .router(RequestPhase::Prefill)
            .with_core(|core| worker_ids(core));
        ids.extend(
            phases
                .router(RequestPhase::Decode)
                .with_core(|core| worker_ids(core)),
        );
        ids.sort_unstable();
        ids.dedup();
        ids
    }

    fn route(
        &self,
        request: PreprocessedRequest,
    ) -> BoxFuture<'static, Result<DisaggLeg, Refusal>> {
        let router = self.router.clone();
        let request_id = Arc::clone(&self.request_id);
        async move {
            match router.generate(&request_id, request).await {
                Ok(stream) => Ok(DisaggLeg(stream)),
                Err(error) => Err(match error.lost_worker() {
                    Some((phase, worker_id)) => Refusal::Lost { phase, worker_id },
                    None => Refusal::Failed(error.to_string()),
                }),
            }
        }
        .boxed()
    }
}

fn worker_ids<S: kvroute_sessions::AffinityStore>(
    core: &kvroute_router_core::KvRouterCore<S>,
) -> Vec<WorkerId> {
    let mut ids: Vec<WorkerId> = core.workers().map(|w| w.worker_id).collect();
    ids.sort_unstable();
    ids.dedup();
    ids
}

/// What is left of a request's migrations, and the workers it lost.
#[derive(Debug)]
struct Budget {
    remaining: u32,
    failed: Vec<WorkerId>,
}

impl Budget {
    fn new(max_migrations: u32) -> Self {
        Self {
            remaining: max_migrations,
            failed: Vec::new(),
        }
    }

    /// Whether `request` may move off `worker_id`, lost in `phase`: not once the limit is
    /// reached, and not when the request pins that phase to that very worker (the pin is
    /// honoured, so the loss is the caller's to see).
    fn may_move(
        &self,
        request: &PreprocessedRequest,
        phase: RequestPhase,
        worker_id: WorkerId,
    ) -> bool {
        if self.remaining == 0 {
            return false;
        }
        let pinned = request
            .routing
            .as_ref()
            .and_then(|r| r.pinned_worker(phase));
        if pinned == Some(worker_id) {
            tracing::warn!(
                %phase,
                worker_id,
                "the request is pinned to the worker it lost; not migrating it"
            );
            return false;
        }
        true
    }

    /// Spends one migration on the loss of `worker_id`.
    fn lost(&mut self, worker_id: WorkerId) {
        self.remaining -= 1;
        self.failed.push(worker_id);
    }

    /// Excludes `worker_id`, whose engine could not be reached, at no cost: nothing was sent
    /// there, and each worker is excluded once, so such moves are bounded by the fleet's size.
    fn unreachable(&mut self, worker_id: WorkerId) {
        self.failed.push(worker_id);
    }

    /// Whether `request` may move off `worker_id`, whose engine could not be reached: always,
    /// unless the request pins that worker.
    fn may_skip(
        &self,
        request: &PreprocessedRequest,
        phase: RequestPhase,
        worker_id: WorkerId,
    ) -> bool {
        let pinned = request
            .routing
            .as_ref()
            .and_then(|r| r.pinned_worker(phase));
        pinned != Some(worker_id) && !self.failed.contains(&worker_id)
    }

    /// For a request whose `worker_id` was lost in `phase` before it streamed: whether to route
    /// it again, spending a migration on the loss if so (see [`Self::may_move`]).
    fn retry_unstarted(
        &mut self,
        request: &PreprocessedRequest,
        phase: RequestPhase,
        worker_id: WorkerId,
    ) -> bool {
        let retry = self.may_move(request, phase, worker_id);
        if retry {
            self.lost(worker_id);
        }
        retry
    }
}

/// The continuation of `request` after `generated` tokens: the prompt plus those tokens, with
/// the token budget reduced accordingly, allowed only on the `live` workers that did not fail it
/// (and that the client allowed).
fn continuation(
    request: &PreprocessedRequest,
    generated: &[u32],
    live: Vec<WorkerId>,
    failed: &[WorkerId],
) -> PreprocessedRequest {
    let mut req = request.clone();
    req.token_ids.extend_from_slice(generated);
    // Multimodal routing tokens describe the original prompt only.
    if !generated.is_empty() {
        req.mm_routing_info = None;
    }
    let done = u32::try_from(generated.len()).unwrap_or(u32::MAX);
    let stop = &mut req.stop_conditions;
    stop.max_tokens = stop.max_tokens.map(|m| m.saturating_sub(done).max(1));
    stop.min_tokens = stop.min_tokens.map(|m| m.saturating_sub(done));
    let hints = req.routing_mut();
    let allowed = hints.allowed_worker_ids.take();
    hints.allowed_worker_ids = Some(
        live.into_iter()
            .filter(|w| !failed.contains(w))
            .filter(|w| allowed.as_ref().is_none_or(|a| a.contains(w)))
            .collect(),
    );
    req
}

enum State<S> {
    Streaming(Box<S>),
    Rerouting(BoxFuture<'static, Result<S, Refusal>>),
    Done,
}

/// One request across the workers that served it: the state machine both migrating streams
/// share.
struct Migration<R: Reroute> {
    router: R,
    request: PreprocessedRequest,
    generated: Vec<u32>,
    budget: Budget,
    migrations: u32,
    placement: R::Placement,
    state: State<R::Stream>,
    /// The worker-loss error that started the current migration (returned if it fails).
    error: Option<RequestError>,
    /// The prompt token details of the first prefill that reported any, taken from each
    /// attempt's stream before it is dropped.
    prefill_details: Option<PromptTokensDetails>,
    /// The caller asked the worker to stop: a lost worker ends the stream rather than moving it.
    stopping: bool,
    /// Output arrived as text without token ids: it cannot be continued elsewhere.
    text_only: bool,
}

impl<R: Reroute> Migration<R> {
    /// The request streaming from `stream`; a `budget` already spent on workers lost before it
    /// streamed counts as one move.
    fn new(router: R, request: PreprocessedRequest, budget: Budget, stream: R::Stream) -> Self {
        Self {
            router,
            request,
            generated: Vec::new(),
            migrations: u32::from(!budget.failed.is_empty()),
            budget,
            placement: R::placement(&stream),
            state: State::Streaming(Box::new(stream)),
            error: None,
            prefill_details: None,
            stopping: false,
            text_only: false,
        }
    }

    /// Asks the current worker to finish gracefully; no migration happens after this.
    fn stop_generating(&mut self) {
        self.stopping = true;
        if let State::Streaming(stream) = &mut self.state {
            R::stop_generating(stream);
        }
    }

    /// The first reported prefill details: an earlier attempt's, else the current one's.
    fn prefill_details(&self) -> Option<PromptTokensDetails> {
        self.prefill_details.or_else(|| match &self.state {
            State::Streaming(stream) => R::prefill_details(stream),
            _ => None,
        })
    }

    /// Keeps the current attempt's prefill details (when none were kept yet) before its stream
    /// is dropped.
    fn keep_prefill_details(&mut self) {
        self.prefill_details = self.prefill_details();
    }

    /// Spends a migration on the loss of `worker_id` and routes the continuation; replacing the
    /// state drops the old stream, which frees the dead request's load.
    fn start_migration(&mut self, worker_id: WorkerId) {
        self.budget.lost(worker_id);
        tracing::warn!(
            worker_id,
            generated = self.generated.len(),
            remaining = self.budget.remaining,
            "worker lost mid-stream; migrating the request"
        );
        self.reroute();
    }

    /// Routes the continuation (after the budget recorded the failed worker).
    fn reroute(&mut self) {
        let request = continuation(
            &self.request,
            &self.generated,
            self.router.live_workers(),
            &self.budget.failed,
        );
        self.state = State::Rerouting(self.router.route(request));
    }

    fn poll_next(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<LlmResponse, RequestError>>> {
        loop {
            match &mut self.state {
                State::Done => return Poll::Ready(None),
                State::Streaming(stream) => match Pin::new(stream.as_mut()).poll_next(cx) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(None) => {
                        self.keep_prefill_details();
                        self.state = State::Done;
                        return Poll::Ready(None);
                    }
                    Poll::Ready(Some(Ok(item))) => {
                        if let Some(data) = &item.data {
                            self.generated.extend_from_slice(&data.token_ids);
                            if data.token_ids.is_empty()
                                && data.text.as_deref().is_some_and(|t| !t.is_empty())
                            {
                                self.text_only = true;
                            }
                        }
                        return Poll::Ready(Some(Ok(item)));
                    }
                    Poll::Ready(Some(Err(error))) => {
                        self.keep_prefill_details();
                        let (worker, phase) = R::output(&self.placement);
                        if error.is_unreachable()
                            && self.generated.is_empty()
                            && !self.stopping
                            && self.budget.may_skip(&self.request, phase, worker.worker_id)
                        {
                            tracing::warn!(
                                worker_id = worker.worker_id,
                                %error,
                                "the worker's engine cannot be reached; sending the request to \
                                 another worker (no migration spent)"
                            );
                            self.error = Some(error);
                            self.budget.unreachable(worker.worker_id);
                            self.reroute();
                            continue;
                        }
                        if error.is_timeout() && self.generated.is_empty() {
                            tracing::warn!(
                                worker_id = worker.worker_id,
                                %error,
                                "no first token within the limit; moving the request"
                            );
                        }
                        if self.text_only && error.is_worker_unavailable() {
                            // The engine streamed text without token ids (the `openai`
                            // dialect): a continuation cannot be built from what the client
                            // already has, and starting over would repeat it.
                            tracing::warn!(
                                worker_id = worker.worker_id,
                                %error,
                                "worker lost after streaming text without token ids; ending the \
                                 stream instead of migrating it"
                            );
                            self.state = State::Done;
                            return Poll::Ready(Some(Err(RequestError::Engine {
                                message: format!(
                                    "worker {} was lost mid-stream and its engine streams text \
                                     without token ids, so the answer cannot be continued on \
                                     another worker: {error}",
                                    worker.worker_id
                                ),
                            })));
                        }
                        if error.is_worker_unavailable()
                            && !self.stopping
                            && self.budget.may_move(&self.request, phase, worker.worker_id)
                        {
                            self.error = Some(error);
                            self.start_migration(worker.worker_id);
                            continue;
                        }
                        self.state = State::Done;
                        return Poll::Ready(Some(Err(error)));
                    }
                },
                State::Rerouting(future) => match future.as_mut().poll(cx) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(Ok(stream)) => {
                        self.migrations += 1;
                        self.placement = R::placement(&stream);
                        self.error = None;
                        self.state = State::Streaming(Box::new(stream));
                    }
                    Poll::Ready(Err(Refusal::Lost { phase, worker_id }))
                        if self.budget.may_move(&self.request, phase, worker_id) =>
                    {
                        self.start_migration(worker_id);
                    }
                    Poll::Ready(Err(refusal)) => {
                        let reason = match refusal {
                            Refusal::Lost { phase, worker_id } => {
                                format!("{phase} worker {worker_id} is unavailable")
                            }
                            Refusal::Failed(reason) => reason,
                        };
                        tracing::warn!(%reason, "migration failed");
                        self.state = State::Done;
                        let error = self
                            .error
                            .take()
                            .unwrap_or(RequestError::WorkerUnavailable {
                                addr: String::new(),
                                reason,
                            });
                        return Poll::Ready(Some(Err(error)));
                    }
                },
            }
        }
    }
}
