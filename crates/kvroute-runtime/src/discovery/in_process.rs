//! Discovery inside one process, with leases that expire when not renewed.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Weak};
use std::time::Duration;

use futures::future::BoxFuture;
use kvroute_protocols::WorkerId;
use parking_lot::Mutex;
use tokio::sync::watch;
use tokio::time::Instant;

use super::{Discovery, DiscoveryError, InstanceInfo, InstanceSet, validate};

/// Discovery for one process (tests, the demo, simulation). Cloning shares the registry.
///
/// Registrations hold a lease with a time to live; each [`Lease`] renews itself every third of it.
/// A background reaper removes registrations whose lease was not renewed in time, which is how a
/// crashed worker (see [`Lease::abandon`]) disappears.
#[derive(Clone, Debug)]
pub struct InProcessDiscovery {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    ttl: Duration,
    state: Mutex<State>,
    tx: watch::Sender<InstanceSet>,
}

#[derive(Debug, Default)]
struct State {
    entries: HashMap<WorkerId, Entry>,
    next_lease: u64,
}

#[derive(Debug)]
struct Entry {
    info: InstanceInfo,
    lease: u64,
    expires: Instant,
}

impl InProcessDiscovery {
    /// A registry whose leases live `ttl` without renewal. Must be called inside a tokio runtime
    /// (it spawns the reaper, which stops when the last clone is dropped).
    pub fn new(ttl: Duration) -> Self {
        let ttl = ttl.max(Duration::from_millis(10));
        let (tx, _) = watch::channel(InstanceSet::default());
        let inner = Arc::new(Inner {
            ttl,
            state: Mutex::new(State::default()),
            tx,
        });
        let weak = Arc::downgrade(&inner);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(ttl / 4);
            loop {
                tick.tick().await;
                let Some(inner) = weak.upgrade() else { return };
                inner.reap(Instant::now());
            }
        });
        Self { inner }
    }

    /// The lease time to live.
    pub fn ttl(&self) -> Duration {
        self.inner.ttl
    }

    /// Lists `info` under a new lease number that nobody renews yet (the registry server renews
    /// it on a remote worker's heartbeats).
    pub(crate) fn insert(&self, info: InstanceInfo) -> Result<u64, DiscoveryError> {
        validate(&info)?;
        let id = info.id;
        let mut state = self.inner.state.lock();
        if let Some(existing) = state.entries.get(&id) {
            return Err(DiscoveryError::DuplicateId {
                id,
                address: existing.info.address.clone(),
            });
        }
        state.next_lease += 1;
        let lease = state.next_lease;
        state.entries.insert(
            id,
            Entry {
                info,
                lease,
                expires: Instant::now() + self.inner.ttl,
            },
        );
        self.inner.publish(&state);
        Ok(lease)
    }

    /// Extends lease `lease` of instance `id`; false when it is no longer held.
    pub(crate) fn renew(&self, id: WorkerId, lease: u64) -> bool {
        self.inner.renew(id, lease)
    }

    /// Removes instance `id` if it is still held under `lease`.
    pub(crate) fn revoke(&self, id: WorkerId, lease: u64) {
        self.inner.revoke(id, lease);
    }
}

impl Inner {
    fn publish(&self, state: &State) {
        let set: BTreeMap<_, _> = state
            .entries
            .iter()
            .map(|(id, e)| (*id, e.info.clone()))
            .collect();
        self.tx.send_replace(Arc::new(set));
    }

    fn reap(&self, now: Instant) {
        let mut state = self.state.lock();
        let before = state.entries.len();
        state.entries.retain(|_, e| e.expires > now);
        if state.entries.len() != before {
            self.publish(&state);
        }
    }

    fn renew(&self, id: WorkerId, lease: u64) -> bool {
        let mut state = self.state.lock();
        match state.entries.get_mut(&id) {
            Some(e) if e.lease == lease => {
                e.expires = Instant::now() + self.ttl;
                true
            }
            _ => false,
        }
    }

    fn revoke(&self, id: WorkerId, lease: u64) {
        let mut state = self.state.lock();
        if state.entries.get(&id).is_some_and(|e| e.lease == lease) {
            state.entries.remove(&id);
            self.publish(&state);
        }
    }
}

impl Discovery for InProcessDiscovery {
    fn register(&self, info: InstanceInfo) -> BoxFuture<'_, Result<Lease, DiscoveryError>> {
        Box::pin(async move {
            let id = info.id;
            let lease = self.insert(info)?;
            let weak = Arc::downgrade(&self.inner);
            let period = self.inner.ttl / 3;
            let heartbeat = tokio::spawn(async move {
                let mut tick = tokio::time::interval(period);
                loop {
                    tick.tick().await;
                    let Some(inner) = weak.upgrade() else { return };
                    if !inner.renew(id, lease) {
                        return;
                    }
                }
            });
            let weak: Weak<Inner> = Arc::downgrade(&self.inner);
            Ok(Lease::new(
                id,
                Some(heartbeat.abort_handle()),
                Box::new(move || {
                    if let Some(inner) = weak.upgrade() {
                        inner.revoke(id, lease);
                    }
                }),
            ))
        })
    }

    fn watch(&self) -> watch::Receiver<InstanceSet> {
        self.inner.tx.subscribe()
    }
}

/// A registration's liveness. It renews itself in the background; dropping it (or
/// [`Lease::revoke`]) deregisters at once.
pub struct Lease {
    id: WorkerId,
    heartbeat: Option<tokio::task::AbortHandle>,
    revoke: Option<Box<dyn FnOnce() + Send + Sync>>,
}

impl Lease {
    /// A lease for backends to build: `heartbeat` is the renewal task (aborted when the lease
    /// ends), `revoke` deregisters.
    pub fn new(
        id: WorkerId,
        heartbeat: Option<tokio::task::AbortHandle>,
        revoke: Box<dyn FnOnce() + Send + Sync>,
    ) -> Self {
        Self {
            id,
            heartbeat,
            revoke: Some(revoke),
        }
    }

    /// A lease with nothing to renew or revoke (fixed-membership backends).
    pub fn detached(id: WorkerId) -> Self {
        Self {
            id,
            heartbeat: None,
            revoke: None,
        }
    }

    /// The registered instance's id.
    pub fn id(&self) -> WorkerId {
        self.id
    }

    /// Deregisters now.
    pub fn revoke(self) {
        drop(self);
    }

    /// Stops renewing without deregistering, as a crashed process would: the registration
    /// disappears once its time to live runs out.
    pub fn abandon(mut self) {
        self.revoke = None;
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Some(heartbeat) = self.heartbeat.take() {
            heartbeat.abort();
        }
        if let Some(revoke) = self.revoke.take() {
            revoke();
        }
    }
}

impl std::fmt::Debug for Lease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lease")
            .field("id", &self.id)
            .field("renewing", &self.heartbeat.is_some())
            .finish()
    }
}
