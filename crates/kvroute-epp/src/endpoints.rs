//! The endpoint table: which `ip:port` the proxy sends each worker's requests to, from the
//! workers' discovery metadata ([`ENDPOINT_METADATA`]), kept current from the discovery watch.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;

use kvroute_protocols::WorkerId;
use kvroute_runtime::{ENDPOINT_METADATA, InstanceSet, WorkerRole};
use parking_lot::RwLock;
use tokio::sync::watch;

/// The workers the picker can send to, by endpoint and by id.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct EndpointTable {
    by_worker: HashMap<WorkerId, SocketAddr>,
    by_endpoint: HashMap<SocketAddr, WorkerId>,
    /// Workers listed without a usable endpoint (no metadata, not `ip:port`, or not
    /// aggregated), with why.
    unusable: Vec<(WorkerId, String)>,
}

impl EndpointTable {
    /// The table of the aggregated workers of `instances` that name an `ip:port` endpoint.
    pub fn from_instances(instances: &InstanceSet) -> Self {
        let mut table = Self::default();
        for (id, info) in instances.iter() {
            if info.role != WorkerRole::Aggregated {
                table.unusable.push((
                    *id,
                    format!(
                        "its role is {:?}; the endpoint picker serves aggregated workers only",
                        info.role
                    ),
                ));
                continue;
            }
            let Some(raw) = info.metadata.get(ENDPOINT_METADATA) else {
                table.unusable.push((
                    *id,
                    format!(
                        "it registered no `{ENDPOINT_METADATA}` (the engine's ip:port); start it \
                         with --endpoint or give its fleet entry an engine_url"
                    ),
                ));
                continue;
            };
            match raw.parse::<SocketAddr>() {
                Ok(addr) => {
                    if let Some(other) = table.by_endpoint.insert(addr, *id) {
                        table.unusable.push((
                            other,
                            format!("worker {id} registered the same endpoint {addr}"),
                        ));
                        table.by_worker.remove(&other);
                    }
                    table.by_worker.insert(*id, addr);
                }
                Err(_) => table.unusable.push((
                    *id,
                    format!("its `{ENDPOINT_METADATA}` {raw:?} is not an ip:port"),
                )),
            }
        }
        table
    }

    /// The endpoint of `worker`.
    pub fn endpoint(&self, worker: WorkerId) -> Option<SocketAddr> {
        self.by_worker.get(&worker).copied()
    }

    /// The worker serving at `endpoint`.
    pub fn worker(&self, endpoint: SocketAddr) -> Option<WorkerId> {
        self.by_endpoint.get(&endpoint).copied()
    }

    /// How many workers have an endpoint.
    pub fn len(&self) -> usize {
        self.by_worker.len()
    }

    /// Whether no worker has an endpoint.
    pub fn is_empty(&self) -> bool {
        self.by_worker.is_empty()
    }

    /// Every worker with an endpoint, in id order.
    pub fn workers(&self) -> Vec<WorkerId> {
        let mut ids: Vec<_> = self.by_worker.keys().copied().collect();
        ids.sort_unstable();
        ids
    }

    /// Workers listed without a usable endpoint, with why.
    pub fn unusable(&self) -> &[(WorkerId, String)] {
        &self.unusable
    }
}

/// The endpoint table, shared and kept current.
#[derive(Debug, Clone)]
pub struct Endpoints {
    table: Arc<RwLock<Arc<EndpointTable>>>,
    /// How many workers have an endpoint, for readiness.
    ready: watch::Sender<usize>,
}

impl Default for Endpoints {
    fn default() -> Self {
        Self {
            table: Arc::default(),
            ready: watch::Sender::new(0),
        }
    }
}

impl Endpoints {
    /// A fixed table (tests, or a fleet that never changes).
    pub fn fixed(table: EndpointTable) -> Self {
        let endpoints = Self::default();
        endpoints.ready.send_replace(table.len());
        *endpoints.table.write() = Arc::new(table);
        endpoints
    }

    /// Follows how many workers have an endpoint (readiness: at least one).
    pub fn ready(&self) -> watch::Receiver<usize> {
        self.ready.subscribe()
    }

    /// A table following `instances`: rebuilt at every change, until the watch closes. Workers
    /// without a usable endpoint are logged once per change. Must be called inside a tokio
    /// runtime.
    pub fn follow(mut instances: watch::Receiver<InstanceSet>) -> Self {
        let endpoints = Self::default();
        endpoints.replace(&instances.borrow_and_update());
        let shared = endpoints.clone();
        tokio::spawn(async move {
            while instances.changed().await.is_ok() {
                let set = instances.borrow_and_update().clone();
                shared.replace(&set);
            }
        });
        endpoints
    }

    fn replace(&self, instances: &InstanceSet) {
        let table = EndpointTable::from_instances(instances);
        for (worker, why) in table.unusable() {
            tracing::warn!(worker, "worker left out of the endpoint picker: {why}");
        }
        tracing::info!(endpoints = table.len(), "endpoint table updated");
        self.ready.send_replace(table.len());
        *self.table.write() = Arc::new(table);
    }

    /// The table now.
    pub fn table(&self) -> Arc<EndpointTable> {
        self.table.read().clone()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use kvroute_runtime::InstanceInfo;

    use super::*;

    fn instance(id: WorkerId, endpoint: Option<&str>, role: WorkerRole) -> InstanceInfo {
        let mut info = InstanceInfo::new(id, "127.0.0.1:1", 16).with_role(role);
        if let Some(e) = endpoint {
            info.metadata
                .insert(ENDPOINT_METADATA.to_owned(), e.to_owned());
        }
        info
    }

    #[test]
    fn the_table_maps_both_ways_and_says_why_a_worker_is_left_out() {
        let set: InstanceSet = Arc::new(BTreeMap::from([
            (
                1,
                instance(1, Some("10.0.0.1:8000"), WorkerRole::Aggregated),
            ),
            (2, instance(2, None, WorkerRole::Aggregated)),
            (3, instance(3, Some("engine:8000"), WorkerRole::Aggregated)),
            (4, instance(4, Some("10.0.0.4:8000"), WorkerRole::Prefill)),
            (5, instance(5, Some("[::1]:9000"), WorkerRole::Aggregated)),
        ]));
        let table = EndpointTable::from_instances(&set);
        assert_eq!(table.workers(), vec![1, 5]);
        assert_eq!(table.endpoint(1), Some("10.0.0.1:8000".parse().unwrap()));
        assert_eq!(table.worker("[::1]:9000".parse().unwrap()), Some(5));
        let why: BTreeMap<_, _> = table.unusable().iter().cloned().collect();
        assert!(why[&2].contains("no `endpoint`"), "{}", why[&2]);
        assert!(why[&3].contains("not an ip:port"), "{}", why[&3]);
        assert!(why[&4].contains("aggregated workers only"), "{}", why[&4]);
    }

    #[test]
    fn two_workers_claiming_one_endpoint_keep_only_the_later() {
        let set: InstanceSet = Arc::new(BTreeMap::from([
            (
                1,
                instance(1, Some("10.0.0.1:8000"), WorkerRole::Aggregated),
            ),
            (
                2,
                instance(2, Some("10.0.0.1:8000"), WorkerRole::Aggregated),
            ),
        ]));
        let table = EndpointTable::from_instances(&set);
        assert_eq!(table.workers(), vec![2]);
        assert_eq!(table.unusable().len(), 1);
        assert_eq!(table.unusable()[0].0, 1);
    }
}
