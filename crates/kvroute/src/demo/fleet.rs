//! The demo's fleet and service, all in this process: simulated engines ([`LiveMocker`]) served
//! as workers over TCP on loopback, in-process discovery and event plane, and the KV router with
//! its OpenAI-compatible HTTP frontend on an ephemeral port.
//!
//! Each worker's engine is wrapped in [`Counted`], which reads the cached prompt tokens the
//! engine reports in every finished request's usage: the hit rate the demo prints is what the
//! engines actually found in their caches, not what the router predicted.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Context, bail};
use futures::StreamExt;
use kvroute_mocker::MockerConfig;
use kvroute_mocker::live::LiveMocker;
use kvroute_protocols::kv_events::KvCacheEvent;
use kvroute_protocols::{PreprocessedRequest, SessionControl};
use kvroute_router::http::{AppState, HttpConfig, serve};
use kvroute_router::{KvPushRouter, KvPushRouterConfig, ModelRegistry, Policy};
use kvroute_runtime::{
    DEFAULT_RING_CAPACITY, Discovery, Engine, EngineError, EventPlane, InProcessDiscovery,
    InProcessEventPlane, InstanceInfo, KvEventPublisher, Lease, LlmResponse, LoadReporter,
    RequestContext, ResponseStream, WorkerServer, WorkerServerConfig,
};

use crate::load::{LoadSampler, spawn_load_sampler};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// The name of the served mock model.
pub(crate) const MODEL: &str = "mock";

/// How often each engine's load is reported.
const LOAD_REPORT_INTERVAL: Duration = Duration::from_millis(100);

/// What one worker's engine reported.
#[derive(Debug, Default)]
pub(crate) struct WorkerStats {
    /// Requests it received.
    pub(crate) requests: AtomicU64,
    /// Prompt tokens of the requests it finished.
    pub(crate) prompt_tokens: AtomicU64,
    /// Of those, the tokens it found in its prefix cache.
    pub(crate) cached_tokens: AtomicU64,
    /// Response streams still open.
    pub(crate) in_flight: AtomicI64,
}

/// A [`LiveMocker`] that counts what it serves.
struct Counted {
    inner: Arc<LiveMocker>,
    stats: Arc<WorkerStats>,
}

/// Decrements a worker's open streams when the stream it rides is dropped.
struct Open(Arc<WorkerStats>);

impl Drop for Open {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Engine for Counted {
    type Request = PreprocessedRequest;
    type Response = LlmResponse;

    fn generate(
        &self,
        request: PreprocessedRequest,
        context: RequestContext,
    ) -> Result<ResponseStream<LlmResponse>, EngineError> {
        self.stats.requests.fetch_add(1, Ordering::Relaxed);
        self.stats.in_flight.fetch_add(1, Ordering::SeqCst);
        let open = Open(self.stats.clone());
        let stream = self.inner.generate(request, context)?;
        Ok(Box::pin(stream.map(move |item| {
            let stats = &open.0;
            if let Some(usage) = item.data.as_ref().and_then(|d| d.completion_usage.as_ref()) {
                let cached = usage
                    .prompt_tokens_details
                    .as_ref()
                    .and_then(|d| d.cached_tokens)
                    .unwrap_or(0);
                stats
                    .prompt_tokens
                    .fetch_add(u64::from(usage.prompt_tokens), Ordering::Relaxed);
                stats
                    .cached_tokens
                    .fetch_add(u64::from(cached), Ordering::Relaxed);
            }
            item
        })))
    }

    fn session_control(&self, control: SessionControl) -> Result<(), EngineError> {
        self.inner.session_control(control)
    }

    fn kv_dump(&self) -> Vec<KvCacheEvent> {
        self.inner.kv_dump()
    }
}

/// One running worker.
struct Worker {
    id: u64,
    stats: Arc<WorkerStats>,
    /// Reads the engine's load into reports on the event plane.
    _load: LoadSampler,
    _server: WorkerServer,
    _lease: Lease,
}

/// The simulated fleet: dropping it stops every worker.
pub(crate) struct Fleet {
    discovery: InProcessDiscovery,
    plane: Arc<InProcessEventPlane>,
    workers: Vec<Worker>,
    block_size: u32,
}

impl Fleet {
    /// Starts `n` workers (ids 1..=n) running `mocker`, each with its own seed.
    pub(crate) async fn start(n: usize, mocker: &MockerConfig) -> anyhow::Result<Self> {
        let discovery = InProcessDiscovery::new(Duration::from_secs(30));
        // Large enough that the router never lags behind a burst of KV events.
        let plane = Arc::new(InProcessEventPlane::new(1 << 16));
        let mut workers = Vec::with_capacity(n);
        for id in 1..=n as u64 {
            let publisher = KvEventPublisher::with_event_plane(
                id,
                DEFAULT_RING_CAPACITY,
                plane.clone() as Arc<dyn EventPlane>,
            );
            let config = MockerConfig {
                seed: mocker.seed.wrapping_add(id),
                ..mocker.clone()
            };
            let stats = Arc::new(WorkerStats::default());
            let live = Arc::new(
                LiveMocker::spawn(config, 0, publisher.clone())
                    .context("starting a simulated engine")?,
            );
            // The engine's own queue, reported as a `kvroute worker` does (more often: the
            // idle check at the end waits for it).
            let reporter = LoadReporter::new(id, LOAD_REPORT_INTERVAL);
            reporter.forward_to(plane.clone() as Arc<dyn EventPlane>);
            let sampled = live.clone();
            let load = spawn_load_sampler(reporter, LOAD_REPORT_INTERVAL, move || {
                let report = sampled.load_report();
                async move { anyhow::Ok(vec![report]) }
            });
            let engine = Counted {
                inner: live,
                stats: stats.clone(),
            };
            let server = WorkerServer::bind(
                "127.0.0.1:0",
                Arc::new(engine),
                WorkerServerConfig::new(id).with_kv_events(publisher),
            )
            .await
            .context("binding a worker on 127.0.0.1")?;
            let info = InstanceInfo::new(id, server.local_addr().to_string(), mocker.block_size);
            let lease = discovery
                .register(info)
                .await
                .context("registering a worker")?;
            workers.push(Worker {
                id,
                stats,
                _load: load,
                _server: server,
                _lease: lease,
            });
        }
        Ok(Self {
            discovery,
            plane,
            workers,
            block_size: mocker.block_size,
        })
    }

    /// Every worker's id and counters.
    pub(crate) fn stats(&self) -> impl Iterator<Item = (u64, &WorkerStats)> {
        self.workers.iter().map(|w| (w.id, &*w.stats))
    }
}

/// The router and its HTTP frontend, serving on 127.0.0.1.
pub(crate) struct Service {
    /// `http://127.0.0.1:PORT`.
    pub(crate) base: String,
    state: AppState,
    stop: oneshot::Sender<()>,
    task: JoinHandle<std::io::Result<()>>,
}

impl Service {
    /// Starts a router with `policy` over `fleet`, and its frontend on an ephemeral port.
    pub(crate) async fn start(fleet: &Fleet, policy: Policy, seed: u64) -> anyhow::Result<Self> {
        let mut config = KvPushRouterConfig::new(fleet.block_size);
        config.core.policy = policy;
        config.seed = seed;
        let router = KvPushRouter::start(
            config,
            fleet.discovery.watch(),
            fleet.plane.clone() as Arc<dyn EventPlane>,
        )
        .await
        .context("starting the router")?;
        let state = AppState::new(router, ModelRegistry::mock(MODEL), HttpConfig::default());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .context("binding the HTTP frontend on 127.0.0.1")?;
        let base = format!("http://{}", listener.local_addr()?);
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(serve(listener, state.clone(), async move {
            let _ = stopped.await;
        }));
        Ok(Self {
            base,
            state,
            stop,
            task,
        })
    }

    /// Stops the frontend (draining what is in flight) and the router.
    pub(crate) async fn shutdown(self) -> anyhow::Result<()> {
        let _ = self.stop.send(());
        self.task
            .await
            .context("the HTTP frontend panicked")?
            .context("the HTTP frontend failed")
    }

    /// Waits (up to two seconds) until the router, the frontend and every worker hold nothing,
    /// then checks the same through `/metrics`; fails naming every non-zero load otherwise.
    pub(crate) async fn check_idle(
        &self,
        fleet: &Fleet,
        client: &reqwest::Client,
    ) -> anyhow::Result<()> {
        let mut problems = Vec::new();
        for _ in 0..200 {
            problems = self.busy(fleet);
            if problems.is_empty() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let text = client
            .get(format!("{}/metrics", self.base))
            .send()
            .await
            .and_then(reqwest::Response::error_for_status)
            .context("GET /metrics")?
            .text()
            .await
            .context("reading /metrics")?;
        let gauges = nonzero_worker_gauges(&text);
        let seen = text.contains("kvroute_router_worker_active_requests{");
        if !seen {
            problems.push("/metrics lists no per-worker load gauge".to_owned());
        }
        problems.extend(gauges);
        if !problems.is_empty() {
            bail!(
                "the fleet is not idle after the workload drained (every request must free its \
                 load): {}",
                problems.join("; ")
            );
        }
        Ok(())
    }

    /// Every non-zero load, in words.
    fn busy(&self, fleet: &Fleet) -> Vec<String> {
        let mut problems = Vec::new();
        let in_flight = self.state.in_flight();
        if in_flight != 0 {
            problems.push(format!("the frontend holds {in_flight} requests"));
        }
        self.state.router().with_core(|core| {
            if core.active_requests() != 0 {
                problems.push(format!(
                    "the router tracks {} requests",
                    core.active_requests()
                ));
            }
            let workers: Vec<_> = core.workers().collect();
            for w in workers {
                match core.worker_load(w) {
                    Some(l)
                        if l.active_requests == 0
                            && l.prefill_tokens == 0
                            && l.decode_blocks == 0.0 => {}
                    Some(l) => problems.push(format!(
                        "worker {w}: {} requests, {} prefill tokens, {} decode blocks",
                        l.active_requests, l.prefill_tokens, l.decode_blocks
                    )),
                    None => problems.push(format!("worker {w}: no load record")),
                }
                match core.reported_load(w).and_then(|r| r.requests()) {
                    Some(0) => {}
                    Some(n) => problems.push(format!("worker {w}'s engine reports {n} requests")),
                    None => problems.push(format!("worker {w}'s engine has not reported its load")),
                }
            }
        });
        for (id, stats) in fleet.stats() {
            let open = stats.in_flight.load(Ordering::SeqCst);
            if open != 0 {
                problems.push(format!("worker {id} has {open} response streams open"));
            }
        }
        problems
    }
}

/// The per-worker load gauges of a Prometheus exposition that are not zero.
pub(crate) fn nonzero_worker_gauges(text: &str) -> Vec<String> {
    const GAUGES: [&str; 4] = [
        "kvroute_router_worker_active_requests{",
        "kvroute_router_worker_prefill_tokens{",
        "kvroute_router_worker_active_blocks{",
        "kvroute_router_worker_reported_requests{",
    ];
    text.lines()
        .filter(|line| GAUGES.iter().any(|g| line.starts_with(g)))
        .filter(|line| {
            line.rsplit(' ')
                .next()
                .and_then(|v| v.parse::<f64>().ok())
                .is_none_or(|v| v != 0.0)
        })
        .map(|line| format!("/metrics: {line}"))
        .collect()
}

#[cfg(test)]
mod tests;
