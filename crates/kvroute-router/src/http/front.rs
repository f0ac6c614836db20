//! Other front doors over the same request path: a proxy that hands kvroute an OpenAI request
//! it will send on itself (the Envoy endpoint picker, `kvroute-epp`) prepares it here, exactly
//! as the HTTP frontend does (the same checks, limits, `nvext`, routing headers, model lookup,
//! chat template and tokenizer, with the same errors), takes an admission slot, and routes it
//! with [`crate::KvPushRouter::pick`].

use std::time::Instant;

use axum::http::HeaderMap;
use kvroute_protocols::{PreprocessedRequest, from_json};

use super::admission::Permit;
use super::error::ApiError;
use super::openai::{ChatCompletionRequest, CompletionRequest};
use super::prepare;
use super::state::AppState;

/// The OpenAI endpoints whose requests are routed by their prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpenAiEndpoint {
    /// `POST /v1/chat/completions`.
    Chat,
    /// `POST /v1/completions`.
    Completion,
}

impl OpenAiEndpoint {
    /// The endpoint a request path names (a query string is ignored), or `None` for any other
    /// path.
    pub fn from_path(path: &str) -> Option<Self> {
        let path = path.split(['?', '#']).next().unwrap_or_default();
        match path.trim_end_matches('/') {
            "/v1/chat/completions" => Some(Self::Chat),
            "/v1/completions" => Some(Self::Completion),
            _ => None,
        }
    }
}

/// An OpenAI request prepared for routing by another front door.
#[derive(Debug, Clone)]
pub struct FrontRequest {
    /// What the router routes (tokens, routing hints, session control, annotations).
    pub request: PreprocessedRequest,
    /// Whether the client asked for a streamed (server-sent events) response.
    pub stream: bool,
    /// The served model the request names.
    pub model: String,
}

/// A slot of the frontend's admission limit (`max_in_flight`), held for as long as the request
/// it admitted runs.
#[derive(Debug)]
pub struct AdmissionPermit {
    _slot: Permit,
}

impl AppState {
    /// Prepares the OpenAI request `body`, sent to `endpoint` with `headers` (routing headers
    /// apply as on the HTTP frontend): the same checks and errors as `POST` on that endpoint,
    /// except the body's size, which the caller bounds by [`super::HttpConfig::max_body_bytes`].
    pub fn prepare_openai(
        &self,
        endpoint: OpenAiEndpoint,
        headers: &HeaderMap,
        body: &[u8],
    ) -> Result<FrontRequest, ApiError> {
        let received = Instant::now();
        let prepared = match endpoint {
            OpenAiEndpoint::Chat => {
                let req: ChatCompletionRequest =
                    from_json(body).map_err(|e| ApiError::from_protocol(&e, false))?;
                prepare::chat_parsed(self, headers, req, received)?
            }
            OpenAiEndpoint::Completion => {
                let req: CompletionRequest =
                    from_json(body).map_err(|e| ApiError::from_protocol(&e, false))?;
                prepare::completion_parsed(self, headers, req, received)?
            }
        };
        Ok(FrontRequest {
            request: prepared.request,
            stream: prepared.reply.stream,
            model: prepared.reply.model.name.clone(),
        })
    }

    /// Takes an admission slot, waiting (up to `queue_timeout`) while `max_in_flight` requests
    /// run: 429 when `max_queued` already wait, 503 when none freed in time.
    pub async fn admit(&self) -> Result<AdmissionPermit, ApiError> {
        self.inner
            .admission
            .admit()
            .await
            .map(|slot| AdmissionPermit { _slot: slot })
    }
}
