//! Preparing a request: the checks of a parsed body, tokenization (the chat template, or the
//! prompt), and the worker request with what its response needs to know ([`Prepared`]). The
//! endpoints of both completions share this path; only their body type and prompt differ.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::http::HeaderMap;
use kvroute_protocols::headers::{HEADER_DP_RANK, HEADER_WORKER_INSTANCE_ID};
use kvroute_protocols::{HeaderOverrides, NvExt, PreprocessedRequest};

use super::body::{ReadBody, parse_body};
use super::error::ApiError;
use super::openai::{
    CHAT_ROLES, ChatCompletionRequest, CompletionRequest, Content, Params, Prompt,
};
use super::response::{Endpoint, Reply, ResponseMeta};
use super::state::AppState;
use crate::model::Model;
use crate::tokenizer::TemplateMessage;

/// A request ready to route.
pub(super) struct Prepared {
    /// What the worker is sent.
    pub(super) request: PreprocessedRequest,
    /// What its response needs to know.
    pub(super) reply: Reply,
    /// Where the pinned dp rank came from: the `x-dp-rank` header, else `nvext.dp_rank`.
    pub(super) dp_rank_param: &'static str,
    /// Where the pinned worker came from: the `x-worker-instance-id` header, else
    /// `nvext.backend_instance_id`.
    pub(super) worker_param: &'static str,
}

/// A `POST /v1/chat/completions` body, received at `received`, ready to route.
pub(super) fn chat(
    state: &AppState,
    headers: &HeaderMap,
    body: Result<ReadBody, ApiError>,
    received: Instant,
) -> Result<Prepared, ApiError> {
    let req: ChatCompletionRequest = parse_body(body)?;
    chat_parsed(state, headers, req, received)
}

/// [`chat`] of a body already parsed.
pub(super) fn chat_parsed(
    state: &AppState,
    headers: &HeaderMap,
    req: ChatCompletionRequest,
    received: Instant,
) -> Result<Prepared, ApiError> {
    refuse_unsupported(req.unsupported_parameter())?;
    check_roles(&req)?;
    let mut params = req.params();
    check_max_tokens(state, "max_completion_tokens", req.max_completion_tokens)?;
    check_params(state, &params)?;
    let model = lookup(state, &req.model)?;
    let nvext = nvext_with_headers(state, params.nvext.take(), headers)?;
    let tokens = match nvext.as_ref().and_then(|e| e.token_data.clone()) {
        Some(tokens) => tokens,
        None => tokenized(state, || chat_tokens(&model, &req))?,
    };
    params.max_tokens = req.max_completion_tokens.or(params.max_tokens);
    let p = prepare(
        state,
        model,
        tokens,
        params,
        nvext,
        Endpoint::Chat,
        received,
    )?;
    Ok(with_pin_params(p, headers))
}

/// A `POST /v1/completions` body, received at `received`, ready to route.
pub(super) fn completion(
    state: &AppState,
    headers: &HeaderMap,
    body: Result<ReadBody, ApiError>,
    received: Instant,
) -> Result<Prepared, ApiError> {
    let req: CompletionRequest = parse_body(body)?;
    completion_parsed(state, headers, req, received)
}

/// [`completion`] of a body already parsed.
pub(super) fn completion_parsed(
    state: &AppState,
    headers: &HeaderMap,
    req: CompletionRequest,
    received: Instant,
) -> Result<Prepared, ApiError> {
    refuse_unsupported(req.unsupported_parameter())?;
    let mut params = req.params();
    check_params(state, &params)?;
    let model = lookup(state, &req.model)?;
    let nvext = nvext_with_headers(state, params.nvext.take(), headers)?;
    let tokens = match nvext.as_ref().and_then(|e| e.token_data.clone()) {
        Some(tokens) => tokens,
        None => prompt_tokens(state, &model, req.prompt)?,
    };
    let p = prepare(
        state,
        model,
        tokens,
        params,
        nvext,
        Endpoint::Completion,
        received,
    )?;
    Ok(with_pin_params(p, headers))
}

/// Runs `tokenize` (the chat template and the tokenizer, or the tokenizer alone), counting its
/// time in the `tokenizing` phase of `routing_overhead_seconds`.
fn tokenized(
    state: &AppState,
    tokenize: impl FnOnce() -> Result<Vec<u32>, ApiError>,
) -> Result<Vec<u32>, ApiError> {
    let start = Instant::now();
    let tokens = tokenize();
    state.router().metrics().on_tokenized(start.elapsed());
    tokens
}

/// `p`, naming its pins as the request set them (a header, else the nvext field).
fn with_pin_params(mut p: Prepared, headers: &HeaderMap) -> Prepared {
    p.dp_rank_param = dp_rank_param(headers);
    p.worker_param = worker_param(headers);
    p
}

/// The param naming a dp-rank pin: the header when the request set it, else the nvext field.
fn dp_rank_param(headers: &HeaderMap) -> &'static str {
    if headers.contains_key(HEADER_DP_RANK) {
        HEADER_DP_RANK
    } else {
        "nvext.dp_rank"
    }
}

/// The param naming a worker pin: the header when the request set it, else the nvext field.
fn worker_param(headers: &HeaderMap) -> &'static str {
    if headers.contains_key(HEADER_WORKER_INSTANCE_ID) {
        HEADER_WORKER_INSTANCE_ID
    } else {
        "nvext.backend_instance_id"
    }
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

fn prompt_tokens(state: &AppState, model: &Model, prompt: Prompt) -> Result<Vec<u32>, ApiError> {
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
    tokenized(state, || {
        model
            .tokenizer
            .encode(&text)
            .map_err(|e| ApiError::invalid(e.to_string(), Some("prompt".to_owned())))
    })
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
        reply: Reply {
            meta: ResponseMeta {
                id: format!("{prefix}-{hash:016x}{n:x}"),
                created: now.as_secs(),
                model: model.name.clone(),
                endpoint,
            },
            model,
            stream: params.stream.unwrap_or(false),
            include_usage: params.stream_options.is_some_and(|o| o.include_usage),
            want_worker_id,
            want_timing,
            received,
            received_unix_ms: u64::try_from(now.as_millis()).unwrap_or(u64::MAX),
        },
        request: req,
        dp_rank_param: "nvext.dp_rank",
        worker_param: "nvext.backend_instance_id",
    })
}
