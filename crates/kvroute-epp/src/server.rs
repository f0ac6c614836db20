//! Serving the picker: the gRPC server (ext_proc and health) and the HTTP side (`/metrics`,
//! `/health`, `/live`).

use std::future::Future;
use std::pin::Pin;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use futures::Stream;
use serde_json::json;
use tokio::net::TcpListener;
use tonic::transport::server::TcpIncoming;
use tonic::{Request, Status, Streaming};
use tonic_health::ServingStatus;

use crate::exchange::Exchange;
use crate::picker::Picker;

/// The ext_proc service's name, as the gRPC health service knows it.
pub const EXT_PROC_SERVICE: &str = "envoy.service.ext_proc.v3.ExternalProcessor";

/// The picker's gRPC server failed.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// Binding or reading the listener failed.
    #[error("the endpoint picker's listener: {0}")]
    Io(#[from] std::io::Error),
    /// The gRPC server stopped with an error.
    #[error("the endpoint picker's gRPC server: {0}")]
    Transport(#[from] tonic::transport::Error),
}

/// Serves `picker` on `listener` (gRPC over HTTP/2 cleartext: the ext_proc service and the
/// health service) until `shutdown` resolves, then lets open streams finish.
///
/// Health: `liveness` is served from the start; `readiness` and [`EXT_PROC_SERVICE`] while at
/// least one worker has an endpoint.
pub async fn serve(
    listener: TcpListener,
    picker: Picker,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter
        .set_service_status("liveness", ServingStatus::Serving)
        .await;
    let mut ready = picker.endpoints().ready();
    let follow = tokio::spawn(async move {
        loop {
            let status = if *ready.borrow_and_update() > 0 {
                ServingStatus::Serving
            } else {
                ServingStatus::NotServing
            };
            reporter.set_service_status("readiness", status).await;
            reporter.set_service_status(EXT_PROC_SERVICE, status).await;
            reporter.set_service_status("", status).await;
            if ready.changed().await.is_err() {
                break;
            }
        }
    });
    // Small messages both ways on every request: Nagle's algorithm would hold them back.
    let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
    let result = tonic::transport::Server::builder()
        .add_service(health)
        .add_service(ExternalProcessorServer::new(picker))
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await;
    follow.abort();
    Ok(result?)
}

/// The picker's HTTP side: `/metrics` (the router's and the picker's, OpenMetrics), `/health`
/// (200 while at least one worker has an endpoint, else 503, with counts) and `/live`.
pub fn metrics_app(picker: Picker) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/health", get(health))
        .route(
            "/live",
            get(|| async { axum::Json(json!({"status": "live"})) }),
        )
        .with_state(picker)
}

async fn metrics(State(picker): State<Picker>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        picker.metrics_text(),
    )
        .into_response()
}

async fn health(State(picker): State<Picker>) -> Response {
    let table = picker.endpoints().table();
    let workers = picker.state().router().with_core(|c| c.workers().count());
    let healthy = !table.is_empty();
    let status = if healthy {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let unusable: Vec<_> = table
        .unusable()
        .iter()
        .map(|(w, why)| json!({"worker": w, "why": why}))
        .collect();
    let body = json!({
        "status": if healthy { "healthy" } else { "unhealthy" },
        "endpoints": table.len(),
        "workers": workers,
        "unusable": unusable,
        "in_flight": picker.state().in_flight(),
        "models": picker.state().models().names().collect::<Vec<_>>(),
    });
    (status, axum::Json(body)).into_response()
}

#[tonic::async_trait]
impl ExternalProcessor for Picker {
    type ProcessStream =
        Pin<Box<dyn Stream<Item = Result<ProcessingResponse, Status>> + Send + 'static>>;

    /// One stream, one request: each message from Envoy is answered in the order the protocol
    /// requires, on the stream's own task (no hop to another task and back). When Envoy closes
    /// the stream, or the connection breaks, the exchange is dropped, which frees what it held.
    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<tonic::Response<Self::ProcessStream>, Status> {
        let mut incoming = request.into_inner();
        let picker = self.clone();
        let answers = async_stream::stream! {
            let mut exchange = Exchange::new(picker);
            while let Ok(Some(message)) = incoming.message().await {
                for answer in exchange.on_message(message).await {
                    yield Ok(answer);
                }
                if exchange.finished() {
                    break;
                }
            }
        };
        Ok(tonic::Response::new(Box::pin(answers)))
    }
}
