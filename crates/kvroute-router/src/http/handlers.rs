//! The endpoints: each parses and prepares its request ([`super::prepare`]), admits and routes
//! it, and answers through [`super::response`].

use std::time::Instant;

use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use kvroute_prefill::DisaggMode;
use serde_json::{Value, json};

use super::body::ReadBody;
use super::error::ApiError;
use super::prepare::{self, Prepared};
use super::response::{self, Output};
use super::state::AppState;
use crate::metrics::text::{merge_families, prometheus_text};
use crate::metrics::{ROUTER_DECODE, ROUTER_PREFILL};
use crate::migration::MigratingResponse;
use crate::push::is_query;

pub(crate) async fn chat_completions(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Result<ReadBody, ApiError>,
) -> Response {
    let received = Instant::now();
    match prepare::chat(&state, &headers, body, received) {
        Ok(p) => run(state, p).await,
        Err(e) => e.into_response(),
    }
}

pub(crate) async fn completions(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Result<ReadBody, ApiError>,
) -> Response {
    let received = Instant::now();
    match prepare::completion(&state, &headers, body, received) {
        Ok(p) => run(state, p).await,
        Err(e) => e.into_response(),
    }
}

/// 404 for a path the frontend does not serve, in OpenAI's error shape.
pub(crate) async fn not_found(uri: axum::http::Uri) -> Response {
    ApiError::not_found(format!(
        "no such endpoint: {}; this router serves /v1/chat/completions, /v1/completions, \
         /v1/models, /health, /live and /metrics",
        uri.path()
    ))
    .into_response()
}

/// 405 for a method a served path does not take, in OpenAI's error shape.
pub(crate) async fn method_not_allowed(
    method: axum::http::Method,
    uri: axum::http::Uri,
) -> Response {
    let expected = if uri.path().starts_with("/v1/") && uri.path().contains("completions") {
        "POST"
    } else {
        "GET"
    };
    ApiError::method_not_allowed(format!(
        "{method} is not allowed on {}; expected {expected}",
        uri.path()
    ))
    .into_response()
}

/// The OpenAI model object of a served model.
fn model_object(name: &str) -> Value {
    json!({"id": name, "object": "model", "created": 0, "owned_by": "kvroute"})
}

pub(crate) async fn models(State(state): State<AppState>) -> Response {
    let data: Vec<Value> = state.models().names().map(model_object).collect();
    axum::Json(json!({"object": "list", "data": data})).into_response()
}

/// `GET /v1/models/{id}`: the model object, or 404 `model_not_found`.
pub(crate) async fn model(State(state): State<AppState>, Path(id): Path<String>) -> Response {
    match state.models().get(&id) {
        Some(model) => axum::Json(model_object(&model.name)).into_response(),
        None => ApiError::unknown_model(&id).into_response(),
    }
}

pub(crate) async fn health(State(state): State<AppState>) -> Response {
    let prefill = state
        .disagg()
        .map_or(0, |d| d.prefill_router().with_core(|c| c.workers().count()));
    let workers = state.router().with_core(|c| c.workers().count()) + prefill;
    let healthy = workers > 0;
    let status = if healthy {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let body = json!({
        "status": if healthy { "healthy" } else { "unhealthy" },
        "workers": workers,
        "in_flight": state.in_flight(),
        "models": state.models().names().collect::<Vec<_>>(),
    });
    (status, axum::Json(body)).into_response()
}

pub(crate) async fn live() -> Response {
    axum::Json(json!({"status": "live"})).into_response()
}

/// The content type of the OpenMetrics text.
const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The content type of the Prometheus text format 0.0.4.
const PROMETHEUS_TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";

/// `GET /metrics`, negotiated on `Accept`: OpenMetrics 1.0 when the client accepts
/// `application/openmetrics-text` (as Prometheus does), else the Prometheus text format 0.0.4
/// ([`prometheus_text`]).
pub(crate) async fn metrics(State(state): State<AppState>, headers: HeaderMap) -> Response {
    let openmetrics = headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| v.contains("application/openmetrics-text"));
    for name in state.models().names() {
        if let Some(model) = state.models().get(name) {
            let encoder = model.tokenizer.encoder();
            state
                .router()
                .metrics()
                .set_tokenizer_encoder(name, encoder);
        }
    }
    let mut text = metrics_openmetrics(&state);
    let extra = state.extra_metrics_text();
    if !extra.is_empty() {
        let at = text.rfind("# EOF").unwrap_or(text.len());
        text.insert_str(at, &extra);
    }
    if openmetrics {
        ([(header::CONTENT_TYPE, OPENMETRICS)], text).into_response()
    } else {
        (
            [(header::CONTENT_TYPE, PROMETHEUS_TEXT)],
            prometheus_text(&text),
        )
            .into_response()
    }
}

/// The OpenMetrics text of the router (both routers', when serving disaggregated).
fn metrics_openmetrics(state: &AppState) -> String {
    // Serving disaggregated (while a prefill worker is registered, or always when enforced,
    // as `generate` decides): both routers, told apart by the `router` label. Otherwise the
    // decode-phase router serves alone and its text is the aggregated one, unlabelled.
    match state
        .disagg()
        .filter(|d| d.router().config().mode == DisaggMode::Enforced || d.router().is_active())
    {
        None => state.router().metrics_text(),
        Some(d) => merge_families(
            &state.router().metrics_text_labelled(ROUTER_DECODE),
            &d.prefill_router().metrics_text_labelled(ROUTER_PREFILL),
        ),
    }
}

/// Admits and routes a prepared request, and answers it.
async fn run(state: AppState, p: Prepared) -> Response {
    let retry = state.config().admission.retry_after;
    let permit = match state.inner.admission.admit().await {
        Ok(permit) => permit,
        Err(e) => return e.into_response(),
    };
    // Disaggregated while a prefill worker is registered (or always when enforced, so that the
    // prefill router refuses); a query is answered by the decode-phase router's `select`.
    let disagg = state.disagg().filter(|d| {
        !is_query(&p.request)
            && (d.router().config().mode == DisaggMode::Enforced || d.router().is_active())
    });
    let output = match disagg {
        Some(d) => match state
            .inner
            .migrator
            .generate_disagg(d.router(), &p.reply.meta.id, p.request.clone())
            .await
        {
            Ok(stream) => Output::Disagg(Box::new(stream)),
            Err(e) => return ApiError::from_prefill(&e, retry).into_response(),
        },
        None => match state.inner.migrator.generate(p.request.clone()).await {
            Ok(MigratingResponse::Query(answer)) => {
                drop(permit);
                return response::query_response(&p.reply, p.request.token_ids.len(), *answer);
            }
            Ok(MigratingResponse::Stream(stream)) => Output::Migrating(stream),
            Err(e) => {
                return ApiError::from_router(&e, retry)
                    .with_dp_rank_param(p.dp_rank_param)
                    .with_worker_param(p.worker_param)
                    .into_response();
            }
        },
    };
    response::respond(&state, p.reply, &p.request, output, permit).await
}
