//! The request guard: whatever happens to a routed request, its load leaves the scheduler.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use futures::Stream;
use kvroute_protocols::WorkerWithDpRank;
use kvroute_protocols::annotated::ERROR_EVENT;
use kvroute_runtime::{LlmResponse, LlmRoutedStream, RequestError};
use kvroute_scheduler::RequestId;

use crate::load_sync::Local;
use crate::metrics::Outcome;
use crate::shared::Inner;
use kvroute_router_core::Routed;

/// Tracks one routed request in the core until it ends: marks prefill complete at the first
/// token, grows the output blocks as tokens arrive, and frees the request exactly once, on
/// completion ([`RequestGuard::finish`]), on failure ([`RequestGuard::fail`]), or when dropped
/// unfinished (cancellation, a panic, a dropped future), running the session commands that
/// ending implies (the deferred `close`, or closing a session the request opened).
#[derive(Debug)]
pub struct RequestGuard {
    inner: Arc<Inner>,
    id: RequestId,
    worker: WorkerWithDpRank,
    sent: Instant,
    last_tokens: Option<Instant>,
    output_tokens: u64,
    done: bool,
}

impl RequestGuard {
    pub(crate) fn new(inner: Arc<Inner>, id: RequestId, worker: WorkerWithDpRank) -> Self {
        Self {
            inner,
            id,
            worker,
            sent: Instant::now(),
            last_tokens: None,
            output_tokens: 0,
            done: false,
        }
    }

    /// The request's id in the core.
    pub fn id(&self) -> RequestId {
        self.id
    }

    /// The worker it was routed to.
    pub fn worker(&self) -> WorkerWithDpRank {
        self.worker
    }

    /// Output tokens seen so far.
    pub fn output_tokens(&self) -> u64 {
        self.output_tokens
    }

    /// Whether the response's start (its first tokens) has been recorded.
    pub(crate) fn first_seen(&self) -> bool {
        self.last_tokens.is_some()
    }

    /// The router this request is held in.
    pub(crate) fn inner(&self) -> &Arc<Inner> {
        &self.inner
    }

    /// The engine reported `reported` of the prompt's tokens served from its cache, where the
    /// router predicted `predicted` (its index's overlap on this worker, in tokens): recorded
    /// per worker, so an operator sees whether KV routing works on their fleet.
    ///
    /// For a worker in approximate mode, a report far below the prediction drops the worker's
    /// stale predictions (see [`crate::KvRouterCore::on_cache_report`]).
    pub(crate) fn on_cache_report(&self, isl_tokens: u64, predicted: u64, reported: u64) {
        self.inner
            .metrics
            .on_cache_report(self.worker, isl_tokens, predicted, reported);
        let dropped = self
            .inner
            .state
            .lock()
            .core
            .on_cache_report(self.id, reported);
        if dropped > 0 {
            self.inner
                .metrics
                .on_prediction_reset(self.worker.worker_id);
            tracing::info!(
                worker = %self.worker,
                predicted,
                reported,
                dropped,
                "the engine reported far fewer cached tokens than predicted (it restarted or \
                 evicted them): dropped the worker's other predicted blocks"
            );
        }
    }

    /// Records `tokens` new output tokens (the first call, even with zero tokens, marks the
    /// prefill complete).
    pub fn on_tokens(&mut self, tokens: u64) {
        if self.done {
            return;
        }
        let now = Instant::now();
        let first = self.last_tokens.is_none();
        // After the first token the core only counts output tokens when it tracks output
        // blocks (off by default, as the reference's `router_track_output_blocks`): otherwise
        // a streamed token need not take the router's state lock at all.
        if first || self.inner.config.core.scheduler.track_output_blocks {
            let mut state = self.inner.state.lock();
            if first {
                let _ = state.core.on_first_token(self.id);
            }
            if tokens > 0 {
                let _ = state.core.on_output_tokens(self.id, tokens);
            }
        }
        if first {
            self.inner.metrics.on_first_token(now - self.sent);
            if let Some(sync) = &self.inner.load_sync {
                sync.local(Local::PrefillDone(self.id));
            }
        }
        self.inner
            .metrics
            .on_tokens(tokens, self.last_tokens.map(|t| now - t));
        self.last_tokens = Some(now);
        self.output_tokens += tokens;
    }

    /// The request completed: frees it and runs its deferred session commands.
    pub fn finish(mut self) {
        self.end(Outcome::Ok);
    }

    /// The request failed: frees it and undoes its session binding.
    pub fn fail(mut self) {
        self.end(Outcome::Error);
    }

    /// The engine refused the request (an error item): frees it and undoes its session
    /// binding, counted as `rejected`, not as a failure of the worker or the transport.
    pub fn reject(mut self) {
        self.end(Outcome::Rejected);
    }

    fn end(&mut self, outcome: Outcome) {
        if self.done {
            return;
        }
        self.done = true;
        let commands = {
            let mut state = self.inner.state.lock();
            match outcome {
                Outcome::Ok => state.core.on_finished(self.id),
                Outcome::Error | Outcome::Rejected | Outcome::Cancelled => {
                    state.core.on_failed(self.id)
                }
            }
        };
        if let Some(sync) = &self.inner.load_sync {
            sync.local(Local::Freed(self.id));
        }
        self.inner.metrics.on_finished(outcome);
        self.inner.spawn_session_commands(commands);
    }
}

impl Drop for RequestGuard {
    fn drop(&mut self) {
        self.end(Outcome::Cancelled);
    }
}

/// A routed response stream: the worker's items, with the guard updated on each and settled when
/// the stream ends, or at once on a failure (an error item or a transport error), which counts
/// as `outcome="error"` however the stream is dropped afterwards. Dropping it early, before any
/// failure or end, cancels the request on the worker and frees it (`outcome="cancelled"`: the
/// client went away).
#[derive(Debug)]
pub struct KvRoutedStream {
    inner: LlmRoutedStream,
    guard: Option<RequestGuard>,
    /// How the request failed, once it has (`Error` or `Rejected`).
    failed: Option<Outcome>,
    /// Whether the engine's cached-token report has been compared with the prediction (only the
    /// first report of a stream counts).
    cache_reported: bool,
    decision: Routed,
}

impl KvRoutedStream {
    pub(crate) fn new(inner: LlmRoutedStream, guard: RequestGuard, decision: Routed) -> Self {
        Self {
            inner,
            guard: Some(guard),
            failed: None,
            cache_reported: false,
            decision,
        }
    }

    /// Leaves the engine's cached-token reports out of the prediction metrics.
    pub(crate) fn skip_cache_report(&mut self) {
        self.cache_reported = true;
    }

    /// Compares the engine's first report of cached prompt tokens with the prediction.
    fn check_cache_report(&mut self, data: &kvroute_protocols::LLMEngineOutput) {
        if self.cache_reported {
            return;
        }
        let Some(reported) = data
            .completion_usage
            .and_then(|u| u.prompt_tokens_details)
            .and_then(|d| d.cached_tokens)
        else {
            return;
        };
        self.cache_reported = true;
        let Some(guard) = &self.guard else { return };
        let isl = self.decision.isl_tokens;
        let predicted = self
            .decision
            .predicted_cached_tokens(guard.inner.config.core.block_size());
        guard.on_cache_report(isl, predicted, u64::from(reported).min(isl));
    }

    /// The routing decision (worker, overlap, cost breakdown, timings).
    pub fn decision(&self) -> &Routed {
        &self.decision
    }

    /// The worker serving the request.
    pub fn worker(&self) -> WorkerWithDpRank {
        self.decision.worker
    }

    /// The underlying runtime stream (to stop or kill the request on the worker).
    pub fn runtime_stream(&mut self) -> &mut LlmRoutedStream {
        &mut self.inner
    }

    fn settle(&mut self) {
        if let Some(guard) = self.guard.take() {
            match self.failed {
                Some(Outcome::Rejected) => guard.reject(),
                Some(_) => guard.fail(),
                None => {
                    guard.inner.on_worker_success(guard.worker.worker_id);
                    guard.finish();
                }
            }
        }
    }
}

impl Stream for KvRoutedStream {
    type Item = Result<LlmResponse, RequestError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let polled = Pin::new(&mut self.inner).poll_next(cx);
        match &polled {
            Poll::Ready(Some(Ok(item))) => {
                if let Some(data) = &item.data {
                    let mut tokens = data.token_ids.len() as u64;
                    if let Some(guard) = self.guard.as_mut() {
                        // An engine that streams text without ids (`openai`) is counted by its
                        // own usage report, once, when no id was counted.
                        if tokens == 0 && guard.output_tokens() == 0 {
                            tokens = data
                                .completion_usage
                                .map_or(0, |u| u64::from(u.completion_tokens));
                        }
                        guard.on_tokens(tokens);
                    }
                    self.check_cache_report(data);
                }
                let engine_failed = item.data.as_ref().is_some_and(|d| {
                    matches!(
                        d.finish_reason,
                        Some(kvroute_protocols::FinishReason::Error(_))
                    )
                });
                let refused = item.error.is_some() || item.event.as_deref() == Some(ERROR_EVENT);
                if engine_failed || refused {
                    self.failed = Some(if refused {
                        Outcome::Rejected
                    } else {
                        Outcome::Error
                    });
                    // Settled now: a consumer stops at a failure and drops the stream, which
                    // must not count as the client cancelling.
                    self.settle();
                }
            }
            Poll::Ready(Some(Err(error))) => {
                if let Some(guard) = &self.guard {
                    guard.inner.on_worker_failure(guard.worker.worker_id, error);
                }
                self.failed = Some(Outcome::Error);
                self.settle();
            }
            Poll::Ready(None) => self.settle(),
            Poll::Pending => {}
        }
        polled
    }
}
