//! The NATS side of `kvroute serve --nats` and `kvroute worker --nats`: one connection, the
//! KV event stream and the discovery bucket.

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

/// Registers in NATS, on their behalf, the workers that registered with this router's own
/// registry (`--registry-listen` beside `--nats`), for as long as they stay registered here, so
/// every router replica serves them. A registration NATS refuses (another live worker holds the
/// id) is logged and retried every few seconds. The task ends with the registry; dropping it
/// withdraws every registration it made.
pub(crate) fn proxy_registrations(
    mut registry: tokio::sync::watch::Receiver<kvroute_runtime::InstanceSet>,
    discovery: NatsDiscovery,
) -> tokio::task::JoinHandle<()> {
    use kvroute_runtime::Discovery as _;
    tokio::spawn(async move {
        let mut leases = std::collections::BTreeMap::new();
        let mut retry = tokio::time::interval(Duration::from_secs(2));
        retry.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let current = registry.borrow_and_update().clone();
            // Withdraw what left or changed (a changed one is registered again below).
            leases.retain(|id, (info, _lease)| current.get(id) == Some(&*info));
            for (id, info) in current.iter() {
                if leases.contains_key(id) {
                    continue;
                }
                match discovery.register(info.clone()).await {
                    Ok(lease) => {
                        tracing::info!(
                            worker = id,
                            "registered in NATS on behalf of a worker registered here"
                        );
                        leases.insert(*id, (info.clone(), lease));
                    }
                    Err(error) => {
                        tracing::warn!(worker = id, %error, "cannot register this worker in NATS yet; retrying");
                    }
                }
            }
            tokio::select! {
                changed = registry.changed() => if changed.is_err() { return },
                _ = retry.tick(), if leases.len() < current.len() => {}
            }
        }
    })
}
