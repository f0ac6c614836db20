//! The NATS side of `kvroute serve --nats` and `kvroute worker --nats`: one connection, the
//! KV event stream and the discovery bucket, and the flags that prove who connects
//! ([`NatsAuth`]).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use kvroute_nats::{
    ConnectError, EventStreamConfig, Nats, NatsAffinityStore, NatsAffinityStoreConfig, NatsConfig,
    NatsDiscovery, NatsDiscoveryConfig, NatsEventPlane, NatsSnapshotStore,
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

/// How a router or worker proves itself to NATS beyond the URL's own user and password or token
/// (`nats://USER:PASS@HOST:PORT`, `nats://TOKEN@HOST:PORT`), and whom it trusts. `[nats]` keys
/// of `serve`, flags of both.
#[derive(Debug, Default, Clone, PartialEq, serde::Deserialize, clap::Args)]
#[serde(default, deny_unknown_fields)]
pub(crate) struct NatsAuth {
    /// A NATS credentials file (user JWT and nkey seed, as `nsc` writes it).
    #[arg(long = "nats-creds", value_name = "FILE")]
    pub(crate) creds_file: Option<PathBuf>,
    /// A file holding an nkey user seed (SU...), for a server that lists the user's public key.
    #[arg(long = "nats-nkey", value_name = "FILE")]
    pub(crate) nkey_file: Option<PathBuf>,
    /// Trust the CA certificates in this PEM file and require TLS with NATS.
    #[arg(long = "nats-tls-ca", value_name = "FILE")]
    pub(crate) tls_ca: Option<PathBuf>,
}

impl NatsAuth {
    /// Whether anything is set (allowed only together with a NATS URL).
    pub(crate) fn is_set(&self) -> bool {
        self.creds_file.is_some() || self.nkey_file.is_some() || self.tls_ca.is_some()
    }

    /// These options with every one `flags` gives replacing these.
    pub(crate) fn overridden_by(self, flags: NatsAuth) -> NatsAuth {
        NatsAuth {
            creds_file: flags.creds_file.or(self.creds_file),
            nkey_file: flags.nkey_file.or(self.nkey_file),
            tls_ca: flags.tls_ca.or(self.tls_ca),
        }
    }
}

/// Connects to `url` (retrying for a minute while NATS does not answer; a refused credential or
/// a TLS failure fails at once) and opens the namespace's stream and bucket.
pub(crate) async fn connect(
    url: &str,
    namespace: &str,
    lease_ttl: Duration,
    auth: &NatsAuth,
) -> anyhow::Result<Shared> {
    let config = NatsConfig {
        creds_file: auth.creds_file.clone(),
        nkey_file: auth.nkey_file.clone(),
        tls_ca: auth.tls_ca.clone(),
        ..NatsConfig::new(url)
            .with_namespace(namespace)
            .with_client_name(format!("kvroute-{}", std::process::id()))
    };
    // Never log a password or token.
    let url = &config.display_url();
    // Started together with NATS: wait for it as a worker waits for its router; a URL that is
    // not a NATS address fails at once.
    let mut retry = crate::retry::StartupRetry::new(format!("NATS at {url}"));
    let nats = loop {
        match Nats::connect(&config).await {
            Ok(nats) => break nats,
            Err(error @ ConnectError::Unreachable { .. }) => {
                if !retry.wait(&error).await {
                    return Err(anyhow::Error::new(error).context(format!(
                        "NATS at {url} was not reachable within {:?}",
                        crate::retry::STARTUP_DEADLINE
                    )));
                }
            }
            Err(error) => return Err(error.into()),
        }
    };
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
    /// The index snapshot shared by the routers that index the same workers (`name`: which).
    pub(crate) async fn snapshot_store(&self, name: &str) -> anyhow::Result<NatsSnapshotStore> {
        NatsSnapshotStore::start(&self.nats, name)
            .await
            .context("opening the NATS snapshot object store")
    }

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
