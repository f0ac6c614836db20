//! The push router: sends a request to one live worker chosen by a simple load-spreading mode.
//!
//! It knows nothing about KV caches; the KV-aware router picks a worker itself and uses
//! [`RouteMode::Direct`]. What the push router owns is the connection pool, the in-flight count
//! per worker (released when the response stream ends or is dropped), and failure handling: a
//! worker that cannot be connected to is taken out for an exponential backoff and, unless the
//! request was directed at it, the request goes to another worker.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use futures::Stream;
use kvroute_protocols::WorkerId;
use parking_lot::Mutex;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::sync::watch;
use tokio::time::Instant;

use crate::client::{Client, ClientConfig, ClientStream, EncodedRequest};
use crate::discovery::{InstanceSet, WorkerRole};
use crate::error::RequestError;
use crate::local::{LocalEngines, LocalStream};

/// How the push router picks a worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RouteMode {
    /// The next worker in id order.
    RoundRobin,
    /// A uniformly random worker.
    Random,
    /// Two random workers; the one with fewer requests in flight.
    PowerOfTwoChoices,
    /// Exactly this worker; fails if it is unreachable.
    Direct(WorkerId),
}

/// How a [`PushRouter`] behaves.
#[derive(Debug, Clone)]
pub struct PushRouterConfig {
    /// How each worker connection is made.
    pub client: ClientConfig,
    /// Only route to instances with this role; `None` routes to every instance.
    pub role: Option<WorkerRole>,
    /// The first backoff after a failed connect; it doubles per consecutive failure.
    pub backoff_initial: Duration,
    /// The longest backoff.
    pub backoff_max: Duration,
    /// The seed of the random choices (for reproducible tests).
    pub seed: u64,
    /// Engines this process serves itself: a worker listed at one of their addresses gets its
    /// streamed requests directly, without the connection (see [`LocalEngines`]). Empty by
    /// default.
    pub local: LocalEngines,
}

/// How long a router waits for a worker's first response item by default: a backstop above
/// every engine's own first-byte limit (kvroute-engines' `first_byte_timeout_ms`, 300 s by
/// default), which fires first and tells the router why. Dead or frozen worker processes are
/// caught much sooner by the connection's keepalive.
pub const DEFAULT_WORKER_FIRST_RESPONSE_TIMEOUT: Duration = Duration::from_secs(900);

impl Default for PushRouterConfig {
    fn default() -> Self {
        Self {
            client: ClientConfig {
                first_response_timeout: Some(DEFAULT_WORKER_FIRST_RESPONSE_TIMEOUT),
                ..ClientConfig::default()
            },
            role: None,
            backoff_initial: Duration::from_millis(100),
            backoff_max: Duration::from_secs(10),
            seed: 0x6b76_726f_7574_6521,
            local: LocalEngines::default(),
        }
    }
}

/// Why the push router could not start a request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RouteError {
    /// No worker is registered (with the configured role).
    #[error("no workers are available{}", role.map(|r| format!(" with role {r:?}")).unwrap_or_default())]
    NoWorkers {
        /// The role filter in force.
        role: Option<WorkerRole>,
    },
    /// Every candidate worker is backing off after failures.
    #[error("all {count} workers are backing off after connection failures")]
    AllBackingOff {
        /// How many workers are registered.
        count: usize,
    },
    /// The directed worker is not registered.
    #[error("worker {id} is not registered")]
    UnknownWorker {
        /// The worker id.
        id: WorkerId,
    },
    /// The request failed on the chosen worker.
    #[error("worker {worker_id}: {source}")]
    Request {
        /// The worker that failed it.
        worker_id: WorkerId,
        /// What went wrong.
        source: RequestError,
    },
}

/// Sends requests to the live workers of a discovery watch. Cheap to clone.
pub struct PushRouter<Req, Resp> {
    inner: Arc<Inner<Req, Resp>>,
}

impl<Req, Resp> Clone for PushRouter<Req, Resp> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
        }
    }
}

struct Inner<Req, Resp> {
    config: PushRouterConfig,
    instances: watch::Receiver<InstanceSet>,
    workers: Mutex<HashMap<WorkerId, Arc<WorkerSlot<Req, Resp>>>>,
    rr: AtomicUsize,
    rng: Mutex<ChaCha8Rng>,
}

struct WorkerSlot<Req, Resp> {
    address: String,
    in_flight: Arc<AtomicUsize>,
    conn: tokio::sync::Mutex<Option<Client<Req, Resp>>>,
    health: Mutex<Health>,
}

#[derive(Default)]
struct Health {
    failures: u32,
    backoff_until: Option<Instant>,
}

impl<Req, Resp> PushRouter<Req, Resp>
where
    Req: Serialize + 'static,
    Resp: DeserializeOwned + 'static,
{
    /// A router over the instances of `instances` (from [`crate::Discovery::watch`]).
    pub fn new(instances: watch::Receiver<InstanceSet>, config: PushRouterConfig) -> Self {
        let rng = ChaCha8Rng::seed_from_u64(config.seed);
        Self {
            inner: Arc::new(Inner {
                config,
                instances,
                workers: Mutex::new(HashMap::new()),
                rr: AtomicUsize::new(0),
                rng: Mutex::new(rng),
            }),
        }
    }

    /// Requests in flight on `worker` through this router.
    pub fn in_flight(&self, worker: WorkerId) -> usize {
        self.inner
            .workers
            .lock()
            .get(&worker)
            .map_or(0, |w| w.in_flight.load(Ordering::Relaxed))
    }

    /// Whether `worker` is currently taken out after connection failures.
    pub fn is_backing_off(&self, worker: WorkerId) -> bool {
        let now = Instant::now();
        self.inner
            .workers
            .lock()
            .get(&worker)
            .is_some_and(|w| w.health.lock().backoff_until.is_some_and(|t| t > now))
    }

    /// Sends `request` to a worker chosen by `mode`, retrying on another worker when a connection
    /// fails (except in [`RouteMode::Direct`]). Returns the stream, which releases the worker's
    /// in-flight count when it ends or is dropped.
    pub async fn generate(
        &self,
        request_id: &str,
        request: &Req,
        mode: RouteMode,
    ) -> Result<RoutedStream<Resp>, RouteError> {
        // Encoded on the first send over a connection; an engine of this process takes the
        // request as it is.
        let mut encoded: Option<EncodedRequest> = None;
        let mut tried: Vec<WorkerId> = Vec::new();
        loop {
            let (id, slot) = self.pick(mode, &tried)?;
            let sent = match self.inner.config.local.get::<Req, Resp>(&slot.address) {
                Some(start) => {
                    let local = LocalStream::start(&*start, id, &slot.address, request_id, request);
                    let timeout = self.inner.config.client.first_response_timeout;
                    Ok(ClientStream::local(local, timeout))
                }
                None => {
                    let encoded = match &mut encoded {
                        Some(encoded) => encoded,
                        None => encoded.insert(
                            EncodedRequest::new(
                                request_id,
                                request,
                                self.inner.config.client.max_frame_bytes,
                            )
                            .map_err(|source| RouteError::Request {
                                worker_id: id,
                                source,
                            })?,
                        ),
                    };
                    self.send(&slot, encoded).await
                }
            };
            match sent {
                Ok(stream) => {
                    slot.health.lock().failures = 0;
                    slot.in_flight.fetch_add(1, Ordering::Relaxed);
                    return Ok(RoutedStream {
                        worker_id: id,
                        inner: stream,
                        in_flight: slot.in_flight.clone(),
                        released: false,
                    });
                }
                Err(source) if source.is_worker_unavailable() => {
                    self.back_off(&slot);
                    tried.push(id);
                    if matches!(mode, RouteMode::Direct(_)) {
                        return Err(RouteError::Request {
                            worker_id: id,
                            source,
                        });
                    }
                }
                Err(source) => {
                    return Err(RouteError::Request {
                        worker_id: id,
                        source,
                    });
                }
            }
        }
    }

    /// The pooled connection to `worker` (connecting if needed), for unary calls such as
    /// [`Client::session_control`], [`Client::kv_events_range`] and [`Client::kv_dump`].
    pub async fn client(&self, worker: WorkerId) -> Result<Client<Req, Resp>, RouteError> {
        let (id, slot) = self.pick(RouteMode::Direct(worker), &[])?;
        match self.connected(&slot).await {
            Ok(client) => {
                slot.health.lock().failures = 0;
                Ok(client)
            }
            Err(source) => {
                if source.is_worker_unavailable() {
                    self.back_off(&slot);
                }
                Err(RouteError::Request {
                    worker_id: id,
                    source,
                })
            }
        }
    }

    async fn send(
        &self,
        slot: &WorkerSlot<Req, Resp>,
        encoded: &EncodedRequest,
    ) -> Result<ClientStream<Resp>, RequestError> {
        self.connected(slot).await?.generate_encoded(encoded).await
    }

    async fn connected(
        &self,
        slot: &WorkerSlot<Req, Resp>,
    ) -> Result<Client<Req, Resp>, RequestError> {
        let mut conn = slot.conn.lock().await;
        match conn.as_ref() {
            Some(c) if !c.is_closed() => Ok(c.clone()),
            _ => {
                let c = Client::connect(&slot.address, self.inner.config.client.clone()).await?;
                *conn = Some(c.clone());
                Ok(c)
            }
        }
    }

    fn back_off(&self, slot: &WorkerSlot<Req, Resp>) {
        let config = &self.inner.config;
        let mut health = slot.health.lock();
        let shift = health.failures.min(16);
        health.failures = health.failures.saturating_add(1);
        let backoff = config
            .backoff_initial
            .saturating_mul(1 << shift)
            .min(config.backoff_max);
        health.backoff_until = Some(Instant::now() + backoff);
    }

    fn pick(
        &self,
        mode: RouteMode,
        tried: &[WorkerId],
    ) -> Result<(WorkerId, Arc<WorkerSlot<Req, Resp>>), RouteError> {
        let set = self.inner.instances.borrow().clone();
        let role = self.inner.config.role;
        let mut workers = self.inner.workers.lock();
        // Forget workers discovery dropped, so a re-registered id starts fresh.
        workers.retain(|id, _| set.contains_key(id));
        let mut slot_for = |id: WorkerId, address: &str| {
            let slot = workers
                .entry(id)
                .or_insert_with(|| Arc::new(WorkerSlot::new(address)));
            if slot.address != address {
                *slot = Arc::new(WorkerSlot::new(address));
            }
            slot.clone()
        };
        if let RouteMode::Direct(id) = mode {
            let info = set.get(&id).ok_or(RouteError::UnknownWorker { id })?;
            return Ok((id, slot_for(id, &info.address)));
        }
        let now = Instant::now();
        let eligible: Vec<_> = set
            .values()
            .filter(|i| role.is_none_or(|r| i.role == r))
            .collect();
        if eligible.is_empty() {
            return Err(RouteError::NoWorkers { role });
        }
        let mut candidates: Vec<(WorkerId, Arc<WorkerSlot<Req, Resp>>)> = eligible
            .iter()
            .filter(|i| !tried.contains(&i.id))
            .map(|i| (i.id, slot_for(i.id, &i.address)))
            .filter(|(_, s)| s.health.lock().backoff_until.is_none_or(|t| t <= now))
            .collect();
        if candidates.is_empty() {
            return Err(RouteError::AllBackingOff {
                count: eligible.len(),
            });
        }
        let n = candidates.len();
        let index = match mode {
            RouteMode::RoundRobin => self.inner.rr.fetch_add(1, Ordering::Relaxed) % n,
            RouteMode::Random => self.inner.rng.lock().gen_range(0..n),
            RouteMode::PowerOfTwoChoices => {
                let (a, b) = {
                    let mut rng = self.inner.rng.lock();
                    (rng.gen_range(0..n), rng.gen_range(0..n))
                };
                let load = |i: usize| candidates[i].1.in_flight.load(Ordering::Relaxed);
                if load(b) < load(a) { b } else { a }
            }
            RouteMode::Direct(_) => 0,
        };
        Ok(candidates.swap_remove(index))
    }
}

impl<Req, Resp> WorkerSlot<Req, Resp> {
    fn new(address: &str) -> Self {
        Self {
            address: address.to_owned(),
            in_flight: Arc::new(AtomicUsize::new(0)),
            conn: tokio::sync::Mutex::new(None),
            health: Mutex::new(Health::default()),
        }
    }
}

/// A response stream from the worker the push router chose; holds one unit of that worker's
/// in-flight count until it ends or is dropped.
pub struct RoutedStream<Resp> {
    worker_id: WorkerId,
    inner: ClientStream<Resp>,
    in_flight: Arc<AtomicUsize>,
    released: bool,
}

impl<Resp> RoutedStream<Resp> {
    /// The worker serving the request.
    pub fn worker_id(&self) -> WorkerId {
        self.worker_id
    }

    /// The underlying stream (to stop or kill the request).
    pub fn stream_mut(&mut self) -> &mut ClientStream<Resp> {
        &mut self.inner
    }

    fn release(&mut self) {
        if !self.released {
            self.released = true;
            self.in_flight.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

impl<Resp: DeserializeOwned> Stream for RoutedStream<Resp> {
    type Item = Result<Resp, RequestError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let polled = Pin::new(&mut self.inner).poll_next(cx);
        if let Poll::Ready(None) = polled {
            self.release();
        }
        polled
    }
}

impl<Resp> Drop for RoutedStream<Resp> {
    fn drop(&mut self) {
        self.release();
    }
}

impl<Resp> std::fmt::Debug for RoutedStream<Resp> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RoutedStream")
            .field("worker_id", &self.worker_id)
            .finish_non_exhaustive()
    }
}
