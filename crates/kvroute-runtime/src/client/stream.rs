//! One request's response stream on the caller's side.

use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::Stream;
use kvroute_protocols::WorkerId;
use serde::de::DeserializeOwned;
use tokio::sync::mpsc;
use tokio::time::Sleep;

use super::{Connection, Incoming};
use crate::error::RequestError;
use crate::frame::{self, CancelKind};
use crate::local::LocalStream;

/// The responses of one request. Yields items until the worker ends the stream; an error item is
/// the last. Dropping it before the end kills the request on the worker.
///
/// The stream runs over a worker connection, or, for an engine this process serves itself
/// (see [`crate::LocalEngines`]), directly on the engine; both behave alike.
pub struct ClientStream<Resp> {
    transport: Transport<Resp>,
    first_deadline: Option<(Pin<Box<Sleep>>, Duration)>,
    done: bool,
}

enum Transport<Resp> {
    /// Over a worker connection: request `id`'s frames arrive on `rx`.
    Remote {
        conn: Arc<Connection>,
        id: u64,
        rx: mpsc::UnboundedReceiver<Incoming>,
        _resp: PhantomData<fn() -> Resp>,
    },
    /// On an engine of this process.
    Local(Box<LocalStream<Resp>>),
}

impl<Resp> ClientStream<Resp> {
    /// A stream for request `id`, whose first-response clock starts now.
    pub(super) fn new(
        conn: Arc<Connection>,
        id: u64,
        rx: mpsc::UnboundedReceiver<Incoming>,
    ) -> Self {
        let first_deadline = conn.config.first_response_timeout;
        Self::with_deadline(
            Transport::Remote {
                conn,
                id,
                rx,
                _resp: PhantomData,
            },
            first_deadline,
        )
    }

    /// A stream that may wait for its first item forever (a subscription).
    pub(super) fn without_deadline(
        conn: Arc<Connection>,
        id: u64,
        rx: mpsc::UnboundedReceiver<Incoming>,
    ) -> Self {
        let mut stream = Self::new(conn, id, rx);
        stream.first_deadline = None;
        stream
    }

    /// A stream running on an engine of this process, whose first-response clock starts now.
    pub(crate) fn local(
        stream: LocalStream<Resp>,
        first_response_timeout: Option<Duration>,
    ) -> Self {
        Self::with_deadline(Transport::Local(Box::new(stream)), first_response_timeout)
    }

    fn with_deadline(transport: Transport<Resp>, first_response_timeout: Option<Duration>) -> Self {
        Self {
            transport,
            first_deadline: first_response_timeout.map(|d| (Box::pin(tokio::time::sleep(d)), d)),
            done: false,
        }
    }

    /// Asks the engine to finish gracefully; keep reading to get the final items.
    pub fn stop(&self) {
        if !self.done {
            match &self.transport {
                Transport::Remote { conn, id, .. } => conn.cancel(*id, CancelKind::Stop),
                Transport::Local(local) => local.stop(),
            }
        }
    }

    /// Drops the request on the worker now; the stream ends.
    pub fn kill(&mut self) {
        self.finish(true);
    }

    /// The worker this stream runs on.
    pub fn worker_id(&self) -> WorkerId {
        match &self.transport {
            Transport::Remote { conn, .. } => conn.worker_id,
            Transport::Local(local) => local.worker_id(),
        }
    }

    /// Whether the stream runs on an engine of this process rather than over a connection.
    pub fn is_local(&self) -> bool {
        matches!(self.transport, Transport::Local(_))
    }

    fn finish(&mut self, kill: bool) {
        if !self.done {
            self.done = true;
            match &mut self.transport {
                Transport::Remote { conn, id, .. } => {
                    conn.slots.lock().open.remove(id);
                    if kill {
                        conn.cancel(*id, CancelKind::Kill);
                    }
                }
                Transport::Local(local) => local.finish(kill),
            }
        }
    }

    /// The next item over a connection; ends the stream where the item is its last.
    fn poll_remote(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Resp, RequestError>>>
    where
        Resp: DeserializeOwned,
    {
        let Transport::Remote { conn, rx, .. } = &mut self.transport else {
            unreachable!("poll_remote on a local stream");
        };
        let incoming = match rx.poll_recv(cx) {
            Poll::Ready(incoming) => incoming,
            Poll::Pending => return Poll::Pending,
        };
        let item = match incoming {
            Some(Incoming::Item(body)) => {
                match frame::decode::<Resp>(&body, conn.config.max_frame_bytes) {
                    Ok(item) => return Poll::Ready(Some(Ok(item))),
                    Err(message) => {
                        self.finish(true);
                        return Poll::Ready(Some(Err(RequestError::Decode { message })));
                    }
                }
            }
            Some(Incoming::End) => None,
            Some(Incoming::Failed(e)) => Some(Err(e)),
            Some(Incoming::Reply(_)) => Some(Err(RequestError::Decode {
                message: "expected a stream item, got a unary reply".to_owned(),
            })),
            None => Some(Err(conn.unavailable())),
        };
        self.finish(false);
        Poll::Ready(item)
    }
}

impl<Resp> std::fmt::Debug for ClientStream<Resp> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut d = f.debug_struct("ClientStream");
        match &self.transport {
            Transport::Remote { id, .. } => d.field("id", id),
            Transport::Local(local) => d.field("local", local),
        };
        d.field("done", &self.done).finish()
    }
}

impl<Resp: DeserializeOwned> Stream for ClientStream<Resp> {
    type Item = Result<Resp, RequestError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if self.done {
            return Poll::Ready(None);
        }
        let this = &mut *self;
        let polled = match &mut this.transport {
            Transport::Remote { .. } => this.poll_remote(cx),
            Transport::Local(local) => {
                let polled = local.poll_item(cx);
                // A response leaves the stream open; the end, a refusal or a failure closes it.
                if let Poll::Ready(item) = &polled
                    && !matches!(item, Some(Ok(_)))
                {
                    this.finish(false);
                }
                polled
            }
        };
        match polled {
            Poll::Ready(item) => {
                this.first_deadline = None;
                Poll::Ready(item)
            }
            Poll::Pending => {
                if let Some((sleep, after)) = &mut this.first_deadline
                    && sleep.as_mut().poll(cx).is_ready()
                {
                    let after = *after;
                    this.finish(true);
                    return Poll::Ready(Some(Err(RequestError::FirstResponseTimeout { after })));
                }
                Poll::Pending
            }
        }
    }
}

impl<Resp> Drop for ClientStream<Resp> {
    fn drop(&mut self) {
        self.finish(true);
    }
}
