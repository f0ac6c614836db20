//! Request migration: when a worker dies mid-stream, the request continues on another worker
//! with its prompt plus the tokens generated so far, and the caller sees one stream.
//!
//! [`Migrator`] wraps [`KvPushRouter::generate`]. Its [`MigratingStream`] passes items through
//! and remembers the generated tokens; when the worker's stream fails with a worker-loss error
//! ([`RequestError::is_worker_unavailable`]) it drops that stream (whose guard frees the dead
//! request's load), routes a continuation that excludes every worker that failed this request,
//! and carries on, up to `max_migrations` times. Engine errors (the worker is alive and said no)
//! are never migrated: another worker would most likely say the same.

use std::pin::Pin;
use std::task::{Context, Poll};

use futures::future::BoxFuture;
use futures::{FutureExt, Stream};
use kvroute_protocols::{PreprocessedRequest, WorkerId, WorkerWithDpRank};
use kvroute_runtime::{LlmResponse, RequestError};

use crate::guard::KvRoutedStream;
use crate::push::{KvPushRouter, KvResponse, KvRouterError, QueryAnswer};
use crate::request::Routed;

/// The default number of migrations per request.
pub const DEFAULT_MAX_MIGRATIONS: u32 = 3;

/// Routes requests through a [`KvPushRouter`], migrating them when their worker dies.
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

    /// Routes and sends `request` (see [`KvPushRouter::generate`]); the stream migrates.
    pub async fn generate(
        &self,
        request: PreprocessedRequest,
    ) -> Result<MigratingResponse, KvRouterError> {
        let original = request.clone();
        match self.router.generate(request).await? {
            KvResponse::Query(answer) => Ok(MigratingResponse::Query(Box::new(answer))),
            KvResponse::Stream(stream) => {
                Ok(MigratingResponse::Stream(Box::new(MigratingStream {
                    router: self.router.clone(),
                    request: original,
                    generated: Vec::new(),
                    remaining: self.max_migrations,
                    migrations: 0,
                    failed: Vec::new(),
                    first_decision: stream.decision().clone(),
                    worker: stream.worker(),
                    state: State::Streaming(Box::new(stream)),
                    error: None,
                })))
            }
        }
    }
}

enum State {
    Streaming(Box<KvRoutedStream>),
    Rerouting(BoxFuture<'static, Result<KvResponse, KvRouterError>>),
    Done,
}

/// The items of one request across every worker that served it. Dropping it cancels the request
/// on its current worker and frees its load.
pub struct MigratingStream {
    router: KvPushRouter,
    request: PreprocessedRequest,
    generated: Vec<u32>,
    remaining: u32,
    migrations: u32,
    failed: Vec<WorkerId>,
    first_decision: Routed,
    worker: WorkerWithDpRank,
    state: State,
    /// The worker-loss error that started the current migration (returned if it fails).
    error: Option<RequestError>,
}

impl std::fmt::Debug for MigratingStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MigratingStream")
            .field("worker", &self.worker)
            .field("migrations", &self.migrations)
            .field("generated", &self.generated.len())
            .finish_non_exhaustive()
    }
}

impl MigratingStream {
    /// The first routing decision (its predicted cache hits are the request's).
    pub fn first_decision(&self) -> &Routed {
        &self.first_decision
    }

    /// The worker serving the request now.
    pub fn worker(&self) -> WorkerWithDpRank {
        self.worker
    }

    /// How many times the request moved to another worker.
    pub fn migrations(&self) -> u32 {
        self.migrations
    }

    /// The tokens generated so far, across workers.
    pub fn generated(&self) -> &[u32] {
        &self.generated
    }

    /// The continuation of the request: the prompt plus the tokens generated so far, with the
    /// token budget reduced accordingly and the failed workers excluded.
    fn continuation(&self) -> PreprocessedRequest {
        let mut req = self.request.clone();
        req.token_ids.extend_from_slice(&self.generated);
        // Multimodal routing tokens describe the original prompt only.
        req.mm_routing_info = None;
        let done = u32::try_from(self.generated.len()).unwrap_or(u32::MAX);
        let stop = &mut req.stop_conditions;
        stop.max_tokens = stop.max_tokens.map(|m| m.saturating_sub(done).max(1));
        stop.min_tokens = stop.min_tokens.map(|m| m.saturating_sub(done));
        let live: Vec<WorkerId> = self.router.with_core(|core| {
            let mut ids: Vec<WorkerId> = core.workers().map(|w| w.worker_id).collect();
            ids.dedup();
            ids
        });
        let hints = req.routing_mut();
        let allowed = hints.allowed_worker_ids.take();
        hints.allowed_worker_ids = Some(
            live.into_iter()
                .filter(|w| !self.failed.contains(w))
                .filter(|w| allowed.as_ref().is_none_or(|a| a.contains(w)))
                .collect(),
        );
        req
    }

    fn start_migration(&mut self) {
        self.remaining -= 1;
        let request = self.continuation();
        let router = self.router.clone();
        tracing::warn!(
            worker = %self.worker,
            generated = self.generated.len(),
            remaining = self.remaining,
            "worker lost mid-stream; migrating the request"
        );
        self.state = State::Rerouting(async move { router.generate(request).await }.boxed());
    }
}

impl Stream for MigratingStream {
    type Item = Result<LlmResponse, RequestError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        loop {
            match &mut this.state {
                State::Done => return Poll::Ready(None),
                State::Streaming(stream) => match Pin::new(stream.as_mut()).poll_next(cx) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(None) => {
                        this.state = State::Done;
                        return Poll::Ready(None);
                    }
                    Poll::Ready(Some(Ok(item))) => {
                        if let Some(data) = &item.data {
                            this.generated.extend_from_slice(&data.token_ids);
                        }
                        return Poll::Ready(Some(Ok(item)));
                    }
                    Poll::Ready(Some(Err(error))) => {
                        if error.is_worker_unavailable() && this.remaining > 0 {
                            this.failed.push(this.worker.worker_id);
                            this.error = Some(error);
                            // Dropping the old stream frees the dead request's load.
                            this.start_migration();
                            continue;
                        }
                        this.state = State::Done;
                        return Poll::Ready(Some(Err(error)));
                    }
                },
                State::Rerouting(future) => match future.as_mut().poll(cx) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(Ok(KvResponse::Stream(stream))) => {
                        this.migrations += 1;
                        this.worker = stream.worker();
                        this.error = None;
                        this.state = State::Streaming(Box::new(stream));
                    }
                    Poll::Ready(Ok(KvResponse::Query(_))) => {
                        // A query is answered on the first call; a continuation never is one.
                        this.state = State::Done;
                        return Poll::Ready(this.error.take().map(Err));
                    }
                    Poll::Ready(Err(KvRouterError::Send { worker, source }))
                        if this.remaining > 0 && send_lost_worker(&source) =>
                    {
                        this.failed.push(worker.worker_id);
                        this.worker = worker;
                        this.start_migration();
                    }
                    Poll::Ready(Err(route_error)) => {
                        tracing::warn!(%route_error, "migration failed");
                        this.state = State::Done;
                        let error = this
                            .error
                            .take()
                            .unwrap_or(RequestError::WorkerUnavailable {
                                addr: String::new(),
                                reason: route_error.to_string(),
                            });
                        return Poll::Ready(Some(Err(error)));
                    }
                },
            }
        }
    }
}

/// Whether a failed send lost its worker (so another worker may take the continuation).
fn send_lost_worker(error: &kvroute_runtime::RouteError) -> bool {
    match error {
        kvroute_runtime::RouteError::Request { source, .. } => source.is_worker_unavailable(),
        kvroute_runtime::RouteError::UnknownWorker { .. } => true,
        _ => false,
    }
}
