//! The engine abstraction a worker serves, and the per-request context that carries cancellation.

use std::pin::Pin;
use std::sync::Arc;

use futures::Stream;
use kvroute_protocols::SessionControl;
use kvroute_protocols::kv_events::KvCacheEvent;
use parking_lot::Mutex;
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio_util::sync::CancellationToken;

/// A stream of response items from an engine.
pub type ResponseStream<T> = Pin<Box<dyn Stream<Item = T> + Send + 'static>>;

/// Something that generates a stream of responses for a request: an LLM engine, the mocker, or a
/// test double. The request plane serves any `Engine` with [`crate::WorkerServer`].
///
/// `generate` is synchronous so that the trait stays object safe and cheap: an engine enqueues
/// the request and returns a stream (typically a channel receiver) that its own loop feeds. It
/// must stop producing when the stream is dropped, and should end the stream early once
/// [`RequestContext::is_stopped`] holds.
pub trait Engine: Send + Sync + 'static {
    /// The request type (for LLM workers, `PreprocessedRequest`).
    type Request: Serialize + DeserializeOwned + Send + 'static;
    /// The response item type (for LLM workers, `Annotated<LLMEngineOutput>`).
    type Response: Serialize + DeserializeOwned + Send + 'static;

    /// Starts generating for `request`; `context` carries its id and cancellation.
    fn generate(
        &self,
        request: Self::Request,
        context: RequestContext,
    ) -> Result<ResponseStream<Self::Response>, EngineError>;

    /// Opens or closes an engine-side session (`action` open or close). Engines without sessions
    /// keep the default, which reports the call as unsupported.
    fn session_control(&self, control: SessionControl) -> Result<(), EngineError> {
        let _ = control;
        Err(EngineError::Unsupported {
            operation: "session_control",
        })
    }

    /// Every KV block the engine currently holds, as `Stored` events (their `event_id` is ignored).
    /// A router that joins late rebuilds this worker's state from it. Engines that publish no KV
    /// events keep the default, an empty dump.
    fn kv_dump(&self) -> Vec<KvCacheEvent> {
        Vec::new()
    }
}

/// Why an engine refused a request or call.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    /// The request was refused (invalid, over capacity, shutting down, ...).
    #[error("request refused: {message}")]
    Rejected {
        /// Why.
        message: String,
    },
    /// The engine does not implement this operation.
    #[error("the engine does not support {operation}")]
    Unsupported {
        /// The operation's name.
        operation: &'static str,
    },
    /// The engine behind this worker cannot serve (it is down, restarting or overloaded). Unlike
    /// [`EngineError::Rejected`], another worker may well serve the request: callers see
    /// [`crate::RequestError::WorkerUnavailable`] and may migrate it.
    #[error("engine unavailable: {message}")]
    Unavailable {
        /// What happened (connection refused, reset mid-stream, 503, ...).
        message: String,
    },
    /// The engine could not be reached at all (its connection was refused): the request was
    /// never sent, so moving it to another worker costs nothing and is always sound. Callers
    /// see [`crate::RequestError::EngineUnreachable`].
    #[error("engine unreachable: {message}")]
    Unreachable {
        /// What happened (connection refused, no route, ...).
        message: String,
    },
    /// The engine sent nothing within its first-byte limit (queueing plus prefill took too
    /// long): the request was abandoned before any output. Callers see
    /// [`crate::RequestError::EngineTimeout`] and may move it to another worker.
    #[error("engine timed out: {message}")]
    Timeout {
        /// What timed out, naming the limit.
        message: String,
    },
}

/// The id and cancellation state of one request, shared by the caller's side of the transport
/// and the engine.
///
/// Two levels of cancellation exist: *stop* asks the engine to finish gracefully (end the stream
/// soon, with whatever final item it emits for a cancelled request), *kill* means the caller is
/// gone and the stream is dropped at once. A kill implies a stop.
#[derive(Debug, Clone)]
pub struct RequestContext {
    id: Arc<str>,
    stop: CancellationToken,
    kill: CancellationToken,
    failure: Arc<Mutex<Option<EngineError>>>,
}

impl RequestContext {
    /// A fresh context for request `id`.
    pub fn new(id: impl Into<Arc<str>>) -> Self {
        Self {
            id: id.into(),
            stop: CancellationToken::new(),
            kill: CancellationToken::new(),
            failure: Arc::default(),
        }
    }

    /// Ends the request with a typed failure instead of a normal end: an engine whose stream has
    /// already started calls this, then ends its stream, and the worker sends the caller this
    /// error (an [`EngineError::Unavailable`] becomes a worker loss the caller may migrate) in
    /// place of the end of stream. The first failure recorded wins.
    pub fn fail(&self, error: EngineError) {
        self.failure.lock().get_or_insert(error);
    }

    /// The failure recorded with [`RequestContext::fail`], if any.
    pub fn failure(&self) -> Option<EngineError> {
        self.failure.lock().clone()
    }

    /// The request id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Asks the engine to finish gracefully.
    pub fn stop_generating(&self) {
        self.stop.cancel();
    }

    /// Marks the request as killed (and stopped).
    pub fn kill(&self) {
        self.stop.cancel();
        self.kill.cancel();
    }

    /// Whether a stop or a kill was requested.
    pub fn is_stopped(&self) -> bool {
        self.stop.is_cancelled()
    }

    /// Whether a kill was requested.
    pub fn is_killed(&self) -> bool {
        self.kill.is_cancelled()
    }

    /// Completes once a stop or a kill is requested.
    pub async fn stopped(&self) {
        self.stop.cancelled().await;
    }

    /// Completes once a kill is requested.
    pub async fn killed(&self) {
        self.kill.cancelled().await;
    }
}
