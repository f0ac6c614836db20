//! Discovery: which worker instances exist, where they listen, and what they serve.
//!
//! Callers see the live set through a `tokio::sync::watch` channel of [`InstanceSet`] snapshots:
//! a watcher always has the current set and is woken on every change, and [`diff_instances`] turns two
//! snapshots into additions and removals. Liveness is a lease: a registration stays only while
//! its [`Lease`] keeps it alive, so a worker that crashes (stops renewing) disappears after the
//! lease's time to live. This is the shape of NATS KV (a key per instance, a TTL, a watch).

mod in_process;
mod registry;
mod static_file;

use std::collections::BTreeMap;
use std::sync::Arc;

use futures::future::BoxFuture;
use kvroute_protocols::WorkerId;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

pub use in_process::{InProcessDiscovery, Lease};
pub use registry::{RegistryChecks, RegistryServer, RemoteDiscovery, RemoteDiscoveryConfig};
pub use static_file::{StaticDiscovery, StaticFleetError};

/// What a worker instance serves.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WorkerRole {
    /// Prefill and decode on the same worker.
    #[default]
    Aggregated,
    /// Prefill only (disaggregated serving).
    Prefill,
    /// Decode only (disaggregated serving).
    Decode,
}

/// The metadata key naming the address, `ip:port`, a proxy sends a worker's requests to: its
/// engine's own HTTP server. Set by workers that front an engine, read by front doors whose
/// proxy carries requests to the engine itself (the Envoy endpoint picker).
pub const ENDPOINT_METADATA: &str = "endpoint";

/// One registered worker instance.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InstanceInfo {
    /// The instance id (unique in the fleet).
    pub id: WorkerId,
    /// The request-plane address, `host:port`.
    pub address: String,
    /// What the instance serves.
    #[serde(default)]
    pub role: WorkerRole,
    /// Tokens per KV block on this instance.
    pub kv_block_size: u32,
    /// Data-parallel ranks inside this instance (at least 1).
    #[serde(default = "one")]
    pub dp_size: u32,
    /// Free-form metadata (model name, engine kind, ...).
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
}

fn one() -> u32 {
    1
}

impl InstanceInfo {
    /// An aggregated instance with one data-parallel rank and no metadata.
    pub fn new(id: WorkerId, address: impl Into<String>, kv_block_size: u32) -> Self {
        Self {
            id,
            address: address.into(),
            role: WorkerRole::Aggregated,
            kv_block_size,
            dp_size: 1,
            metadata: BTreeMap::new(),
        }
    }

    /// The same instance with `role`.
    pub fn with_role(mut self, role: WorkerRole) -> Self {
        self.role = role;
        self
    }

    /// The same instance with `dp_size` ranks.
    pub fn with_dp_size(mut self, dp_size: u32) -> Self {
        self.dp_size = dp_size;
        self
    }
}

/// The live instances by id; snapshots are immutable and cheap to clone.
pub type InstanceSet = Arc<BTreeMap<WorkerId, InstanceInfo>>;

/// A change between two snapshots.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DiscoveryEvent {
    /// An instance appeared (or re-registered with different details).
    Added(InstanceInfo),
    /// An instance is gone.
    Removed(WorkerId),
}

/// A watch of `instances` passed through `filter`: the first value at once, then every change
/// whose filtered set differs from the last one sent. The task following `instances` ends when
/// either side closes. Filters keep state across calls if they need to (to log once, say).
pub fn filtered_instances(
    mut instances: watch::Receiver<InstanceSet>,
    mut filter: impl FnMut(&InstanceSet) -> InstanceSet + Send + 'static,
) -> watch::Receiver<InstanceSet> {
    let (tx, rx) = watch::channel(filter(&instances.borrow_and_update()));
    tokio::spawn(async move {
        while instances.changed().await.is_ok() {
            let next = filter(&instances.borrow_and_update());
            tx.send_if_modified(|current| {
                let changed = **current != *next;
                if changed {
                    *current = next;
                }
                changed
            });
            if tx.is_closed() {
                break;
            }
        }
    });
    rx
}

/// The changes that turn `old` into `new`, removals first, each in id order.
pub fn diff_instances(
    old: &BTreeMap<WorkerId, InstanceInfo>,
    new: &BTreeMap<WorkerId, InstanceInfo>,
) -> Vec<DiscoveryEvent> {
    let removed = old
        .keys()
        .filter(|id| !new.contains_key(id))
        .map(|id| DiscoveryEvent::Removed(*id));
    let added = new
        .iter()
        .filter(|(id, info)| old.get(id) != Some(info))
        .map(|(_, info)| DiscoveryEvent::Added(info.clone()));
    removed.chain(added).collect()
}

/// Why discovery refused an operation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DiscoveryError {
    /// The instance is malformed.
    #[error("invalid instance {id}: {reason}")]
    InvalidInstance {
        /// The instance id.
        id: WorkerId,
        /// What is wrong.
        reason: String,
    },
    /// Another live instance already holds this id.
    #[error("instance id {id} is already registered at {address}")]
    DuplicateId {
        /// The instance id.
        id: WorkerId,
        /// Where the existing instance listens.
        address: String,
    },
    /// This implementation has a fixed membership.
    #[error("this discovery backend has a fixed membership and does not accept registrations")]
    ReadOnly,
    /// The registry refused this process outright (it does not prove the fleet secret, or
    /// speaks another protocol version); retrying cannot help.
    #[error("the registry refused this worker: {message}")]
    Refused {
        /// Why.
        message: String,
    },
    /// The backing service is unreachable.
    #[error("discovery unavailable: {message}")]
    Unavailable {
        /// What happened.
        message: String,
    },
}

/// A registry of worker instances. Object safe, so callers hold an `Arc<dyn Discovery>`.
pub trait Discovery: Send + Sync + 'static {
    /// Registers `info` under a lease; the instance stays listed while the returned [`Lease`]
    /// lives (it renews itself) and disappears when it is dropped, revoked, or stops renewing.
    fn register(&self, info: InstanceInfo) -> BoxFuture<'_, Result<Lease, DiscoveryError>>;

    /// The live instances, now and on every change.
    fn watch(&self) -> watch::Receiver<InstanceSet>;
}

/// Checks what every discovery backend requires of an instance (an address, a block size and at
/// least one data-parallel rank); backends outside this crate call it too.
pub fn validate(info: &InstanceInfo) -> Result<(), DiscoveryError> {
    let invalid = |reason: &str| DiscoveryError::InvalidInstance {
        id: info.id,
        reason: reason.to_owned(),
    };
    if info.address.is_empty() {
        return Err(invalid("address must be host:port, got an empty string"));
    }
    if info.kv_block_size == 0 {
        return Err(invalid("kv_block_size must be at least 1, got 0"));
    }
    if info.dp_size == 0 {
        return Err(invalid("dp_size must be at least 1, got 0"));
    }
    Ok(())
}

#[cfg(test)]
mod tests;
