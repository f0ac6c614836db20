//! `kvroute worker --mock`: a simulated engine (kvroute-mocker) served over the TCP request
//! plane, registered with a router and publishing its KV events.
//!
//! The worker registers with the router's registry (`--router`) under a heartbeat lease, so a
//! crashed worker disappears (at once when its process dies, after the lease's time to live when
//! its host vanishes). Its KV events are numbered by a [`KvEventPublisher`] that the router
//! subscribes to over the request plane. An optional HTTP endpoint (`--metrics-listen`) exposes
//! what the worker saw (requests, session opens and closes) in Prometheus text. On SIGINT or
//! SIGTERM it deregisters first (no new requests arrive), then lets in-flight requests finish,
//! up to the drain timeout.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Context as _, bail};
use kvroute_mocker::MockerConfig;
use kvroute_mocker::disagg::{DecodeConfig, Role};
use kvroute_mocker::live::LiveMocker;
use kvroute_protocols::kv_events::KvCacheEvent;
use kvroute_protocols::{PreprocessedRequest, SessionAction, SessionControl};
use kvroute_runtime::{
    DEFAULT_RING_CAPACITY, Discovery as _, Engine, EngineError, InstanceInfo, KvEventPublisher,
    LlmResponse, RemoteDiscovery, RemoteDiscoveryConfig, RequestContext, ResponseStream,
    WorkerRole, WorkerServer, WorkerServerConfig,
};
use parking_lot::Mutex;

use crate::signal;

/// `kvroute worker` arguments.
#[derive(Debug, clap::Args)]
pub(crate) struct WorkerArgs {
    /// Serve the simulated engine (the only engine this binary embeds).
    #[arg(long)]
    mock: bool,
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
    /// A mocker config file (TOML, or JSON for a .json path): block size, capacity, timing.
    #[arg(long, value_name = "FILE")]
    mocker_config: Option<PathBuf>,
    /// Run the simulated engine this many times faster than the modelled GPU (overrides the file).
    #[arg(long)]
    speedup: Option<f64>,
    /// Serve `/metrics` (Prometheus text) and `/health` over HTTP on this address.
    #[arg(long, value_name = "IP:PORT")]
    metrics_listen: Option<SocketAddr>,
    /// On SIGINT/SIGTERM, how long in-flight requests may take to finish, in seconds.
    #[arg(long, default_value_t = 30)]
    drain_timeout_secs: u64,
}

/// `--role` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum RoleArg {
    Aggregated,
    Prefill,
    Decode,
}

/// Runs the worker until a shutdown signal.
pub(crate) fn run(args: WorkerArgs) -> anyhow::Result<()> {
    if !args.mock {
        bail!("only simulated workers exist in this binary; pass --mock");
    }
    let mut mocker = match &args.mocker_config {
        None => MockerConfig::default(),
        Some(path) => MockerConfig::from_file(path)
            .with_context(|| format!("reading mocker config {}", path.display()))?,
    };
    if let Some(speedup) = args.speedup {
        mocker.speedup = speedup;
    }
    mocker
        .validate()
        .context("invalid mocker configuration (--mocker-config / --speedup)")?;
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
    let publisher = KvEventPublisher::new(id, DEFAULT_RING_CAPACITY);
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
    let stats = Arc::new(WorkerStats::default());
    let engine = Arc::new(CountingEngine {
        inner: engine,
        stats: stats.clone(),
    });
    let config = WorkerServerConfig::new(id).with_kv_events(publisher);
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
        Some(addr) => Some(serve_metrics(addr, stats.clone()).await?),
    };

    let mut info = InstanceInfo::new(id, address.clone(), block_size).with_role(worker_role);
    info.metadata
        .insert("engine".to_owned(), "mocker".to_owned());
    info.metadata.insert(
        kvroute_runtime::KV_EVENTS_METADATA.to_owned(),
        "true".to_owned(),
    );
    let registration = match &args.router {
        None => None,
        Some(router) => {
            let registry = router
                .trim_start_matches("tcp://")
                .trim_end_matches('/')
                .to_owned();
            let discovery =
                RemoteDiscovery::new(registry.clone(), RemoteDiscoveryConfig::default());
            let lease = register_with_retry(&discovery, info.clone())
                .await
                .with_context(|| format!("registering with the router at {registry}"))?;
            Some((discovery, lease))
        }
    };
    let metrics = metrics_addr.map_or_else(|| "none".to_owned(), |a| a.to_string());
    println!(
        "kvroute worker: id={id} role={} listen={address} metrics={metrics}",
        role_name(worker_role)
    );
    tracing::info!(id, %address, role = role_name(worker_role), "worker ready");

    let signal_name = signal::shutdown().await;
    tracing::info!(
        signal = signal_name,
        in_flight = stats.in_flight(),
        "shutting down"
    );
    // Deregister first so that the router stops sending, then drain what is in flight.
    if let Some((discovery, lease)) = registration {
        lease.revoke();
        if !discovery.flush(Duration::from_secs(2)).await {
            tracing::warn!("the registry did not confirm the deregistration in time");
        }
    }
    let drained = tokio::time::timeout(Duration::from_secs(args.drain_timeout_secs), async {
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
    tracing::info!("stopped");
    Ok(())
}

fn role_name(role: WorkerRole) -> &'static str {
    match role {
        WorkerRole::Aggregated => "aggregated",
        WorkerRole::Prefill => "prefill",
        WorkerRole::Decode => "decode",
    }
}

/// Registers, retrying for a while when the router is not up yet (workers and router are often
/// started together).
async fn register_with_retry(
    discovery: &RemoteDiscovery,
    info: InstanceInfo,
) -> anyhow::Result<kvroute_runtime::Lease> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        match discovery.register(info.clone()).await {
            Ok(lease) => return Ok(lease),
            Err(error) if tokio::time::Instant::now() < deadline => {
                tracing::info!(%error, "router not reachable yet; retrying");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(error) => return Err(error.into()),
        }
    }
}

/// What the worker observed, for `/metrics`.
#[derive(Debug, Default)]
struct WorkerStats {
    requests: AtomicU64,
    finished: AtomicU64,
    session_opens: AtomicU64,
    session_closes: AtomicU64,
    sessions: Mutex<BTreeSet<String>>,
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
                "sessions_open",
                "Sessions opened and not yet closed",
                "gauge",
                self.sessions.lock().len() as u64,
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

/// The simulated engine, with what it is asked counted for `/metrics` and shutdown.
struct CountingEngine {
    inner: LiveMocker,
    stats: Arc<WorkerStats>,
}

impl Engine for CountingEngine {
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
        self.inner.kv_dump()
    }
}

/// Serves `/metrics` and `/health` on `addr`; returns the bound address.
async fn serve_metrics(addr: SocketAddr, stats: Arc<WorkerStats>) -> anyhow::Result<SocketAddr> {
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
                async move { stats.prometheus() }
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
