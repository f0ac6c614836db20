//! Engines a process serves itself, reached without the request plane's TCP hop.
//!
//! A router that fronts engines from its own process (`kvroute serve` with a static fleet of
//! engine entries) lists each engine at the loopback address of the [`crate::WorkerServer`] it
//! runs for it. Sending every request, and every streamed token, over that loopback connection
//! costs an encode, a write, a read and a decode per item on both sides for nothing. A
//! [`LocalEngines`] registry, shared by the [`crate::PushRouter`]s of the process through
//! [`crate::PushRouterConfig::local`], lets a router call such an engine directly: the request is
//! handed over in memory and the response stream is polled in the router's own task.
//!
//! The direct path keeps the request plane's behaviour, so that nothing above it can tell the
//! two apart: `stop` and `kill` act on the request's [`RequestContext`], dropping the stream
//! kills the request, the first-response timeout applies, an engine's refusal or recorded
//! [`RequestContext::fail`] arrives as the stream's last item, mapped to the same
//! [`RequestError`] the wire would have delivered. Only the streamed requests take it: unary
//! calls (session control, KV event ranges and dumps) and subscriptions keep the connection,
//! which the worker server still serves to every other caller.

use std::any::Any;
use std::collections::HashMap;
use std::sync::Arc;
use std::task::{Context, Poll};

use futures::StreamExt;
use kvroute_protocols::WorkerId;
use parking_lot::RwLock;
use sync_wrapper::SyncWrapper;

use crate::engine::{Engine, EngineError, RequestContext, ResponseStream};
use crate::error::RequestError;

/// Starts one request on an in-process engine.
type Start<Req, Resp> =
    dyn Fn(&Req, RequestContext) -> Result<ResponseStream<Resp>, EngineError> + Send + Sync;

/// Engines this process serves itself, by the request-plane address they are listed under.
/// Cheap to clone; clones share the registry.
#[derive(Clone, Default)]
pub struct LocalEngines {
    by_address: Arc<RwLock<HashMap<String, Arc<dyn Any + Send + Sync>>>>,
}

impl std::fmt::Debug for LocalEngines {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut addresses: Vec<String> = self.by_address.read().keys().cloned().collect();
        addresses.sort();
        f.debug_struct("LocalEngines")
            .field("addresses", &addresses)
            .finish()
    }
}

impl LocalEngines {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers `engine` as the one listed at `address` (the `local_addr` of the
    /// [`crate::WorkerServer`] serving it), replacing any engine registered there before. Routers
    /// sharing this registry send their streamed requests for `address` to `engine` directly
    /// until the returned registration is dropped.
    #[must_use = "the engine is unregistered when the registration is dropped"]
    pub fn register<E>(&self, address: impl Into<String>, engine: Arc<E>) -> LocalRegistration
    where
        E: Engine,
        E::Request: Clone,
    {
        let start: Arc<Start<E::Request, E::Response>> =
            Arc::new(move |request: &E::Request, context| {
                engine.generate(request.clone(), context)
            });
        let address = address.into();
        self.by_address
            .write()
            .insert(address.clone(), Arc::new(start));
        LocalRegistration {
            engines: self.clone(),
            address,
        }
    }

    /// How many engines are registered.
    pub fn len(&self) -> usize {
        self.by_address.read().len()
    }

    /// Whether no engine is registered.
    pub fn is_empty(&self) -> bool {
        self.by_address.read().is_empty()
    }

    /// Whether an engine is registered at `address`.
    pub fn contains(&self, address: &str) -> bool {
        self.by_address.read().contains_key(address)
    }

    /// The engine at `address`, if one with these request and response types is registered.
    pub(crate) fn get<Req: 'static, Resp: 'static>(
        &self,
        address: &str,
    ) -> Option<Arc<Start<Req, Resp>>> {
        let map = self.by_address.read();
        map.get(address)?
            .downcast_ref::<Arc<Start<Req, Resp>>>()
            .cloned()
    }
}

/// An engine's place in a [`LocalEngines`] registry; dropping it unregisters the engine (streams
/// already started on it run to their end).
#[derive(Debug)]
pub struct LocalRegistration {
    engines: LocalEngines,
    address: String,
}

impl LocalRegistration {
    /// The address the engine is registered at.
    pub fn address(&self) -> &str {
        &self.address
    }
}

impl Drop for LocalRegistration {
    fn drop(&mut self) {
        self.engines.by_address.write().remove(&self.address);
    }
}

/// One request running on an in-process engine: the stream behind a local
/// [`crate::ClientStream`].
pub(crate) struct LocalStream<Resp> {
    worker_id: WorkerId,
    address: Arc<str>,
    context: RequestContext,
    /// The engine's responses; `None` once the stream ended or was killed. Only ever used
    /// through `&mut`, so wrapping it keeps the stream `Sync` as the remote one is.
    responses: Option<SyncWrapper<ResponseStream<Resp>>>,
    /// The engine's refusal of the request, delivered as the first and last item.
    refused: Option<RequestError>,
}

impl<Resp> LocalStream<Resp> {
    /// Starts `request` (with id `request_id`) on `start`, the engine listed at `address`.
    pub(crate) fn start<Req>(
        start: &Start<Req, Resp>,
        worker_id: WorkerId,
        address: &str,
        request_id: &str,
        request: &Req,
    ) -> Self {
        let context = RequestContext::new(request_id);
        let address: Arc<str> = address.into();
        let (responses, refused) = match start(request, context.clone()) {
            Ok(responses) => (Some(SyncWrapper::new(responses)), None),
            Err(e) => (None, Some(local_error(e, &address))),
        };
        Self {
            worker_id,
            address,
            context,
            responses,
            refused,
        }
    }

    pub(crate) fn worker_id(&self) -> WorkerId {
        self.worker_id
    }

    /// Asks the engine to finish gracefully.
    pub(crate) fn stop(&self) {
        self.context.stop_generating();
    }

    /// Ends the stream here; `kill` also tells the engine the caller is gone.
    pub(crate) fn finish(&mut self, kill: bool) {
        if kill {
            self.context.kill();
        }
        self.responses = None;
        self.refused = None;
    }

    /// The next item: `Ready(Some(Ok))` for a response, `Ready(Some(Err))` for the refusal or
    /// the failure the engine recorded (the last item), `Ready(None)` at a normal end.
    pub(crate) fn poll_item(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Resp, RequestError>>> {
        if let Some(refused) = self.refused.take() {
            return Poll::Ready(Some(Err(refused)));
        }
        let Some(responses) = self.responses.as_mut() else {
            return Poll::Ready(None);
        };
        match responses.get_mut().poll_next_unpin(cx) {
            Poll::Ready(Some(item)) => Poll::Ready(Some(Ok(item))),
            Poll::Ready(None) => {
                self.responses = None;
                let failure = self.context.failure();
                Poll::Ready(failure.map(|e| Err(local_error(e, &self.address))))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<Resp> std::fmt::Debug for LocalStream<Resp> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalStream")
            .field("worker_id", &self.worker_id)
            .field("request", &self.context.id())
            .finish_non_exhaustive()
    }
}

/// The error the request plane would deliver for the engine's `e`: the worker server's mapping
/// to a wire error, then the client's mapping back, so the two paths cannot drift apart.
fn local_error(e: EngineError, address: &str) -> RequestError {
    crate::client::remote_error(crate::server::engine_error(e), address)
}
