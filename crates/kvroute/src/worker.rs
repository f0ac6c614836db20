//! `kvroute worker`: an engine served over the TCP request plane, registered with a router and
//! publishing its KV events. The engine is the simulator (`--mock`, kvroute-mocker) or a real
//! one behind its HTTP API (`--engine vllm|sglang|trtllm|llamacpp|openai --engine-url URL`, the
//! sidecar shape of [`crate::adapter`]); a sidecar waits for its engine to be healthy before it
//! registers, leaves the fleet while the engine fails its health checks, and comes back when it
//! recovers.
//!
//! The worker registers with the router's registry (`--router`) under a heartbeat lease, so a
//! crashed worker disappears (at once when its process dies, after the lease's time to live when
//! its host vanishes). Its KV events are numbered by a [`KvEventPublisher`] that the router
//! subscribes to over the request plane. An optional HTTP endpoint (`--metrics-listen`) exposes
//! what the worker saw (requests, session opens and closes) in Prometheus text. On SIGINT or
//! SIGTERM it deregisters first (no new requests arrive), then lets in-flight requests finish,
//! up to the drain timeout.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Context as _, bail};
use kvroute_engines::EngineKind;
use kvroute_mocker::MockerConfig;
use kvroute_mocker::disagg::{DecodeConfig, Role};
use kvroute_mocker::live::LiveMocker;
use kvroute_protocols::kv_events::KvCacheEvent;
use kvroute_protocols::{PreprocessedRequest, SessionAction, SessionControl};
use kvroute_runtime::{
    DEFAULT_RING_CAPACITY, Discovery, Engine, EngineError, InstanceInfo, KvEventPublisher,
    LOAD_REPORTS_METADATA, LlmEngine, LlmResponse, LoadReporter, RemoteDiscovery,
    RemoteDiscoveryConfig, RequestContext, ResponseStream, WorkerRole, WorkerServer,
    WorkerServerConfig,
};
use parking_lot::Mutex;

use crate::adapter::{Adapter, EngineSpec};
use crate::cli::HumanDuration;
use crate::load::{LoadSampler, spawn_load_sampler};
use crate::mocker_args::MockerArgs;
use crate::signal;

/// `kvroute worker` arguments.
#[derive(Debug, clap::Args)]
#[command(group = clap::ArgGroup::new("backend").required(true).args(["mock", "engine"]))]
pub(crate) struct WorkerArgs {
    /// Serve the simulated engine (kvroute-mocker).
    #[arg(long)]
    mock: bool,
    /// Serve a real engine through its HTTP API, prompts sent as token ids: vllm, trtllm and
    /// openai through `/v1/completions`, sglang through `/generate`, llamacpp through
    /// `/completion`.
    #[arg(
        long,
        value_name = "vllm|sglang|trtllm|llamacpp|openai",
        requires = "engine_url"
    )]
    engine: Option<EngineKind>,
    /// The engine's HTTP address, e.g. http://127.0.0.1:8000.
    #[arg(long, value_name = "URL", requires = "engine")]
    engine_url: Option<String>,
    /// The engine's ZMQ KV event publisher, e.g. tcp://127.0.0.1:5557 (vLLM
    /// `--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
    /// "endpoint": "tcp://*:5557"}'`). Without it the router predicts this worker's cache from its
    /// own decisions (approximate mode).
    #[arg(long, value_name = "tcp://HOST:PORT", requires = "engine")]
    kv_events: Option<String>,
    /// The engine's ZMQ replay socket (vLLM `"replay_endpoint"`), to recover missed event batches.
    #[arg(long, value_name = "tcp://HOST:PORT", requires = "kv_events")]
    kv_events_replay: Option<String>,
    /// Tokens per KV block of the engine (vLLM `--block-size`, SGLang `--page-size`); must
    /// equal the router's `[router] block_size` (default 16).
    #[arg(long, value_name = "TOKENS", conflicts_with = "mock")]
    kv_block_size: Option<u32>,
    /// The `model` sent to the engine instead of each request's own.
    #[arg(long, value_name = "NAME", requires = "engine")]
    served_model_name: Option<String>,
    /// How long a request may wait for the engine's first byte (its queue wait plus prefill:
    /// engines send nothing before the first token). When it passes, the request goes back to
    /// the router, which moves it to another worker (or answers 504 `timeout` when none can
    /// take it), and the router's passive health counts it against this worker.
    #[arg(
        long,
        default_value = "300s",
        value_name = "DURATION",
        requires = "engine"
    )]
    first_byte_timeout: HumanDuration,
    /// The longest silence between two pieces of a started response (a frozen engine, a
    /// connection cut without a reset): when it passes, the request migrates with the tokens
    /// generated so far.
    #[arg(
        long,
        default_value = "60s",
        value_name = "DURATION",
        requires = "engine"
    )]
    idle_timeout: HumanDuration,
    /// A file whose first line is the engine's API key, sent as `Authorization: Bearer`
    /// (`vllm serve --api-key`, an OpenAI server). Also read from the environment variable
    /// KVROUTE_ENGINE_API_KEY. Never logged.
    #[arg(long, value_name = "FILE", requires = "engine")]
    engine_api_key_file: Option<PathBuf>,
    /// How long to wait at start for the engine to answer its health check (250ms, 5s, 2m, ...).
    #[arg(long, default_value = "120s", value_name = "DURATION")]
    engine_wait: HumanDuration,
    /// What the worker serves.
    #[arg(long, value_enum, default_value = "aggregated")]
    role: RoleArg,
    /// The request-plane address, ip:port (port 0 picks a free port).
    #[arg(long, default_value = "127.0.0.1:0", value_name = "IP:PORT")]
    listen: SocketAddr,
    /// The address the router should dial (default: the bound address; 127.0.0.1 when bound to
    /// an unspecified ip).
    #[arg(long, value_name = "HOST:PORT")]
    advertise: Option<String>,
    /// The instance id, unique in the fleet (default: random).
    #[arg(long)]
    id: Option<u64>,
    /// The router's registry address (`[discovery] registry_listen` of `kvroute serve`), host:port.
    /// Without it the worker only serves (for a static fleet file).
    #[arg(long, value_name = "HOST:PORT")]
    router: Option<String>,
    /// A NATS server with JetStream, nats://HOST:PORT, instead of --router: the worker
    /// registers in NATS and publishes its KV events to JetStream, where every `kvroute serve
    /// --nats` router finds them.
    #[arg(long = "nats", value_name = "URL", conflicts_with = "router")]
    nats: Option<String>,
    /// The NATS namespace (as `kvroute serve --nats-namespace`; default kvroute).
    #[arg(
        long = "nats-namespace",
        value_name = "NAME",
        requires = "nats",
        default_value = "kvroute"
    )]
    nats_namespace: String,
    /// With --nats: how long the registration stays listed without renewal (renewed every third
    /// of it), as `kvroute serve --lease-ttl`.
    #[arg(long, value_name = "DURATION", requires = "nats", default_value = "5s")]
    lease_ttl: HumanDuration,
    /// Credentials and TLS for NATS, as `kvroute serve`'s.
    #[command(flatten)]
    nats_auth: crate::cli::nats::NatsAuth,
    /// The fleet's shared secret, the same file as the router's `--fleet-secret-file`: the
    /// worker proves it when it registers and serves only routers that prove it.
    #[arg(long, value_name = "FILE")]
    fleet_secret_file: Option<PathBuf>,
    /// Mutual TLS with the routers: the fleet's CA (PEM), as `kvroute serve --fleet-ca`.
    #[arg(long, value_name = "FILE", requires_all = ["fleet_cert", "fleet_key"])]
    fleet_ca: Option<PathBuf>,
    /// This worker's certificate (PEM, signed by --fleet-ca), naming the host or IP it is
    /// reached at (--advertise).
    #[arg(long, value_name = "FILE", requires = "fleet_ca")]
    fleet_cert: Option<PathBuf>,
    /// The private key of --fleet-cert (PEM).
    #[arg(long, value_name = "FILE", requires = "fleet_ca")]
    fleet_key: Option<PathBuf>,
    /// The simulated engine (--mock).
    #[command(flatten)]
    mocker: MockerArgs,
    /// Serve `/metrics` (Prometheus text) and `/health` over HTTP on this address.
    #[arg(long, value_name = "IP:PORT")]
    metrics_listen: Option<SocketAddr>,
    /// On SIGINT/SIGTERM, how long in-flight requests may take to finish (250ms, 5s, 2m, ...;
    /// the same flag and format as `kvroute serve --drain-timeout`).
    #[arg(long, default_value = "30s", value_name = "DURATION")]
    drain_timeout: HumanDuration,
    /// How often the worker reads its engine's load (requests running and waiting, KV blocks
    /// in use) and reports it to the routers, which hold their predicted load against it
    /// (at least 50ms). The report is repeated at this interval while it does not change.
    #[arg(long, default_value = "1s", value_name = "DURATION")]
    load_report_interval: HumanDuration,
}

/// The shortest `--load-report-interval`.
const MIN_LOAD_REPORT_INTERVAL: Duration = Duration::from_millis(50);

/// `--role` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum RoleArg {
    Aggregated,
    Prefill,
    Decode,
}

/// Runs the worker until a shutdown signal.
pub(crate) fn run(args: WorkerArgs) -> anyhow::Result<()> {
    if args.load_report_interval.0 < MIN_LOAD_REPORT_INTERVAL {
        bail!(
            "--load-report-interval must be at least {MIN_LOAD_REPORT_INTERVAL:?}, got {:?}",
            args.load_report_interval.0
        );
    }
    if args.nats_auth.is_set() && args.nats.is_none() {
        bail!("--nats-creds, --nats-nkey and --nats-tls-ca need --nats URL");
    }
    if args.engine.is_some() {
        if args.mocker.any_given() {
            bail!(
                "--profile, --mocker-config, --speedup, --block-size and --cache-blocks configure \
                 the simulated engine (--mock), not --engine"
            );
        }
        if args.role != RoleArg::Aggregated {
            bail!(
                "--role prefill|decode is for simulated workers; an --engine worker is aggregated"
            );
        }
        if args.kv_block_size == Some(0) {
            bail!("--kv-block-size must be at least 1 token");
        }
        signal::init_tracing();
        return tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .context("starting the tokio runtime")?
            .block_on(serve_engine(args));
    }
    let mocker = args.mocker.config()?;
    signal::init_tracing();
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the tokio runtime")?
        .block_on(serve(args, mocker))
}

async fn serve(args: WorkerArgs, mocker: MockerConfig) -> anyhow::Result<()> {
    let id = args.id.unwrap_or_else(|| u64::from(rand::random::<u32>()));
    let block_size = mocker.block_size;
    // Numbered from this process's start time, so a restart never reuses an event id.
    let publisher = KvEventPublisher::new(id, DEFAULT_RING_CAPACITY).starting_at(
        kvroute_runtime::incarnation_event_base(std::time::SystemTime::now()),
    );
    let (role, worker_role) = match args.role {
        RoleArg::Aggregated => (None, WorkerRole::Aggregated),
        RoleArg::Prefill => (
            Some(Role::Prefill {
                worker_id: id,
                rooms: None,
            }),
            WorkerRole::Prefill,
        ),
        RoleArg::Decode => (
            Some(Role::Decode(DecodeConfig::default())),
            WorkerRole::Decode,
        ),
    };
    let engine = match role {
        None => LiveMocker::spawn(mocker, 0, publisher.clone()),
        Some(role) => LiveMocker::spawn_with_role(mocker, 0, publisher.clone(), role),
    }
    .context("starting the simulated engine")?;
    let engine = Arc::new(engine);
    let interval = args.load_report_interval.0;
    let reporter = LoadReporter::new(id, interval);
    let sampled = engine.clone();
    let sampler = spawn_load_sampler(reporter.clone(), interval, move || {
        let report = sampled.load_report();
        async move { anyhow::Ok(vec![report]) }
    });
    let mut metadata = BTreeMap::new();
    metadata.insert("engine".to_owned(), "mocker".to_owned());
    metadata.insert(
        kvroute_runtime::KV_EVENTS_METADATA.to_owned(),
        "true".to_owned(),
    );
    let worker = Worker {
        id,
        role: worker_role,
        block_size,
        metadata,
        publisher,
        adapter: None,
        reporter: Some(reporter),
        _sampler: Some(sampler),
    };
    run_worker(&args, worker, engine).await
}

/// `--engine`: a real engine behind the adapter.
async fn serve_engine(args: WorkerArgs) -> anyhow::Result<()> {
    let id = args.id.unwrap_or_else(|| u64::from(rand::random::<u32>()));
    let (Some(engine), Some(engine_url)) = (args.engine, args.engine_url.clone()) else {
        bail!("--engine needs --engine-url");
    };
    let spec = EngineSpec {
        engine,
        engine_url,
        kv_events: args.kv_events.clone(),
        kv_events_replay: args.kv_events_replay.clone(),
        served_model_name: args.served_model_name.clone(),
        first_byte_timeout: Some(args.first_byte_timeout.0),
        idle_timeout: Some(args.idle_timeout.0),
        api_key: engine_api_key(args.engine_api_key_file.as_deref())?,
    };
    let block_size = args.kv_block_size.unwrap_or(DEFAULT_ENGINE_BLOCK_SIZE);
    let adapter = Adapter::start(
        id,
        &spec,
        block_size,
        args.engine_wait.0,
        args.load_report_interval.0,
    )
    .await?;
    let engine = adapter.engine.clone();
    let worker = Worker {
        id,
        role: WorkerRole::Aggregated,
        block_size,
        metadata: adapter.metadata(),
        publisher: adapter.publisher.clone(),
        reporter: adapter.load_reporter().cloned(),
        adapter: Some(Arc::new(adapter)),
        _sampler: None,
    };
    run_worker(&args, worker, engine).await
}

/// The environment variable an engine API key may come from.
pub(crate) const ENGINE_API_KEY_ENV: &str = "KVROUTE_ENGINE_API_KEY";

/// The engine API key: from `--engine-api-key-file`, else from [`ENGINE_API_KEY_ENV`].
fn engine_api_key(file: Option<&std::path::Path>) -> anyhow::Result<Option<String>> {
    if let Some(path) = file {
        return crate::adapter::read_api_key(path).map(Some);
    }
    Ok(std::env::var(ENGINE_API_KEY_ENV)
        .ok()
        .map(|k| k.trim().to_owned())
        .filter(|k| !k.is_empty()))
}

/// The block size an `--engine` worker assumes without `--kv-block-size` (vLLM's default).
const DEFAULT_ENGINE_BLOCK_SIZE: u32 = 16;

/// What every worker registers and publishes, whatever its engine.
struct Worker {
    id: u64,
    role: WorkerRole,
    block_size: u32,
    metadata: BTreeMap<String, String>,
    publisher: KvEventPublisher,
    adapter: Option<Arc<Adapter>>,
    /// The engine's load reports, when its load can be read.
    reporter: Option<LoadReporter>,
    /// The task reading the simulated engine's load (an adapter runs its own).
    _sampler: Option<LoadSampler>,
}

/// Serves `engine` as `worker`, registers it, and runs until a shutdown signal (or, behind an
/// adapter, until its event feed proves unusable).
async fn run_worker<E: LlmEngine>(
    args: &WorkerArgs,
    worker: Worker,
    engine: Arc<E>,
) -> anyhow::Result<()> {
    let Worker {
        id,
        role: worker_role,
        block_size,
        metadata,
        publisher,
        adapter,
        reporter,
        _sampler,
    } = worker;
    let publisher_first_id = publisher.first_event_id();
    let stats = Arc::new(WorkerStats::default());
    let engine = Arc::new(CountingEngine {
        inner: engine,
        stats: stats.clone(),
    });
    // With NATS, every event from here on also goes to JetStream (the ring keeps serving gap
    // recovery and dumps over the request plane).
    let nats = match &args.nats {
        None => None,
        Some(url) => {
            let shared = crate::cli::nats::connect(
                url,
                &args.nats_namespace,
                args.lease_ttl.0,
                &args.nats_auth,
            )
            .await?;
            publisher.forward_to(Arc::new(shared.plane.clone()));
            if let Some(reporter) = &reporter {
                reporter.forward_to(Arc::new(shared.plane.clone()));
            }
            Some(shared)
        }
    };
    let secret = match &args.fleet_secret_file {
        Some(path) => Some(
            kvroute_runtime::FleetSecret::from_file(path)
                .context("loading the fleet secret (--fleet-secret-file)")?,
        ),
        None => None,
    };
    let fleet_tls = match (&args.fleet_ca, &args.fleet_cert, &args.fleet_key) {
        (Some(ca), Some(cert), Some(key)) => Some(
            kvroute_runtime::FleetTls::load(ca, cert, key)
                .context("loading the fleet's TLS files")?,
        ),
        _ => None,
    };
    if let Some(tls) = &fleet_tls {
        tokio::spawn(crate::signal::reload_fleet_tls_on_sighup(tls.clone()));
    }
    let mut config = WorkerServerConfig::new(id)
        .with_kv_events(publisher)
        .with_fleet_secret(secret.clone())
        .with_tls(fleet_tls.clone());
    if let Some(reporter) = &reporter {
        config = config.with_load_reports(reporter.clone());
    }
    let server = WorkerServer::bind(args.listen, engine, config)
        .await
        .with_context(|| format!("binding the request plane on {}", args.listen))?;
    let bound = server.local_addr();
    let address = args.advertise.clone().unwrap_or_else(|| {
        let ip = if bound.ip().is_unspecified() {
            std::net::IpAddr::from([127, 0, 0, 1])
        } else {
            bound.ip()
        };
        SocketAddr::new(ip, bound.port()).to_string()
    });

    let metrics_addr = match args.metrics_listen {
        None => None,
        Some(addr) => Some(serve_metrics(addr, stats.clone(), adapter.clone()).await?),
    };

    let mut info = InstanceInfo::new(id, address.clone(), block_size).with_role(worker_role);
    info.metadata = metadata;
    // Where this life's KV events start: a router reading them from a durable stream (NATS)
    // catches up from there without asking for a dump.
    info.metadata.insert(
        kvroute_runtime::KV_EVENT_BASE_METADATA.to_owned(),
        publisher_first_id.to_string(),
    );
    if reporter.is_some() {
        // Routers' bridges subscribe to the reports of workers that say they send them.
        info.metadata
            .insert(LOAD_REPORTS_METADATA.to_owned(), "true".to_owned());
    }
    if let Some(secret) = &secret {
        // Registrations in NATS pass no registry that checks the secret: they carry a proof.
        info.metadata.insert(
            kvroute_runtime::FLEET_PROOF_METADATA.to_owned(),
            secret.registration_proof(id, &address),
        );
    }
    let registration = match (&args.router, &args.nats) {
        (None, None) => None,
        (_, Some(url)) => {
            let shared = nats.as_ref().context("the NATS connection is open")?;
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
            remote_config.client.fleet_secret = secret.clone();
            remote_config.client.tls = fleet_tls.clone();
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
    let registration = registration.map(Arc::new);
    let metrics = metrics_addr.map_or_else(|| "none".to_owned(), |a| a.to_string());
    println!(
        "kvroute worker: id={id} role={} listen={address} metrics={metrics}",
        role_name(worker_role)
    );
    tracing::info!(id, %address, role = role_name(worker_role), "worker ready");

    let health = match (&adapter, &registration) {
        (Some(adapter), Some(registration)) => Some(tokio::spawn(watch_engine_health(
            adapter.clone(),
            registration.clone(),
            info.clone(),
            stats.clone(),
        ))),
        _ => None,
    };
    let failure = async {
        match &adapter {
            Some(adapter) => adapter.failed().await,
            None => std::future::pending().await,
        }
    };
    let outcome = tokio::select! {
        signal_name = signal::shutdown() => {
            tracing::info!(
                signal = signal_name,
                in_flight = stats.in_flight(),
                "shutting down"
            );
            Ok(())
        }
        error = failure => {
            tracing::error!(error = %format!("{error:#}"), "the engine's KV event feed is unusable; stopping");
            Err(error)
        }
    };
    if let Some(health) = health {
        health.abort();
    }
    // Deregister first so that the router stops sending, then drain what is in flight.
    if let Some(registration) = registration {
        if let Some(lease) = registration.lease.lock().await.take() {
            lease.revoke();
        }
        if let Some(remote) = &registration.remote
            && !remote.flush(Duration::from_secs(2)).await
        {
            tracing::warn!("the registry did not confirm the deregistration in time");
        }
    }
    let drained = tokio::time::timeout(args.drain_timeout.0, async {
        while stats.in_flight() > 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    if drained.is_err() {
        tracing::warn!(
            in_flight = stats.in_flight(),
            "drain timeout: exiting with requests in flight"
        );
    }
    drop(server);
    if let Some(shared) = &nats
        && !shared.plane.settle(Duration::from_secs(2)).await
    {
        tracing::warn!("JetStream did not acknowledge every KV event before exit");
    }
    tracing::info!("stopped");
    outcome
}

/// A worker's registration: the registry client and its lease, taken away while the engine
/// is unhealthy.
struct Registration {
    discovery: Arc<dyn Discovery>,
    /// The router's registry client (not with NATS), to confirm the deregistration.
    remote: Option<RemoteDiscovery>,
    lease: tokio::sync::Mutex<Option<kvroute_runtime::Lease>>,
}

/// How often a sidecar checks its engine's health, and after how many failures in a row it
/// leaves the fleet.
const HEALTH_INTERVAL: Duration = Duration::from_secs(2);
const HEALTH_FAILURES_TO_LEAVE: u32 = 3;

/// Takes the worker out of the fleet while its engine fails health checks (so the router stops
/// choosing it), and registers it again once the engine answers.
async fn watch_engine_health(
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

fn role_name(role: WorkerRole) -> &'static str {
    match role {
        WorkerRole::Aggregated => "aggregated",
        WorkerRole::Prefill => "prefill",
        WorkerRole::Decode => "decode",
    }
}

/// Registers, retrying with backoff ([`crate::retry::StartupRetry`]) while the router or NATS
/// cannot be reached (workers and router are often started together). A refusal (the id is
/// taken, the block size is not the router's) is final: retrying cannot change it.
async fn register_with_retry(
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

/// What the worker observed, for `/metrics`.
#[derive(Debug)]
struct WorkerStats {
    requests: AtomicU64,
    finished: AtomicU64,
    session_opens: AtomicU64,
    session_closes: AtomicU64,
    /// KV dumps asked by routers (a router that catches up from a durable stream asks none).
    kv_dumps: AtomicU64,
    sessions: Mutex<BTreeSet<String>>,
    /// 1 while the engine answers its health checks (always 1 for the simulator).
    engine_up: AtomicU64,
}

impl Default for WorkerStats {
    fn default() -> Self {
        Self {
            requests: AtomicU64::new(0),
            finished: AtomicU64::new(0),
            session_opens: AtomicU64::new(0),
            session_closes: AtomicU64::new(0),
            kv_dumps: AtomicU64::new(0),
            sessions: Mutex::default(),
            engine_up: AtomicU64::new(1),
        }
    }
}

impl WorkerStats {
    fn in_flight(&self) -> u64 {
        self.requests.load(Ordering::SeqCst) - self.finished.load(Ordering::SeqCst)
    }

    fn prometheus(&self) -> String {
        let line = |name: &str, help: &str, kind: &str, value: u64| {
            format!(
                "# HELP kvroute_worker_{name} {help}\n# TYPE kvroute_worker_{name} {kind}\nkvroute_worker_{name} {value}\n"
            )
        };
        [
            line(
                "requests_total",
                "Requests received",
                "counter",
                self.requests.load(Ordering::SeqCst),
            ),
            line(
                "requests_in_flight",
                "Requests being served",
                "gauge",
                self.in_flight(),
            ),
            line(
                "session_opens_total",
                "Session open calls received",
                "counter",
                self.session_opens.load(Ordering::SeqCst),
            ),
            line(
                "session_closes_total",
                "Session close calls received",
                "counter",
                self.session_closes.load(Ordering::SeqCst),
            ),
            line(
                "kv_dumps_total",
                "KV cache dumps routers asked for",
                "counter",
                self.kv_dumps.load(Ordering::SeqCst),
            ),
            line(
                "sessions_open",
                "Sessions opened and not yet closed",
                "gauge",
                self.sessions.lock().len() as u64,
            ),
            line(
                "engine_up",
                "1 while the engine answers its health checks",
                "gauge",
                self.engine_up.load(Ordering::SeqCst),
            ),
        ]
        .concat()
    }
}

/// Counts ends of a request's stream, however it ends (finished, cancelled, connection lost).
struct Finished(Arc<WorkerStats>);

impl Drop for Finished {
    fn drop(&mut self) {
        self.0.finished.fetch_add(1, Ordering::SeqCst);
    }
}

/// The engine, with what it is asked counted for `/metrics` and shutdown.
struct CountingEngine<E> {
    inner: Arc<E>,
    stats: Arc<WorkerStats>,
}

impl<E: LlmEngine> Engine for CountingEngine<E> {
    type Request = PreprocessedRequest;
    type Response = LlmResponse;

    fn generate(
        &self,
        request: PreprocessedRequest,
        context: RequestContext,
    ) -> Result<ResponseStream<LlmResponse>, EngineError> {
        self.stats.requests.fetch_add(1, Ordering::SeqCst);
        let finished = Finished(self.stats.clone());
        let mut inner = self.inner.generate(request, context)?;
        Ok(Box::pin(futures::stream::poll_fn(move |cx| {
            let _ = &finished;
            inner.as_mut().poll_next(cx)
        })))
    }

    fn session_control(&self, control: SessionControl) -> Result<(), EngineError> {
        match control.action {
            Some(SessionAction::Open) => {
                self.stats.session_opens.fetch_add(1, Ordering::SeqCst);
                self.stats
                    .sessions
                    .lock()
                    .insert(control.session_id.clone());
                tracing::info!(session = %control.session_id, "session open");
            }
            Some(SessionAction::Close) => {
                self.stats.session_closes.fetch_add(1, Ordering::SeqCst);
                self.stats.sessions.lock().remove(&control.session_id);
                tracing::info!(session = %control.session_id, "session close");
            }
            _ => {}
        }
        self.inner.session_control(control)
    }

    fn kv_dump(&self) -> Vec<KvCacheEvent> {
        self.stats.kv_dumps.fetch_add(1, Ordering::SeqCst);
        self.inner.kv_dump()
    }
}

/// The KV event feed's counters, in Prometheus text.
fn listener_metrics(adapter: &Adapter) -> String {
    let Some(s) = adapter.listener_stats() else {
        return String::new();
    };
    let counter = |name: &str, help: &str, value: u64| {
        format!(
            "# HELP kvroute_worker_kv_{name} {help}\n# TYPE kvroute_worker_kv_{name} counter\nkvroute_worker_kv_{name}_total {value}\n"
        )
    };
    [
        counter("messages", "Engine KV event batches received", s.messages),
        counter("events", "Engine KV events republished", s.events),
        counter("gaps", "Jumps in the engine's event sequence", s.gaps),
        counter(
            "lost_messages",
            "Event batches lost in gaps and not replayed",
            s.lost_messages,
        ),
        counter(
            "replayed_messages",
            "Event batches recovered from the replay socket",
            s.replayed_messages,
        ),
        counter(
            "restarts",
            "Times the engine's event sequence restarted (its blocks cleared)",
            s.restarts,
        ),
        counter(
            "decode_errors",
            "Event batches or events that could not be decoded",
            s.decode_errors,
        ),
        counter(
            "block_size_mismatches",
            "Stored events whose block size is not the worker's",
            s.block_size_mismatches,
        ),
    ]
    .concat()
}

/// Serves `/metrics` and `/health` on `addr`; returns the bound address.
async fn serve_metrics(
    addr: SocketAddr,
    stats: Arc<WorkerStats>,
    adapter: Option<Arc<Adapter>>,
) -> anyhow::Result<SocketAddr> {
    use axum::routing::get;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding the metrics endpoint on {addr}"))?;
    let bound = listener.local_addr()?;
    let app = axum::Router::new()
        .route(
            "/metrics",
            get(move || {
                let stats = stats.clone();
                let adapter = adapter.clone();
                async move {
                    let mut text = stats.prometheus();
                    if let Some(adapter) = &adapter {
                        text.push_str(&listener_metrics(adapter));
                    }
                    text
                }
            }),
        )
        .route("/health", get(|| async { "ok" }));
    tokio::spawn(async move {
        if let Err(error) = axum::serve(listener, app).await {
            tracing::warn!(%error, "metrics endpoint stopped");
        }
    });
    Ok(bound)
}
