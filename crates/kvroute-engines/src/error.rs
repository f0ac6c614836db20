//! Errors an engine reports, and how they are sorted: an engine that cannot serve right now
//! (the request may go elsewhere) against an engine that refuses this request.

use kvroute_runtime::EngineError;
use serde_json::Value;

/// Why [`crate::HttpEngine::health`] failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HealthError {
    /// No answer: connection refused or reset, or the health timeout passed.
    #[error("engine at {url} is unreachable: {message}")]
    Unreachable {
        /// The health endpoint.
        url: String,
        /// What went wrong.
        message: String,
    },
    /// The engine answered with a status other than 2xx (503 while a model loads).
    #[error("engine at {url} is unhealthy: HTTP {status}: {message}")]
    Unhealthy {
        /// The health endpoint.
        url: String,
        /// The HTTP status.
        status: u16,
        /// The engine's error message, or its body.
        message: String,
    },
}

impl From<HealthError> for EngineError {
    fn from(e: HealthError) -> Self {
        EngineError::Unavailable {
            message: e.to_string(),
        }
    }
}

/// What went wrong with one request, as the stream reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Failure {
    /// The engine refused the request (4xx, 500, an in-stream error): one error item.
    Refused(String),
    /// The engine cannot serve now (down, overloaded, connection lost): the request context
    /// fails with [`EngineError::Unavailable`] and the caller may migrate the request.
    Unavailable(String),
    /// A chunk the dialect cannot read: one error item naming what was wrong.
    Malformed(String),
}

/// Whether an HTTP status says "not now" rather than "not this request": rate limited (429) or
/// a gateway or server that is down or overloaded (502, 503, 504).
pub(crate) fn is_unavailable_status(status: u16) -> bool {
    matches!(status, 429 | 502 | 503 | 504)
}

/// The OpenAI error code of an engine's refusal, when the answer says which: a prompt longer
/// than the engine's context is `context_length_exceeded` (llama.cpp's
/// `exceed_context_size_error`, vLLM's "maximum context length", SGLang's "longer than the
/// model's context length").
pub(crate) fn refusal_code(body: &str) -> Option<&'static str> {
    let lower = body.to_ascii_lowercase();
    let context = [
        "exceed_context_size",
        "context length",
        "context size",
        "context_length",
    ];
    context
        .iter()
        .any(|needle| lower.contains(needle))
        .then_some("context_length_exceeded")
}

/// The longest excerpt of an engine's body quoted in a message.
const EXCERPT_CHARS: usize = 512;

/// The message of an engine's error body, whatever its shape: OpenAI and vLLM
/// `{"error": {"message"}}`, SGLang `{"error": {"message"}}`, `{"error": "..."}` or
/// `{"message"}`, FastAPI `{"detail"}`, llama.cpp `{"error": {"code", "message", "type"}}`;
/// otherwise the body itself, shortened.
pub(crate) fn error_message(body: &str) -> String {
    match serde_json::from_str::<Value>(body) {
        Ok(v) => message_of(&v).unwrap_or_else(|| excerpt(body)),
        Err(_) if body.trim().is_empty() => "(empty body)".to_owned(),
        Err(_) => excerpt(body),
    }
}

/// The message of a JSON error body, if it has one of the known shapes.
pub(crate) fn message_of(v: &Value) -> Option<String> {
    let text = |v: &Value| v.as_str().map(str::to_owned);
    if let Some(error) = v.get("error") {
        if let Some(s) = text(error) {
            return Some(s);
        }
        if let Some(m) = error.get("message").and_then(text) {
            return Some(m);
        }
        return Some(excerpt(&error.to_string()));
    }
    if let Some(m) = v.get("message").and_then(text) {
        return Some(m);
    }
    match v.get("detail") {
        Some(Value::String(s)) => Some(s.clone()),
        Some(other) => Some(excerpt(&other.to_string())),
        None => None,
    }
}

/// The HTTP status code a JSON error value carries (`error.code` or `code`), if any.
pub(crate) fn code_of(v: &Value) -> Option<u16> {
    let code = |v: &Value| v.as_u64().and_then(|c| u16::try_from(c).ok());
    v.get("error")
        .and_then(|e| e.get("code"))
        .and_then(code)
        .or_else(|| v.get("code").and_then(code))
}

/// An error an engine sent inside a stream as text (an `error:` field, or a data event that is
/// not JSON), sorted like [`error_value`].
pub(crate) fn stream_error(kind: &str, raw: &str) -> Failure {
    match serde_json::from_str::<Value>(raw) {
        Ok(v) => error_value(kind, &v),
        Err(_) => Failure::Refused(format!("{kind} engine error: {}", excerpt(raw))),
    }
}

/// An error an engine sent inside a stream: the value of an `{"error": ...}` chunk's `error`, or
/// a whole error object. Sorted by its status code: 429/502/503/504 are
/// [`Failure::Unavailable`], anything else (or no code) a refusal.
pub(crate) fn error_value(kind: &str, error: &Value) -> Failure {
    let message = match error {
        Value::String(s) => s.clone(),
        other => other
            .get("message")
            .and_then(Value::as_str)
            .map(str::to_owned)
            .or_else(|| message_of(other))
            .unwrap_or_else(|| excerpt(&other.to_string())),
    };
    let code = code_of(error);
    match code {
        Some(code) if is_unavailable_status(code) => Failure::Unavailable(format!(
            "{kind} engine reported error {code} mid-stream: {message}"
        )),
        Some(code) => Failure::Refused(format!("{kind} engine error {code}: {message}")),
        None => Failure::Refused(format!("{kind} engine error: {message}")),
    }
}

/// `s` cut to [`EXCERPT_CHARS`] characters.
pub(crate) fn excerpt(s: &str) -> String {
    let s = s.trim();
    match s.char_indices().nth(EXCERPT_CHARS) {
        Some((cut, _)) => format!("{}...", &s[..cut]),
        None => s.to_owned(),
    }
}
