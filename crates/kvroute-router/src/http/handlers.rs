//! The request handlers: parse, validate, tokenize, admit, route, respond.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::{FromRequest, Path, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use kvroute_prefill::DisaggMode;
use kvroute_protocols::headers::{HEADER_DP_RANK, HEADER_WORKER_INSTANCE_ID};
use kvroute_protocols::{
    FinishReason, HeaderOverrides, LLMEngineOutput, NvExt, NvExtResponse, PreprocessedRequest,
    TimingInfo, WorkerIdInfo, WorkerWithDpRank, from_json,
};
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::stop::StopMatcher;
use crate::http::AppState;
use crate::http::admission::Permit;
use crate::http::error::ApiError;
use crate::http::openai::{
    CHAT_ROLES, ChatCompletionRequest, CompletionRequest, Content, Endpoint, Params, Prompt,
    ResponseMeta, finish_reason_str, usage,
};
use crate::metrics::{ROUTER_DECODE, ROUTER_PREFILL};
use crate::migration::{MigratingDisaggStream, MigratingResponse, MigratingStream};
use crate::model::Model;
use crate::push::{QueryAnswer, is_query};
use crate::tokenizer::{IncrementalDetokenizer, TemplateMessage};
use kvroute_runtime::{LlmResponse, RequestError};

/// A request ready to route.
struct Prepared {
    model: Arc<Model>,
    request: PreprocessedRequest,
    stream: bool,
    include_usage: bool,
    want_worker_id: bool,
    want_timing: bool,
    meta: ResponseMeta,
    received: Instant,
    received_unix_ms: u64,
    /// Where the pinned dp rank came from: the `x-dp-rank` header, else `nvext.dp_rank`.
    dp_rank_param: &'static str,
    /// Where the pinned worker came from: the `x-worker-instance-id` header, else
    /// `nvext.backend_instance_id`.
    worker_param: &'static str,
}

pub(crate) async fn chat_completions(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Result<ReadBody, ApiError>,
) -> Response {
    let received = Instant::now();
    let prepared = (|| {
        let req: ChatCompletionRequest = parse_body(body)?;
        refuse_unsupported(req.unsupported_parameter())?;
        check_roles(&req)?;
        let mut params = req.params();
        check_max_tokens(&state, "max_completion_tokens", req.max_completion_tokens)?;
        check_params(&state, &params)?;
        let model = lookup(&state, &req.model)?;
        let nvext = nvext_with_headers(&state, params.nvext.take(), &headers)?;
        let tokens = match nvext.as_ref().and_then(|e| e.token_data.clone()) {
            Some(tokens) => tokens,
            None => chat_tokens(&model, &req)?,
        };
        params.max_tokens = req.max_completion_tokens.or(params.max_tokens);
        prepare(
            &state,
            model,
            tokens,
            params,
            nvext,
            Endpoint::Chat,
            received,
        )
    })();
    match prepared {
        Ok(mut p) => {
            p.dp_rank_param = dp_rank_param(&headers);
            p.worker_param = worker_param(&headers);
            run(state, p).await
        }
        Err(e) => e.into_response(),
    }
}

pub(crate) async fn completions(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Result<ReadBody, ApiError>,
) -> Response {
    let received = Instant::now();
    let prepared = (|| {
        let req: CompletionRequest = parse_body(body)?;
        refuse_unsupported(req.unsupported_parameter())?;
        let mut params = req.params();
        check_params(&state, &params)?;
        let model = lookup(&state, &req.model)?;
        let nvext = nvext_with_headers(&state, params.nvext.take(), &headers)?;
        let tokens = match nvext.as_ref().and_then(|e| e.token_data.clone()) {
            Some(tokens) => tokens,
            None => prompt_tokens(&model, req.prompt)?,
        };
        prepare(
            &state,
            model,
            tokens,
            params,
            nvext,
            Endpoint::Completion,
            received,
        )
    })();
    match prepared {
        Ok(mut p) => {
            p.dp_rank_param = dp_rank_param(&headers);
            p.worker_param = worker_param(&headers);
            run(state, p).await
        }
        Err(e) => e.into_response(),
    }
}

/// The param naming a dp-rank pin: the header when the request set it, else the nvext field.
fn dp_rank_param(headers: &HeaderMap) -> &'static str {
    if headers.contains_key(HEADER_DP_RANK) {
        HEADER_DP_RANK
    } else {
        "nvext.dp_rank"
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

/// The param naming a worker pin: the header when the request set it, else the nvext field.
fn worker_param(headers: &HeaderMap) -> &'static str {
    if headers.contains_key(HEADER_WORKER_INSTANCE_ID) {
        HEADER_WORKER_INSTANCE_ID
    } else {
        "nvext.backend_instance_id"
    }
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

/// An OpenMetrics text in the Prometheus text format 0.0.4: no `# EOF`, no `# UNIT` lines, no
/// `_created` samples, and a counter's `# HELP` and `# TYPE` lines naming its `_total` samples
/// (OpenMetrics names the family without the suffix).
pub(crate) fn prometheus_text(openmetrics: &str) -> String {
    let mut counters = std::collections::HashSet::new();
    let mut created = std::collections::HashSet::new();
    for line in openmetrics.lines() {
        let Some(rest) = line.strip_prefix("# TYPE ") else {
            continue;
        };
        let mut parts = rest.split(' ');
        let (Some(name), Some(kind)) = (parts.next(), parts.next()) else {
            continue;
        };
        if kind == "counter" {
            counters.insert(name);
        }
        if matches!(kind, "counter" | "histogram" | "summary" | "gaugehistogram") {
            created.insert(name);
        }
    }
    let mut out = String::with_capacity(openmetrics.len());
    for line in openmetrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let meta = ["# HELP ", "# TYPE "]
            .into_iter()
            .find_map(|p| line.strip_prefix(p).map(|rest| (p, rest)));
        if let Some((prefix, rest)) = meta {
            let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
            if counters.contains(name) && !name.ends_with("_total") {
                out.push_str(&format!("{prefix}{name}_total {tail}\n"));
                continue;
            }
        } else if !line.starts_with('#') {
            let name = line.split(['{', ' ']).next().unwrap_or("");
            if name
                .strip_suffix("_created")
                .is_some_and(|family| created.contains(family))
            {
                continue;
            }
        }
        out.push_str(line);
        out.push('\n');
    }
    out
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

/// One metric family of an OpenMetrics text: its name (from `# HELP`, else `# TYPE`), its
/// metadata lines and its samples.
struct Family<'a> {
    name: &'a str,
    meta: Vec<&'a str>,
    samples: Vec<&'a str>,
}

/// The families of an OpenMetrics text, in order (up to `# EOF`). A family starts at a `# HELP`
/// or `# TYPE` line naming a family other than the current one.
fn families(text: &str) -> Vec<Family<'_>> {
    let mut out: Vec<Family<'_>> = Vec::new();
    for line in text.lines() {
        if line == "# EOF" {
            break;
        }
        let named = ["# HELP ", "# TYPE ", "# UNIT "]
            .iter()
            .find_map(|p| line.strip_prefix(p))
            .map(|rest| rest.split(' ').next().unwrap_or(""));
        match (named, out.last_mut()) {
            (Some(name), Some(f)) if f.name == name => f.meta.push(line),
            (Some(name), _) => out.push(Family {
                name,
                meta: vec![line],
                samples: Vec::new(),
            }),
            (None, Some(f)) => f.samples.push(line),
            // Samples before any metadata: a family of their own, without a name.
            (None, None) => out.push(Family {
                name: "",
                meta: Vec::new(),
                samples: vec![line],
            }),
        }
    }
    out
}

/// Two OpenMetrics texts (both routers' when serving disaggregated, whose samples carry
/// distinct `router` labels) as one: each family of `first` with its metadata once and
/// `second`'s samples of the same family right after `first`'s, so that every family stays
/// contiguous; families only `second` has follow, then a single `# EOF`.
pub(crate) fn merge_families(first: &str, second: &str) -> String {
    let first = families(first);
    let second = families(second);
    let mut out = String::new();
    let mut push = |line: &str| {
        out.push_str(line);
        out.push('\n');
    };
    for f in &first {
        f.meta.iter().chain(&f.samples).for_each(|l| push(l));
        for s in second.iter().filter(|s| s.name == f.name) {
            s.samples.iter().for_each(|l| push(l));
        }
    }
    for s in second
        .iter()
        .filter(|s| !first.iter().any(|f| f.name == s.name))
    {
        s.meta.iter().chain(&s.samples).for_each(|l| push(l));
    }
    push("# EOF");
    out
}

/// The body budget of [`crate::http::HttpConfig::max_body_memory_bytes`]: a semaphore of
/// bytes a body reserves before it is read and holds until it is parsed.
#[derive(Debug)]
pub(crate) struct BodyBudget {
    bytes: Arc<Semaphore>,
    total: usize,
    waiting: AtomicUsize,
}

impl BodyBudget {
    /// A budget of `max_memory` bytes, at least `max_body` (one largest body fits), at most
    /// `u32::MAX` (what a reservation can take at once).
    pub(crate) fn new(max_body: usize, max_memory: usize) -> Self {
        let total = max_memory.max(max_body).min(u32::MAX as usize);
        Self {
            bytes: Arc::new(Semaphore::new(total)),
            total,
            waiting: AtomicUsize::new(0),
        }
    }

    /// Bytes reserved now.
    pub(crate) fn reserved(&self) -> usize {
        self.total - self.bytes.available_permits()
    }

    /// Reservations waiting now.
    pub(crate) fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Relaxed)
    }

    /// Reserves `bytes` (at most the whole budget), waiting for them to be free.
    async fn reserve(&self, bytes: usize) -> OwnedSemaphorePermit {
        struct Waiting<'a>(&'a AtomicUsize);
        impl Drop for Waiting<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::Relaxed);
            }
        }
        self.waiting.fetch_add(1, Ordering::Relaxed);
        let _waiting = Waiting(&self.waiting);
        let n = u32::try_from(bytes.min(self.total)).unwrap_or(u32::MAX);
        self.bytes
            .clone()
            .acquire_many_owned(n)
            .await
            .expect("the body budget is never closed")
    }
}

/// A request body read within the frontend's limits, with its reservation of the body budget
/// (released when this is dropped, after parsing).
pub(crate) struct ReadBody {
    bytes: Bytes,
    _reservation: OwnedSemaphorePermit,
}

impl FromRequest<AppState> for ReadBody {
    type Rejection = ApiError;

    /// 413 when `Content-Length` exceeds `max_body_bytes`, before anything is buffered; else
    /// reserves the body's size (`max_body_bytes` without a `Content-Length`) from the budget,
    /// waiting up to `body_timeout` (503 after that), then reads the body within `body_timeout`
    /// (408 after that; 413 when a body without `Content-Length` passes the limit).
    ///
    /// A refused body is discarded (never buffered) up to [`DRAIN_FACTOR`] times the limit
    /// within `body_timeout` before the 413 goes out, so the client, which is usually still
    /// writing it, reads the answer instead of a reset, and the connection stays usable. A larger
    /// one is answered at once with `Connection: close`.
    async fn from_request(req: Request, state: &AppState) -> Result<Self, ApiError> {
        let config = state.config();
        let limit = config.max_body_bytes;
        let declared = req
            .headers()
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok());
        let drain_limit = limit.saturating_mul(DRAIN_FACTOR);
        if let Some(len) = declared
            && len > limit as u64
        {
            let error = body_too_large(&format!("Content-Length {len}"), limit);
            if len > drain_limit as u64 {
                return Err(error.closing());
            }
            let drained = discard_body(req, 0, drain_limit, config.body_timeout).await;
            return Err(if drained { error } else { error.closing() });
        }
        // `declared` fits in usize here: it is at most `limit`.
        let expected = declared.map_or(limit, |len| len as usize);
        let reservation =
            tokio::time::timeout(config.body_timeout, state.inner.bodies.reserve(expected))
                .await
                .map_err(|_| {
                    ApiError::unavailable(
                        "too many request bodies are being read; retry later",
                        config.admission.retry_after,
                    )
                })?;
        let mut body = req.into_body().into_data_stream();
        let read = async {
            let mut bytes = Vec::with_capacity(declared.map_or(0, |_| expected));
            while let Some(chunk) = body.next().await {
                let chunk = chunk.map_err(|e| {
                    ApiError::invalid(format!("failed to read the request body: {e}"), None)
                        .closing()
                })?;
                if bytes.len() + chunk.len() > limit {
                    let seen = bytes.len() + chunk.len();
                    drop(bytes);
                    let error = body_too_large("the body", limit);
                    let drained =
                        discard_stream(&mut body, seen, drain_limit, config.body_timeout).await;
                    return Err(if drained { error } else { error.closing() });
                }
                bytes.extend_from_slice(&chunk);
            }
            Ok(Bytes::from(bytes))
        };
        let bytes = tokio::time::timeout(config.body_timeout, read)
            .await
            .map_err(|_| ApiError {
                status: StatusCode::REQUEST_TIMEOUT,
                message: format!(
                    "the request body was not received within body_timeout ({:?})",
                    config.body_timeout
                ),
                kind: "invalid_request_error",
                param: None,
                code: Some("request_timeout"),
                retry_after: None,
                close_connection: true,
            })??;
        Ok(Self {
            bytes,
            _reservation: reservation,
        })
    }
}

/// How far past `max_body_bytes` a refused body is still read (and thrown away) so that its
/// client gets the 413 cleanly; see [`ReadBody`].
const DRAIN_FACTOR: usize = 4;

/// Reads and throws away `req`'s body; see [`discard_stream`].
async fn discard_body(req: Request, seen: usize, limit: usize, timeout: Duration) -> bool {
    let mut body = req.into_body().into_data_stream();
    discard_stream(&mut body, seen, limit, timeout).await
}

/// Reads and throws away the rest of a body of which `seen` bytes were read: true when it
/// ended within `limit` bytes in all and within `timeout`, so the connection can carry the
/// answer and the next request.
async fn discard_stream(
    body: &mut axum::body::BodyDataStream,
    mut seen: usize,
    limit: usize,
    timeout: Duration,
) -> bool {
    let drain = async {
        while let Some(chunk) = body.next().await {
            let Ok(chunk) = chunk else { return false };
            seen = seen.saturating_add(chunk.len());
            if seen > limit {
                return false;
            }
        }
        true
    };
    tokio::time::timeout(timeout, drain).await.unwrap_or(false)
}

/// 413 naming the `max_body_bytes` limit `what` exceeds.
fn body_too_large(what: &str, limit: usize) -> ApiError {
    ApiError::too_large(
        format!("request body too large: {what} exceeds max_body_bytes ({limit} bytes)"),
        "request_too_large",
    )
}

/// The typed request of a body; its reservation of the body budget ends with this call.
fn parse_body<T: DeserializeOwned>(body: Result<ReadBody, ApiError>) -> Result<T, ApiError> {
    let body = body?;
    from_json(&body.bytes).map_err(|e| ApiError::from_protocol(&e, false))
}

/// 400 for a parameter of [`crate::http::openai::UNSUPPORTED_PARAMETERS`] the request sets.
fn refuse_unsupported(param: Option<&'static str>) -> Result<(), ApiError> {
    match param {
        None => Ok(()),
        Some(name) => Err(ApiError::invalid(
            format!("`{name}` is not supported by this router"),
            Some(name.to_owned()),
        )),
    }
}

/// 400 for a message whose role is not one of [`CHAT_ROLES`].
fn check_roles(req: &ChatCompletionRequest) -> Result<(), ApiError> {
    match req
        .messages
        .iter()
        .enumerate()
        .find(|(_, m)| !CHAT_ROLES.contains(&m.role.as_str()))
    {
        None => Ok(()),
        Some((i, m)) => Err(ApiError::invalid(
            format!(
                "role must be one of {}, got {:?}",
                CHAT_ROLES.join(", "),
                m.role
            ),
            Some(format!("messages[{i}].role")),
        )),
    }
}

/// 400 unless `value` (of the parameter `name`) is within 1..=`max_prompt_tokens`: the router
/// knows no model's context length, so the configured longest prompt bounds the output too.
fn check_max_tokens(state: &AppState, name: &str, value: Option<u32>) -> Result<(), ApiError> {
    let max = state.config().max_prompt_tokens;
    match value {
        Some(v) if v == 0 || v as usize > max => Err(ApiError::invalid(
            format!("{name} must be between 1 and {max}, got {v}"),
            Some(name.to_owned()),
        )),
        _ => Ok(()),
    }
}

/// 400 for a generation parameter out of its range (the ranges of OpenAI and vLLM).
fn check_params(state: &AppState, params: &Params) -> Result<(), ApiError> {
    check_max_tokens(state, "max_tokens", params.max_tokens)?;
    let check = |name: &str, value: Option<f32>, ok: fn(f32) -> bool, range: &str| match value {
        Some(v) if !v.is_finite() => Err(ApiError::invalid(
            format!("{name} must be {range}, got a number too large to read"),
            Some(name.to_owned()),
        )),
        Some(v) if !ok(v) => Err(ApiError::invalid(
            format!("{name} must be {range}, got {v}"),
            Some(name.to_owned()),
        )),
        _ => Ok(()),
    };
    check(
        "temperature",
        params.temperature,
        |v| (0.0..=2.0).contains(&v),
        "between 0 and 2",
    )?;
    check("top_p", params.top_p, |v| v > 0.0 && v <= 1.0, "in (0, 1]")?;
    check(
        "presence_penalty",
        params.presence_penalty,
        |v| (-2.0..=2.0).contains(&v),
        "between -2 and 2",
    )?;
    check(
        "frequency_penalty",
        params.frequency_penalty,
        |v| (-2.0..=2.0).contains(&v),
        "between -2 and 2",
    )?;
    check(
        "repetition_penalty",
        params.repetition_penalty,
        |v| v > 0.0,
        "greater than 0",
    )?;
    match params.top_k {
        Some(k) if k < -1 => Err(ApiError::invalid(
            format!("top_k must be -1 (disabled) or at least 0, got {k}"),
            Some("top_k".to_owned()),
        )),
        _ => Ok(()),
    }
}

fn lookup(state: &AppState, name: &str) -> Result<Arc<Model>, ApiError> {
    state
        .models()
        .get(name)
        .cloned()
        .ok_or_else(|| ApiError::unknown_model(name))
}

fn nvext_with_headers(
    state: &AppState,
    nvext: Option<NvExt>,
    headers: &HeaderMap,
) -> Result<Option<NvExt>, ApiError> {
    if let Some(ext) = &nvext {
        ext.validate(&state.config().limits)
            .map_err(|e| ApiError::from_protocol(&e, true))?;
    }
    let overrides =
        HeaderOverrides::from_headers(headers.iter().map(|(n, v)| (n.as_str(), v.as_bytes())))
            .map_err(|e| ApiError::from_protocol(&e, false))?;
    Ok(overrides.apply(nvext))
}

fn chat_tokens(model: &Model, req: &ChatCompletionRequest) -> Result<Vec<u32>, ApiError> {
    if req.messages.is_empty() {
        return Err(ApiError::invalid(
            "messages must hold at least one message",
            Some("messages".to_owned()),
        ));
    }
    let mut messages = Vec::with_capacity(req.messages.len());
    for (i, m) in req.messages.iter().enumerate() {
        let content = match &m.content {
            None => String::new(),
            Some(Content::Text(t)) => t.clone(),
            Some(Content::Parts(parts)) => {
                let mut text = String::new();
                for (j, part) in parts.iter().enumerate() {
                    match (part.kind.as_str(), &part.text) {
                        ("text", Some(t)) => text.push_str(t),
                        _ => {
                            return Err(ApiError::invalid(
                                format!(
                                    "content parts must be {{\"type\": \"text\", \"text\": ...}}, \
                                     got type {:?}",
                                    part.kind
                                ),
                                Some(format!("messages[{i}].content[{j}]")),
                            ));
                        }
                    }
                }
                text
            }
        };
        messages.push(TemplateMessage {
            role: m.role.clone(),
            content,
        });
    }
    let use_raw = false;
    let text = model
        .template
        .render(&messages, !use_raw)
        .map_err(|e| ApiError::from_tokenizer(&e))?;
    model
        .tokenizer
        .encode(&text)
        .map_err(|e| ApiError::from_tokenizer(&e))
}

fn prompt_tokens(model: &Model, prompt: Prompt) -> Result<Vec<u32>, ApiError> {
    let one = |n: usize| {
        if n == 1 {
            Ok(())
        } else {
            Err(ApiError::invalid(
                format!("prompt must be one prompt (batches are not served), got {n}"),
                Some("prompt".to_owned()),
            ))
        }
    };
    let text = match prompt {
        Prompt::Tokens(tokens) => return Ok(tokens),
        Prompt::TokenBatches(mut batch) => {
            one(batch.len())?;
            return Ok(batch.swap_remove(0));
        }
        Prompt::Text(text) => text,
        Prompt::Texts(mut texts) => {
            one(texts.len())?;
            texts.swap_remove(0)
        }
    };
    model
        .tokenizer
        .encode(&text)
        .map_err(|e| ApiError::invalid(e.to_string(), Some("prompt".to_owned())))
}

fn prepare(
    state: &AppState,
    model: Arc<Model>,
    tokens: Vec<u32>,
    params: Params,
    nvext: Option<NvExt>,
    endpoint: Endpoint,
    received: Instant,
) -> Result<Prepared, ApiError> {
    if params.n.is_some_and(|n| n != 1) {
        return Err(ApiError::invalid(
            "n must be 1 (one choice per request)",
            Some("n".to_owned()),
        ));
    }
    if tokens.is_empty() {
        return Err(ApiError::invalid(
            "the prompt must hold at least one token",
            Some("prompt".to_owned()),
        ));
    }
    let max = state.config().max_prompt_tokens;
    if tokens.len() > max {
        return Err(ApiError::too_large(
            format!(
                "the prompt has {} tokens, more than the limit of {max}",
                tokens.len()
            ),
            "context_length_exceeded",
        ));
    }
    let want = |field: &str| nvext.as_ref().is_some_and(|e| e.wants_extra_field(field));
    let (want_worker_id, want_timing) = (want("worker_id"), want("timing"));
    let mut req = PreprocessedRequest::new(model.name.clone(), tokens);
    req.eos_token_ids = model.eos_token_ids.clone();
    if let Some(salt) = params.cache_salt.as_deref().filter(|s| !s.is_empty()) {
        req.set_cache_salt(salt);
    }
    let stop = &mut req.stop_conditions;
    stop.max_tokens = params.max_tokens;
    stop.min_tokens = params.min_tokens;
    stop.stop = params.stop.map(|s| s.into_vec());
    stop.ignore_eos = params.ignore_eos;
    let sampling = &mut req.sampling_options;
    sampling.n = params.n;
    sampling.temperature = params.temperature;
    sampling.top_p = params.top_p;
    sampling.top_k = params.top_k;
    sampling.seed = params.seed;
    sampling.presence_penalty = params.presence_penalty;
    sampling.frequency_penalty = params.frequency_penalty;
    sampling.repetition_penalty = params.repetition_penalty;
    sampling.include_stop_str_in_output = params.include_stop_str_in_output;
    if let Some(ext) = nvext {
        if ext.greed_sampling == Some(true) {
            // Greedy decoding in every dialect: temperature 0 and the single most likely token.
            req.sampling_options.temperature = Some(0.0);
            req.sampling_options.top_k = Some(1);
        }
        req.stop_conditions.max_thinking_tokens = ext.max_thinking_tokens;
        req.annotations = ext.annotations.unwrap_or_default();
        req.request_timestamp_ms = ext.request_timestamp_ms;
        let hints = req.routing_mut();
        hints.backend_instance_id = ext.backend_instance_id;
        hints.prefill_worker_id = ext.prefill_worker_id;
        hints.decode_worker_id = ext.decode_worker_id;
        hints.dp_rank = ext.dp_rank;
        hints.prefill_dp_rank = ext.prefill_dp_rank;
        hints.expected_output_tokens = ext.agent_hints.as_ref().and_then(|h| h.osl);
        hints.priority = ext.agent_hints.as_ref().and_then(|h| h.priority);
        hints.session_control = ext.session_control;
        hints.routing_constraints = ext.routing_constraints;
    }
    if let Some(adapter) = &model.lora_name {
        req.routing_mut().lora_name = Some(adapter.clone());
    }
    let n = state.inner.next_id.fetch_add(1, Ordering::Relaxed);
    let hash = xxhash_rust::xxh3::xxh3_64_with_seed(&n.to_le_bytes(), state.inner.id_salt);
    let prefix = match endpoint {
        Endpoint::Chat => "chatcmpl",
        Endpoint::Completion => "cmpl",
    };
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    Ok(Prepared {
        meta: ResponseMeta {
            id: format!("{prefix}-{hash:016x}{n:x}"),
            created: now.as_secs(),
            model: model.name.clone(),
            endpoint,
        },
        model,
        request: req,
        stream: params.stream.unwrap_or(false),
        include_usage: params.stream_options.is_some_and(|o| o.include_usage),
        want_worker_id,
        want_timing,
        received,
        received_unix_ms: u64::try_from(now.as_millis()).unwrap_or(u64::MAX),
        dp_rank_param: "nvext.dp_rank",
        worker_param: "nvext.backend_instance_id",
    })
}

async fn run(state: AppState, p: Prepared) -> Response {
    let retry = state.config().admission.retry_after;
    let permit = match state.inner.admission.admit().await {
        Ok(permit) => permit,
        Err(e) => return e.into_response(),
    };
    let prompt_len = p.request.token_ids.len();
    // Disaggregated while a prefill worker is registered (or always when enforced, so that the
    // prefill router refuses); a query is answered by the decode-phase router's `select`.
    let disagg = state.disagg().filter(|d| {
        !is_query(&p.request)
            && (d.router().config().mode == DisaggMode::Enforced || d.router().is_active())
    });
    let response = match disagg {
        Some(d) => match state
            .inner
            .migrator
            .generate_disagg(d.router(), &p.meta.id, p.request.clone())
            .await
        {
            Ok(stream) => Output::Disagg(Box::new(stream)),
            Err(e) => return ApiError::from_prefill(&e, retry).into_response(),
        },
        None => match state.inner.migrator.generate(p.request.clone()).await {
            Ok(MigratingResponse::Query(answer)) => {
                drop(permit);
                return query_response(&p, *answer);
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
    let stream = response;
    let hit_rate = match &stream {
        Output::Migrating(s) => Some(
            s.first_decision()
                .predicted_hit_rate(state.inner.block_size),
        ),
        Output::Disagg(_) => None,
    };
    let track = Tracker::new(&p, hit_rate, prompt_len);
    if p.stream {
        // The status line waits for the first item (engines send nothing before their first
        // token either), so that a request failed before any output gets its real status (an
        // engine's 4xx, a 503, a 504) instead of a 200 whose stream carries the error.
        let mut stream = stream;
        let first = stream.next().await;
        match &first {
            Some(Err(e)) => return ApiError::from_stream(e, retry).into_response(),
            Some(Ok(item)) => {
                if let Some(failure) = EngineFailure::of(item) {
                    return failure.api_error().into_response();
                }
            }
            None => {}
        }
        sse_response(&state, p, (first, stream), track, permit)
    } else {
        whole_response(&state, p, stream, track).await
    }
}

fn query_response(p: &Prepared, answer: QueryAnswer) -> Response {
    let ext = NvExtResponse {
        worker_id: Some(worker_info(answer.worker)),
        timing: None,
        token_ids: Some(answer.token_ids),
    };
    let ext = serde_json::to_value(ext).ok();
    if p.stream {
        let chunk = p.meta.chunk(Some(""), true, Some("stop"), ext);
        let events = futures::stream::iter([
            Ok::<_, Infallible>(Event::default().data(chunk.to_string())),
            Ok(Event::default().data("[DONE]")),
        ]);
        Sse::new(events).into_response()
    } else {
        let prompt = p.request.token_ids.len();
        axum::Json(p.meta.response("", "stop", usage(prompt, 0, None), ext)).into_response()
    }
}

/// The response stream of one request, however it was routed.
enum Output {
    /// Aggregated, through the migrator.
    Migrating(Box<MigratingStream>),
    /// Through the prefill router (disaggregated, or its aggregated fallback).
    Disagg(Box<MigratingDisaggStream>),
}

impl Output {
    /// Asks the worker to finish gracefully (a stop string ended the text). Disaggregated, the
    /// decode worker is left to finish by itself: engines apply `stop` themselves too, and the
    /// rest of its output is neither sent nor counted.
    fn stop_generating(&mut self) {
        if let Output::Migrating(s) = self {
            s.stop_generating();
        }
    }

    async fn next(&mut self) -> Option<Result<LlmResponse, RequestError>> {
        match self {
            Output::Migrating(s) => s.next().await,
            Output::Disagg(s) => s.next().await,
        }
    }

    /// The workers serving the request: the prefill worker is the decode worker when prefill
    /// did not run on a worker of its own.
    fn workers(&self) -> WorkerIdInfo {
        match self {
            Output::Migrating(s) => worker_info(s.worker()),
            Output::Disagg(s) => {
                let decode = s.worker();
                let prefill = s.prefill_worker().unwrap_or(decode);
                WorkerIdInfo {
                    prefill_worker_id: Some(prefill.worker_id),
                    prefill_dp_rank: Some(prefill.dp_rank),
                    decode_worker_id: Some(decode.worker_id),
                    decode_dp_rank: Some(decode.dp_rank),
                }
            }
        }
    }

    /// The cached prompt tokens the prefill worker reported, when prefill ran on one (read once
    /// the stream has ended, when they are known on every path).
    fn prefill_cached_tokens(&self) -> Option<u32> {
        match self {
            Output::Migrating(_) => None,
            Output::Disagg(s) => s.prefill_tokens_details().and_then(|d| d.cached_tokens),
        }
    }
}

fn worker_info(w: WorkerWithDpRank) -> WorkerIdInfo {
    WorkerIdInfo {
        prefill_worker_id: Some(w.worker_id),
        prefill_dp_rank: Some(w.dp_rank),
        decode_worker_id: Some(w.worker_id),
        decode_dp_rank: Some(w.dp_rank),
    }
}

/// What one request has produced so far, for text, usage, timing and the finish reason.
///
/// `prompt_tokens` and `completion_tokens` are the router's own counts (it tokenized the prompt
/// and counts the tokens it relays); from the engines it takes only the cached prompt tokens
/// (`completion_usage.prompt_tokens_details.cached_tokens`), which it cannot know itself.
struct Tracker {
    model: Arc<Model>,
    detok: IncrementalDetokenizer,
    prompt_tokens: usize,
    completion_tokens: usize,
    /// The first cached-token count an engine streaming the output reported, if any did.
    cached_tokens: Option<u32>,
    finish: Option<FinishReason>,
    received: Instant,
    received_unix_ms: u64,
    sent: Instant,
    first: Option<Instant>,
    last: Option<Instant>,
    hit_rate: Option<f64>,
    max_tokens: Option<u32>,
    /// The request's stop strings, applied to the text sent.
    stop: StopMatcher,
    /// Text that came without token ids (an `openai`-dialect engine), for counting its tokens
    /// when the engine reports no usage.
    untokenized: String,
    /// The output tokens the engine last reported in its usage.
    reported_completion_tokens: Option<u32>,
}

/// What one engine item became.
enum Step {
    /// Text to send (possibly empty).
    Text(String),
    /// The engine failed the request.
    Failed(EngineFailure),
}

/// An engine's failure of a request, as an error item said it.
struct EngineFailure {
    message: String,
    /// The HTTP status the engine answered with, when it refused the request over HTTP.
    status: Option<u16>,
    /// The OpenAI error code it implies (`context_length_exceeded`).
    code: Option<String>,
}

impl EngineFailure {
    /// The failure `item` reports: an error item, or an output finished with an error.
    fn of(item: &LlmResponse) -> Option<Self> {
        if item.is_error() {
            return Some(Self {
                message: item.error_message().unwrap_or("engine error").to_owned(),
                status: item.error_status(),
                code: item.error_code().map(str::to_owned),
            });
        }
        match item.data.as_ref().and_then(|d| d.finish_reason.as_ref()) {
            Some(FinishReason::Error(message)) => Some(Self {
                message: message.clone(),
                status: None,
                code: None,
            }),
            _ => None,
        }
    }

    /// The client's answer: an engine's 4xx keeps its status (the request is at fault, and
    /// clients must not retry it); anything else the engine failed is a 502.
    fn api_error(&self) -> ApiError {
        let message = format!("the engine failed the request: {}", self.message);
        match self.status {
            Some(status) if (400..500).contains(&status) && status != 429 => {
                ApiError::engine_refused(status, message, self.code.clone())
            }
            _ => ApiError::bad_gateway(message),
        }
    }
}

impl Tracker {
    fn new(p: &Prepared, hit_rate: Option<f64>, prompt_tokens: usize) -> Self {
        Self {
            model: p.model.clone(),
            detok: IncrementalDetokenizer::new(),
            prompt_tokens,
            completion_tokens: 0,
            untokenized: String::new(),
            reported_completion_tokens: None,
            cached_tokens: None,
            finish: None,
            received: p.received,
            received_unix_ms: p.received_unix_ms,
            sent: Instant::now(),
            first: None,
            last: None,
            hit_rate,
            max_tokens: p.request.stop_conditions.max_tokens,
            stop: StopMatcher::new(
                p.request
                    .stop_conditions
                    .stop
                    .as_deref()
                    .unwrap_or_default(),
                p.request
                    .sampling_options
                    .include_stop_str_in_output
                    .unwrap_or(false),
            ),
        }
    }

    /// Whether a stop string ended the text (the worker should be asked to stop).
    fn stopped(&self) -> bool {
        self.stop.matched()
    }

    /// The text held back in case it began a stop string, once the output has ended.
    fn finish_text(&mut self) -> String {
        self.stop.finish()
    }

    fn on_item(&mut self, item: &kvroute_runtime::LlmResponse) -> Step {
        if let Some(failure) = EngineFailure::of(item) {
            return Step::Failed(failure);
        }
        let Some(data) = &item.data else {
            return Step::Text(String::new());
        };
        Step::Text(self.on_output(data))
    }

    fn on_output(&mut self, data: &LLMEngineOutput) -> String {
        // After a stop string, the engine's further output is neither sent nor counted, and the
        // request has finished with `stop` whatever the engine says.
        let stopped = self.stop.matched();
        let text_only =
            data.token_ids.is_empty() && data.text.as_deref().is_some_and(|t| !t.is_empty());
        if (!data.token_ids.is_empty() || text_only) && !stopped {
            let now = Instant::now();
            self.first.get_or_insert(now);
            self.last = Some(now);
            self.completion_tokens += data.token_ids.len();
        }
        if let Some(usage) = data.completion_usage {
            self.reported_completion_tokens = Some(usage.completion_tokens);
        }
        if data.finish_reason.is_some() && !stopped {
            self.finish = data.finish_reason.clone();
        }
        // The first report wins. Engines report usage on their last item, and across a migration
        // the worker that took over reports over its continuation prompt (the client's prompt
        // plus the tokens generated before the move), while `cached_tokens` means cached tokens
        // of the client's prompt: a first worker that did report (on an earlier item) measured
        // exactly that. A later worker's count is used when no earlier one reported (the usual
        // case: a lost worker sends no last item) and is capped at the prompt's length in
        // `usage`; since prefix caching hits a prefix, the cap leaves exactly the client's
        // prompt tokens found cached. Disaggregated, the items are the decode worker's, whose
        // count `usage` uses only when the prefill worker reported none: the prompt's cache
        // hits happen on the prefill worker.
        if self.cached_tokens.is_none() {
            self.cached_tokens = data
                .completion_usage
                .and_then(|u| u.prompt_tokens_details)
                .and_then(|d| d.cached_tokens);
        }
        if stopped {
            return String::new();
        }
        let text = match &data.text {
            Some(text) => {
                if data.token_ids.is_empty() {
                    self.untokenized.push_str(text);
                }
                text.clone()
            }
            None => self
                .detok
                .push(self.model.tokenizer.as_ref(), &data.token_ids)
                .unwrap_or_default(),
        };
        let text = self.stop.push(&text);
        if self.stop.matched() {
            self.finish = Some(FinishReason::Stop);
        }
        text
    }

    /// The output tokens: those relayed as ids, plus, for text that came without ids, the
    /// engine's own count (its usage), else the text tokenized with the model's tokenizer.
    fn output_tokens(&self) -> usize {
        if self.untokenized.is_empty() {
            return self.completion_tokens;
        }
        let text_tokens = match self.reported_completion_tokens {
            Some(n) => usize::try_from(n).unwrap_or(usize::MAX),
            None => self
                .model
                .tokenizer
                .encode(&self.untokenized)
                .map_or(0, |ids| ids.len()),
        };
        self.completion_tokens.max(text_tokens)
    }

    fn finish_reason(&self) -> &'static str {
        match &self.finish {
            Some(reason) => finish_reason_str(reason),
            None if self
                .max_tokens
                .is_some_and(|m| self.output_tokens() >= m as usize) =>
            {
                "length"
            }
            None => "stop",
        }
    }

    /// The usage to report, given the cached tokens the prefill worker reported (`prefill`),
    /// which win over the output's engine's: in disaggregated serving the prompt is computed,
    /// and its cache hit, on the prefill worker (Dynamo's decode workers, too, report the
    /// prefill's details). The first prefill's count wins across migrations, and either count
    /// is capped at the prompt's length, for the reasons given in `on_output`.
    fn usage(&self, prefill: Option<u32>) -> Value {
        let cached = prefill.or(self.cached_tokens).map(|c| {
            usize::try_from(c)
                .unwrap_or(usize::MAX)
                .min(self.prompt_tokens)
        });
        usage(self.prompt_tokens, self.output_tokens(), cached)
    }

    fn timing(&self) -> TimingInfo {
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
        let end = self.last.unwrap_or_else(Instant::now);
        TimingInfo {
            request_received_ms: Some(self.received_unix_ms),
            prefill_wait_time_ms: Some(ms(self.sent - self.received)),
            prefill_time_ms: self.first.map(|f| ms(f - self.sent)),
            ttft_ms: self.first.map(|f| ms(f - self.received)),
            total_time_ms: Some(ms(end - self.received)),
            avg_itl_ms: match (self.first, self.output_tokens()) {
                (Some(first), n) if n > 1 => Some(ms(end - first) / (n - 1) as f64),
                _ => None,
            },
            kv_hit_rate: self.hit_rate,
        }
    }
}

fn nvext_value(worker: Option<WorkerIdInfo>, timing: Option<TimingInfo>) -> Option<Value> {
    if worker.is_none() && timing.is_none() {
        return None;
    }
    serde_json::to_value(NvExtResponse {
        worker_id: worker,
        timing,
        token_ids: None,
    })
    .ok()
}

async fn whole_response(
    state: &AppState,
    p: Prepared,
    mut stream: Output,
    mut track: Tracker,
) -> Response {
    let retry = state.config().admission.retry_after;
    let grace = state.config().stop_grace;
    let mut text = String::new();
    let mut stop_deadline = None;
    while let Some(item) = next_within(&mut stream, stop_deadline).await {
        match item {
            Ok(item) => match track.on_item(&item) {
                Step::Text(t) => {
                    text.push_str(&t);
                    if track.stopped() && stop_deadline.is_none() {
                        stop_deadline = Some(tokio::time::Instant::now() + grace);
                        stream.stop_generating();
                    }
                }
                Step::Failed(failure) => return failure.api_error().into_response(),
            },
            Err(e) => return ApiError::from_stream(&e, retry).into_response(),
        }
    }
    text.push_str(&track.finish_text());
    let ext = nvext_value(
        p.want_worker_id.then(|| stream.workers()),
        p.want_timing.then(|| track.timing()),
    );
    axum::Json(p.meta.response(
        &text,
        track.finish_reason(),
        track.usage(stream.prefill_cached_tokens()),
        ext,
    ))
    .into_response()
}

/// The stream's next item; `None` at its end, or once `deadline` (the grace after a graceful
/// stop) passed: the worker ignored the stop, and dropping the stream then cancels the request.
async fn next_within(
    stream: &mut Output,
    deadline: Option<tokio::time::Instant>,
) -> Option<Result<LlmResponse, RequestError>> {
    let Some(deadline) = deadline else {
        return stream.next().await;
    };
    match tokio::time::timeout_at(deadline, stream.next()).await {
        Ok(item) => item,
        Err(_) => {
            tracing::warn!("the worker did not stop after a stop string; cancelling the request");
            None
        }
    }
}

fn data(value: &Value) -> Result<Event, Infallible> {
    Ok(Event::default().data(value.to_string()))
}

/// Streams the response; `first` is the item already taken from `stream` (or its end).
fn sse_response(
    state: &AppState,
    p: Prepared,
    (first, mut stream): (Option<Result<LlmResponse, RequestError>>, Output),
    mut track: Tracker,
    permit: Permit,
) -> Response {
    let keep_alive = state.config().keep_alive;
    let grace = state.config().stop_grace;
    let events = async_stream::stream! {
        // The permit and the routed stream live as long as this body: a client that goes away
        // drops both, cancelling the request on its worker and freeing its slot.
        let _permit = permit;
        let worker = p.want_worker_id.then(|| stream.workers());
        let opening = p.meta.chunk(
            (p.meta.endpoint == Endpoint::Chat).then_some(""),
            true,
            None,
            nvext_value(worker, None),
        );
        if p.meta.endpoint == Endpoint::Chat {
            yield data(&opening);
        }
        let mut stop_deadline = None;
        let mut first = Some(first);
        loop {
            let item = match first.take() {
                Some(item) => item,
                None => next_within(&mut stream, stop_deadline).await,
            };
            let Some(item) = item else { break };
            let failure = match item {
                Ok(item) => match track.on_item(&item) {
                    Step::Text(t) => {
                        if !t.is_empty() {
                            yield data(&p.meta.chunk(Some(&t), false, None, None));
                        }
                        if track.stopped() && stop_deadline.is_none() {
                            stop_deadline = Some(tokio::time::Instant::now() + grace);
                            stream.stop_generating();
                        }
                        continue;
                    }
                    Step::Failed(failure) => failure.api_error(),
                },
                Err(e) => ApiError::from_stream(&e, std::time::Duration::ZERO),
            };
            yield data(&failure.body());
            return;
        }
        let rest = track.finish_text();
        if !rest.is_empty() {
            yield data(&p.meta.chunk(Some(&rest), false, None, None));
        }
        let ext = nvext_value(
            p.want_worker_id.then(|| stream.workers()),
            p.want_timing.then(|| track.timing()),
        );
        yield data(&p.meta.chunk(None, false, Some(track.finish_reason()), ext));
        if p.include_usage {
            yield data(&p.meta.usage_chunk(track.usage(stream.prefill_cached_tokens())));
        }
        yield Ok(Event::default().data("[DONE]"));
    };
    Sse::new(events)
        .keep_alive(KeepAlive::new().interval(keep_alive))
        .into_response()
}

#[cfg(test)]
mod tests;
