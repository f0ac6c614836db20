//! [`NatsDiscovery`]: worker registrations in a NATS KV bucket, under leases.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_nats::jetstream::kv;
use bytes::Bytes;
use futures::StreamExt;
use futures::future::BoxFuture;
use kvroute_protocols::WorkerId;
use kvroute_runtime::{
    Discovery, DiscoveryError, InstanceInfo, InstanceSet, Lease, WarnThrottle, validate_instance,
};
use parking_lot::Mutex;
use tokio::sync::watch;
use tokio::time::Instant;

use crate::client::{ConnectError, Nats, NatsStatus};

/// How registrations live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NatsDiscoveryConfig {
    /// A registration not renewed within this time is dropped by every watcher (and by the
    /// server); it is renewed every third of it.
    pub lease_ttl: Duration,
}

impl Default for NatsDiscoveryConfig {
    fn default() -> Self {
        Self {
            lease_ttl: Duration::from_secs(10),
        }
    }
}

/// Discovery on the KV bucket `<namespace>_instances`: one key per worker id holding its
/// [`InstanceInfo`] as JSON. A registration creates the key and renews it every third of the
/// lease's time to live; revoking deletes it. A key that exists is taken over when its holder is
/// dead (a crashed worker restarted with the same id: the same address, or one that no longer
/// accepts connections) and refused while the holder answers. Renewals are compare-and-swap
/// writes, so a process whose key was taken over stops renewing instead of fighting for it.
/// Watchers list what the bucket holds and drop an entry nobody renewed within the time to live
/// (the longer of theirs and the one the registration states under [`LEASE_TTL_METADATA`]),
/// since a lapsed key vanishes from the bucket without telling watchers. While the connection to
/// NATS is down nothing is dropped (no renewal could arrive): routers keep the last known fleet. Cheap to clone; the
/// watch task stops when the last clone is dropped.
#[derive(Debug, Clone)]
pub struct NatsDiscovery {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    store: kv::Store,
    status: NatsStatus,
    ttl: Duration,
    tx: watch::Sender<InstanceSet>,
    seen: Mutex<HashMap<WorkerId, (InstanceInfo, Instant)>>,

    task: Mutex<Option<tokio::task::AbortHandle>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Some(task) = self.task.lock().take() {
            task.abort();
        }
    }
}

impl NatsDiscovery {
    /// Discovery over `nats`, creating (or reusing) the bucket, and watching it. Must be called
    /// inside a tokio runtime. The first listing is loaded before this returns.
    pub async fn start(nats: &Nats, config: &NatsDiscoveryConfig) -> Result<Self, ConnectError> {
        let ttl = config.lease_ttl.max(Duration::from_millis(300));
        let bucket = format!("{}_instances", nats.namespace);
        let setup = |e: String| ConnectError::Setup {
            what: format!("the discovery bucket {bucket}"),
            message: e,
        };
        let store = nats
            .key_value(&bucket, ttl * 2)
            .await
            .map_err(|e| setup(e.to_string()))?;
        let (tx, _) = watch::channel(InstanceSet::default());
        let inner = Arc::new(Inner {
            store,
            status: nats.status().clone(),
            ttl,
            tx,
            seen: Mutex::new(HashMap::new()),
            task: Mutex::new(None),
        });
        let (loaded_tx, loaded_rx) = tokio::sync::oneshot::channel();
        let task = tokio::spawn(follow(Arc::downgrade(&inner), loaded_tx));
        *inner.task.lock() = Some(task.abort_handle());
        // The initial listing, bounded: an empty or unreachable bucket must not hang start-up.
        let _ = tokio::time::timeout(Duration::from_secs(5), loaded_rx).await;
        Ok(Self { inner })
    }

    /// The lease time to live.
    pub fn ttl(&self) -> Duration {
        self.inner.ttl
    }
}

/// Follows the bucket (re-watching after an interruption) and reaps lapsed entries.
async fn follow(inner: std::sync::Weak<Inner>, loaded: tokio::sync::oneshot::Sender<()>) {
    let mut loaded = Some(loaded);
    let mut backoff = Duration::from_millis(100);
    let watch_failures = WarnThrottle::default();
    loop {
        let Some(strong) = inner.upgrade() else {
            return;
        };
        let ttl = strong.ttl;
        let watch = strong.store.watch_with_history(">").await;
        // An empty bucket sends no entry, so the first listing is complete at once; otherwise
        // it is when the watch reports no entry pending (`delta == 0`).
        if watch.is_ok() && loaded.is_some() {
            let mut stream = strong.store.stream.clone();
            if let Ok(info) = stream.info().await
                && info.state.messages == 0
                && let Some(done) = loaded.take()
            {
                let _ = done.send(());
            }
        }
        drop(strong);
        let mut watch = match watch {
            Ok(watch) => watch,
            Err(error) => {
                if let Some(more) = watch_failures.check(std::time::Instant::now()) {
                    tracing::warn!(%error, "cannot watch the NATS discovery bucket; retrying{more}");
                }
                reap(&inner);
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(2));
                continue;
            }
        };
        backoff = Duration::from_millis(100);
        let mut tick = tokio::time::interval(ttl / 4);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                entry = watch.next() => match entry {
                    Some(Ok(entry)) => {
                        let Some(strong) = inner.upgrade() else { return };
                        strong.on_entry(&entry);
                        if entry.delta == 0
                            && let Some(done) = loaded.take()
                        {
                            let _ = done.send(());
                        }
                    }
                    Some(Err(error)) => {
                        tracing::warn!(%error, "NATS discovery watch interrupted; re-watching");
                        break;
                    }
                    None => break,
                },
                _ = tick.tick() => {
                    if inner.upgrade().is_none() {
                        return;
                    }
                    reap(&inner);
                }
            }
        }
        tokio::time::sleep(backoff).await;
    }
}

fn reap(inner: &std::sync::Weak<Inner>) {
    if let Some(inner) = inner.upgrade() {
        let now = Instant::now();
        let mut seen = inner.seen.lock();
        // Without NATS no renewal can arrive, whether the workers live or not: keep routing to
        // the last known fleet, and give every entry a whole TTL once the connection is back.
        if !inner.status.connected() {
            for (_, at) in seen.values_mut() {
                *at = now;
            }
            return;
        }
        let before = seen.len();
        seen.retain(|id, (info, at)| {
            let live = now.duration_since(*at) <= entry_ttl(info, inner.ttl);
            if !live {
                tracing::info!(
                    worker = id,
                    "worker registration lapsed (not renewed within the lease TTL)"
                );
            }
            live
        });
        if seen.len() != before {
            inner.publish(&seen);
        }
    }
}

impl Inner {
    fn on_entry(&self, entry: &kv::Entry) {
        let Ok(id) = entry.key.parse::<WorkerId>() else {
            tracing::warn!(key = %entry.key, "ignoring a discovery key that is not a worker id");
            return;
        };
        let mut seen = self.seen.lock();
        match entry.operation {
            kv::Operation::Put => match serde_json::from_slice::<InstanceInfo>(&entry.value) {
                Ok(info) if info.id == id => {
                    let changed = seen.get(&id).is_none_or(|(old, _)| *old != info);
                    seen.insert(id, (info, Instant::now()));
                    if changed {
                        self.publish(&seen);
                    }
                }
                Ok(info) => tracing::warn!(
                    key = %entry.key,
                    id = info.id,
                    "ignoring a registration whose id differs from its key"
                ),
                Err(error) => {
                    tracing::warn!(key = %entry.key, %error, "ignoring a malformed registration");
                }
            },
            kv::Operation::Delete | kv::Operation::Purge => {
                if seen.remove(&id).is_some() {
                    self.publish(&seen);
                }
            }
        }
    }

    fn publish(&self, seen: &HashMap<WorkerId, (InstanceInfo, Instant)>) {
        let set: BTreeMap<WorkerId, InstanceInfo> = seen
            .iter()
            .map(|(id, (info, _))| (*id, info.clone()))
            .collect();
        self.tx.send_replace(Arc::new(set));
    }
}

/// The metadata key under which a registration states its lease's time to live (milliseconds),
/// so that watchers configured with a shorter one do not drop it between renewals.
pub const LEASE_TTL_METADATA: &str = "nats_lease_ttl_ms";

/// How long `info` stays listed without renewal: its own stated TTL when longer than `ttl`.
fn entry_ttl(info: &InstanceInfo, ttl: Duration) -> Duration {
    info.metadata
        .get(LEASE_TTL_METADATA)
        .and_then(|v| v.parse::<u64>().ok())
        .map_or(ttl, |ms| ttl.max(Duration::from_millis(ms)))
}

fn unavailable(e: impl std::fmt::Display) -> DiscoveryError {
    DiscoveryError::Unavailable {
        message: e.to_string(),
    }
}

impl Discovery for NatsDiscovery {
    fn register(&self, info: InstanceInfo) -> BoxFuture<'_, Result<Lease, DiscoveryError>> {
        Box::pin(async move {
            validate_instance(&info)?;
            let mut info = info;
            info.metadata.insert(
                LEASE_TTL_METADATA.to_owned(),
                self.inner.ttl.as_millis().to_string(),
            );
            let key = info.id.to_string();
            let value = Bytes::from(serde_json::to_vec(&info).map_err(unavailable)?);
            let store = self.inner.store.clone();
            let revision = claim(&store, &info, &value).await?;
            let revision = Arc::new(AtomicU64::new(revision));
            let heartbeat = tokio::spawn(renew(
                store.clone(),
                info.id,
                value.clone(),
                revision.clone(),
                self.inner.ttl / 3,
            ));
            let revoke = Box::new(move || {
                if let Ok(handle) = tokio::runtime::Handle::try_current() {
                    handle.spawn(async move {
                        // Only our own registration: one taken over by a restarted worker stays.
                        let last = revision.load(Ordering::SeqCst);
                        let Some(revision) = owned_revision(&store, &key, &value, last).await
                        else {
                            return;
                        };
                        if let Err(error) = store.delete_expect_revision(&key, Some(revision)).await {
                            tracing::warn!(%key, %error, "deregistering from NATS failed; the registration lapses after its TTL");
                        }
                    });
                }
            });
            Ok(Lease::new(info.id, Some(heartbeat.abort_handle()), revoke))
        })
    }

    fn watch(&self) -> watch::Receiver<InstanceSet> {
        self.inner.tx.subscribe()
    }
}

/// How long a registration's holder has to accept a TCP connection before it is taken for dead.
const HOLDER_PROBE_TIMEOUT: Duration = Duration::from_secs(1);

/// Writes `value` under `info`'s key and returns its revision: creates the key, or takes it over
/// from a previous process that held the id and died (its key lives until the lease lapses).
/// The holder is dead when it registered the address this process now holds, or when its
/// address no longer accepts connections; a holder that answers keeps the id.
async fn claim(
    store: &kv::Store,
    info: &InstanceInfo,
    value: &Bytes,
) -> Result<u64, DiscoveryError> {
    let key = info.id.to_string();
    // A few rounds: the key may vanish or change between reading and writing it.
    let mut holder = "an unknown address".to_owned();
    for _ in 0..3 {
        match store.create(&key, value.clone()).await {
            Ok(revision) => return Ok(revision),
            Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => {}
            Err(e) => return Err(unavailable(e)),
        }
        let entry = match store.entry(key.clone()).await.map_err(unavailable)? {
            Some(entry) if entry.operation == kv::Operation::Put => entry,
            // Deleted or lapsed meanwhile: create it again.
            _ => continue,
        };
        let old = serde_json::from_slice::<InstanceInfo>(&entry.value).ok();
        holder = old.as_ref().map_or_else(
            || "an unreadable registration".to_owned(),
            |old| old.address.clone(),
        );
        if let Some(old) = &old
            && old.address != info.address
            && answers(&old.address).await
        {
            return Err(DiscoveryError::DuplicateId {
                id: info.id,
                address: holder,
            });
        }
        match store.update(&key, value.clone(), entry.revision).await {
            Ok(revision) => {
                tracing::info!(
                    worker = info.id,
                    previous = %holder,
                    "took over the registration of worker {} left by a previous process at {holder}",
                    info.id
                );
                return Ok(revision);
            }
            // Written meanwhile (the holder renewed after all, or another process took it): look again.
            Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => {}
            Err(e) => return Err(unavailable(e)),
        }
    }
    Err(DiscoveryError::DuplicateId {
        id: info.id,
        address: holder,
    })
}

/// Whether something accepts TCP connections at `address` within [`HOLDER_PROBE_TIMEOUT`].
async fn answers(address: &str) -> bool {
    matches!(
        tokio::time::timeout(
            HOLDER_PROBE_TIMEOUT,
            tokio::net::TcpStream::connect(address)
        )
        .await,
        Ok(Ok(_))
    )
}

/// The revision under which the bucket holds our `value` at `key`: `last` when nothing wrote
/// since, else the current one if it is still ours (a write whose acknowledgement was lost).
/// `None` when the key is gone or holds another process's registration.
async fn owned_revision(store: &kv::Store, key: &str, value: &Bytes, last: u64) -> Option<u64> {
    match store.entry(key.to_owned()).await {
        Ok(Some(entry)) if entry.operation == kv::Operation::Put && entry.value == *value => {
            Some(entry.revision)
        }
        Ok(_) => None,
        // Cannot tell: try with the last revision we wrote.
        Err(_) => Some(last),
    }
}

/// Renews the registration every `every` with a compare-and-swap on the last revision written,
/// so it never overwrites a registration another process took over: then it stops, saying so.
/// A key that lapsed (NATS was down longer than the lease) is created again.
async fn renew(
    store: kv::Store,
    id: WorkerId,
    value: Bytes,
    revision: Arc<AtomicU64>,
    every: Duration,
) {
    let key = id.to_string();
    let failures = WarnThrottle::default();
    let mut tick = tokio::time::interval(every);
    tick.tick().await;
    loop {
        tick.tick().await;
        let last = revision.load(Ordering::SeqCst);
        let error = match store.update(&key, value.clone(), last).await {
            Ok(new) => {
                revision.store(new, Ordering::SeqCst);
                if let Some(more) = failures.flush(std::time::Instant::now()) {
                    tracing::warn!(%key, "renewing the NATS registration failed{more}; renewed again");
                }
                continue;
            }
            Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => {
                match store.entry(key.clone()).await {
                    // Ours after all (a renewal whose acknowledgement was lost): go on from it.
                    Ok(Some(entry))
                        if entry.operation == kv::Operation::Put && entry.value == value =>
                    {
                        revision.store(entry.revision, Ordering::SeqCst);
                        continue;
                    }
                    Ok(Some(entry)) if entry.operation == kv::Operation::Put => {
                        let holder = serde_json::from_slice::<InstanceInfo>(&entry.value)
                            .map_or_else(
                                |_| "an unreadable registration".to_owned(),
                                |i| i.address,
                            );
                        tracing::warn!(
                            worker = id,
                            %holder,
                            "the registration of worker {id} was taken over by another process at {holder}; \
                             no longer renewing it"
                        );
                        return;
                    }
                    // Lapsed or deleted: register again.
                    Ok(_) => match store.create(&key, value.clone()).await {
                        Ok(new) => {
                            revision.store(new, Ordering::SeqCst);
                            tracing::info!(
                                worker = id,
                                "the NATS registration had lapsed; registered again"
                            );
                            continue;
                        }
                        // Someone created it meanwhile: the next round looks at it.
                        Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => continue,
                        Err(e) => e.to_string(),
                    },
                    Err(e) => e.to_string(),
                }
            }
            Err(e) => e.to_string(),
        };
        if let Some(more) = failures.check(std::time::Instant::now()) {
            tracing::warn!(%key, %error, "renewing the NATS registration failed; retrying{more}");
        }
    }
}
