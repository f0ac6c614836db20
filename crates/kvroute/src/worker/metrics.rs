//! What a worker observed ([`WorkerStats`], counted by [`CountingEngine`] around the engine),
//! served with the adapter's KV event counters as Prometheus text on `--metrics-listen`.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::Context as _;
use kvroute_protocols::kv_events::KvCacheEvent;
use kvroute_protocols::{PreprocessedRequest, SessionAction, SessionControl};
use kvroute_runtime::{
    Engine, EngineError, LlmEngine, LlmResponse, RequestContext, ResponseStream,
};
use parking_lot::Mutex;

use crate::adapter::Adapter;

/// What the worker observed, for `/metrics`.
#[derive(Debug)]
pub(super) struct WorkerStats {
    pub(super) requests: AtomicU64,
    pub(super) finished: AtomicU64,
    pub(super) session_opens: AtomicU64,
    pub(super) session_closes: AtomicU64,
    /// KV dumps asked by routers (a router that catches up from a durable stream asks none).
    pub(super) kv_dumps: AtomicU64,
    pub(super) sessions: Mutex<BTreeSet<String>>,
    /// 1 while the engine answers its health checks (always 1 for the simulator).
    pub(super) engine_up: AtomicU64,
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
    pub(super) fn in_flight(&self) -> u64 {
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
pub(super) struct CountingEngine<E> {
    pub(super) inner: Arc<E>,
    pub(super) stats: Arc<WorkerStats>,
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
pub(super) async fn serve_metrics(
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
