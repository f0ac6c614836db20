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

/// The responses of one request. Yields items until the worker ends the stream; an error item is
/// the last. Dropping it before the end kills the request on the worker.
pub struct ClientStream<Resp> {
    conn: Arc<Connection>,
    id: u64,
    rx: mpsc::UnboundedReceiver<Incoming>,
    first_deadline: Option<(Pin<Box<Sleep>>, Duration)>,
    done: bool,
    _resp: PhantomData<fn() -> Resp>,
}

impl<Resp> ClientStream<Resp> {
    /// A stream for request `id`, whose first-response clock starts now.
    pub(super) fn new(
        conn: Arc<Connection>,
        id: u64,
        rx: mpsc::UnboundedReceiver<Incoming>,
    ) -> Self {
        let first_deadline = conn
            .config
            .first_response_timeout
            .map(|d| (Box::pin(tokio::time::sleep(d)), d));
        Self {
            conn,
            id,
            rx,
            first_deadline,
            done: false,
            _resp: PhantomData,
        }
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

    /// Asks the engine to finish gracefully; keep reading to get the final items.
    pub fn stop(&self) {
        if !self.done {
            self.conn.cancel(self.id, CancelKind::Stop);
        }
    }

    /// Drops the request on the worker now; the stream ends.
    pub fn kill(&mut self) {
        self.finish(true);
    }

    /// The worker this stream runs on.
    pub fn worker_id(&self) -> WorkerId {
        self.conn.worker_id
    }

    fn finish(&mut self, kill: bool) {
        if !self.done {
            self.done = true;
            self.conn.slots.lock().open.remove(&self.id);
            if kill {
                self.conn.cancel(self.id, CancelKind::Kill);
            }
        }
    }
}

impl<Resp> std::fmt::Debug for ClientStream<Resp> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientStream")
            .field("id", &self.id)
            .field("done", &self.done)
            .finish()
    }
}

impl<Resp: DeserializeOwned> Stream for ClientStream<Resp> {
    type Item = Result<Resp, RequestError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if self.done {
            return Poll::Ready(None);
        }
        match self.rx.poll_recv(cx) {
            Poll::Ready(incoming) => {
                self.first_deadline = None;
                let item = match incoming {
                    Some(Incoming::Item(body)) => {
                        let decoded =
                            frame::decode::<Resp>(&body, self.conn.config.max_frame_bytes);
                        match decoded {
                            Ok(item) => return Poll::Ready(Some(Ok(item))),
                            Err(message) => {
                                self.finish(true);
                                Some(Err(RequestError::Decode { message }))
                            }
                        }
                    }
                    Some(Incoming::End) => None,
                    Some(Incoming::Failed(e)) => Some(Err(e)),
                    Some(Incoming::Reply(_)) => Some(Err(RequestError::Decode {
                        message: "expected a stream item, got a unary reply".to_owned(),
                    })),
                    None => Some(Err(self.conn.unavailable())),
                };
                self.finish(false);
                Poll::Ready(item)
            }
            Poll::Pending => {
                if let Some((sleep, after)) = &mut self.first_deadline
                    && sleep.as_mut().poll(cx).is_ready()
                {
                    let after = *after;
                    self.finish(true);
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
