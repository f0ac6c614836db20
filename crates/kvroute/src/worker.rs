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

mod args;
mod metrics;
mod register;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, bail};
use kvroute_mocker::MockerConfig;
use kvroute_mocker::disagg::{DecodeConfig, Role};
use kvroute_mocker::live::LiveMocker;
use kvroute_runtime::{
    DEFAULT_RING_CAPACITY, FleetSecret, FleetTls, InstanceInfo, KvEventPublisher,
    LOAD_REPORTS_METADATA, LlmEngine, LoadReporter, WorkerRole, WorkerServer, WorkerServerConfig,
};

use crate::adapter::{Adapter, EngineSpec};
use crate::cli::nats::Shared;
use crate::load::MIN_LOAD_REPORT_INTERVAL;
use crate::load::{LoadSampler, spawn_load_sampler};
use crate::signal;
use args::RoleArg;
pub(crate) use args::WorkerArgs;
use metrics::{CountingEngine, WorkerStats, serve_metrics};
use register::{Registration, watch_engine_health};

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
        role: match args.role {
            RoleArg::Aggregated => WorkerRole::Aggregated,
            RoleArg::Prefill => WorkerRole::Prefill,
            RoleArg::Decode => WorkerRole::Decode,
        },
        bootstrap_port: args.bootstrap_port,
    };
    crate::adapter::check_role(engine, spec.role)?;
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
    let mut metadata = adapter.metadata();
    let endpoint = match &args.endpoint {
        Some(endpoint) => Some(crate::cli::endpoint::parse(endpoint).context("--endpoint")?),
        // Best effort: a URL whose host does not resolve here gives no endpoint.
        None => crate::cli::endpoint::of_url(&spec.engine_url).ok(),
    };
    if let Some(endpoint) = endpoint {
        metadata.insert(
            kvroute_runtime::ENDPOINT_METADATA.to_owned(),
            endpoint.to_string(),
        );
    }
    let worker = Worker {
        id,
        role: spec.role,
        block_size,
        metadata,
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
    let nats = connect_nats(args, &publisher, reporter.as_ref()).await?;
    let (secret, fleet_tls) = load_fleet_security(args)?;
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
    let address = advertised_address(args, server.local_addr());

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
    let registration = Registration::start(args, nats.as_ref(), &info, secret, fleet_tls)
        .await?
        .map(Arc::new);
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
        registration.withdraw().await;
    }
    drain(&stats, args.drain_timeout.0).await;
    drop(server);
    if let Some(shared) = &nats
        && !shared.plane.settle(Duration::from_secs(2)).await
    {
        tracing::warn!("JetStream did not acknowledge every KV event before exit");
    }
    tracing::info!("stopped");
    outcome
}

/// With `--nats`, the connection; every KV event (and load report) from here on also goes to
/// JetStream (the ring keeps serving gap recovery and dumps over the request plane).
async fn connect_nats(
    args: &WorkerArgs,
    publisher: &KvEventPublisher,
    reporter: Option<&LoadReporter>,
) -> anyhow::Result<Option<Shared>> {
    let Some(url) = &args.nats else {
        return Ok(None);
    };
    let shared =
        crate::cli::nats::connect(url, &args.nats_namespace, args.lease_ttl.0, &args.nats_auth)
            .await?;
    publisher.forward_to(Arc::new(shared.plane.clone()));
    if let Some(reporter) = reporter {
        reporter.forward_to(Arc::new(shared.plane.clone()));
    }
    Ok(Some(shared))
}

/// The fleet's secret and mutual TLS files, loaded; the TLS files are re-read on SIGHUP.
fn load_fleet_security(
    args: &WorkerArgs,
) -> anyhow::Result<(Option<FleetSecret>, Option<FleetTls>)> {
    let secret = match &args.fleet_secret_file {
        Some(path) => Some(
            FleetSecret::from_file(path)
                .context("loading the fleet secret (--fleet-secret-file)")?,
        ),
        None => None,
    };
    let fleet_tls = match (&args.fleet_ca, &args.fleet_cert, &args.fleet_key) {
        (Some(ca), Some(cert), Some(key)) => {
            Some(FleetTls::load(ca, cert, key).context("loading the fleet's TLS files")?)
        }
        _ => None,
    };
    if let Some(tls) = &fleet_tls {
        tokio::spawn(crate::signal::reload_fleet_tls_on_sighup(tls.clone()));
    }
    Ok((secret, fleet_tls))
}

/// The address routers dial: `--advertise`, else the bound one (127.0.0.1 when bound to an
/// unspecified ip).
fn advertised_address(args: &WorkerArgs, bound: SocketAddr) -> String {
    args.advertise.clone().unwrap_or_else(|| {
        let ip = if bound.ip().is_unspecified() {
            std::net::IpAddr::from([127, 0, 0, 1])
        } else {
            bound.ip()
        };
        SocketAddr::new(ip, bound.port()).to_string()
    })
}

/// Waits, up to `timeout`, for the requests in flight to finish.
async fn drain(stats: &WorkerStats, timeout: Duration) {
    let drained = tokio::time::timeout(timeout, async {
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
}

fn role_name(role: WorkerRole) -> &'static str {
    match role {
        WorkerRole::Aggregated => "aggregated",
        WorkerRole::Prefill => "prefill",
        WorkerRole::Decode => "decode",
    }
}
