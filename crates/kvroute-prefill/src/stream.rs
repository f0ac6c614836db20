//! The response stream the prefill router hands back, and what it routed.

use std::pin::Pin;
use std::task::{Context, Poll};

use futures::Stream;
use kvroute_protocols::{Annotated, BootstrapInfo, LLMEngineOutput, WorkerWithDpRank};
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

/// The decode (or aggregated) response stream of one request, with the routing it got.
///
/// On the bootstrap path it also owns the background prefill: dropping the stream before it ends
/// (client gone) cancels that prefill too; once the decode stream has ended the prefill is left
/// to finish on its own.
pub struct DisaggStream {
    served: Served,
    worker: WorkerWithDpRank,
    inner: PhaseStream,
    prefill_task: Option<JoinHandle<()>>,
    ended: bool,
}

impl DisaggStream {
    pub(crate) fn new(
        served: Served,
        worker: WorkerWithDpRank,
        inner: PhaseStream,
        prefill_task: Option<JoinHandle<()>>,
    ) -> Self {
        Self {
            served,
            worker,
            inner,
            prefill_task,
            ended: false,
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
        match &self.served {
            Served::PrefillResult { prefill } | Served::Bootstrap { prefill, .. } => Some(*prefill),
            Served::Aggregated => None,
        }
    }
}

impl Stream for DisaggStream {
    type Item = Annotated<LLMEngineOutput>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let polled = self.inner.as_mut().poll_next(cx);
        if let Poll::Ready(None) = polled {
            self.ended = true;
        }
        polled
    }
}

impl Drop for DisaggStream {
    fn drop(&mut self) {
        if !self.ended
            && let Some(task) = self.prefill_task.take()
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
