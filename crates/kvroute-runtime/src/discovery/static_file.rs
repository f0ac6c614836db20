//! Discovery from a fixed fleet file.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use futures::future::BoxFuture;
use serde::Deserialize;
use tokio::sync::watch;

use super::{Discovery, DiscoveryError, InstanceInfo, InstanceSet, Lease, validate};

/// A fixed fleet read from a file: TOML (`[[workers]]` tables) or, for a `.json` path, JSON
/// (`{"workers": [...]}`). Each worker has the fields of [`InstanceInfo`]:
///
/// ```toml
/// [[workers]]
/// id = 1
/// address = "10.0.0.1:7100"
/// role = "aggregated"   # or "prefill" / "decode"; default aggregated
/// kv_block_size = 16
/// dp_size = 1           # default 1
/// metadata = { model = "llama-3-8b" }
/// ```
///
/// Membership never changes; a worker that is down is handled by the push router's backoff.
/// Registering an instance that the file lists succeeds (with a detached lease), so worker
/// processes can call `register` whatever the backend; any other registration is refused.
#[derive(Debug, Clone)]
pub struct StaticDiscovery {
    tx: Arc<watch::Sender<InstanceSet>>,
}

/// Why a fleet file was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StaticFleetError {
    /// The file could not be read.
    #[error("cannot read fleet file {path}: {source}")]
    Io {
        /// The path.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file is not a valid fleet description.
    #[error("invalid fleet file: {message}")]
    Parse {
        /// The parser's message, with the location.
        message: String,
    },
    /// An instance is invalid or an id repeats.
    #[error("invalid fleet: {0}")]
    Invalid(DiscoveryError),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FleetFile {
    workers: Vec<InstanceInfo>,
}

impl StaticDiscovery {
    /// Reads a fleet file (JSON if the path ends in `.json`, TOML otherwise).
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, StaticFleetError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| StaticFleetError::Io {
            path: path.display().to_string(),
            source,
        })?;
        if path.extension().is_some_and(|e| e == "json") {
            Self::from_json_str(&text)
        } else {
            Self::from_toml_str(&text)
        }
    }

    /// Parses a TOML fleet description.
    pub fn from_toml_str(text: &str) -> Result<Self, StaticFleetError> {
        let file: FleetFile = toml::from_str(text).map_err(|e| StaticFleetError::Parse {
            message: e.to_string(),
        })?;
        Self::from_instances(file.workers).map_err(StaticFleetError::Invalid)
    }

    /// Parses a JSON fleet description.
    pub fn from_json_str(text: &str) -> Result<Self, StaticFleetError> {
        let file: FleetFile = serde_json::from_str(text).map_err(|e| StaticFleetError::Parse {
            message: e.to_string(),
        })?;
        Self::from_instances(file.workers).map_err(StaticFleetError::Invalid)
    }

    /// A fleet of exactly `instances`.
    pub fn from_instances(instances: Vec<InstanceInfo>) -> Result<Self, DiscoveryError> {
        let mut set = BTreeMap::new();
        for info in instances {
            validate(&info)?;
            if let Some(existing) = set.get(&info.id) {
                let existing: &InstanceInfo = existing;
                return Err(DiscoveryError::DuplicateId {
                    id: info.id,
                    address: existing.address.clone(),
                });
            }
            set.insert(info.id, info);
        }
        let (tx, _) = watch::channel(Arc::new(set));
        Ok(Self { tx: Arc::new(tx) })
    }

    /// The fleet.
    pub fn instances(&self) -> InstanceSet {
        self.tx.borrow().clone()
    }
}

impl Discovery for StaticDiscovery {
    fn register(&self, info: InstanceInfo) -> BoxFuture<'_, Result<Lease, DiscoveryError>> {
        let listed = self.tx.borrow().get(&info.id) == Some(&info);
        Box::pin(async move {
            if listed {
                Ok(Lease::detached(info.id))
            } else {
                Err(DiscoveryError::ReadOnly)
            }
        })
    }

    fn watch(&self) -> watch::Receiver<InstanceSet> {
        self.tx.subscribe()
    }
}
