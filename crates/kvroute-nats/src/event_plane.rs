//! [`NatsEventPlane`]: the runtime's event plane on NATS, with KV events on JetStream.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_nats::jetstream::{self, consumer, stream};
use bytes::Bytes;
use futures::StreamExt;
use futures::future::BoxFuture;
use kvroute_runtime::{
    EventPlane, EventPlaneError, KV_EVENT_SUBJECT, Message, Subscription, WarnThrottle,
    check_subject, decode_router_event,
};

use crate::client::{ConnectError, Nats};

/// The JetStream stream that holds KV events.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventStreamConfig {
    /// Events older than this are dropped from the stream (a router that restarts later than
    /// this falls back to the workers' rings and dumps).
    pub max_age: Duration,
    /// The stream's size bound; the oldest events go first.
    pub max_bytes: i64,
    /// A re-published event (same worker and event id) within this window is stored once.
    pub duplicate_window: Duration,
}

impl Default for EventStreamConfig {
    fn default() -> Self {
        Self {
            max_age: Duration::from_secs(3600),
            max_bytes: 1 << 30,
            duplicate_window: Duration::from_secs(120),
        }
    }
}

/// The event plane on NATS. KV events published on [`KV_EVENT_SUBJECT`] go to the JetStream
/// stream `<NAMESPACE>_KV_EVENTS` on subject `<namespace>.kv_events.<worker id>`, with the
/// message id `<worker id>.<event id>` (so a re-publish is stored once); a subscription to
/// [`KV_EVENT_SUBJECT`] reads that stream from its oldest retained event and follows it. Every
/// other subject is NATS core publish/subscribe under `<namespace>.`. Cheap to clone.
#[derive(Debug, Clone)]
pub struct NatsEventPlane {
    nats: Nats,
    stream: Arc<str>,
    counters: Arc<Counters>,
}

#[derive(Debug, Default)]
struct Counters {
    published: AtomicU64,
    /// Sent and not yet acknowledged (or failed).
    unacked: AtomicU64,
    publish_failures: AtomicU64,
    duplicates: AtomicU64,
    /// While NATS is down every event's acknowledgement fails: one line per window says so.
    unacked_warnings: WarnThrottle,
}

impl NatsEventPlane {
    /// The plane over `nats`, creating (or reusing) the KV event stream.
    pub async fn start(nats: Nats, config: &EventStreamConfig) -> Result<Self, ConnectError> {
        let name = format!("{}_KV_EVENTS", nats.namespace);
        let subjects = vec![format!("{}.{KV_EVENT_SUBJECT}.>", nats.namespace)];
        let wanted = stream::Config {
            name: name.clone(),
            subjects,
            max_age: config.max_age,
            max_bytes: config.max_bytes,
            duplicate_window: config.duplicate_window,
            storage: stream::StorageType::File,
            discard: stream::DiscardPolicy::Old,
            ..Default::default()
        };
        let setup = |e: String| ConnectError::Setup {
            what: format!("the KV event stream {name}"),
            message: e,
        };
        let mut stream = nats
            .jetstream
            .get_or_create_stream(wanted.clone())
            .await
            .map_err(|e| setup(e.to_string()))?;
        // Another process created it with other bounds: take this process's.
        let current = stream
            .info()
            .await
            .map_err(|e| setup(e.to_string()))?
            .config
            .clone();
        if current.max_age != wanted.max_age
            || current.max_bytes != wanted.max_bytes
            || current.duplicate_window != wanted.duplicate_window
        {
            nats.jetstream
                .update_stream(wanted)
                .await
                .map_err(|e| setup(e.to_string()))?;
        }
        Ok(Self {
            nats,
            stream: name.into(),
            counters: Arc::default(),
        })
    }

    /// KV events sent to the stream.
    pub fn published(&self) -> u64 {
        self.counters.published.load(Ordering::Relaxed)
    }

    /// KV events the stream did not acknowledge (the consumers' gap recovery repairs them).
    pub fn publish_failures(&self) -> u64 {
        self.counters.publish_failures.load(Ordering::Relaxed)
    }

    /// KV events the stream already held (re-published after a retry or a restart).
    pub fn duplicates(&self) -> u64 {
        self.counters.duplicates.load(Ordering::Relaxed)
    }

    /// Waits (up to `timeout`) until JetStream acknowledged (or refused) every KV event sent;
    /// says whether it did. A worker calls it before it exits: events still on their way when
    /// the connection closes are lost (the routers would have to repair the gap from a worker
    /// that is gone).
    pub async fn settle(&self, timeout: Duration) -> bool {
        let settled = async {
            while self.counters.unacked.load(Ordering::Relaxed) > 0 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        };
        tokio::time::timeout(timeout, settled).await.is_ok()
    }

    /// The connection.
    pub fn nats(&self) -> &Nats {
        &self.nats
    }

    async fn publish_kv_event(&self, payload: Bytes) -> Result<(), EventPlaneError> {
        let event = decode_router_event(&payload).map_err(|e| EventPlaneError::Unavailable {
            message: format!("a KV event must be a JSON RouterEvent: {e}"),
        })?;
        let subject = format!(
            "{}.{KV_EVENT_SUBJECT}.{}",
            self.nats.namespace, event.worker_id
        );
        let message = jetstream::message::PublishMessage::build()
            .payload(payload)
            .message_id(format!("{}.{}", event.worker_id, event.event.event_id));
        let ack = self
            .nats
            .jetstream
            .send_publish(subject, message)
            .await
            .map_err(|e| {
                self.counters
                    .publish_failures
                    .fetch_add(1, Ordering::Relaxed);
                EventPlaneError::Unavailable {
                    message: e.to_string(),
                }
            })?;
        self.counters.published.fetch_add(1, Ordering::Relaxed);
        self.counters.unacked.fetch_add(1, Ordering::Relaxed);
        // Acks are awaited off the publishing path, so a worker's events stream at the rate the
        // connection takes them; a lost one shows up as a gap that consumers repair.
        let counters = self.counters.clone();
        tokio::spawn(async move {
            match ack.await {
                Ok(ack) => {
                    if ack.duplicate {
                        counters.duplicates.fetch_add(1, Ordering::Relaxed);
                    }
                    if let Some(more) = counters.unacked_warnings.flush(std::time::Instant::now()) {
                        tracing::warn!(
                            "KV events were not acknowledged by JetStream; routers will repair the gaps{more}"
                        );
                    }
                }
                Err(error) => {
                    counters.publish_failures.fetch_add(1, Ordering::Relaxed);
                    if let Some(more) = counters.unacked_warnings.check(std::time::Instant::now()) {
                        tracing::warn!(%error, "a KV event was not acknowledged by JetStream; routers will repair the gap{more}");
                    }
                }
            }
            counters.unacked.fetch_sub(1, Ordering::Relaxed);
        });
        Ok(())
    }

    /// The stream position of the newest KV event the stream holds (0 when it is empty).
    pub async fn last_sequence(&self) -> Result<u64, EventPlaneError> {
        let unavailable = |e: String| EventPlaneError::Unavailable { message: e };
        let mut stream = self
            .nats
            .jetstream
            .get_stream(self.stream.as_ref())
            .await
            .map_err(|e| unavailable(e.to_string()))?;
        Ok(stream
            .info()
            .await
            .map_err(|e| unavailable(e.to_string()))?
            .state
            .last_sequence)
    }

    /// `start`, or 0 (the oldest retained event) when the stream no longer holds it: a consumer
    /// asked to start before the first retained sequence would wait for it forever.
    async fn clamp_start(&self, start: u64) -> Result<u64, EventPlaneError> {
        if start == 0 {
            return Ok(0);
        }
        let mut stream = self
            .nats
            .jetstream
            .get_stream(self.stream.as_ref())
            .await
            .map_err(|e| EventPlaneError::Unavailable {
                message: e.to_string(),
            })?;
        let first = stream
            .info()
            .await
            .map_err(|e| EventPlaneError::Unavailable {
                message: e.to_string(),
            })?
            .state
            .first_sequence;
        Ok(if start < first { 0 } else { start })
    }

    /// An ordered push consumer of the KV event stream from `start` (its oldest event when 0).
    async fn kv_consumer(&self, start: u64) -> Result<consumer::push::Ordered, EventPlaneError> {
        let unavailable = |e: String| EventPlaneError::Unavailable { message: e };
        let stream = self
            .nats
            .jetstream
            .get_stream(self.stream.as_ref())
            .await
            .map_err(|e| unavailable(e.to_string()))?;
        let deliver_policy = if start == 0 {
            consumer::DeliverPolicy::All
        } else {
            consumer::DeliverPolicy::ByStartSequence {
                start_sequence: start,
            }
        };
        stream
            // A push consumer (flow control, idle heartbeats): the pull-based ordered consumer
            // of async-nats stalls at batch boundaries against NATS 2.9 servers.
            .create_consumer(consumer::push::OrderedConfig {
                deliver_subject: self.nats.client.new_inbox(),
                filter_subject: format!("{}.{KV_EVENT_SUBJECT}.>", self.nats.namespace),
                deliver_policy,
                ..Default::default()
            })
            .await
            .map_err(|e| unavailable(e.to_string()))?
            .messages()
            .await
            .map_err(|e| unavailable(e.to_string()))
    }

    /// The KV event stream from sequence `start` (its oldest retained event when 0 or when
    /// `start` is no longer held), followed for as long as the subscription lives: when the
    /// consumer fails (NATS restarted, connection lost) it is re-created from the event after
    /// the last one delivered, so nothing is skipped or repeated (events the stream no longer
    /// holds show up as gaps, which the router repairs).
    async fn subscribe_kv_events(&self, start: u64) -> Result<Subscription, EventPlaneError> {
        let start = self.clamp_start(start).await?;
        let first = self.kv_consumer(start).await?;
        let plane = self.clone();
        let subject: Arc<str> = KV_EVENT_SUBJECT.into();
        Ok(Box::pin(async_stream::stream! {
            let mut messages = Some(first);
            let mut next: u64 = start;
            let mut backoff = Duration::from_millis(100);
            // Retried every 2 s at most while NATS is down: one line per window says so.
            let resume_failures = WarnThrottle::default();
            loop {
                let mut current = match messages.take() {
                    Some(m) => m,
                    None => match plane.kv_consumer(next).await {
                        Ok(m) => {
                            tracing::info!(from = next, "KV event stream resumed");
                            backoff = Duration::from_millis(100);
                            m
                        }
                        Err(error) => {
                            if let Some(more) = resume_failures.check(std::time::Instant::now()) {
                                tracing::warn!(%error, ?backoff, "cannot resume the KV event stream yet{more}");
                            }
                            tokio::time::sleep(backoff).await;
                            backoff = (backoff * 2).min(Duration::from_secs(2));
                            continue;
                        }
                    },
                };
                while let Some(message) = current.next().await {
                    match message {
                        Ok(message) => {
                            let sequence = message.info().ok().map(|info| info.stream_sequence);
                            if let Some(sequence) = sequence {
                                next = sequence + 1;
                            }
                            yield Message {
                                subject: subject.clone(),
                                payload: message.payload.clone(),
                                event: None,
                                sequence,
                            };
                        }
                        Err(error) => {
                            tracing::warn!(%error, "KV event stream interrupted; resuming");
                            break;
                        }
                    }
                }
                tokio::time::sleep(backoff).await;
            }
        }))
    }

    async fn subscribe_core(&self, pattern: &str) -> Result<Subscription, EventPlaneError> {
        let full = format!("{}.{pattern}", self.nats.namespace);
        let subscriber =
            self.nats
                .client
                .subscribe(full)
                .await
                .map_err(|e| EventPlaneError::Unavailable {
                    message: e.to_string(),
                })?;
        let prefix_len = self.nats.namespace.len() + 1;
        Ok(Box::pin(subscriber.map(move |message| Message {
            subject: message.subject.as_str()[prefix_len..].into(),
            payload: message.payload,
            sequence: None,
            event: None,
        })))
    }
}

impl EventPlane for NatsEventPlane {
    fn publish<'a>(
        &'a self,
        subject: &'a str,
        payload: Bytes,
    ) -> BoxFuture<'a, Result<(), EventPlaneError>> {
        Box::pin(async move {
            check_subject(subject, false)?;
            if subject == KV_EVENT_SUBJECT {
                return self.publish_kv_event(payload).await;
            }
            self.nats
                .client
                .publish(format!("{}.{subject}", self.nats.namespace), payload)
                .await
                .map_err(|e| EventPlaneError::Unavailable {
                    message: e.to_string(),
                })
        })
    }

    fn subscribe<'a>(
        &'a self,
        pattern: &'a str,
    ) -> BoxFuture<'a, Result<Subscription, EventPlaneError>> {
        Box::pin(async move {
            check_subject(pattern, true)?;
            if pattern == KV_EVENT_SUBJECT {
                self.subscribe_kv_events(0).await
            } else {
                self.subscribe_core(pattern).await
            }
        })
    }

    fn keeps_history(&self) -> bool {
        true
    }

    fn subscribe_after<'a>(
        &'a self,
        pattern: &'a str,
        sequence: u64,
    ) -> BoxFuture<'a, Result<Subscription, EventPlaneError>> {
        Box::pin(async move {
            check_subject(pattern, true)?;
            if pattern != KV_EVENT_SUBJECT {
                return Err(EventPlaneError::Unsupported {
                    what: "resuming a subject other than the KV events (only they are kept)",
                });
            }
            self.subscribe_kv_events(sequence.saturating_add(1)).await
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subjects_and_patterns_are_checked_like_the_in_process_plane() {
        let check = check_subject;
        assert!(check("kv_events", false).is_ok());
        assert!(check("load.router-1", false).is_ok());
        assert!(check("load.*", true).is_ok());
        assert!(check("load.>", true).is_ok());
        assert!(check("load.*", false).is_err());
        assert!(check("a..b", false).is_err());
        assert!(check("", true).is_err());
        assert!(check("a.>.b", true).is_err());
        assert!(check("a.b*", true).is_err());
    }
}
