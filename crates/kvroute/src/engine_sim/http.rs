//! One simulated engine's HTTP API in vLLM's dialect: the routes, request checks and the small
//! endpoints; [`super::generate`] runs the completions.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use kvroute_router::tokenizer::TemplateMessage;
use serde::de::DeserializeOwned;
use serde_json::json;

use super::generate::{self, Job};
use super::kv_transfer::{self, Asked, Handshake};
use super::metrics;
use super::openai::{
    ChatMessage, ChatRequest, CompletionRequest, Envelope, Kind, Prompt, TokenizeRequest,
    error_response,
};
use super::state::Sim;

/// The engine's routes.
pub(super) fn app(sim: Arc<Sim>) -> Router {
    Router::new()
        .route("/health", get(|| async { StatusCode::OK }))
        .route("/v1/models", get(models))
        .route("/metrics", get(metrics))
        .route("/tokenize", post(tokenize))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/kv_transfer/pull", post(pull_blocks))
        .with_state(sim)
}

/// A request the engine refuses, answered with vLLM's error body.
pub(super) struct ApiError {
    status: StatusCode,
    kind: &'static str,
    message: String,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        error_response(self.status, self.kind, &self.message)
    }
}

fn bad_request(message: &str) -> ApiError {
    ApiError {
        status: StatusCode::BAD_REQUEST,
        kind: "BadRequestError",
        message: message.to_owned(),
    }
}

fn parse<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| bad_request(&format!("invalid request body: {e}")))
}

async fn models(State(sim): State<Arc<Sim>>) -> Response {
    axum::Json(json!({
        "object": "list",
        "data": [{
            "id": sim.model,
            "object": "model",
            "created": sim.started,
            "owned_by": "vllm",
            "root": sim.model,
            "parent": null,
            "max_model_len": sim.max_model_len,
            "permission": [],
        }],
    }))
    .into_response()
}

async fn metrics(State(sim): State<Arc<Sim>>) -> Response {
    let load = sim.engine.load_report();
    let text = metrics::render(&sim.model, &load, &sim.counters, &sim.cache);
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

async fn tokenize(State(sim): State<Arc<Sim>>, body: Bytes) -> Result<Response, ApiError> {
    let request: TokenizeRequest = parse(&body)?;
    let tokens = match (&request.prompt, &request.messages) {
        (Some(prompt), None) => encode(&sim, prompt)?,
        (None, Some(messages)) => render_chat(&sim, messages)?,
        _ => {
            return Err(bad_request(
                "expected exactly one of `prompt` and `messages`",
            ));
        }
    };
    Ok(axum::Json(json!({
        "count": tokens.len(),
        "max_model_len": sim.max_model_len,
        "tokens": tokens,
        "token_strs": null,
    }))
    .into_response())
}

fn encode(sim: &Sim, text: &str) -> Result<Vec<u32>, ApiError> {
    sim.text
        .tokenizer
        .encode(text)
        .map_err(|e| bad_request(&e.to_string()))
}

fn render_chat(sim: &Sim, messages: &[ChatMessage]) -> Result<Vec<u32>, ApiError> {
    let messages: Vec<TemplateMessage> = messages
        .iter()
        .map(|m| TemplateMessage {
            role: m.role.clone(),
            content: m.text(),
        })
        .collect();
    let text = sim
        .text
        .template
        .render(&messages, true)
        .map_err(|e| bad_request(&e.to_string()))?;
    encode(sim, &text)
}

/// The model a request names must be the served one, as vLLM answers otherwise.
fn check_model(sim: &Sim, model: Option<&str>) -> Result<(), ApiError> {
    match model {
        Some(model) if model != sim.model => Err(ApiError {
            status: StatusCode::NOT_FOUND,
            kind: "NotFoundError",
            message: format!("The model `{model}` does not exist."),
        }),
        _ => Ok(()),
    }
}

fn envelope(sim: &Sim, kind: Kind, return_token_ids: bool) -> Envelope {
    let n = sim.next_id.fetch_add(1, Ordering::Relaxed);
    let prefix = match kind {
        Kind::Completion => "cmpl",
        Kind::Chat => "chatcmpl",
    };
    Envelope {
        kind,
        id: format!("{prefix}-{n:016x}"),
        created: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        model: sim.model.clone(),
        return_token_ids,
    }
}

/// The job for a prompt, after vLLM's length checks.
fn job(
    sim: &Sim,
    envelope: Envelope,
    prompt: Vec<u32>,
    max_tokens: Option<u32>,
    common: &super::openai::Common,
    handshake: Handshake,
) -> Result<Job, ApiError> {
    let len = prompt.len() as u32;
    if prompt.is_empty() {
        return Err(bad_request(
            "the prompt is empty; expected at least one token",
        ));
    }
    if len >= sim.max_model_len {
        return Err(bad_request(&format!(
            "This model's maximum context length is {} tokens. However, your request has {len} \
             input tokens. Please reduce the length of the input messages.",
            sim.max_model_len
        )));
    }
    let room = sim.max_model_len - len;
    let max_tokens = max_tokens.unwrap_or(room);
    if max_tokens == 0 || max_tokens > room {
        return Err(bad_request(&format!(
            "max_tokens must be 1..={room} for a prompt of {len} tokens (max_model_len {}), \
             got {max_tokens}",
            sim.max_model_len
        )));
    }
    Ok(Job {
        envelope,
        prompt,
        max_tokens,
        stream: common.stream,
        include_usage: common.include_usage(),
        handshake,
    })
}

async fn completions(State(sim): State<Arc<Sim>>, body: Bytes) -> Result<Response, ApiError> {
    let request: CompletionRequest = parse(&body)?;
    check_model(&sim, request.model.as_deref())?;
    let prompt = match request.prompt {
        Prompt::Ids(ids) => ids,
        Prompt::Text(text) => encode(&sim, &text)?,
        Prompt::IdLists(mut lists) if lists.len() == 1 => lists.remove(0),
        Prompt::Texts(texts) if texts.len() == 1 => encode(&sim, &texts[0])?,
        _ => {
            return Err(bad_request(
                "batched prompts are not supported; expected one prompt",
            ));
        }
    };
    let common = &request.common;
    let envelope = envelope(&sim, Kind::Completion, common.return_token_ids);
    let handshake = handshake(&sim, common, &prompt).await?;
    let job = job(&sim, envelope, prompt, common.max_tokens, common, handshake)?;
    Ok(generate::run(sim, job).await)
}

async fn chat_completions(State(sim): State<Arc<Sim>>, body: Bytes) -> Result<Response, ApiError> {
    let request: ChatRequest = parse(&body)?;
    check_model(&sim, request.model.as_deref())?;
    let prompt = render_chat(&sim, &request.messages)?;
    let common = &request.common;
    let max_tokens = request.max_completion_tokens.or(common.max_tokens);
    let envelope = envelope(&sim, Kind::Chat, common.return_token_ids);
    let handshake = handshake(&sim, common, &prompt).await?;
    let job = job(&sim, envelope, prompt, max_tokens, common, handshake)?;
    Ok(generate::run(sim, job).await)
}

/// What the request's `kv_transfer_params` ask; a decode request's blocks are pulled from the
/// prefill engine they name (refused with a 400 saying why when that fails).
async fn handshake(
    sim: &Sim,
    common: &super::openai::Common,
    prompt: &[u32],
) -> Result<Handshake, ApiError> {
    let Some(params) = common.kv_transfer_params.as_ref().filter(|p| !p.is_null()) else {
        return Ok(Handshake::None);
    };
    match kv_transfer::asked(params).map_err(|m| bad_request(&m))? {
        Asked::Nothing => Ok(Handshake::None),
        Asked::RemoteDecode => Ok(Handshake::RemoteDecode),
        Asked::RemotePrefill(pull) => {
            let transferred_tokens = kv_transfer::pull(&sim.client, &pull, prompt)
                .await
                .map_err(|m| bad_request(&m))?;
            Ok(Handshake::RemotePrefill { transferred_tokens })
        }
    }
}

/// `POST /kv_transfer/pull`: another engine takes blocks this one holds.
async fn pull_blocks(State(sim): State<Arc<Sim>>, body: Bytes) -> Result<Response, ApiError> {
    let request: kv_transfer::PullRequest = parse(&body)?;
    let pull = &request.pull;
    if pull.engine_id != sim.address.engine_id {
        return Err(ApiError {
            status: StatusCode::NOT_FOUND,
            kind: "NotFoundError",
            message: format!(
                "blocks of engine {} were asked of engine {}",
                pull.engine_id, sim.address.engine_id
            ),
        });
    }
    let transferred = sim
        .transfers
        .take(&pull.engine_id, &pull.block_ids, &request.prompt)
        .map_err(|message| ApiError {
            status: StatusCode::NOT_FOUND,
            kind: "NotFoundError",
            message,
        })?;
    Ok(axum::Json(json!({"transferred_tokens": transferred})).into_response())
}
