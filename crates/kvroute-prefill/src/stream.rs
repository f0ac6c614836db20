//! The response stream the prefill router hands back, and what it routed.

use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll, ready};

use futures::{FutureExt, Stream};
use kvroute_protocols::{
    Annotated, BootstrapInfo, LLMEngineOutput, PromptTokensDetails, WorkerWithDpRank,
};
use kvroute_runtime::RequestError;
use tokio::task::JoinHandle;

use crate::phase::PhaseStream;

/// How a request was served.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Served {
    /// Prefill ran first and its result was carried into the decode request.
    PrefillResult {
        /// The prefill worker.
        prefill: WorkerWithDpRank,
    },
    /// Prefill runs concurrently; the decode worker fetches the KV from the bootstrap room.
    Bootstrap {
        /// The prefill worker.
        prefill: WorkerWithDpRank,
        /// Where the decode worker meets it.
        info: BootstrapInfo,
    },
    /// No prefill worker was used (none registered, or fallback after a prefill failure).
    Aggregated,
}

impl Served {
    /// The prefill worker, when prefill ran on one.
    pub fn prefill_worker(&self) -> Option<WorkerWithDpRank> {
        match self {
            Served::PrefillResult { prefill } | Served::Bootstrap { prefill, .. } => Some(*prefill),
            Served::Aggregated => None,
        }
    }
}

/// The decode (or aggregated) response stream of one request, with the routing it got.
///
/// On the bootstrap path it also owns the background prefill: dropping the stream before the
/// decode output ends (client gone) cancels that prefill too; once the decode output has ended
/// the prefill is left to finish on its own. The stream itself ends only once that background
/// prefill has ended as well, so that the prefill worker's prompt token details
/// ([`Self::prefill_tokens_details`]) are known when it ends, whichever of the two workers
/// answered last. This seldom waits: the decode worker cannot produce a token before the KV has
/// left the prefill worker, whose one-token answer is then due. A prefill worker that still has
/// not answered [`PREFILL_DETAILS_GRACE`] after the decode output ended does not hold the response
/// up any longer: the stream ends without its details and the prefill is left to finish.
pub struct DisaggStream {
    served: Served,
    worker: WorkerWithDpRank,
    inner: PhaseStream,
    prefill: PrefillLink,
    /// Whether the decode output has ended.
    ended: bool,
    /// Started when the decode output ends with the background prefill still running.
    grace: Option<Pin<Box<tokio::time::Sleep>>>,
    /// Whether the decode worker has produced output (its KV arrived).
    decoding: bool,
}

/// How long a finished decode output waits for its background prefill (bootstrap path) before the
/// stream ends without the prefill worker's prompt token details.
pub const PREFILL_DETAILS_GRACE: std::time::Duration = std::time::Duration::from_secs(2);

/// What a [`DisaggStream`] keeps of its prefill.
#[derive(Debug, Default)]
pub(crate) struct PrefillLink {
    /// The prefill worker's prompt token details once known: at once on the prefill-result
    /// path, when the background prefill finishes on the bootstrap path (it sets them before
    /// its task ends), never when no prefill worker was used.
    pub(crate) details: Arc<OnceLock<PromptTokensDetails>>,
    /// The background prefill of the bootstrap path, until it has ended.
    pub(crate) task: Option<JoinHandle<()>>,
    /// Why the background prefill failed, set before its task ends: the decode worker waits
    /// for KV that will never come, so the pair fails.
    pub(crate) failed: Arc<OnceLock<String>>,
}

impl PrefillLink {
    /// The link of a prefill that is over, having reported `details`.
    pub(crate) fn finished(details: Option<PromptTokensDetails>) -> Self {
        let link = Self::default();
        if let Some(details) = details {
            let _ = link.details.set(details);
        }
        link
    }
}

impl DisaggStream {
    pub(crate) fn new(
        served: Served,
        worker: WorkerWithDpRank,
        inner: PhaseStream,
        prefill: PrefillLink,
    ) -> Self {
        Self {
            served,
            worker,
            inner,
            prefill,
            ended: false,
            grace: None,
            decoding: false,
        }
    }

    /// How the request was served.
    pub fn served(&self) -> &Served {
        &self.served
    }

    /// The decode (or aggregated) worker streaming the output.
    pub fn worker(&self) -> WorkerWithDpRank {
        self.worker
    }

    /// The prefill worker, when prefill ran on one.
    pub fn prefill_worker(&self) -> Option<WorkerWithDpRank> {
        self.served.prefill_worker()
    }

    /// The prompt token details the prefill worker reported (its cached prompt tokens are the
    /// request's: the prompt is computed there, the decode worker receives its KV), if it
    /// reported any. Known from the start on the prefill-result path and, on the bootstrap
    /// path, once the background prefill has finished, which is always the case once the
    /// stream has ended; `None` when no prefill worker was used.
    pub fn prefill_tokens_details(&self) -> Option<PromptTokensDetails> {
        self.prefill.details.get().copied()
    }
}

impl DisaggStream {
    /// The next item with a transport failure as a typed `Err` (a lost worker is
    /// [`RequestError::is_worker_unavailable`]), where the [`Stream`] implementation turns it
    /// into an error item. A request migrates on this.
    pub fn poll_result(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Annotated<LLMEngineOutput>, RequestError>>> {
        if !self.ended {
            if let Some(message) = self.prefill_failed(cx) {
                // The decode worker would wait for the KV until its own timeout: dropping its
                // stream cancels it there now, and the pair fails together.
                self.ended = true;
                self.inner = Box::pin(futures::stream::empty());
                return Poll::Ready(Some(Ok(Annotated::from_error(message))));
            }
            match self.inner.as_mut().poll_next(cx) {
                Poll::Ready(None) => self.ended = true,
                Poll::Ready(Some(Ok(item))) => {
                    self.decoding |= item.data.is_some();
                    return Poll::Ready(Some(Ok(item)));
                }
                polled => return polled,
            }
        }
        // The decode output is over; the stream ends with the background prefill, whose
        // details are then set (or never will be: it failed, or was cancelled).
        if let Some(task) = self.prefill.task.as_mut()
            && task.poll_unpin(cx).is_pending()
        {
            let grace = self
                .grace
                .get_or_insert_with(|| Box::pin(tokio::time::sleep(PREFILL_DETAILS_GRACE)));
            ready!(grace.as_mut().poll(cx));
            tracing::debug!(
                prefill = ?self.served.prefill_worker(),
                "the background prefill outlived the decode output by the grace; ending without \
                 its details"
            );
        }
        // Dropping the handle detaches the task (a finished one, or one past the grace).
        self.prefill.task = None;
        Poll::Ready(None)
    }
}

impl DisaggStream {
    /// The background prefill's failure, once its task has ended with one while the decode
    /// worker has produced nothing yet (once it has, the KV has arrived and decoding goes on).
    fn prefill_failed(&mut self, cx: &mut Context<'_>) -> Option<String> {
        if self.decoding {
            return None;
        }
        let task = self.prefill.task.as_mut()?;
        if task.poll_unpin(cx).is_pending() {
            return None;
        }
        self.prefill.task = None;
        let message = self.prefill.failed.get()?;
        let prefill = self.served.prefill_worker();
        Some(format!(
            "the prefill of this request failed on prefill worker {}, so its decode worker \
             cannot receive the KV: {message}",
            prefill.map_or_else(|| "?".to_owned(), |w| w.to_string())
        ))
    }
}

/// The output items; a transport failure (see [`DisaggStream::poll_result`]) arrives as an
/// error item ([`Annotated::from_error`]).
impl Stream for DisaggStream {
    type Item = Annotated<LLMEngineOutput>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.poll_result(cx)
            .map(|item| item.map(|r| r.unwrap_or_else(|e| Annotated::from_error(e.to_string()))))
    }
}

impl Drop for DisaggStream {
    fn drop(&mut self) {
        if !self.ended
            && let Some(task) = self.prefill.task.take()
        {
            task.abort();
        }
    }
}

impl std::fmt::Debug for DisaggStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DisaggStream")
            .field("served", &self.served)
            .field("worker", &self.worker)
            .field("ended", &self.ended)
            .finish_non_exhaustive()
    }
}
