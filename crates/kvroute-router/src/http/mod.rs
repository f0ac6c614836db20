//! The OpenAI-compatible HTTP frontend (axum): `POST /v1/chat/completions` and
//! `POST /v1/completions` (streaming as server-sent events, or whole), `GET /v1/models` and
//! `GET /v1/models/{id}`,
//! `/health`, `/live` and `/metrics`.
//!
//! Build an [`AppState`] from a [`KvPushRouter`](crate::KvPushRouter), the served models
//! ([`ModelRegistry`](crate::ModelRegistry)) and an [`HttpConfig`]; [`app`] turns it into an axum
//! `Router`, [`serve`] runs it on a listener until a shutdown future resolves, then drains the
//! requests in flight.
//!
//! A request goes: body (size-limited) → typed JSON ([`kvroute_protocols::from_json`], so a
//! wrong type names its JSON path) → `nvext` validation → routing headers applied over `nvext`
//! ([`kvroute_protocols::HeaderOverrides`]; an unparsable header is a 400) → model lookup (404)
//! → tokens (`nvext.token_data`, else the chat template and tokenizer; too many is a 413) →
//! admission (a bounded number in flight, a bounded wait: 429 or 503 with `Retry-After`) → the
//! KV router, with migration ([`Migrator`](crate::Migrator)) → the response. The SSE body owns
//! the routed stream, so a client that disconnects drops it, which cancels the request on its
//! worker and frees its load.
//!
//! With [`AppState::with_disagg`] the frontend serves disaggregated while prefill workers are
//! registered: the request goes through kvroute-prefill's `PrefillRouter` over a
//! [`KvPhaseRouter`](crate::KvPhaseRouter) (prefill on a prefill worker, then decode), and
//! `nvext.worker_id` names both workers. Otherwise (no prefill worker, optional
//! disaggregation) it takes the migrating path above over the decode-phase router.
//!
//! A query-only request (`nvext.annotations` holding `query_instance_id:`) is answered with the
//! chosen worker in `nvext.worker_id` and the prompt's tokens in `nvext.token_ids`; nothing is
//! sent to a worker.
//!
//! The rooms: `handlers` holds the endpoints only; `body` reads a body within its limits (the
//! body budget and the extractor); `prepare` turns a body into a request ready to route (checks,
//! tokenization, the worker request); `response` is the one place that decides what a response
//! says (text, finish reason, usage, timing) and writes it, whole or as server-sent events;
//! [`openai`] holds the request bodies; `state` and `config` what the handlers share.

mod admission;
mod auth;
mod body;
mod config;
mod error;
mod front;
mod handlers;
pub mod openai;
mod prepare;
mod response;
mod state;
mod stop;
mod tls;

use std::future::Future;
use std::time::Duration;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::routing::{get, post};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;

pub use admission::AdmissionConfig;
pub use auth::{ApiKeyError, ApiKeys};
pub use config::HttpConfig;
pub use error::ApiError;
pub use front::{AdmissionPermit, FrontRequest, OpenAiEndpoint};
pub use state::{AppState, Disagg, ExtraMetrics};
pub use tls::{ServerTls, TlsError};

/// The frontend's routes over `state`.
pub fn app(state: AppState) -> Router {
    let body_limit = state.config().max_body_bytes;
    // The API: behind client authentication when keys are configured.
    let api = Router::new()
        .route("/v1/chat/completions", post(handlers::chat_completions))
        .route("/v1/completions", post(handlers::completions))
        .route("/v1/models", get(handlers::models))
        .route("/v1/models/{id}", get(handlers::model))
        .route_layer(axum::middleware::from_fn_with_state(
            auth::KeyCheck::new(state.api_keys().cloned(), state.router().clone()),
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
