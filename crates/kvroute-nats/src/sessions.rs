//! [`NatsAffinityStore`]: sticky-session bindings shared by router replicas through a KV bucket.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_nats::jetstream::kv;
use bytes::Bytes;
use futures::StreamExt;
use kvroute_protocols::WorkerWithDpRank;
use kvroute_sessions::{
    AffinityBinding, AffinityKind, AffinityStore, AffinityToken, ExpiredBinding,
    InMemoryAffinityStore, PutOutcome, StoreError,
};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

use crate::client::{ConnectError, Nats};

/// How the shared session store behaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NatsAffinityStoreConfig {
    /// This router replica's id (unique among the replicas; a random one is fine).
    pub origin: u64,
    /// Bindings held at most (the local mirror's bound).
    pub max_sessions: usize,
    /// The server drops a binding this long after its last write, whatever its TTL (the
    /// longest session any client may keep).
    pub max_age: Duration,
}

impl NatsAffinityStoreConfig {
    /// Defaults for the replica `origin`: 1,000,000 sessions, a day at most.
    pub fn new(origin: u64) -> Self {
        Self {
            origin,
            max_sessions: kvroute_sessions::DEFAULT_MAX_SESSIONS,
            max_age: Duration::from_secs(24 * 3600),
        }
    }
}

/// Sticky-session bindings shared by router replicas: each replica keeps a local mirror (reads
/// never wait on the network) and writes every change to the KV bucket `<namespace>_sessions`;
/// every replica watches the bucket and applies the others' changes to its mirror, so a session
/// bound through one router is honoured by all of them.
///
/// - A binding carries its TTL; a replica that refreshes it (an intermediate turn) re-publishes
///   it at most every quarter of the TTL, so the others do not expire a live session.
/// - The replica that wrote a binding last owns it: only the owner reports it expired (and so
///   closes its engine session); the others drop it silently. Removing a binding (close, soft
///   worker loss, a rolled-back open) removes it everywhere.
/// - Consistency: last writer wins, in the bucket's order, which every replica converges to; two
///   replicas binding one session in the same instant end with the later binding. While NATS is
///   unreachable a replica works on its mirror alone; its writes are kept (the latest per
///   session) and re-sent every second until NATS takes them, unless the bucket meanwhile holds
///   a newer write of that session from another replica.
#[derive(Debug, Clone)]
pub struct NatsAffinityStore {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    local: InMemoryAffinityStore,
    origin: u64,
    writes: mpsc::UnboundedSender<Write>,
    /// Other replicas' changes, applied at the next call (which brings the caller's clock).
    pending: Mutex<Vec<Remote>>,
    meta: Mutex<HashMap<String, Meta>>,
    counters: Arc<Counters>,
    tasks: Vec<tokio::task::AbortHandle>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

#[derive(Debug, Default)]
struct Counters {
    write_failures: AtomicU64,
    resent: AtomicU64,
    superseded: AtomicU64,
    remote_applied: AtomicU64,
}

/// One change to write to the bucket.
#[derive(Debug)]
struct Write {
    key: String,
    value: Bytes,
    written_unix_ms: u64,
}

#[derive(Debug, Clone, Copy)]
struct Meta {
    ttl: Duration,
    replicated_at: Duration,
    /// The latest write came from another replica.
    remote: bool,
}

#[derive(Debug)]
enum Remote {
    Put {
        session: String,
        binding: AffinityBinding,
        ttl: Duration,
        left: Duration,
    },
    Remove {
        session: String,
    },
}

/// A binding as stored in the bucket (a removal is a tombstone, so that it carries its origin).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Stored {
    origin: u64,
    /// When it was written (Unix ms): a write held back by an outage yields to a newer one.
    #[serde(default)]
    written_unix_ms: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    binding: Option<StoredBinding>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct StoredBinding {
    worker_id: u64,
    dp_rank: u32,
    engine_backed: bool,
    ttl_ms: u64,
    written_unix_ms: u64,
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// A session id as a bucket key: hex, since session ids are free-form.
fn key_of(session: &str) -> String {
    let mut key = String::with_capacity(session.len() * 2 + 1);
    key.push('s');
    for b in session.bytes() {
        key.push_str(&format!("{b:02x}"));
    }
    key
}

fn session_of(key: &str) -> Option<String> {
    let hex = key.strip_prefix('s')?;
    if hex.len() % 2 != 0 {
        return None;
    }
    let bytes: Option<Vec<u8>> = (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).ok())
        .collect();
    String::from_utf8(bytes?).ok()
}

impl NatsAffinityStore {
    /// The store over `nats`, creating (or reusing) the bucket and watching it. Must be called
    /// inside a tokio runtime.
    pub async fn start(
        nats: &Nats,
        config: &NatsAffinityStoreConfig,
    ) -> Result<Self, ConnectError> {
        let bucket = format!("{}_sessions", nats.namespace);
        let store =
            nats.key_value(&bucket, config.max_age)
                .await
                .map_err(|e| ConnectError::Setup {
                    what: format!("the session bucket {bucket}"),
                    message: e,
                })?;
        let (writes, rx) = mpsc::unbounded_channel::<Write>();
        let counters = Arc::new(Counters::default());
        let writer = tokio::spawn(write_loop(store.clone(), rx, counters.clone()));
        let inner = Arc::new_cyclic(|weak: &std::sync::Weak<Inner>| {
            let watcher = tokio::spawn(watch(store, config.origin, weak.clone()));
            Inner {
                local: InMemoryAffinityStore::new(config.max_sessions),
                origin: config.origin,
                writes,
                pending: Mutex::new(Vec::new()),
                meta: Mutex::new(HashMap::new()),
                counters,
                tasks: vec![writer.abort_handle(), watcher.abort_handle()],
            }
        });
        Ok(Self { inner })
    }

    /// Writes to the bucket that failed (NATS unreachable).
    pub fn write_failures(&self) -> u64 {
        self.inner.counters.write_failures.load(Ordering::Relaxed)
    }

    /// Writes re-sent after NATS came back.
    pub fn resent(&self) -> u64 {
        self.inner.counters.resent.load(Ordering::Relaxed)
    }

    /// Writes held back by an outage and dropped because another replica wrote that session
    /// later.
    pub fn superseded(&self) -> u64 {
        self.inner.counters.superseded.load(Ordering::Relaxed)
    }

    /// Other replicas' changes applied here.
    pub fn remote_applied(&self) -> u64 {
        self.inner.counters.remote_applied.load(Ordering::Relaxed)
    }
}

/// Writes changes to the bucket in order; what NATS does not take is kept (the latest per
/// session) and re-sent every second, unless the bucket meanwhile holds a newer write.
async fn write_loop(
    store: kv::Store,
    mut rx: mpsc::UnboundedReceiver<Write>,
    counters: Arc<Counters>,
) {
    let mut unsent: HashMap<String, Write> = HashMap::new();
    let mut retry = tokio::time::interval(Duration::from_secs(1));
    retry.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            write = rx.recv() => {
                let Some(write) = write else { return };
                unsent.remove(&write.key);
                if let Err(error) = store.put(&write.key, write.value.clone()).await {
                    counters.write_failures.fetch_add(1, Ordering::Relaxed);
                    if unsent.is_empty() {
                        tracing::warn!(%error, "a session binding was not written to NATS; keeping it to re-send when NATS is back");
                    }
                    unsent.insert(write.key.clone(), write);
                }
            }
            _ = retry.tick(), if !unsent.is_empty() => {
                let keys: Vec<String> = unsent.keys().cloned().collect();
                for key in keys {
                    let newer = match store.entry(&key).await {
                        Ok(Some(entry)) => serde_json::from_slice::<Stored>(&entry.value)
                            .is_ok_and(|s| s.written_unix_ms > unsent[&key].written_unix_ms),
                        Ok(None) => false,
                        // Still unreachable: try again at the next tick.
                        Err(_) => break,
                    };
                    if newer {
                        counters.superseded.fetch_add(1, Ordering::Relaxed);
                        unsent.remove(&key);
                        continue;
                    }
                    if store.put(&key, unsent[&key].value.clone()).await.is_err() {
                        break;
                    }
                    unsent.remove(&key);
                    counters.resent.fetch_add(1, Ordering::Relaxed);
                }
                if unsent.is_empty() {
                    tracing::info!("session bindings written during the NATS outage are shared again");
                }
            }
        }
    }
}

async fn watch(store: kv::Store, origin: u64, inner: std::sync::Weak<Inner>) {
    let mut backoff = Duration::from_millis(100);
    loop {
        let mut updates = match store.watch_with_history(">").await {
            Ok(w) => w,
            Err(error) => {
                tracing::warn!(%error, "cannot watch the NATS session bucket; retrying");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(2));
                continue;
            }
        };
        backoff = Duration::from_millis(100);
        while let Some(entry) = updates.next().await {
            let Ok(entry) = entry else { break };
            let Some(inner) = inner.upgrade() else { return };
            let Some(session) = session_of(&entry.key) else {
                continue;
            };
            let remote = match entry.operation {
                kv::Operation::Put => match serde_json::from_slice::<Stored>(&entry.value) {
                    Ok(stored) if stored.origin == origin => continue,
                    Ok(Stored { binding: None, .. }) => Remote::Remove { session },
                    Ok(Stored {
                        binding: Some(b), ..
                    }) => {
                        let age = unix_ms().saturating_sub(b.written_unix_ms);
                        let left = b.ttl_ms.saturating_sub(age);
                        if left == 0 {
                            Remote::Remove { session }
                        } else {
                            Remote::Put {
                                session,
                                binding: AffinityBinding {
                                    worker: WorkerWithDpRank::new(b.worker_id, b.dp_rank),
                                    kind: if b.engine_backed {
                                        AffinityKind::EngineBacked
                                    } else {
                                        AffinityKind::RouterOnly
                                    },
                                },
                                ttl: Duration::from_millis(b.ttl_ms),
                                left: Duration::from_millis(left),
                            }
                        }
                    }
                    Err(error) => {
                        tracing::warn!(key = %entry.key, %error, "ignoring a malformed session binding");
                        continue;
                    }
                },
                kv::Operation::Delete | kv::Operation::Purge => Remote::Remove { session },
            };
            inner.pending.lock().push(remote);
        }
        tokio::time::sleep(backoff).await;
    }
}

impl Inner {
    fn write(&self, session: &str, binding: Option<(AffinityBinding, Duration)>) {
        let written_unix_ms = unix_ms();
        let stored = Stored {
            origin: self.origin,
            written_unix_ms,
            binding: binding.map(|(b, ttl)| StoredBinding {
                worker_id: b.worker.worker_id,
                dp_rank: b.worker.dp_rank,
                engine_backed: b.kind == AffinityKind::EngineBacked,
                ttl_ms: ttl.as_millis() as u64,
                written_unix_ms,
            }),
        };
        let value = serde_json::to_vec(&stored).unwrap_or_default();
        let _ = self.writes.send(Write {
            key: key_of(session),
            value: Bytes::from(value),
            written_unix_ms,
        });
    }

    /// Applies the other replicas' changes that arrived since the last call.
    fn apply_pending(&self, now: Duration) {
        let pending = std::mem::take(&mut *self.pending.lock());
        if pending.is_empty() {
            return;
        }
        let mut meta = self.meta.lock();
        for change in pending {
            self.counters.remote_applied.fetch_add(1, Ordering::Relaxed);
            match change {
                Remote::Put {
                    session,
                    binding,
                    ttl,
                    left,
                } => match self.local.put(&session, binding, left, now) {
                    Ok(_) => {
                        meta.insert(
                            session,
                            Meta {
                                ttl,
                                replicated_at: now,
                                remote: true,
                            },
                        );
                    }
                    Err(error) => {
                        tracing::warn!(%error, "a shared session binding was not mirrored")
                    }
                },
                Remote::Remove { session } => {
                    self.local.remove(&session);
                    meta.remove(&session);
                }
            }
        }
    }
}

impl AffinityStore for NatsAffinityStore {
    fn get(&self, session_id: &str, now: Duration) -> Option<AffinityToken> {
        let inner = &self.inner;
        inner.apply_pending(now);
        let token = inner.local.get(session_id, now)?;
        // The refresh must reach the other replicas before they expire the binding.
        let mut meta = inner.meta.lock();
        if let Some(m) = meta.get_mut(session_id)
            && now.saturating_sub(m.replicated_at) >= m.ttl / 4
        {
            m.replicated_at = now;
            m.remote = false;
            inner.write(session_id, Some((token.binding, m.ttl)));
        }
        Some(token)
    }

    fn peek(&self, session_id: &str, now: Duration) -> Option<AffinityToken> {
        self.inner.apply_pending(now);
        self.inner.local.peek(session_id, now)
    }

    fn put(
        &self,
        session_id: &str,
        binding: AffinityBinding,
        ttl: Duration,
        now: Duration,
    ) -> Result<PutOutcome, StoreError> {
        let inner = &self.inner;
        inner.apply_pending(now);
        let outcome = inner.local.put(session_id, binding, ttl, now)?;
        inner.meta.lock().insert(
            session_id.to_owned(),
            Meta {
                ttl,
                replicated_at: now,
                remote: false,
            },
        );
        inner.write(session_id, Some((binding, ttl)));
        Ok(outcome)
    }

    fn remove(&self, session_id: &str) -> Option<AffinityBinding> {
        let inner = &self.inner;
        let removed = inner.local.remove(session_id);
        if inner.meta.lock().remove(session_id).is_some() || removed.is_some() {
            inner.write(session_id, None);
        }
        removed
    }

    fn remove_if_token(&self, session_id: &str, token: AffinityToken) -> bool {
        let inner = &self.inner;
        let removed = inner.local.remove_if_token(session_id, token);
        if removed {
            inner.meta.lock().remove(session_id);
            inner.write(session_id, None);
        }
        removed
    }

    fn expire(&self, now: Duration) -> Vec<ExpiredBinding> {
        let inner = &self.inner;
        inner.apply_pending(now);
        let expired = inner.local.expire(now);
        let mut meta = inner.meta.lock();
        expired
            .into_iter()
            .filter(|e| {
                let owned_elsewhere = meta.remove(&e.session_id).is_some_and(|m| m.remote);
                if !owned_elsewhere {
                    inner.write(&e.session_id, None);
                }
                !owned_elsewhere
            })
            .collect()
    }

    fn len(&self) -> usize {
        self.inner.local.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn session_ids_round_trip_through_bucket_keys() {
        for session in ["abc", "user:42/chat#7", "", "ünïcode space"] {
            let key = key_of(session);
            assert!(
                key.bytes().all(|b| b.is_ascii_alphanumeric()),
                "{key} is a valid KV key"
            );
            assert_eq!(session_of(&key).as_deref(), Some(session));
        }
        assert_eq!(session_of("x00"), None);
        assert_eq!(session_of("s0"), None);
    }
}
