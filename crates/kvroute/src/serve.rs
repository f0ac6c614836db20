//! `kvroute serve`: the OpenAI-compatible frontend and the KV router in front of a fleet.
//!
//! Workers are found by registration (they connect to the registry this process runs, see
//! `kvroute worker --router`), from a static fleet file, or through NATS (`--nats`: workers
//! register in a KV bucket and publish their KV events to JetStream, so several routers share
//! one fleet; see [`crate::cli::nats`]). Without NATS their KV events arrive over the request
//! plane: a [`KvEventBridge`] subscribes to each listed worker and feeds the router's in-process
//! event plane, so no broker is needed. Unless `[router] disagg = "off"`, the KV router of the
//! decode phase serves decode and aggregated workers and another serves prefill workers; while a
//! prefill worker is registered, requests are served disaggregated. On SIGINT or SIGTERM the
//! frontend stops accepting, lets in-flight requests finish (up to the drain timeout), then exits.

mod config;
pub(crate) mod epp;
mod fleet;
mod proxy;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use kvroute_router::http::{self, ApiKeys, AppState, Disagg, ServerTls};
use kvroute_router::{
    DEFAULT_LOAD_SCOPE, InMemoryAffinityStore, KvPhaseRouter, KvPushRouter, KvPushRouterConfig,
    LoadSyncConfig, ModelRegistry, PrefillRouterConfig, SharedAffinityStore, role_filtered,
};
use kvroute_runtime::{
    ClientConfig, Discovery as _, EventPlane, FleetSecret, FleetTls, InProcessDiscovery,
    InProcessEventPlane, InstanceSet, KvEventBridge, KvEventBridgeConfig, RegistryChecks,
    RegistryServer, SnapshotStore, WorkerRole, membership_filtered,
};

pub(crate) use config::ServeOptions;
use config::{Discovery, FleetSource, ServeConfig};

use crate::cli::nats;
use crate::signal;

/// `kvroute serve` arguments.
#[derive(Debug, clap::Args)]
pub(crate) struct ServeArgs {
    /// A TOML config file (see docs/examples/serve.toml); flags override its values.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    #[command(flatten)]
    options: ServeOptions,
}

/// Runs the service until a shutdown signal.
pub(crate) fn run(args: ServeArgs) -> anyhow::Result<()> {
    let config = load_options(args.config.as_deref(), args.options)?.validate()?;
    signal::init_tracing();
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the tokio runtime")?
        .block_on(serve(config))
}

/// The options of the config file at `path` (if any), overridden by the `flags` given.
pub(crate) fn load_options(
    path: Option<&std::path::Path>,
    flags: ServeOptions,
) -> anyhow::Result<ServeOptions> {
    let file = match path {
        None => ServeOptions::default(),
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading config file {}", path.display()))?;
            ServeOptions::from_toml(&text)
                .with_context(|| format!("parsing config file {}", path.display()))?
        }
    };
    Ok(file.overridden_by(flags))
}

/// What the worker registry refuses: another block size than the router's, and, while any
/// served model has only the built-in mock tokenizer, workers fronting real engines (the engine
/// would get token ids of a vocabulary it does not have).
fn registry_checks(config: &ServeConfig, secret: Option<&FleetSecret>) -> RegistryChecks {
    let checks = RegistryChecks::default()
        .with_block_size(config.router.core.block_size())
        .with_fleet_secret(secret.cloned());
    let mock: Vec<String> = config
        .models
        .iter()
        .filter(|m| m.tokenizer.is_none())
        .map(|m| format!("`{}`", m.name))
        .collect();
    if mock.is_empty() {
        return checks;
    }
    checks.refusing_engines(format!(
        "the router serves model(s) {} with the built-in mock tokenizer, which would send this \
         engine token ids of a vocabulary it does not have; start kvroute serve with the model's \
         tokenizer: --model NAME,tokenizer=/path/to/tokenizer.json[,chat_template=PATH]",
        mock.join(", ")
    ))
}

/// The fleet and its routers, started: what `serve` puts its HTTP frontend in front of and
/// `epp` its endpoint picker.
pub(crate) struct Started {
    /// The served models.
    pub(crate) models: ModelRegistry,
    /// The router requests go to (the decode phase's when disaggregated).
    pub(crate) router: KvPushRouter,
    /// Disaggregated serving around both phases' routers.
    pub(crate) disagg: Option<Disagg>,
    /// The listed workers.
    pub(crate) instances: tokio::sync::watch::Receiver<InstanceSet>,
    /// The fleet's TLS files (re-read on SIGHUP with the frontend's).
    pub(crate) fleet_tls: Option<FleetTls>,
    /// Metrics beyond the router's (NATS, replicas).
    pub(crate) extra_metrics: Option<kvroute_router::http::ExtraMetrics>,
    /// Which registry workers register at (`none`, `nats` or an address).
    pub(crate) registry_addr: String,
    /// The discovery, registry, static fleet and event bridge: alive as long as this.
    pub(crate) workers: Workers,
    _bridge: Option<KvEventBridge>,
}

impl Started {
    /// Fails once an engine of the static fleet has an unusable KV event feed.
    pub(crate) async fn engine_failure(&self) -> anyhow::Error {
        match &self.workers.static_fleet {
            Some(fleet) => fleet.failed().await,
            None => std::future::pending().await,
        }
    }
}

/// Loads the models and the fleet's security, finds the workers, and starts the routers.
pub(crate) async fn start(config: &mut ServeConfig) -> anyhow::Result<Started> {
    let models = ModelRegistry::load(&config.models).context("loading the served models")?;
    let (secret, fleet_tls) = load_fleet_security(config)?;
    // The router proves the secret to every worker it connects to, and talks only to those
    // that prove it back (and, with the fleet's TLS, that hold its CA's certificate).
    config.router.push.client.fleet_secret = secret.clone();
    config.router.push.client.tls = fleet_tls.clone();
    let bridge_config = KvEventBridgeConfig {
        client: ClientConfig {
            fleet_secret: secret.clone(),
            tls: fleet_tls.clone(),
            ..KvEventBridgeConfig::default().client
        },
        ..KvEventBridgeConfig::default()
    };
    let security = FleetSecurity {
        secret: secret.as_ref(),
        tls: fleet_tls.as_ref(),
        bridge: &bridge_config,
    };
    let mut workers = Workers::find(config, &security).await?;
    let instances = workers.instances.clone();
    // With NATS the workers publish their KV events to JetStream themselves; otherwise the
    // bridge subscribes to each worker and feeds an in-process plane, but for the engines this
    // process fronts, which forward to that plane directly.
    let plane: Arc<dyn EventPlane> = match &workers.nats {
        Some(shared) => Arc::new(shared.plane.clone()),
        None => Arc::new(InProcessEventPlane::default()),
    };
    let (router, disagg) = start_routers(
        config,
        instances.clone(),
        plane.clone(),
        workers.nats.as_ref(),
    )
    .await?;
    // Fed only once the routers have subscribed: the in-process plane keeps nothing, and an
    // engine's first load report (which states its KV capacity, read by the cost's capacity
    // credit and eviction charges) is sent once at start, then again only when the load changes
    // or a heartbeat passes. Fed before, the first requests were routed blind to every
    // engine's capacity for up to a heartbeat (the peers bench's first 19 requests).
    let bridge = match &workers.nats {
        Some(_) => None,
        None => {
            let local = workers
                .static_fleet
                .as_mut()
                .map(|fleet| fleet.forward_local(&plane))
                .unwrap_or_default();
            Some(KvEventBridge::start_except(
                instances.clone(),
                plane.clone(),
                bridge_config.clone(),
                local,
            ))
        }
    };
    // One set of replica metrics (the names carry no phase label): the router of the decode
    // phase, when disaggregated, which serves every aggregated request too.
    let replica_routers = vec![router.clone()];
    let extra_metrics = workers.nats.as_ref().map(|shared| {
        let status = shared.nats.status().clone();
        let metrics: kvroute_router::http::ExtraMetrics = Arc::new(move || {
            let mut text = status.metrics_text();
            for router in &replica_routers {
                text.push_str(&router.replica_metrics_text());
            }
            text
        });
        metrics
    });
    let registry_addr = match (&workers.registry, &workers.nats) {
        (Some(r), _) => r.local_addr().to_string(),
        (None, Some(_)) => "nats".to_owned(),
        (None, None) => "none".to_owned(),
    };
    Ok(Started {
        models,
        router,
        disagg,
        instances,
        fleet_tls,
        extra_metrics,
        registry_addr,
        workers,
        _bridge: bridge,
    })
}

async fn serve(mut config: ServeConfig) -> anyhow::Result<()> {
    let started = start(&mut config).await?;
    let state = AppState::new(
        started.router.clone(),
        started.models.clone(),
        config.http.clone(),
    );
    let state = match started.disagg.clone() {
        None => state,
        Some(disagg) => state.with_disagg(disagg),
    };
    let state = match started.extra_metrics.clone() {
        Some(metrics) => state.with_extra_metrics(metrics),
        None => state,
    };
    let fleet_tls = started.fleet_tls.clone();
    let (state, tls) = secure_frontend(&config, state, fleet_tls.as_ref())?;
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("binding the HTTP frontend on {}", config.listen))?;
    let http_addr = listener.local_addr()?;
    let registry_addr = &started.registry_addr;
    // One machine-readable line, so scripts and tests can find the ports when they used port 0.
    println!("kvroute serve: http={http_addr} registry={registry_addr}");
    tracing::info!(%http_addr, registry = %registry_addr, "serving");

    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let stopped = async move {
        let _ = stop_rx.await;
    };
    let server = match tls {
        None => tokio::spawn(http::serve(listener, state.clone(), stopped)),
        Some(tls) => tokio::spawn(http::serve_tls(listener, state.clone(), tls, stopped)),
    };
    let engine_failure = started.engine_failure();
    let failure = tokio::select! {
        signal_name = signal::shutdown() => {
            tracing::info!(
                signal = signal_name,
                in_flight = state.in_flight(),
                "draining"
            );
            None
        }
        error = engine_failure => {
            tracing::error!(error = %format!("{error:#}"), "an engine's KV event feed is unusable; stopping");
            Some(error)
        }
    };
    let _ = stop_tx.send(());
    match tokio::time::timeout(config.drain_timeout, server).await {
        Ok(result) => result.context("the HTTP server task")??,
        Err(_) => tracing::warn!(
            in_flight = state.in_flight(),
            after = ?config.drain_timeout,
            "drain timeout: exiting with requests in flight"
        ),
    }
    drop(started);
    tracing::info!("stopped");
    failure.map_or(Ok(()), Err)
}

/// The fleet's secret (warning when there is none) and mutual TLS files, loaded.
fn load_fleet_security(
    config: &ServeConfig,
) -> anyhow::Result<(Option<FleetSecret>, Option<FleetTls>)> {
    let secret = match &config.fleet_secret_file {
        Some(path) => Some(
            FleetSecret::from_file(path)
                .context("loading the fleet secret (--fleet-secret-file)")?,
        ),
        None => {
            tracing::warn!(
                "no fleet secret: any process that reaches the worker registry can join the \
                 fleet and receive prompts (pass --fleet-secret-file)"
            );
            None
        }
    };
    let fleet_tls = match &config.fleet_tls {
        Some([ca, cert, key]) => {
            Some(FleetTls::load(ca, cert, key).context("loading the fleet's TLS files")?)
        }
        None => None,
    };
    Ok((secret, fleet_tls))
}

/// What the router's side of the fleet proves and trusts.
struct FleetSecurity<'a> {
    secret: Option<&'a FleetSecret>,
    tls: Option<&'a FleetTls>,
    /// How KV event bridges connect to workers (with the secret and TLS above).
    bridge: &'a KvEventBridgeConfig,
}

/// How the workers are found, and what must live as long as the service.
pub(crate) struct Workers {
    /// The listed workers (with a fleet secret on NATS, only those proving it).
    instances: tokio::sync::watch::Receiver<InstanceSet>,
    /// The worker registry, with registration or beside NATS.
    registry: Option<RegistryServer>,
    /// The NATS connection.
    nats: Option<nats::Shared>,
    /// The static fleet.
    static_fleet: Option<fleet::Fleet>,
    /// Beside NATS, a registry's workers are registered in NATS by this router and their KV
    /// events bridged to JetStream (both stop with the process).
    _proxied: Option<(AbortOnDrop, KvEventBridge)>,
}

impl Workers {
    /// Opens the discovery `config` names: NATS, a static fleet or the registry (kept alive
    /// for the whole run).
    async fn find(config: &ServeConfig, security: &FleetSecurity<'_>) -> anyhow::Result<Self> {
        let found = match &config.discovery {
            Discovery::Nats {
                url,
                namespace,
                lease_ttl,
                registry_listen,
                auth,
            } => {
                let shared = crate::cli::nats::connect(url, namespace, *lease_ttl, auth).await?;
                // Anyone allowed onto NATS can write a registration: with a fleet secret, only
                // the ones proving it are served.
                let instances = match security.secret {
                    Some(secret) => membership_filtered(shared.discovery.watch(), secret.clone()),
                    None => shared.discovery.watch(),
                };
                let (registry, _proxied) = match registry_listen {
                    None => (None, None),
                    Some(listen) => {
                        let registry = bind_registry(config, security, listen, *lease_ttl).await?;
                        let local = registry.discovery().watch();
                        let proxy =
                            proxy::proxy_registrations(local.clone(), shared.discovery.clone());
                        let bridge = KvEventBridge::start(
                            local,
                            Arc::new(shared.plane.clone()),
                            security.bridge.clone(),
                        );
                        (Some(registry), Some((AbortOnDrop(proxy), bridge)))
                    }
                };
                Workers {
                    instances,
                    registry,
                    nats: Some(shared),
                    static_fleet: None,
                    _proxied,
                }
            }
            Discovery::Static { fleet } => {
                let workers = match fleet {
                    FleetSource::File(path) => fleet::read_file(path)?,
                    FleetSource::Inline(workers) => workers.clone(),
                };
                fleet::check_against_router(
                    &workers,
                    config.router.core.block_size(),
                    &config.models,
                )?;
                // The routers of this process reach these engines directly (their push
                // config's registry), not over the loopback servers listed for them.
                let fleet = fleet::Fleet::start(
                    workers,
                    security.secret.cloned(),
                    security.tls.cloned(),
                    &config.router.push.local,
                )
                .await?;
                Workers {
                    instances: fleet.discovery.watch(),
                    registry: None,
                    nats: None,
                    static_fleet: Some(fleet),
                    _proxied: None,
                }
            }
            Discovery::Registration { listen, lease_ttl } => {
                let registry = bind_registry(config, security, listen, *lease_ttl).await?;
                Workers {
                    instances: registry.discovery().watch(),
                    registry: Some(registry),
                    nats: None,
                    static_fleet: None,
                    _proxied: None,
                }
            }
        };
        Ok(found)
    }
}

/// Binds the worker registry on `listen`, with [`registry_checks`] and the fleet's TLS.
async fn bind_registry(
    config: &ServeConfig,
    security: &FleetSecurity<'_>,
    listen: &SocketAddr,
    lease_ttl: Duration,
) -> anyhow::Result<RegistryServer> {
    RegistryServer::bind_with_checks(
        listen,
        InProcessDiscovery::new(lease_ttl),
        registry_checks(config, security.secret).with_tls(security.tls.cloned()),
    )
    .await
    .with_context(|| format!("binding the worker registry on {listen}"))
}

/// Starts the KV router, or, with disaggregation, the routers of both phases; returns the one
/// the frontend sends requests to (the decode phase's when disaggregated) and the
/// disaggregation around both.
///
/// Router replicas on NATS share their active load and their sticky sessions; each router
/// gets its own replica id. Without NATS a router keeps both to itself. The prefill and decode
/// routers of one process serve different workers: each shares load only with the other
/// processes' router of its phase.
async fn start_routers(
    config: &ServeConfig,
    instances: tokio::sync::watch::Receiver<InstanceSet>,
    plane: Arc<dyn EventPlane>,
    nats: Option<&nats::Shared>,
) -> anyhow::Result<(KvPushRouter, Option<Disagg>)> {
    let replicas = Replicas { config, nats };
    match config.disagg {
        None => {
            let (router_config, store, snapshots) =
                replicas.prepare(DEFAULT_LOAD_SCOPE, "aggregated").await?;
            let router =
                KvPushRouter::start_shared(router_config, instances, plane, store, snapshots)
                    .await
                    .context("starting the KV router")?;
            Ok((router, None))
        }
        Some(mode) => {
            let start = |roles: &'static [WorkerRole], name: &'static str| {
                let instances = role_filtered(instances.clone(), roles);
                let plane = plane.clone();
                async move {
                    let (router_config, store, snapshots) = replicas.prepare(name, name).await?;
                    KvPushRouter::start_shared(router_config, instances, plane, store, snapshots)
                        .await
                        .map_err(anyhow::Error::from)
                }
            };
            let prefill = start(&[WorkerRole::Prefill], "prefill")
                .await
                .context("starting the KV router of the prefill phase")?;
            let decode = start(&[WorkerRole::Decode, WorkerRole::Aggregated], "decode")
                .await
                .context("starting the KV router of the decode phase")?;
            let disagg = Disagg::new(
                KvPhaseRouter::new(prefill, decode.clone()).with_conditional(config.conditional),
                instances,
                PrefillRouterConfig::default().with_mode(mode),
            );
            Ok((decode, Some(disagg)))
        }
    }
}

/// What each router replica of this process starts with.
#[derive(Clone, Copy)]
struct Replicas<'a> {
    config: &'a ServeConfig,
    nats: Option<&'a nats::Shared>,
}

impl Replicas<'_> {
    /// A new replica's configuration (sharing load with the other processes' routers of
    /// `scope`), its session store and, on NATS, the index snapshot `snapshot` shared by the
    /// replicas that index the same workers (a restarted router loads it and reads only the KV
    /// events after it).
    async fn prepare(
        self,
        scope: &'static str,
        snapshot: &'static str,
    ) -> anyhow::Result<(
        KvPushRouterConfig,
        SharedAffinityStore,
        Option<Arc<dyn SnapshotStore>>,
    )> {
        let id: u64 = rand::random();
        let mut router = self.config.router.clone();
        if self.nats.is_some() {
            router.load_sync = Some(LoadSyncConfig::new(id).with_scope(scope));
        }
        let max_sessions = self.config.router.core.max_sessions;
        let store: SharedAffinityStore = match self.nats {
            Some(shared) => Arc::new(shared.session_store(id, max_sessions).await?),
            None => Arc::new(InMemoryAffinityStore::new(max_sessions)),
        };
        let snapshots: Option<Arc<dyn SnapshotStore>> = match self.nats {
            Some(shared) => Some(Arc::new(shared.snapshot_store(snapshot).await?)),
            None => None,
        };
        Ok((router, store, snapshots))
    }
}

/// The frontend's TLS certificate and client API keys, loaded (with the fleet's TLS files,
/// re-read on SIGHUP); `state` requires the keys when there are any.
fn secure_frontend(
    config: &ServeConfig,
    state: AppState,
    fleet_tls: Option<&FleetTls>,
) -> anyhow::Result<(AppState, Option<ServerTls>)> {
    let tls = match &config.tls {
        Some((cert, key)) => {
            let tls = ServerTls::load(cert, key).context("loading the TLS certificate")?;
            tracing::info!(cert = %cert.display(), "serving HTTPS");
            Some(tls)
        }
        None => None,
    };
    let keys = match &config.api_key_file {
        Some(path) => {
            let keys =
                ApiKeys::load(path).context("loading the client API keys (--api-key-file)")?;
            tracing::info!(path = %path.display(), keys = keys.len(), "clients must send an API key on /v1/*");
            Some(keys)
        }
        None => None,
    };
    if keys.is_some() || tls.is_some() || fleet_tls.is_some() {
        tokio::spawn(reload_on_sighup(
            keys.clone(),
            tls.clone(),
            fleet_tls.cloned(),
        ));
    }
    let state = match keys {
        Some(keys) => state.with_api_keys(keys),
        None => {
            tracing::warn!(
                listen = %config.listen,
                "serving unauthenticated requests: anyone who reaches this address is served \
                 (pass --api-key-file to require a key)"
            );
            state
        }
    };
    Ok((state, tls))
}

/// Aborts a background task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Re-reads the client API keys, the frontend's TLS certificate and the fleet's TLS files on
/// every SIGHUP; a file that fails to load keeps what is in use.
async fn reload_on_sighup(
    keys: Option<ApiKeys>,
    tls: Option<ServerTls>,
    fleet_tls: Option<FleetTls>,
) {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let mut hangup = match signal(SignalKind::hangup()) {
            Ok(hangup) => hangup,
            Err(error) => {
                tracing::warn!(%error, "cannot listen for SIGHUP; keys and certificates are not reloaded");
                return;
            }
        };
        while hangup.recv().await.is_some() {
            if let Some(keys) = &keys {
                match keys.reload() {
                    Ok(n) => tracing::info!(keys = n, "SIGHUP: reloaded the client API keys"),
                    Err(error) => tracing::error!(
                        error = %error,
                        "SIGHUP: the client API keys were not reloaded; the old ones stay in use"
                    ),
                }
            }
            if let Some(tls) = &tls {
                match tls.reload() {
                    Ok(()) => tracing::info!("SIGHUP: reloaded the TLS certificate"),
                    Err(error) => tracing::error!(
                        error = %error,
                        "SIGHUP: the TLS certificate was not reloaded; the old one stays in use"
                    ),
                }
            }
            if let Some(fleet_tls) = &fleet_tls {
                crate::signal::reload_fleet_tls(fleet_tls);
            }
        }
    }
    #[cfg(not(unix))]
    let _ = (keys, tls, fleet_tls);
}
