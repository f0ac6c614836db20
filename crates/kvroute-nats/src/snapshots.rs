//! [`NatsSnapshotStore`]: the routers' shared index snapshot, one object in a JetStream object
//! store.

use std::collections::HashMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_nats::jetstream::object_store::{
    self, GetErrorKind, InfoErrorKind, ObjectMetadata, ObjectStore,
};
use bytes::Bytes;
use futures::future::BoxFuture;
use kvroute_runtime::{EventPlaneError, SnapshotStore};
use tokio::io::AsyncReadExt;

use crate::client::{ConnectError, Nats};

/// The object metadata key recording when the snapshot was saved (Unix milliseconds).
const SAVED_AT: &str = "saved_at_unix_ms";

/// A router index snapshot of a namespace: the object `router_index.<name>` in the object store
/// `<namespace>_snapshots` (stream `OBJ_<namespace>_snapshots`); routers that index the same
/// workers share a name (a disaggregated frontend's prefill and decode routers use two). Every router replica may save
/// it; each skips its turn while a fresh one exists ([`SnapshotStore::age`], from the saver's
/// clock). Cheap to clone.
#[derive(Clone)]
pub struct NatsSnapshotStore {
    store: ObjectStore,
    object: String,
}

impl std::fmt::Debug for NatsSnapshotStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsSnapshotStore")
            .field("object", &self.object)
            .finish_non_exhaustive()
    }
}

impl NatsSnapshotStore {
    /// The snapshot `name` over `nats`, creating (or reusing) the bucket.
    pub async fn start(nats: &Nats, name: &str) -> Result<Self, ConnectError> {
        let bucket = format!("{}_snapshots", nats.namespace);
        let setup = |e: String| ConnectError::Setup {
            what: format!("the snapshot object store {bucket}"),
            message: e,
        };
        let store = match nats.jetstream.get_object_store(&bucket).await {
            Ok(store) => store,
            Err(_) => nats
                .jetstream
                .create_object_store(object_store::Config {
                    bucket: bucket.clone(),
                    description: Some("kvroute router index snapshots".to_owned()),
                    ..Default::default()
                })
                .await
                .map_err(|e| setup(e.to_string()))?,
        };
        Ok(Self {
            store,
            object: format!("router_index.{name}"),
        })
    }
}

fn unavailable(e: impl std::fmt::Display) -> EventPlaneError {
    EventPlaneError::Unavailable {
        message: format!("snapshot store: {e}"),
    }
}

fn unix_ms(at: SystemTime) -> u64 {
    at.duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

impl SnapshotStore for NatsSnapshotStore {
    fn load(&self) -> BoxFuture<'_, Result<Option<Bytes>, EventPlaneError>> {
        Box::pin(async move {
            let mut object = match self.store.get(&self.object).await {
                Ok(object) => object,
                Err(e) if e.kind() == GetErrorKind::NotFound => return Ok(None),
                Err(e) => return Err(unavailable(e)),
            };
            let mut bytes = Vec::new();
            object.read_to_end(&mut bytes).await.map_err(unavailable)?;
            Ok(Some(Bytes::from(bytes)))
        })
    }

    fn save(&self, snapshot: Bytes) -> BoxFuture<'_, Result<(), EventPlaneError>> {
        Box::pin(async move {
            let meta = ObjectMetadata {
                name: self.object.clone(),
                description: Some("kvroute router index snapshot".to_owned()),
                chunk_size: Some(256 * 1024),
                metadata: HashMap::from([(
                    SAVED_AT.to_owned(),
                    unix_ms(SystemTime::now()).to_string(),
                )]),
                headers: None,
            };
            let mut reader: &[u8] = &snapshot;
            self.store
                .put(meta, &mut reader)
                .await
                .map(|_| ())
                .map_err(unavailable)
        })
    }

    fn age(&self) -> BoxFuture<'_, Result<Option<Duration>, EventPlaneError>> {
        Box::pin(async move {
            let info = match self.store.info(&self.object).await {
                Ok(info) if !info.deleted => info,
                Ok(_) => return Ok(None),
                Err(e) if e.kind() == InfoErrorKind::NotFound => return Ok(None),
                Err(e) => return Err(unavailable(e)),
            };
            // A snapshot without the stamp (written by something else) counts as old.
            let saved = info
                .metadata
                .get(SAVED_AT)
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0);
            let now = unix_ms(SystemTime::now());
            Ok(Some(Duration::from_millis(now.saturating_sub(saved))))
        })
    }
}
