//! Disaggregated serving against simulated engines: the prefill router over the KV routers of
//! both phases, with real `LiveMocker` prefill and decode workers served over TCP on loopback.
//!
//! Checks the paths the prefill router takes as the fleet changes: aggregated (or refused, when
//! disaggregation is enforced) while no prefill worker exists; prefill then decode with the
//! prefill's result once one registers; decode at once with a bootstrap room when the prefill
//! worker advertises a bootstrap server (the decode worker pulls the room); aggregated again once
//! the last prefill worker leaves. After each scenario every per-worker load on both routers is
//! zero. Every wait is bounded.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use kvroute_mocker::MockerConfig;
use kvroute_mocker::disagg::{BootstrapServer, DecodeConfig, Role};
use kvroute_mocker::live::LiveMocker;
use kvroute_prefill::{DisaggMode, PrefillError, PrefillRouter, PrefillRouterConfig, Served};
use kvroute_protocols::kv_events::KvCacheEvent;
use kvroute_protocols::{PreprocessedRequest, SessionControl, WorkerWithDpRank};
use kvroute_router::{KvPhaseRouter, KvPushRouter, KvPushRouterConfig, role_filtered};
use kvroute_runtime::{
    DEFAULT_RING_CAPACITY, Discovery as _, Engine, EngineError, EventPlane, InProcessDiscovery,
    InProcessEventPlane, InstanceInfo, KvEventPublisher, Lease, LlmResponse, RequestContext,
    ResponseStream, WorkerRole, WorkerServer, WorkerServerConfig,
};
use parking_lot::Mutex;

const BLOCK: u32 = 16;
const MAX_TOKENS: u32 = 4;
/// The bound on every wait: far above what any step takes, so only a hang reaches it.
const BOUND: Duration = Duration::from_secs(10);

fn mocker_config(seed: u64) -> MockerConfig {
    MockerConfig {
        block_size: BLOCK,
        num_blocks: 256,
        // Fast steps: the routing paths are under test, not the timing model.
        speedup: 100.0,
        seed,
        ..MockerConfig::default()
    }
}

/// A simulated engine that remembers every request it was sent.
struct Recording {
    inner: LiveMocker,
    seen: Arc<Mutex<Vec<PreprocessedRequest>>>,
}

impl Engine for Recording {
    type Request = PreprocessedRequest;
    type Response = LlmResponse;

    fn generate(
        &self,
        request: PreprocessedRequest,
        context: RequestContext,
    ) -> Result<ResponseStream<LlmResponse>, EngineError> {
        self.seen.lock().push(request.clone());
        self.inner.generate(request, context)
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
    seen: Arc<Mutex<Vec<PreprocessedRequest>>>,
    bootstrap: Option<BootstrapServer>,
    server: WorkerServer,
    lease: Option<Lease>,
}

impl Worker {
    fn requests(&self) -> Vec<PreprocessedRequest> {
        self.seen.lock().clone()
    }

    /// Stops serving and deregisters.
    fn leave(&mut self) {
        self.lease.take();
        self.server.abort();
    }
}

/// How a worker hands its KV over (a decode worker takes either, so it always gets `Result`).
#[derive(Clone, Copy, PartialEq)]
enum Handoff {
    /// Through its result, carried into the decode request.
    Result,
    /// Through a bootstrap server that decode workers pull rooms from.
    Bootstrap,
}

/// The workers, discovery, event plane, the KV routers of both phases and the prefill router.
struct Cluster {
    discovery: InProcessDiscovery,
    plane: Arc<InProcessEventPlane>,
    prefill: KvPushRouter,
    decode: KvPushRouter,
    router: PrefillRouter<KvPhaseRouter>,
}

impl Cluster {
    async fn start(mode: DisaggMode) -> Cluster {
        let discovery = InProcessDiscovery::new(Duration::from_secs(30));
        let plane = Arc::new(InProcessEventPlane::new(1 << 14));
        let watch = discovery.watch();
        let kv_router = |roles: &'static [WorkerRole]| {
            KvPushRouter::start(
                KvPushRouterConfig::new(BLOCK),
                role_filtered(watch.clone(), roles),
                plane.clone() as Arc<dyn EventPlane>,
            )
        };
        let prefill = kv_router(&[WorkerRole::Prefill]).await.expect("router");
        let decode = kv_router(&[WorkerRole::Decode, WorkerRole::Aggregated])
            .await
            .expect("router");
        let phases = Arc::new(KvPhaseRouter::new(prefill.clone(), decode.clone()));
        let router = PrefillRouter::new(
            phases,
            watch,
            PrefillRouterConfig::default().with_mode(mode),
        );
        Cluster {
            discovery,
            plane,
            prefill,
            decode,
            router,
        }
    }

    /// Starts worker `id` with `role` and registers it; waits until the KV router of its phase
    /// lists it, so that the next request can be routed to it.
    async fn add(&self, id: u64, role: WorkerRole, handoff: Handoff) -> Worker {
        let publisher = KvEventPublisher::with_event_plane(
            id,
            DEFAULT_RING_CAPACITY,
            self.plane.clone() as Arc<dyn EventPlane>,
        );
        let bootstrap = match handoff {
            Handoff::Bootstrap => Some(BootstrapServer::bind("127.0.0.1:0").await.expect("bind")),
            Handoff::Result => None,
        };
        let mocker_role = match role {
            WorkerRole::Prefill => Role::Prefill {
                worker_id: id,
                rooms: bootstrap.as_ref().map(BootstrapServer::rooms),
            },
            _ => Role::Decode(DecodeConfig {
                pull_timeout: BOUND,
                ..DecodeConfig::default()
            }),
        };
        let engine =
            LiveMocker::spawn_with_role(mocker_config(id), 0, publisher.clone(), mocker_role)
                .expect("valid mocker config");
        let seen = Arc::new(Mutex::new(Vec::new()));
        let engine = Arc::new(Recording {
            inner: engine,
            seen: seen.clone(),
        });
        let server = WorkerServer::bind(
            "127.0.0.1:0",
            engine,
            WorkerServerConfig::new(id).with_kv_events(publisher),
        )
        .await
        .expect("bind the worker on 127.0.0.1");
        let mut info =
            InstanceInfo::new(id, server.local_addr().to_string(), BLOCK).with_role(role);
        if let Some(bootstrap) = &bootstrap {
            info.metadata.extend(bootstrap.metadata());
        }
        let lease = self.discovery.register(info).await.expect("register");
        let router = self.phase_router(role).clone();
        eventually("the KV router lists the new worker", || {
            router.with_core(|c| c.has_worker(id))
        })
        .await;
        Worker {
            seen,
            bootstrap,
            server,
            lease: Some(lease),
        }
    }

    fn phase_router(&self, role: WorkerRole) -> &KvPushRouter {
        match role {
            WorkerRole::Prefill => &self.prefill,
            WorkerRole::Decode | WorkerRole::Aggregated => &self.decode,
        }
    }

    /// Serves one request through the prefill router, drains its stream (which must carry
    /// `MAX_TOKENS` tokens and no error) and returns how it was served.
    async fn serve(&self, id: &str, prompt: Vec<u32>) -> Result<Served, PrefillError> {
        let mut request = PreprocessedRequest::new("mock", prompt);
        request.stop_conditions.max_tokens = Some(MAX_TOKENS);
        let mut stream = bounded("routing", self.router.generate(id, request)).await?;
        let mut tokens = 0;
        bounded("the response stream", async {
            while let Some(item) = stream.next().await {
                assert!(!item.is_error(), "request {id}: error item {item:?}");
                tokens += item.data.map_or(0, |d| d.token_ids.len());
            }
        })
        .await;
        assert_eq!(tokens, MAX_TOKENS as usize, "request {id}: output tokens");
        Ok(stream.served().clone())
    }

    /// Waits until no request holds load on either router.
    async fn drained(&self) {
        let (prefill, decode) = (self.prefill.clone(), self.decode.clone());
        eventually("every per-worker load on both routers reads zero", || {
            idle(&prefill) && idle(&decode)
        })
        .await;
    }
}

fn prompt(seed: u32) -> Vec<u32> {
    (0..3 * BLOCK + 5).map(|t| seed * 1000 + t).collect()
}

/// Whether `router` tracks no request and every worker's load is zero.
fn idle(router: &KvPushRouter) -> bool {
    router.with_core(|core| {
        let workers: Vec<WorkerWithDpRank> = core.workers().collect();
        core.active_requests() == 0
            && core.scheduler().active_requests() == 0
            && workers.iter().all(|&w| {
                core.worker_load(w).is_some_and(|l| {
                    l.active_requests == 0 && l.prefill_tokens == 0 && l.decode_blocks == 0.0
                })
            })
    })
}

/// Waits (bounded) until `cond` holds.
async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + BOUND;
    while !cond() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting until {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Awaits `f`, failing the test if it takes longer than the bound.
async fn bounded<T>(what: &str, f: impl Future<Output = T>) -> T {
    tokio::time::timeout(BOUND, f)
        .await
        .unwrap_or_else(|_| panic!("timed out waiting for {what}"))
}

fn run<F: Future<Output = ()>>(f: F) {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime")
        .block_on(f);
}

#[test]
fn optional_disagg_activates_with_a_prefill_worker_and_deactivates_when_it_leaves() {
    run(async {
        let cluster = Cluster::start(DisaggMode::Optional).await;
        let decode = cluster.add(10, WorkerRole::Decode, Handoff::Result).await;

        // No prefill worker: the decode worker serves the request whole.
        assert!(!cluster.router.is_active());
        let served = cluster.serve("agg-1", prompt(1)).await.expect("served");
        assert_eq!(served, Served::Aggregated);
        let seen = decode.requests();
        assert_eq!(seen.len(), 1);
        assert!(seen[0].prefill_result.is_none() && seen[0].bootstrap_info.is_none());

        // A prefill worker registers: prefill (one token) there, then decode with its result.
        let mut prefill = cluster.add(1, WorkerRole::Prefill, Handoff::Result).await;
        assert!(bounded("activation", cluster.router.wait_active(true)).await);
        let served = cluster.serve("disagg-1", prompt(2)).await.expect("served");
        let prefill_worker = WorkerWithDpRank::new(1, 0);
        assert_eq!(
            served,
            Served::PrefillResult {
                prefill: prefill_worker
            }
        );
        let prefilled = prefill.requests();
        assert_eq!(prefilled.len(), 1);
        assert_eq!(prefilled[0].stop_conditions.max_tokens, Some(1));
        assert_eq!(prefilled[0].token_ids, prompt(2));
        let seen = decode.requests();
        assert_eq!(seen.len(), 2);
        let decoded = &seen[1];
        assert_eq!(decoded.token_ids, prompt(2));
        assert_eq!(decoded.stop_conditions.max_tokens, Some(MAX_TOKENS));
        let result = decoded.prefill_result.as_ref().expect("prefill_result");
        assert!(
            !result.disaggregated_params.is_null(),
            "the prefill worker's params reach the decode worker"
        );
        assert!(decoded.bootstrap_info.is_none());
        cluster.drained().await;

        // The last prefill worker leaves: aggregated again.
        prefill.leave();
        assert!(bounded("deactivation", cluster.router.wait_active(false)).await);
        assert!(!cluster.router.is_active());
        let served = cluster.serve("agg-2", prompt(3)).await.expect("served");
        assert_eq!(served, Served::Aggregated);
        assert_eq!(prefill.requests().len(), 1, "no prefill after it left");
        let seen = decode.requests();
        assert_eq!(seen.len(), 3);
        assert!(seen[2].prefill_result.is_none() && seen[2].bootstrap_info.is_none());
        cluster.drained().await;
    });
}

#[test]
fn enforced_disagg_refuses_without_prefill_workers_and_serves_once_one_registers() {
    run(async {
        let cluster = Cluster::start(DisaggMode::Enforced).await;
        let decode = cluster.add(10, WorkerRole::Decode, Handoff::Result).await;

        let refused = cluster.serve("refused-1", prompt(1)).await;
        assert_eq!(refused, Err(PrefillError::NotActivated));
        assert!(
            decode.requests().is_empty(),
            "nothing reaches the decode worker"
        );

        let mut prefill = cluster.add(1, WorkerRole::Prefill, Handoff::Result).await;
        assert!(bounded("activation", cluster.router.wait_active(true)).await);
        let served = cluster.serve("disagg-1", prompt(2)).await.expect("served");
        assert!(matches!(served, Served::PrefillResult { .. }), "{served:?}");
        assert_eq!(prefill.requests().len(), 1);
        assert_eq!(decode.requests().len(), 1);
        cluster.drained().await;

        prefill.leave();
        assert!(bounded("deactivation", cluster.router.wait_active(false)).await);
        let refused = cluster.serve("refused-2", prompt(3)).await;
        assert_eq!(refused, Err(PrefillError::NotActivated));
        assert_eq!(decode.requests().len(), 1);
        cluster.drained().await;
    });
}

#[test]
fn bootstrap_prefill_workers_let_decode_start_at_once_and_pull_the_room() {
    run(async {
        let cluster = Cluster::start(DisaggMode::Optional).await;
        let decode = cluster.add(10, WorkerRole::Decode, Handoff::Result).await;
        let prefill = cluster
            .add(1, WorkerRole::Prefill, Handoff::Bootstrap)
            .await;
        assert!(bounded("activation", cluster.router.wait_active(true)).await);
        let server = prefill.bootstrap.as_ref().expect("bootstrap server");

        for (i, id) in ["boot-1", "boot-2"].into_iter().enumerate() {
            let served = cluster
                .serve(id, prompt(10 + i as u32))
                .await
                .expect("served");
            let Served::Bootstrap {
                prefill: prefill_worker,
                info,
            } = served
            else {
                panic!("expected the bootstrap path, got {served:?}");
            };
            assert_eq!(prefill_worker, WorkerWithDpRank::new(1, 0));
            assert_eq!(info.bootstrap_host, server.local_addr().ip().to_string());
            assert_eq!(info.bootstrap_port, server.local_addr().port());

            // Both sides meet at the same room; the decode request carries no prefill result.
            let prefilled = prefill.requests();
            assert_eq!(prefilled.len(), i + 1);
            assert_eq!(prefilled[i].stop_conditions.max_tokens, Some(1));
            assert_eq!(prefilled[i].bootstrap_info.as_ref(), Some(&info));
            let decoded = decode.requests();
            assert_eq!(decoded.len(), i + 1);
            assert_eq!(decoded[i].bootstrap_info.as_ref(), Some(&info));
            assert!(decoded[i].prefill_result.is_none());
        }
        let rooms = server.rooms();
        // A room leaves the server only when the decode worker pulls it; one nobody pulled
        // would stay (ready) until its time to live.
        eventually("the decode worker pulled every room", || rooms.is_empty()).await;
        cluster.drained().await;
    });
}
