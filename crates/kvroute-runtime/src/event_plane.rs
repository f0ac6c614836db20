//! The event plane: fire-and-forget publish/subscribe by subject, as NATS core offers it.
//!
//! Subjects are dot-separated tokens; a subscription pattern may use `*` for exactly one token and
//! a trailing `>` for one or more tokens, with NATS's meaning, so that a NATS implementation can
//! pass patterns through unchanged. Delivery is at most once: a subscriber that falls behind loses
//! messages (KV events carry ids, so their consumers detect and repair the gap).

use std::pin::Pin;
use std::sync::Arc;

use bytes::Bytes;
use futures::Stream;
use futures::future::BoxFuture;
use kvroute_protocols::kv_events::RouterEvent;
use parking_lot::Mutex;
use tokio::sync::broadcast;

/// One message received on a subscription.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// The subject it was published on.
    pub subject: Arc<str>,
    /// The payload, opaque to the plane.
    pub payload: Bytes,
    /// Where the message sits in the plane's durable history (the JetStream stream sequence of
    /// a KV event), for planes that keep one ([`EventPlane::subscribe_after`]); `None` otherwise.
    pub sequence: Option<u64>,
    /// A KV event handed over as it is, where publisher and subscriber share this process's
    /// memory ([`EventPlane::publish_router_event`] on the [`InProcessEventPlane`]); `payload` is
    /// then empty. Read KV events with [`Message::router_event`], which takes this or decodes the
    /// payload.
    pub event: Option<Arc<RouterEvent>>,
}

impl Message {
    /// The KV event this message carries: the one handed over in memory, or its payload
    /// decoded ([`decode_router_event`]).
    pub fn router_event(&self) -> Result<RouterEvent, serde_json::Error> {
        match &self.event {
            Some(event) => Ok(RouterEvent::clone(event)),
            None => decode_router_event(&self.payload),
        }
    }
}

/// The messages matching one subscription, in publish order, until the plane is dropped.
pub type Subscription = Pin<Box<dyn Stream<Item = Message> + Send + 'static>>;

/// Why the event plane refused an operation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EventPlaneError {
    /// The subject or pattern is malformed.
    #[error("invalid subject {subject:?}: {reason}")]
    InvalidSubject {
        /// The subject as given.
        subject: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The plane cannot do this (for example resume from a position: it keeps no history).
    #[error("this event plane does not support {what}")]
    Unsupported {
        /// The operation refused.
        what: &'static str,
    },
    /// The backing service is unreachable.
    #[error("event plane unavailable: {message}")]
    Unavailable {
        /// What happened.
        message: String,
    },
}

/// Publish/subscribe by subject. Object safe, so a router holds an `Arc<dyn EventPlane>` and does
/// not care whether it is in-process or NATS.
pub trait EventPlane: Send + Sync + 'static {
    /// Publishes `payload` on `subject` (no wildcards) to every current matching subscriber.
    fn publish<'a>(
        &'a self,
        subject: &'a str,
        payload: Bytes,
    ) -> BoxFuture<'a, Result<(), EventPlaneError>>;

    /// Publishes a KV event on [`KV_EVENT_SUBJECT`](crate::KV_EVENT_SUBJECT): encoded
    /// ([`encode_router_event`]) unless the plane can hand it over in memory, as the
    /// [`InProcessEventPlane`] does (its subscribers skip a JSON round trip per event).
    fn publish_router_event(
        &self,
        event: RouterEvent,
    ) -> BoxFuture<'_, Result<(), EventPlaneError>> {
        Box::pin(async move {
            self.publish(crate::KV_EVENT_SUBJECT, encode_router_event(&event))
                .await
        })
    }

    /// Subscribes to every subject matching `pattern`.
    fn subscribe<'a>(
        &'a self,
        pattern: &'a str,
    ) -> BoxFuture<'a, Result<Subscription, EventPlaneError>>;

    /// Whether a subscription to [`KV_EVENT_SUBJECT`](crate::KV_EVENT_SUBJECT) starts from the
    /// plane's retained history rather than from now (a durable stream, such as JetStream):
    /// a router then learns a worker's blocks from the stream instead of asking it for a dump.
    fn keeps_history(&self) -> bool {
        false
    }

    /// Like [`EventPlane::subscribe`], from the message after position `sequence` of the
    /// plane's history (a [`Message::sequence`]); when the history no longer reaches back that
    /// far, from its oldest retained message (consumers of numbered events see the loss as a
    /// gap). Planes without history refuse with [`EventPlaneError::Unsupported`].
    fn subscribe_after<'a>(
        &'a self,
        pattern: &'a str,
        sequence: u64,
    ) -> BoxFuture<'a, Result<Subscription, EventPlaneError>> {
        let _ = (pattern, sequence);
        Box::pin(async {
            Err(EventPlaneError::Unsupported {
                what: "resuming a subscription from a stream position",
            })
        })
    }
}

/// One slot that keeps the newest snapshot of a router's index, shared by the router replicas
/// of a fleet (a JetStream object in kvroute-nats), so that a router that starts or restarts
/// loads it and reads only the events after it ([`EventPlane::subscribe_after`]).
pub trait SnapshotStore: Send + Sync + 'static {
    /// The stored snapshot, if any.
    fn load(&self) -> BoxFuture<'_, Result<Option<Bytes>, EventPlaneError>>;

    /// Replaces the stored snapshot.
    fn save(&self, snapshot: Bytes) -> BoxFuture<'_, Result<(), EventPlaneError>>;

    /// How long ago the stored snapshot was saved (by any replica), if there is one: replicas
    /// skip their turn while a fresh one exists.
    fn age(&self) -> BoxFuture<'_, Result<Option<std::time::Duration>, EventPlaneError>>;
}

/// A [`SnapshotStore`] in this process's memory (tests, and routers that share one process).
#[derive(Debug, Default)]
pub struct InMemorySnapshotStore {
    slot: Mutex<Option<(Bytes, std::time::Instant)>>,
}

impl InMemorySnapshotStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }
}

impl SnapshotStore for InMemorySnapshotStore {
    fn load(&self) -> BoxFuture<'_, Result<Option<Bytes>, EventPlaneError>> {
        let snapshot = self.slot.lock().as_ref().map(|(b, _)| b.clone());
        Box::pin(async move { Ok(snapshot) })
    }

    fn save(&self, snapshot: Bytes) -> BoxFuture<'_, Result<(), EventPlaneError>> {
        *self.slot.lock() = Some((snapshot, std::time::Instant::now()));
        Box::pin(async { Ok(()) })
    }

    fn age(&self) -> BoxFuture<'_, Result<Option<std::time::Duration>, EventPlaneError>> {
        let age = self.slot.lock().as_ref().map(|(_, at)| at.elapsed());
        Box::pin(async move { Ok(age) })
    }
}

/// The in-process event plane: a broadcast channel per subscription.
#[derive(Debug)]
pub struct InProcessEventPlane {
    capacity: usize,
    subscribers: Mutex<Vec<(Vec<String>, broadcast::Sender<Message>)>>,
}

/// How many messages an in-process subscriber may fall behind before it loses some.
pub const DEFAULT_SUBSCRIBER_CAPACITY: usize = 65_536;

impl Default for InProcessEventPlane {
    fn default() -> Self {
        Self::new(DEFAULT_SUBSCRIBER_CAPACITY)
    }
}

impl InProcessEventPlane {
    /// A plane whose subscribers each buffer up to `capacity` messages.
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            subscribers: Mutex::new(Vec::new()),
        }
    }

    fn publish_now(
        &self,
        subject: &str,
        payload: Bytes,
        event: Option<Arc<RouterEvent>>,
    ) -> Result<(), EventPlaneError> {
        let tokens = tokens(subject, false)?;
        let subject: Arc<str> = subject.into();
        let mut subscribers = self.subscribers.lock();
        subscribers.retain(|(_, tx)| tx.receiver_count() > 0);
        for (pattern, tx) in subscribers.iter() {
            if matches(pattern, &tokens) {
                let _ = tx.send(Message {
                    subject: subject.clone(),
                    payload: payload.clone(),
                    sequence: None,
                    event: event.clone(),
                });
            }
        }
        Ok(())
    }

    fn subscribe_now(&self, pattern: &str) -> Result<Subscription, EventPlaneError> {
        let pattern = tokens(pattern, true)?
            .into_iter()
            .map(str::to_owned)
            .collect();
        let (tx, rx) = broadcast::channel(self.capacity);
        self.subscribers.lock().push((pattern, tx));
        Ok(Box::pin(futures::stream::unfold(rx, |mut rx| async move {
            loop {
                match rx.recv().await {
                    Ok(message) => return Some((message, rx)),
                    Err(broadcast::error::RecvError::Lagged(lost)) => {
                        tracing::warn!(
                            lost,
                            "event plane subscriber fell behind and lost messages"
                        );
                    }
                    Err(broadcast::error::RecvError::Closed) => return None,
                }
            }
        })))
    }
}

impl EventPlane for InProcessEventPlane {
    fn publish<'a>(
        &'a self,
        subject: &'a str,
        payload: Bytes,
    ) -> BoxFuture<'a, Result<(), EventPlaneError>> {
        let result = self.publish_now(subject, payload, None);
        Box::pin(async move { result })
    }

    fn publish_router_event(
        &self,
        event: RouterEvent,
    ) -> BoxFuture<'_, Result<(), EventPlaneError>> {
        let result = self.publish_now(crate::KV_EVENT_SUBJECT, Bytes::new(), Some(Arc::new(event)));
        Box::pin(async move { result })
    }

    fn subscribe<'a>(
        &'a self,
        pattern: &'a str,
    ) -> BoxFuture<'a, Result<Subscription, EventPlaneError>> {
        let result = self.subscribe_now(pattern);
        Box::pin(async move { result })
    }
}

fn tokens(subject: &str, pattern: bool) -> Result<Vec<&str>, EventPlaneError> {
    let invalid = |reason| EventPlaneError::InvalidSubject {
        subject: subject.to_owned(),
        reason,
    };
    if subject.is_empty() {
        return Err(invalid("expected at least one token"));
    }
    let parts: Vec<&str> = subject.split('.').collect();
    for (i, part) in parts.iter().enumerate() {
        if part.is_empty() {
            return Err(invalid("expected non-empty dot-separated tokens"));
        }
        if part.contains(char::is_whitespace) {
            return Err(invalid("expected no whitespace"));
        }
        let wildcard = *part == "*" || *part == ">";
        if wildcard && !pattern {
            return Err(invalid(
                "wildcards are only allowed in subscription patterns",
            ));
        }
        if *part == ">" && i + 1 != parts.len() {
            return Err(invalid("'>' must be the last token"));
        }
        if !wildcard && (part.contains('*') || part.contains('>')) {
            return Err(invalid("wildcards must be whole tokens"));
        }
    }
    Ok(parts)
}

/// Checks a subject (`pattern` false) or a subscription pattern as every event plane must:
/// dot-separated non-empty tokens without whitespace, `*` and a trailing `>` as whole tokens and
/// only in patterns. Planes outside this crate (NATS) call it so all refuse the same input.
pub fn check_subject(subject: &str, pattern: bool) -> Result<(), EventPlaneError> {
    tokens(subject, pattern).map(|_| ())
}

fn matches(pattern: &[String], subject: &[&str]) -> bool {
    for (i, p) in pattern.iter().enumerate() {
        match p.as_str() {
            ">" => return subject.len() > i,
            "*" if i < subject.len() => {}
            literal if subject.get(i) == Some(&literal) => {}
            _ => return false,
        }
    }
    pattern.len() == subject.len()
}

/// Encodes a KV event for the event plane (JSON, Dynamo's shape).
pub fn encode_router_event(event: &RouterEvent) -> Bytes {
    // A RouterEvent holds only integers, enums and vectors, so JSON encoding cannot fail.
    Bytes::from(serde_json::to_vec(event).unwrap_or_default())
}

/// Decodes a KV event published by [`encode_router_event`] (or a Dynamo worker).
pub fn decode_router_event(payload: &[u8]) -> Result<RouterEvent, serde_json::Error> {
    serde_json::from_slice(payload)
}

#[cfg(test)]
mod tests;
