//! The NATS side of `kvroute serve --nats` and `kvroute worker --nats`: one connection, the
//! KV event stream and the discovery bucket.

use std::time::Duration;

use anyhow::Context as _;
use kvroute_nats::{
    EventStreamConfig, Nats, NatsAffinityStore, NatsAffinityStoreConfig, NatsConfig, NatsDiscovery,
    NatsDiscoveryConfig, NatsEventPlane,
};

/// What a router or worker shares through NATS.
#[derive(Debug, Clone)]
pub(crate) struct Shared {
    /// The connection (its status feeds logs and `/metrics`).
    pub(crate) nats: Nats,
    /// Workers' registrations.
    pub(crate) discovery: NatsDiscovery,
    /// KV events (JetStream) and other subjects.
    pub(crate) plane: NatsEventPlane,
}

/// Connects to `url` and opens the namespace's stream and bucket.
pub(crate) async fn connect(
    url: &str,
    namespace: &str,
    lease_ttl: Duration,
) -> anyhow::Result<Shared> {
    let config = NatsConfig::new(url)
        .with_namespace(namespace)
        .with_client_name(format!("kvroute-{}", std::process::id()));
    let nats = Nats::connect(&config).await?;
    let discovery = NatsDiscovery::start(&nats, &NatsDiscoveryConfig { lease_ttl })
        .await
        .context("opening NATS discovery")?;
    let plane = NatsEventPlane::start(nats.clone(), &EventStreamConfig::default())
        .await
        .context("opening the NATS KV event stream")?;
    tracing::info!(%url, namespace, ?lease_ttl, "connected to NATS");
    Ok(Shared {
        nats,
        discovery,
        plane,
    })
}

impl Shared {
    /// The sticky-session store of the router replica `origin`, shared with every other replica.
    pub(crate) async fn session_store(
        &self,
        origin: u64,
        max_sessions: usize,
    ) -> anyhow::Result<NatsAffinityStore> {
        let config = NatsAffinityStoreConfig {
            max_sessions,
            ..NatsAffinityStoreConfig::new(origin)
        };
        NatsAffinityStore::start(&self.nats, &config)
            .await
            .context("opening the NATS session bucket")
    }
}
