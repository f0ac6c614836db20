//! Discovery across processes with no external service: workers register with a registry that
//! the router runs ([`RegistryServer`]), over the request plane's own protocol.
//!
//! A registration is a request stream that stays open: the registry answers it with a lease and
//! keeps the instance listed while the stream lives and the worker renews the lease within its
//! time to live. So a worker process that dies disappears at once (its socket closes, which
//! ends the stream), one whose host vanished disappears after the time to live, and a graceful
//! worker deregisters explicitly. [`RemoteDiscovery`] is the worker's side: it renews, and
//! re-registers by itself when the registry restarts. It also watches the registry's instance
//! set, so another process can follow the same fleet.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use futures::future::BoxFuture;
use kvroute_protocols::WorkerId;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;

use super::{Discovery, DiscoveryError, InProcessDiscovery, InstanceInfo, InstanceSet, Lease};
use crate::client::{Client, ClientConfig, ClientStream};
use crate::engine::{Engine, EngineError, RequestContext, ResponseStream};
use crate::error::RequestError;
use crate::fleet_secret::FleetSecret;
use crate::fleet_tls::FleetTls;
use crate::server::{WorkerServer, WorkerServerConfig};

/// A call to the registry.
#[derive(Debug, Clone, Serialize, Deserialize)]
enum RegistryRequest {
    /// List this instance while the stream lives; answered with [`RegistryReply::Registered`].
    Register(InstanceInfo),
    /// Extend a lease; answered with [`RegistryReply::Renewed`].
    Renew { id: WorkerId, lease: u64 },
    /// Remove the instance now; answered with [`RegistryReply::Deregistered`].
    Deregister { id: WorkerId, lease: u64 },
    /// The instance set now and on every change, as [`RegistryReply::Instances`].
    Watch,
}

/// The registry's answers.
#[derive(Debug, Clone, Serialize, Deserialize)]
enum RegistryReply {
    Registered { lease: u64, ttl_ms: u64 },
    Renewed { alive: bool },
    Deregistered,
    Instances(Vec<InstanceInfo>),
    Refused(Refusal),
}

/// Why a registration was refused, on the wire.
#[derive(Debug, Clone, Serialize, Deserialize)]
enum Refusal {
    Invalid { id: WorkerId, reason: String },
    Duplicate { id: WorkerId, address: String },
    Other { message: String },
}

impl From<DiscoveryError> for Refusal {
    fn from(e: DiscoveryError) -> Self {
        match e {
            DiscoveryError::InvalidInstance { id, reason } => Refusal::Invalid { id, reason },
            DiscoveryError::DuplicateId { id, address } => Refusal::Duplicate { id, address },
            other => Refusal::Other {
                message: other.to_string(),
            },
        }
    }
}

impl From<Refusal> for DiscoveryError {
    fn from(r: Refusal) -> Self {
        match r {
            Refusal::Invalid { id, reason } => DiscoveryError::InvalidInstance { id, reason },
            Refusal::Duplicate { id, address } => DiscoveryError::DuplicateId { id, address },
            Refusal::Other { message } => DiscoveryError::Unavailable { message },
        }
    }
}

/// The registry a router runs so that workers in other processes can register: an
/// [`InProcessDiscovery`] (whose watch the router follows) served over TCP. Dropping it closes
/// the listener and every registration stream, which deregisters every remote worker.
#[derive(Debug)]
pub struct RegistryServer {
    server: WorkerServer,
    discovery: InProcessDiscovery,
}

impl RegistryServer {
    /// Serves `discovery` on `addr` (port 0 picks a free port).
    pub async fn bind(
        addr: impl tokio::net::ToSocketAddrs,
        discovery: InProcessDiscovery,
    ) -> std::io::Result<Self> {
        Self::bind_checked(addr, discovery, None).await
    }

    /// Like [`RegistryServer::bind`], refusing every registration whose `kv_block_size` is not
    /// `kv_block_size` (the router's): such a worker's blocks could never match a request, so
    /// it is told why at once instead of being listed and ignored.
    pub async fn bind_with_block_size(
        addr: impl tokio::net::ToSocketAddrs,
        discovery: InProcessDiscovery,
        kv_block_size: u32,
    ) -> std::io::Result<Self> {
        Self::bind_checked(addr, discovery, Some(kv_block_size)).await
    }

    /// Like [`RegistryServer::bind`], refusing registrations as `checks` says.
    pub async fn bind_with_checks(
        addr: impl tokio::net::ToSocketAddrs,
        discovery: InProcessDiscovery,
        checks: RegistryChecks,
    ) -> std::io::Result<Self> {
        let config = WorkerServerConfig::new(0)
            .with_fleet_secret(checks.fleet_secret.clone())
            .with_tls(checks.tls.clone());
        let engine = Arc::new(RegistryEngine {
            discovery: discovery.clone(),
            checks,
        });
        let server = WorkerServer::bind(addr, engine, config).await?;
        Ok(Self { server, discovery })
    }

    async fn bind_checked(
        addr: impl tokio::net::ToSocketAddrs,
        discovery: InProcessDiscovery,
        kv_block_size: Option<u32>,
    ) -> std::io::Result<Self> {
        let engine = Arc::new(RegistryEngine {
            discovery: discovery.clone(),
            checks: RegistryChecks {
                kv_block_size,
                ..RegistryChecks::default()
            },
        });
        let server = WorkerServer::bind(addr, engine, WorkerServerConfig::new(0)).await?;
        Ok(Self { server, discovery })
    }

    /// The address workers register at.
    pub fn local_addr(&self) -> std::net::SocketAddr {
        self.server.local_addr()
    }

    /// The registry's instances (watch it to follow the fleet).
    pub fn discovery(&self) -> &InProcessDiscovery {
        &self.discovery
    }
}

/// What a [`RegistryServer`] refuses, with the reason the worker is told.
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct RegistryChecks {
    /// The router's block size, when registrations must match it.
    pub kv_block_size: Option<u32>,
    /// When set, workers fronting a real engine (metadata `engine` other than `mocker`, the
    /// simulated engine) are refused with this reason (the router cannot tokenize for them,
    /// say).
    pub refuse_engines: Option<String>,
    /// When set, only workers proving this fleet secret in the request plane's handshake can
    /// register (others are refused before any registration is read, and logged).
    pub fleet_secret: Option<FleetSecret>,
    /// When set, the registry serves over mutual TLS: only workers with a certificate of the
    /// fleet's CA can connect.
    pub tls: Option<FleetTls>,
}

impl RegistryChecks {
    /// Refuses registrations whose `kv_block_size` is not `kv_block_size`.
    pub fn with_block_size(mut self, kv_block_size: u32) -> Self {
        self.kv_block_size = Some(kv_block_size);
        self
    }

    /// Accepts only workers proving `secret` (none: anyone who can connect).
    pub fn with_fleet_secret(mut self, secret: Option<FleetSecret>) -> Self {
        self.fleet_secret = secret;
        self
    }

    /// Serves registrations over mutual TLS (none: plain TCP).
    pub fn with_tls(mut self, tls: Option<FleetTls>) -> Self {
        self.tls = tls;
        self
    }

    /// Refuses workers fronting a real engine, telling them `reason`.
    pub fn refusing_engines(mut self, reason: impl Into<String>) -> Self {
        self.refuse_engines = Some(reason.into());
        self
    }
}

struct RegistryEngine {
    discovery: InProcessDiscovery,
    checks: RegistryChecks,
}

/// Revokes a registration when its stream is dropped (the worker's connection closed).
struct RevokeOnDrop {
    discovery: InProcessDiscovery,
    id: WorkerId,
    lease: u64,
}

impl Drop for RevokeOnDrop {
    fn drop(&mut self) {
        self.discovery.revoke(self.id, self.lease);
    }
}

fn once(reply: RegistryReply) -> ResponseStream<RegistryReply> {
    Box::pin(futures::stream::iter([reply]))
}

impl Engine for RegistryEngine {
    type Request = RegistryRequest;
    type Response = RegistryReply;

    fn generate(
        &self,
        request: RegistryRequest,
        _context: RequestContext,
    ) -> Result<ResponseStream<RegistryReply>, EngineError> {
        let discovery = &self.discovery;
        Ok(match request {
            RegistryRequest::Register(info) => {
                let id = info.id;
                let address = info.address.clone();
                if let Some(reason) = &self.checks.refuse_engines
                    && let Some(engine) = info.metadata.get("engine")
                    && engine != "mocker"
                {
                    tracing::warn!(
                        worker = id,
                        %address,
                        %engine,
                        "registration refused: {reason}"
                    );
                    return Ok(once(RegistryReply::Refused(Refusal::Invalid {
                        id,
                        reason: reason.clone(),
                    })));
                }
                if let Some(router) = self.checks.kv_block_size
                    && info.kv_block_size != router
                {
                    tracing::warn!(
                        worker = id,
                        %address,
                        worker_block_size = info.kv_block_size,
                        router_block_size = router,
                        "registration refused: block sizes differ"
                    );
                    let reason = format!(
                        "kv_block_size {} differs from the router's block size {router}: \
                         start the worker (and its engine) with {router} tokens per block, or \
                         the router with [router] block_size = {}",
                        info.kv_block_size, info.kv_block_size
                    );
                    return Ok(once(RegistryReply::Refused(Refusal::Invalid {
                        id,
                        reason,
                    })));
                }
                match discovery.insert(info) {
                    Err(e) => once(RegistryReply::Refused(e.into())),
                    Ok(lease) => {
                        tracing::info!(worker = id, %address, "worker registered");
                        let guard = RevokeOnDrop {
                            discovery: discovery.clone(),
                            id,
                            lease,
                        };
                        let reply = RegistryReply::Registered {
                            lease,
                            ttl_ms: discovery.ttl().as_millis() as u64,
                        };
                        // The stream stays open (pending) after the reply: the guard lives in
                        // it, so the registration ends when the stream is dropped.
                        Box::pin(
                            futures::stream::iter([reply]).chain(futures::stream::poll_fn(
                                move |_| {
                                    let _ = &guard;
                                    std::task::Poll::Pending
                                },
                            )),
                        )
                    }
                }
            }
            RegistryRequest::Renew { id, lease } => once(RegistryReply::Renewed {
                alive: discovery.renew(id, lease),
            }),
            RegistryRequest::Deregister { id, lease } => {
                discovery.revoke(id, lease);
                tracing::info!(worker = id, "worker deregistered");
                once(RegistryReply::Deregistered)
            }
            RegistryRequest::Watch => {
                let rx = discovery.watch();
                Box::pin(futures::stream::unfold(
                    (rx, true),
                    |(mut rx, first)| async move {
                        if !first {
                            rx.changed().await.ok()?;
                        }
                        let set: Vec<InstanceInfo> =
                            rx.borrow_and_update().values().cloned().collect();
                        Some((RegistryReply::Instances(set), (rx, false)))
                    },
                ))
            }
        })
    }
}

/// How a [`RemoteDiscovery`] talks to its registry.
#[derive(Debug, Clone)]
pub struct RemoteDiscoveryConfig {
    /// Connection settings; the first-response timeout bounds every registry call.
    pub client: ClientConfig,
    /// How long to wait between attempts to (re-)register or re-watch after a failure.
    pub retry_interval: Duration,
}

impl Default for RemoteDiscoveryConfig {
    fn default() -> Self {
        Self {
            client: ClientConfig {
                connect_timeout: Duration::from_secs(2),
                first_response_timeout: Some(Duration::from_secs(5)),
                keepalive_interval: Some(Duration::from_secs(1)),
                ..ClientConfig::default()
            },
            retry_interval: Duration::from_millis(250),
        }
    }
}

type RegistryClient = Client<RegistryRequest, RegistryReply>;

/// Discovery through a [`RegistryServer`] in another process. Cloning shares the connection
/// settings and the keepers of its leases.
#[derive(Debug, Clone)]
pub struct RemoteDiscovery {
    inner: Arc<RemoteInner>,
}

#[derive(Debug)]
struct RemoteInner {
    addr: String,
    config: RemoteDiscoveryConfig,
    keepers: Mutex<Vec<JoinHandle<()>>>,
    watch: Mutex<Option<(watch::Sender<InstanceSet>, JoinHandle<()>)>>,
}

impl Drop for RemoteInner {
    fn drop(&mut self) {
        if let Some((_, task)) = self.watch.lock().take() {
            task.abort();
        }
    }
}

/// A live registration: the connection, the open registration stream and the lease.
struct Registration {
    client: RegistryClient,
    stream: ClientStream<RegistryReply>,
    lease: u64,
    ttl: Duration,
}

impl RemoteDiscovery {
    /// Discovery through the registry at `addr` (`host:port`). Nothing connects until the first
    /// [`Discovery::register`] or [`Discovery::watch`].
    pub fn new(addr: impl Into<String>, config: RemoteDiscoveryConfig) -> Self {
        Self {
            inner: Arc::new(RemoteInner {
                addr: addr.into(),
                config,
                keepers: Mutex::new(Vec::new()),
                watch: Mutex::new(None),
            }),
        }
    }

    /// The registry's address.
    pub fn addr(&self) -> &str {
        &self.inner.addr
    }

    /// Waits (at most `timeout`) until every lease this discovery handed out has ended; after
    /// dropping or revoking a lease, this is when the registry has been told. Returns whether
    /// everything ended in time.
    pub async fn flush(&self, timeout: Duration) -> bool {
        let keepers: Vec<_> = std::mem::take(&mut *self.inner.keepers.lock());
        tokio::time::timeout(timeout, futures::future::join_all(keepers))
            .await
            .is_ok()
    }
}

impl RemoteInner {
    async fn register_once(&self, info: &InstanceInfo) -> Result<Registration, DiscoveryError> {
        let unavailable = |e: RequestError| DiscoveryError::Unavailable {
            message: format!("registry at {}: {e}", self.addr),
        };
        let client = RegistryClient::connect(&self.addr, self.config.client.clone())
            .await
            .map_err(|e| match e {
                RequestError::Handshake { message, .. } => DiscoveryError::Refused {
                    message: format!("registry at {}: {message}", self.addr),
                },
                e => unavailable(e),
            })?;
        let request = RegistryRequest::Register(info.clone());
        let mut stream = client
            .generate(&format!("register-{}", info.id), &request)
            .await
            .map_err(unavailable)?;
        // The registration stream must outlive the first-response deadline, which only bounds
        // the first item.
        match stream.next().await {
            Some(Ok(RegistryReply::Registered { lease, ttl_ms })) => Ok(Registration {
                client,
                stream,
                lease,
                ttl: Duration::from_millis(ttl_ms.max(30)),
            }),
            Some(Ok(RegistryReply::Refused(refusal))) => Err(refusal.into()),
            Some(Ok(other)) => Err(DiscoveryError::Unavailable {
                message: format!("registry answered a registration with {other:?}"),
            }),
            Some(Err(e)) => Err(unavailable(e)),
            None => Err(DiscoveryError::Unavailable {
                message: format!("registry at {} ended the registration", self.addr),
            }),
        }
    }

    async fn call(
        &self,
        client: &RegistryClient,
        request: &RegistryRequest,
    ) -> Option<RegistryReply> {
        let mut stream = client.generate("registry-call", request).await.ok()?;
        stream.next().await?.ok()
    }
}

impl Registration {
    async fn renew(&self, inner: &RemoteInner, id: WorkerId) -> bool {
        let request = RegistryRequest::Renew {
            id,
            lease: self.lease,
        };
        matches!(
            inner.call(&self.client, &request).await,
            Some(RegistryReply::Renewed { alive: true })
        )
    }
}

/// Keeps one registration alive until its lease is revoked (deregister) or abandoned (stop
/// quietly, as a crash would), re-registering whenever the registry loses it.
async fn keep(
    inner: Arc<RemoteInner>,
    info: InstanceInfo,
    mut registration: Registration,
    mut stop: oneshot::Receiver<()>,
) {
    loop {
        let period = registration.ttl / 3;
        let lost = tokio::select! {
            revoked = &mut stop => {
                if revoked.is_ok() {
                    let request = RegistryRequest::Deregister { id: info.id, lease: registration.lease };
                    let _ = inner.call(&registration.client, &request).await;
                }
                return;
            }
            () = tokio::time::sleep(period) => !registration.renew(&inner, info.id).await,
            // The registration stream only ends when the connection or the registry went away.
            _ = registration.stream.next() => true,
        };
        if !lost {
            continue;
        }
        tracing::warn!(worker = info.id, registry = %inner.addr, "registration lost; re-registering");
        registration = loop {
            let attempt = tokio::select! {
                _ = &mut stop => return,
                attempt = inner.register_once(&info) => attempt,
            };
            match attempt {
                Ok(registration) => break registration,
                Err(error) => {
                    tracing::debug!(worker = info.id, %error, "re-registration failed; retrying");
                    tokio::select! {
                        _ = &mut stop => return,
                        () = tokio::time::sleep(inner.config.retry_interval) => {}
                    }
                }
            }
        };
        tracing::info!(worker = info.id, registry = %inner.addr, "re-registered");
    }
}

/// Follows the registry's instance set into `tx`, reconnecting after failures.
async fn follow(inner: std::sync::Weak<RemoteInner>, tx: watch::Sender<InstanceSet>) {
    loop {
        let Some(strong) = inner.upgrade() else {
            return;
        };
        let (addr, config) = (strong.addr.clone(), strong.config.clone());
        drop(strong);
        let result: Result<(), RequestError> = async {
            let client = RegistryClient::connect(&addr, config.client.clone()).await?;
            let mut stream = client.generate("watch", &RegistryRequest::Watch).await?;
            while let Some(reply) = stream.next().await {
                if let RegistryReply::Instances(list) = reply? {
                    let set: BTreeMap<_, _> = list.into_iter().map(|i| (i.id, i)).collect();
                    tx.send_replace(Arc::new(set));
                }
            }
            Ok(())
        }
        .await;
        if let Err(error) = result {
            tracing::debug!(registry = %addr, %error, "registry watch failed; retrying");
        }
        tokio::time::sleep(config.retry_interval).await;
    }
}

impl Discovery for RemoteDiscovery {
    fn register(&self, info: InstanceInfo) -> BoxFuture<'_, Result<Lease, DiscoveryError>> {
        Box::pin(async move {
            super::validate(&info)?;
            let registration = self.inner.register_once(&info).await?;
            let (stop_tx, stop_rx) = oneshot::channel();
            let id = info.id;
            let keeper = tokio::spawn(keep(self.inner.clone(), info, registration, stop_rx));
            {
                let mut keepers = self.inner.keepers.lock();
                keepers.retain(|k| !k.is_finished());
                keepers.push(keeper);
            }
            Ok(Lease::new(
                id,
                None,
                Box::new(move || {
                    let _ = stop_tx.send(());
                }),
            ))
        })
    }

    fn watch(&self) -> watch::Receiver<InstanceSet> {
        let mut slot = self.inner.watch.lock();
        if let Some((tx, _)) = slot.as_ref() {
            return tx.subscribe();
        }
        let (tx, rx) = watch::channel(InstanceSet::default());
        match tokio::runtime::Handle::try_current() {
            Ok(handle) => {
                let task = handle.spawn(follow(Arc::downgrade(&self.inner), tx.clone()));
                *slot = Some((tx, task));
            }
            Err(_) => tracing::warn!("RemoteDiscovery::watch outside a tokio runtime sees nothing"),
        }
        rx
    }
}
