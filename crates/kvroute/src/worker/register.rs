//! A worker's place in the fleet: its registration (with the router's registry or in NATS),
//! retried while the registry is unreachable, and withdrawn while a fronted engine is unhealthy.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::Context as _;
use kvroute_runtime::{
    Discovery, FleetSecret, FleetTls, InstanceInfo, RemoteDiscovery, RemoteDiscoveryConfig,
};

use super::WorkerArgs;
use super::metrics::WorkerStats;
use crate::adapter::Adapter;
use crate::cli::nats::Shared;

/// A worker's registration: the registry client and its lease, taken away while the engine
/// is unhealthy.
pub(super) struct Registration {
    pub(super) discovery: Arc<dyn Discovery>,
    /// The router's registry client (not with NATS), to confirm the deregistration.
    pub(super) remote: Option<RemoteDiscovery>,
    pub(super) lease: tokio::sync::Mutex<Option<kvroute_runtime::Lease>>,
}

impl Registration {
    /// Registers `info` as `args` say: in NATS (`--nats`, over `nats`), with the router's
    /// registry (`--router`, proving the fleet's secret and TLS), or nowhere (`None`: a static
    /// fleet's worker only serves).
    pub(super) async fn start(
        args: &WorkerArgs,
        nats: Option<&Shared>,
        info: &InstanceInfo,
        secret: Option<FleetSecret>,
        fleet_tls: Option<FleetTls>,
    ) -> anyhow::Result<Option<Registration>> {
        let registration = match (&args.router, &args.nats) {
            (None, None) => None,
            (_, Some(url)) => {
                let shared = nats.context("the NATS connection is open")?;
                let discovery: Arc<dyn Discovery> = Arc::new(shared.discovery.clone());
                let lease = register_with_retry(discovery.as_ref(), info.clone(), "NATS")
                    .await
                    .with_context(|| format!("registering in NATS at {url}"))?;
                Some(Registration {
                    discovery,
                    remote: None,
                    lease: tokio::sync::Mutex::new(Some(lease)),
                })
            }
            (Some(router), None) => {
                let registry = router
                    .trim_start_matches("tcp://")
                    .trim_end_matches('/')
                    .to_owned();
                let mut remote_config = RemoteDiscoveryConfig::default();
                remote_config.client.fleet_secret = secret;
                remote_config.client.tls = fleet_tls;
                let discovery = RemoteDiscovery::new(registry.clone(), remote_config);
                let lease = register_with_retry(&discovery, info.clone(), "the router")
                    .await
                    .with_context(|| format!("registering with the router at {registry}"))?;
                Some(Registration {
                    discovery: Arc::new(discovery.clone()),
                    remote: Some(discovery),
                    lease: tokio::sync::Mutex::new(Some(lease)),
                })
            }
        };
        Ok(registration)
    }

    /// Leaves the fleet (so that routers stop sending) and, with the router's registry, waits
    /// briefly for it to confirm.
    pub(super) async fn withdraw(&self) {
        if let Some(lease) = self.lease.lock().await.take() {
            lease.revoke();
        }
        if let Some(remote) = &self.remote
            && !remote.flush(Duration::from_secs(2)).await
        {
            tracing::warn!("the registry did not confirm the deregistration in time");
        }
    }
}

/// How often a sidecar checks its engine's health, and after how many failures in a row it
/// leaves the fleet.
const HEALTH_INTERVAL: Duration = Duration::from_secs(2);
const HEALTH_FAILURES_TO_LEAVE: u32 = 3;

/// Takes the worker out of the fleet while its engine fails health checks (so the router stops
/// choosing it), and registers it again once the engine answers.
pub(super) async fn watch_engine_health(
    adapter: Arc<Adapter>,
    registration: Arc<Registration>,
    info: InstanceInfo,
    stats: Arc<WorkerStats>,
) {
    let mut failures = 0u32;
    loop {
        tokio::time::sleep(HEALTH_INTERVAL).await;
        let healthy = match adapter.engine.health().await {
            Ok(()) => true,
            Err(error) => {
                failures += 1;
                // Loud on the way down; while it stays down, the leave below said it all.
                if failures <= HEALTH_FAILURES_TO_LEAVE {
                    tracing::warn!(%error, failures, "engine health check failed");
                } else {
                    tracing::debug!(%error, failures, "engine still unhealthy");
                }
                false
            }
        };
        let mut lease = registration.lease.lock().await;
        if healthy {
            failures = 0;
            stats.engine_up.store(1, Ordering::SeqCst);
            if lease.is_none() {
                match registration.discovery.register(info.clone()).await {
                    Ok(new) => {
                        tracing::info!("the engine is healthy again; rejoined the fleet");
                        *lease = Some(new);
                    }
                    Err(error) => tracing::warn!(%error, "cannot register again yet"),
                }
            }
        } else if failures >= HEALTH_FAILURES_TO_LEAVE {
            stats.engine_up.store(0, Ordering::SeqCst);
            if let Some(old) = lease.take() {
                tracing::warn!("the engine is unhealthy; leaving the fleet until it recovers");
                old.revoke();
            }
        }
    }
}

/// Registers, retrying with backoff ([`crate::retry::StartupRetry`]) while the router or NATS
/// cannot be reached (workers and router are often started together). A refusal (the id is
/// taken, the block size is not the router's) is final: retrying cannot change it.
pub(super) async fn register_with_retry(
    discovery: &dyn Discovery,
    info: InstanceInfo,
    what: &str,
) -> anyhow::Result<kvroute_runtime::Lease> {
    let mut retry = crate::retry::StartupRetry::new(what);
    loop {
        match discovery.register(info.clone()).await {
            Ok(lease) => return Ok(lease),
            Err(error @ kvroute_runtime::DiscoveryError::Unavailable { .. }) => {
                if !retry.wait(&error).await {
                    return Err(anyhow::Error::new(error).context(format!(
                        "{what} was not reachable within {:?}",
                        crate::retry::STARTUP_DEADLINE
                    )));
                }
            }
            Err(error) => return Err(anyhow::Error::new(error).context(format!("{what} refused"))),
        }
    }
}
