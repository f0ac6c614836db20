//! The prefill workers discovery lists, with their bootstrap endpoints and topology.
//!
//! A worker takes part in disaggregated serving by registering with role
//! [`WorkerRole::Prefill`]; it offers the bootstrap path by advertising
//! [`BOOTSTRAP_HOST_KEY`] and [`BOOTSTRAP_PORT_KEY`] in its discovery metadata.

use std::collections::BTreeMap;

use kvroute_protocols::{BOOTSTRAP_HOST_KEY, BOOTSTRAP_PORT_KEY, WorkerId};
use kvroute_runtime::{InstanceInfo, WorkerRole};

use crate::config::TopologyAffinity;

/// Where a prefill worker's bootstrap server listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BootstrapEndpoint {
    /// Host name or address.
    pub host: String,
    /// TCP port.
    pub port: u16,
}

/// One prefill worker as the prefill router sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefillWorker {
    /// Its id.
    pub id: WorkerId,
    /// Its bootstrap endpoint, when it advertises a valid one.
    pub bootstrap: Option<BootstrapEndpoint>,
    /// Its discovery metadata (topology keys live here).
    pub metadata: BTreeMap<String, String>,
}

/// The prefill workers of one discovery snapshot.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PrefillFleet {
    workers: BTreeMap<WorkerId, PrefillWorker>,
}

impl PrefillFleet {
    /// The prefill workers among `instances`.
    pub fn from_instances(instances: &BTreeMap<WorkerId, InstanceInfo>) -> Self {
        let workers = instances
            .values()
            .filter(|i| i.role == WorkerRole::Prefill)
            .map(|i| {
                let bootstrap = bootstrap_endpoint(&i.metadata);
                if bootstrap.is_none() && i.metadata.contains_key(BOOTSTRAP_HOST_KEY) {
                    tracing::warn!(
                        worker_id = i.id,
                        port = ?i.metadata.get(BOOTSTRAP_PORT_KEY),
                        "prefill worker advertises a bootstrap host without a valid port \
                         (expected 1..=65535); using the prefill-result path for it"
                    );
                }
                let worker = PrefillWorker {
                    id: i.id,
                    bootstrap,
                    metadata: i.metadata.clone(),
                };
                (i.id, worker)
            })
            .collect();
        Self { workers }
    }

    /// Whether no prefill worker is registered (disaggregation is inactive).
    pub fn is_empty(&self) -> bool {
        self.workers.is_empty()
    }

    /// How many prefill workers are registered.
    pub fn len(&self) -> usize {
        self.workers.len()
    }

    /// The prefill worker `id`, if registered.
    pub fn get(&self, id: WorkerId) -> Option<&PrefillWorker> {
        self.workers.get(&id)
    }

    /// Whether any prefill worker offers the bootstrap path.
    pub fn any_bootstrap(&self) -> bool {
        self.workers.values().any(|w| w.bootstrap.is_some())
    }

    /// The prefill workers, in id order.
    pub fn workers(&self) -> impl Iterator<Item = &PrefillWorker> {
        self.workers.values()
    }
}

impl PrefillWorker {
    /// The `"key=value"` topology taints of this worker for `affinity`'s keys, in key order.
    pub fn topology_taints(&self, affinity: &TopologyAffinity) -> Vec<String> {
        affinity
            .keys
            .iter()
            .filter_map(|k| self.metadata.get(k).map(|v| format!("{k}={v}")))
            .collect()
    }
}

/// The bootstrap endpoint in `metadata`: a non-empty host and a port in 1..=65535.
pub fn bootstrap_endpoint(metadata: &BTreeMap<String, String>) -> Option<BootstrapEndpoint> {
    let host = metadata.get(BOOTSTRAP_HOST_KEY).filter(|h| !h.is_empty())?;
    let port: u16 = metadata.get(BOOTSTRAP_PORT_KEY)?.trim().parse().ok()?;
    (port != 0).then(|| BootstrapEndpoint {
        host: host.clone(),
        port,
    })
}
