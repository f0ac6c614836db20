//! The OpenAI-compatible HTTP frontend (axum): `POST /v1/chat/completions` and
//! `POST /v1/completions` (streaming as server-sent events, or whole), `GET /v1/models` and
//! `GET /v1/models/{id}`,
//! `/health`, `/live` and `/metrics`.
//!
//! Build an [`AppState`] from a [`KvPushRouter`], the served models ([`ModelRegistry`]) and an
//! [`HttpConfig`]; [`app`] turns it into an axum `Router`, [`serve`] runs it on a listener until
//! a shutdown future resolves, then drains the requests in flight.
//!
//! A request goes: body (size-limited) → typed JSON ([`kvroute_protocols::from_json`], so a
//! wrong type names its JSON path) → `nvext` validation → routing headers applied over `nvext`
//! ([`kvroute_protocols::HeaderOverrides`]; an unparsable header is a 400) → model lookup (404)
//! → tokens (`nvext.token_data`, else the chat template and tokenizer; too many is a 413) →
//! admission (a bounded number in flight, a bounded wait: 429 or 503 with `Retry-After`) → the
//! KV router, with migration ([`Migrator`]) → the response. The SSE body owns the routed
//! stream, so a client that disconnects drops it, which cancels the request on its worker and
//! frees its load.
//!
//! With [`AppState::with_disagg`] the frontend serves disaggregated while prefill workers are
//! registered: the request goes through kvroute-prefill's `PrefillRouter` over a
//! [`KvPhaseRouter`] (prefill on a prefill worker, then decode), and `nvext.worker_id` names
//! both workers. Otherwise (no prefill worker, optional disaggregation) it takes the migrating
//! path above over the decode-phase router.
//!
//! A query-only request (`nvext.annotations` holding `query_instance_id:`) is answered with the
//! chosen worker in `nvext.worker_id` and the prompt's tokens in `nvext.token_ids`; nothing is
//! sent to a worker.

mod admission;
mod auth;
mod error;
mod handlers;
pub mod openai;
mod stop;
mod tls;

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::routing::{get, post};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use kvroute_prefill::{PrefillRouter, PrefillRouterConfig};
use kvroute_protocols::{Limits, RequestPhase};
use kvroute_runtime::InstanceSet;
use tokio::net::TcpListener;
use tokio::sync::watch;

pub use admission::AdmissionConfig;
pub use auth::{ApiKeyError, ApiKeys};
pub use error::ApiError;
pub use tls::{ServerTls, TlsError};

use crate::migration::{DEFAULT_MAX_MIGRATIONS, Migrator};
use crate::model::ModelRegistry;
use crate::phase::KvPhaseRouter;
use crate::push::KvPushRouter;

/// The frontend's limits and behaviour.
///
/// Memory held by request bodies is bounded: a body is read only after reserving its size (its
/// `Content-Length`, or `max_body_bytes` when the client does not say) from a budget of
/// `max_body_memory_bytes` shared by all connections, and the reservation is held until the
/// body is parsed. So raw bodies being read or parsed take at most `max_body_memory_bytes`
/// (default 256 MiB, 16 bodies of the default 16 MiB limit) however many clients send at once;
/// a request that finds the budget exhausted waits for it (up to `body_timeout`, then 503 with
/// `Retry-After`). A body above `max_body_bytes` is refused with 413 as soon as its
/// `Content-Length` says so, without reading it (or when the read passes the limit, without a
/// `Content-Length`). A client that does not send its headers within `header_timeout` has its
/// connection closed; one that does not send its whole body within `body_timeout` gets 408 and
/// the connection is closed.
#[derive(Debug, Clone, PartialEq)]
pub struct HttpConfig {
    /// Largest request body, in bytes (a larger one is refused with 413).
    pub max_body_bytes: usize,
    /// Bytes of request bodies being read and parsed at once, over all connections (at least
    /// `max_body_bytes` is used).
    pub max_body_memory_bytes: usize,
    /// How long a client may take to send a request's headers before its connection is closed.
    pub header_timeout: Duration,
    /// How long a client may take to send a request's body (408 after that).
    pub body_timeout: Duration,
    /// Longest prompt, in tokens (a longer one is refused with 413).
    pub max_prompt_tokens: usize,
    /// Validation limits of `nvext`.
    pub limits: Limits,
    /// Requests in flight and waiting.
    pub admission: AdmissionConfig,
    /// Interval of SSE keep-alive comments (they also reveal a client that went away).
    pub keep_alive: Duration,
    /// How many times a request moves to another worker when its worker dies mid-stream.
    pub max_migrations: u32,
    /// After a stop string, how long the worker has to end the stream once asked to stop
    /// gracefully; an engine that ignores the request is then cancelled (the answer, cut at the
    /// stop string, is complete either way).
    pub stop_grace: Duration,
}

impl Default for HttpConfig {
    fn default() -> Self {
        Self {
            max_body_bytes: 16 << 20,
            max_body_memory_bytes: 256 << 20,
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(30),
            max_prompt_tokens: 128 * 1024,
            limits: Limits::default(),
            admission: AdmissionConfig::default(),
            keep_alive: Duration::from_secs(15),
            max_migrations: DEFAULT_MAX_MIGRATIONS,
            stop_grace: Duration::from_secs(2),
        }
    }
}

/// Everything the handlers share. Cheap to clone.
#[derive(Clone)]
pub struct AppState {
    inner: Arc<Shared>,
    disagg: Option<Disagg>,
    extra_metrics: Option<ExtraMetrics>,
    api_keys: Option<ApiKeys>,
}

/// Produces OpenMetrics families (no `# EOF`) that `/metrics` appends to the router's own: the
/// state of the services around the router (the NATS connection, ...).
pub type ExtraMetrics = Arc<dyn Fn() -> String + Send + Sync>;

/// Disaggregated serving: the prefill router over the KV routers of both phases. Cheap to clone.
#[derive(Clone)]
pub struct Disagg {
    router: PrefillRouter<KvPhaseRouter>,
    prefill: KvPushRouter,
}

impl std::fmt::Debug for Disagg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Disagg")
            .field("mode", &self.router.config().mode)
            .finish_non_exhaustive()
    }
}

impl Disagg {
    /// Routes each phase with `phases`; active while `instances` (the unfiltered discovery
    /// watch) lists a prefill worker.
    pub fn new(
        phases: KvPhaseRouter,
        instances: watch::Receiver<InstanceSet>,
        config: PrefillRouterConfig,
    ) -> Self {
        let prefill = phases.router(RequestPhase::Prefill).clone();
        Self {
            router: PrefillRouter::new(Arc::new(phases), instances, config),
            prefill,
        }
    }

    /// The prefill router.
    pub fn router(&self) -> &PrefillRouter<KvPhaseRouter> {
        &self.router
    }

    /// The KV router of the prefill phase.
    pub fn prefill_router(&self) -> &KvPushRouter {
        &self.prefill
    }
}

struct Shared {
    migrator: Migrator,
    models: ModelRegistry,
    config: HttpConfig,
    admission: admission::Admission,
    bodies: handlers::BodyBudget,
    block_size: u32,
    next_id: AtomicU64,
    id_salt: u64,
}

impl std::fmt::Debug for AppState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AppState")
            .field("models", &self.inner.models.names().collect::<Vec<_>>())
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

impl AppState {
    /// The state of a frontend serving `models` through `router` (in disaggregated serving, the
    /// router of the decode phase, which also serves requests aggregated).
    pub fn new(router: KvPushRouter, models: ModelRegistry, config: HttpConfig) -> Self {
        let block_size = router.with_core(|c| c.block_size());
        let id_salt = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        Self {
            inner: Arc::new(Shared {
                migrator: Migrator::new(router, config.max_migrations),
                models,
                admission: admission::Admission::new(config.admission),
                bodies: handlers::BodyBudget::new(
                    config.max_body_bytes,
                    config.max_body_memory_bytes,
                ),
                config,
                block_size,
                next_id: AtomicU64::new(1),
                id_salt,
            }),
            disagg: None,
            extra_metrics: None,
            api_keys: None,
        }
    }

    /// This state, answering `/v1/*` only to clients that send one of `keys` as
    /// `Authorization: Bearer KEY` (401 otherwise); `/health`, `/live` and `/metrics` stay open.
    pub fn with_api_keys(mut self, keys: ApiKeys) -> Self {
        self.api_keys = Some(keys);
        self
    }

    /// The client keys, when authentication is on.
    pub fn api_keys(&self) -> Option<&ApiKeys> {
        self.api_keys.as_ref()
    }

    /// This state, with `metrics` appended to `/metrics` (OpenMetrics families whose names do
    /// not clash with the router's; counters named without `_total` in `# TYPE`, as OpenMetrics
    /// wants, since the Prometheus text format is derived from it).
    pub fn with_extra_metrics(mut self, metrics: ExtraMetrics) -> Self {
        self.extra_metrics = Some(metrics);
        self
    }

    /// The extra metrics' text, empty without any.
    pub(crate) fn extra_metrics_text(&self) -> String {
        self.extra_metrics.as_ref().map(|f| f()).unwrap_or_default()
    }

    /// This state, serving disaggregated through `disagg` while it is active (or always, when
    /// disaggregation is enforced).
    pub fn with_disagg(mut self, disagg: Disagg) -> Self {
        self.disagg = Some(disagg);
        self
    }

    /// Disaggregated serving, when configured.
    pub fn disagg(&self) -> Option<&Disagg> {
        self.disagg.as_ref()
    }

    /// The KV router underneath (of the decode phase when serving disaggregated).
    pub fn router(&self) -> &KvPushRouter {
        self.inner.migrator.router()
    }

    /// The served models.
    pub fn models(&self) -> &ModelRegistry {
        &self.inner.models
    }

    /// The configuration.
    pub fn config(&self) -> &HttpConfig {
        &self.inner.config
    }

    /// Requests admitted and not yet finished.
    pub fn in_flight(&self) -> usize {
        self.inner.admission.in_flight()
    }

    /// Bytes taken from the body budget ([`HttpConfig::max_body_memory_bytes`]) by bodies being
    /// read or parsed (and, in part, by a read waiting for the rest of its reservation).
    pub fn body_bytes_reserved(&self) -> usize {
        self.inner.bodies.reserved()
    }

    /// Requests waiting for the body budget before reading their body.
    pub fn body_reads_waiting(&self) -> usize {
        self.inner.bodies.waiting()
    }
}

/// The frontend's routes over `state`.
pub fn app(state: AppState) -> Router {
    let body_limit = state.inner.config.max_body_bytes;
    // The API: behind client authentication when keys are configured.
    let api = Router::new()
        .route("/v1/chat/completions", post(handlers::chat_completions))
        .route("/v1/completions", post(handlers::completions))
        .route("/v1/models", get(handlers::models))
        .route("/v1/models/{id}", get(handlers::model))
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            auth::require_key,
        ));
    Router::new()
        .merge(api)
        .route("/health", get(handlers::health))
        .route("/live", get(handlers::live))
        .route("/metrics", get(handlers::metrics))
        .fallback(handlers::not_found)
        .method_not_allowed_fallback(handlers::method_not_allowed)
        .layer(DefaultBodyLimit::max(body_limit))
        .with_state(state)
}

/// Serves [`app`] on `listener` (HTTP/1.1, `TCP_NODELAY`) until `shutdown` resolves, then
/// stops accepting and waits for the requests in flight (streams included) to end; idle
/// connections are closed. A connection whose client does not send a request's headers within
/// [`HttpConfig::header_timeout`] is closed.
pub async fn serve(
    listener: TcpListener,
    state: AppState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    serve_with(listener, state, None, shutdown).await
}

/// [`serve`] over TLS: each connection's TLS handshake must finish within
/// [`HttpConfig::header_timeout`], else it is closed; a failed handshake is logged at debug
/// level and costs nothing else.
pub async fn serve_tls(
    listener: TcpListener,
    state: AppState,
    tls: ServerTls,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    serve_with(listener, state, Some(tls), shutdown).await
}

async fn serve_with(
    listener: TcpListener,
    state: AppState,
    tls: Option<ServerTls>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let handshake_timeout = state.config().header_timeout;
    let acceptor = tls.as_ref().map(ServerTls::acceptor);
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(state.config().header_timeout);
    let app = app(state);
    let graceful = GracefulShutdown::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let tcp = tokio::select! {
            () = shutdown.as_mut() => break,
            accepted = listener.accept() => match accepted {
                Ok((tcp, _)) => tcp,
                Err(e) if is_connection_error(&e) => continue,
                Err(e) => {
                    // Out of descriptors, most likely: wait for some to be freed.
                    tracing::warn!(error = %e, "accepting an HTTP connection failed; retrying in 1s");
                    tokio::select! {
                        () = shutdown.as_mut() => break,
                        () = tokio::time::sleep(Duration::from_secs(1)) => continue,
                    }
                }
            },
        };
        // Tokens go out as small SSE writes: with Nagle's algorithm on, a write that follows an
        // unacknowledged one waits for the client's delayed ACK (40 ms on Linux), which would
        // put a 40 ms floor under the time to first token.
        let _ = tcp.set_nodelay(true);
        let service = TowerToHyperService::new(app.clone());
        match &acceptor {
            None => {
                let conn = graceful.watch(builder.serve_connection(TokioIo::new(tcp), service));
                tokio::spawn(async move {
                    if let Err(e) = conn.await {
                        tracing::debug!(error = %e, "HTTP connection ended with an error");
                    }
                });
            }
            Some(acceptor) => {
                let (acceptor, builder, watcher) =
                    (acceptor.clone(), builder.clone(), graceful.watcher());
                tokio::spawn(async move {
                    let stream =
                        match tokio::time::timeout(handshake_timeout, acceptor.accept(tcp)).await {
                            Ok(Ok(stream)) => stream,
                            Ok(Err(e)) => {
                                tracing::debug!(error = %e, "TLS handshake failed");
                                return;
                            }
                            Err(_) => {
                                tracing::debug!("TLS handshake timed out");
                                return;
                            }
                        };
                    let conn =
                        watcher.watch(builder.serve_connection(TokioIo::new(stream), service));
                    if let Err(e) = conn.await {
                        tracing::debug!(error = %e, "HTTPS connection ended with an error");
                    }
                });
            }
        }
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}

/// An accept error about one connection (the next accept may succeed at once).
fn is_connection_error(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::{ConnectionAborted, ConnectionRefused, ConnectionReset};
    matches!(
        e.kind(),
        ConnectionRefused | ConnectionAborted | ConnectionReset
    )
}
