//! OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with the right status
//! (and `Retry-After` when retrying later is sound).

use std::time::Duration;

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use kvroute_prefill::{PhaseRouteError, PrefillError};
use kvroute_protocols::ProtocolError;
use kvroute_runtime::RequestError;
use kvroute_scheduler::{FilterStage, SelectError};
use serde_json::json;

use crate::error::KvRouterError;
use crate::tokenizer::TokenizerError;
use kvroute_router_core::RouteError;

/// The `param` of an error about the pinned dp rank (before [`ApiError::with_dp_rank_param`]).
const DP_RANK_PARAM: &str = "nvext.dp_rank";

/// An error answered to an HTTP client.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    /// The HTTP status.
    pub status: StatusCode,
    /// What went wrong, for a person.
    pub message: String,
    /// The OpenAI error type (`invalid_request_error`, ...).
    pub kind: &'static str,
    /// The offending request field (a JSON path, or a header name).
    pub param: Option<String>,
    /// A machine-readable code (`model_not_found`, ...).
    pub code: Option<&'static str>,
    /// Sent as `Retry-After` (whole seconds, at least 1).
    pub retry_after: Option<Duration>,
    /// Answer with `Connection: close`: the request's body was left unread, so the connection
    /// cannot carry another request (and a client must not pool it).
    pub close_connection: bool,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
            retry_after: None,
            close_connection: false,
        }
    }

    /// The same error, answered with `Connection: close` (the request's body was left unread).
    #[must_use]
    pub fn closing(self) -> Self {
        Self {
            close_connection: true,
            ..self
        }
    }

    /// 400: the request is malformed or invalid.
    pub fn invalid(message: impl Into<String>, param: Option<String>) -> Self {
        Self {
            param,
            ..Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
        }
    }

    /// 404: no such model.
    pub fn unknown_model(model: &str) -> Self {
        Self {
            param: Some("model".to_owned()),
            code: Some("model_not_found"),
            ..Self::new(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                format!("the model `{model}` does not exist (GET /v1/models lists the models)"),
            )
        }
    }

    /// 404: no such endpoint.
    pub fn not_found(message: impl Into<String>) -> Self {
        Self {
            code: Some("not_found"),
            ..Self::new(StatusCode::NOT_FOUND, "invalid_request_error", message)
        }
    }

    /// 405: the endpoint does not take this method.
    pub fn method_not_allowed(message: impl Into<String>) -> Self {
        Self {
            code: Some("method_not_allowed"),
            ..Self::new(
                StatusCode::METHOD_NOT_ALLOWED,
                "invalid_request_error",
                message,
            )
        }
    }

    /// 401: no API key, or one not configured (`code: invalid_api_key`, as OpenAI answers).
    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self {
            code: Some("invalid_api_key"),
            ..Self::new(StatusCode::UNAUTHORIZED, "invalid_request_error", message)
        }
    }

    /// 413: the body or the prompt is too large.
    pub fn too_large(message: impl Into<String>, code: &'static str) -> Self {
        Self {
            code: Some(code),
            ..Self::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "invalid_request_error",
                message,
            )
        }
    }

    /// 429: too many requests are waiting; retry after `retry_after`.
    pub fn too_many_requests(message: impl Into<String>, retry_after: Duration) -> Self {
        Self {
            code: Some("rate_limit_exceeded"),
            retry_after: Some(retry_after),
            ..Self::new(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", message)
        }
    }

    /// 503: no worker can take the request now; retry after `retry_after`.
    pub fn unavailable(message: impl Into<String>, retry_after: Duration) -> Self {
        Self {
            code: Some("service_unavailable"),
            retry_after: Some(retry_after),
            ..Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "service_unavailable_error",
                message,
            )
        }
    }

    /// 500: something failed on our side or the engine's.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "internal_error", message)
    }

    /// 502: a worker failed the request before any output reached the client.
    pub fn bad_gateway(message: impl Into<String>) -> Self {
        Self {
            code: Some("upstream_error"),
            ..Self::new(StatusCode::BAD_GATEWAY, "upstream_error", message)
        }
    }

    /// An engine's own refusal of the request with a 4xx `status` (a prompt over its context:
    /// `code` `context_length_exceeded`), passed to the client with that status.
    pub fn engine_refused(status: u16, message: impl Into<String>, code: Option<String>) -> Self {
        let status = StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_REQUEST);
        let code: Option<&'static str> = match code.as_deref() {
            Some("context_length_exceeded") => Some("context_length_exceeded"),
            _ => None,
        };
        Self {
            code,
            ..Self::new(status, "invalid_request_error", message)
        }
    }

    /// 504: no worker sent a first token within its limit.
    pub fn timeout(message: impl Into<String>) -> Self {
        Self {
            code: Some("timeout"),
            ..Self::new(StatusCode::GATEWAY_TIMEOUT, "timeout_error", message)
        }
    }

    /// A failure of disaggregated serving: saturation or no prefill worker while disaggregation
    /// is enforced (503 with `Retry-After`), a pin to an unknown worker (400), a worker that
    /// failed the prefill (502), anything else 500.
    pub fn from_prefill(error: &PrefillError, retry_after: Duration) -> Self {
        let message = error.to_string();
        match error {
            // A lost worker after the migration budget is spent: as `from_stream` answers a lost
            // aggregated worker, retryable (another worker may serve the retry).
            PrefillError::NotActivated
            | PrefillError::ResourceExhausted { .. }
            | PrefillError::WorkerLost { .. } => Self::unavailable(message, retry_after),
            PrefillError::UnknownPrefillWorker { .. } => {
                Self::invalid(message, Some("nvext.prefill_worker_id".to_owned()))
            }
            PrefillError::Route { source, .. } => match source {
                PhaseRouteError::NoWorkers { .. } | PhaseRouteError::ResourceExhausted { .. } => {
                    Self::unavailable(message, retry_after)
                }
                PhaseRouteError::UnknownWorker { .. } => {
                    Self::invalid(message, Some("nvext.backend_instance_id".to_owned()))
                }
                PhaseRouteError::Failed {
                    worker_id: Some(_), ..
                } => Self::bad_gateway(message),
                _ => Self::internal(message),
            },
            PrefillError::PrefillFailed { .. } | PrefillError::NoDisaggregatedParams { .. } => {
                Self::bad_gateway(message)
            }
            _ => Self::internal(message),
        }
    }

    /// 400 from a protocol error: the JSON path (prefixed by `nvext.` for validation rules of
    /// the nvext object) or the header name becomes `param`.
    pub fn from_protocol(error: &ProtocolError, nvext: bool) -> Self {
        let param = match error {
            ProtocolError::Json { path, .. } => (path != ".").then(|| path.clone()),
            ProtocolError::Invalid { field, .. } if nvext => Some(format!("nvext.{field}")),
            ProtocolError::Invalid { field, .. } => Some((*field).to_owned()),
            ProtocolError::Header { name, .. } => Some((*name).to_owned()),
            _ => None,
        };
        Self::invalid(error.to_string(), param)
    }

    /// A tokenizer failure: the prompt or messages are at fault (400), except detokenizing.
    pub fn from_tokenizer(error: &TokenizerError) -> Self {
        match error {
            TokenizerError::Decode(_) | TokenizerError::Load { .. } => {
                Self::internal(error.to_string())
            }
            _ => Self::invalid(error.to_string(), Some("messages".to_owned())),
        }
    }

    /// A routing failure: no worker (503), a bad pin or override (400), a send failure (503).
    pub fn from_router(error: &KvRouterError, retry_after: Duration) -> Self {
        let message = error.to_string();
        match error {
            KvRouterError::Route(RouteError::NoWorkerId { .. }) => {
                Self::invalid(message, Some("nvext.backend_instance_id".to_owned()))
            }
            KvRouterError::Route(RouteError::Select(select)) => match select {
                // A pin to a dp rank no (allowed) worker serves: the client's pin is wrong, as
                // with an unknown worker; the param is set by `with_dp_rank_param`.
                SelectError::NoEndpoints {
                    stage: FilterStage::DpRank,
                }
                | SelectError::DpRankOutOfRange { .. } => {
                    Self::invalid(message, Some(DP_RANK_PARAM.to_owned()))
                }
                SelectError::NoEndpoints { .. }
                | SelectError::AllEligibleWorkersOverloaded { .. }
                | SelectError::PinnedWorkerOverloaded { .. } => {
                    Self::unavailable(message, retry_after)
                }
                SelectError::InvalidOverride(_) => {
                    Self::invalid(message, Some("nvext.router_config_override".to_owned()))
                }
                _ => Self::invalid(message, Some("nvext.backend_instance_id".to_owned())),
            },
            KvRouterError::Route(RouteError::Session(_)) | KvRouterError::Send { .. } => {
                Self::unavailable(message, retry_after)
            }
            _ => Self::internal(message),
        }
    }

    /// This error with `param` naming where the request's dp-rank pin came from (the
    /// `x-dp-rank` header or `nvext.dp_rank`), when it is about that pin.
    pub fn with_dp_rank_param(mut self, param: &str) -> Self {
        if self.param.as_deref() == Some(DP_RANK_PARAM) {
            self.param = Some(param.to_owned());
        }
        self
    }

    /// This error with `param` naming where the request's worker pin came from (the
    /// `x-worker-instance-id` header or `nvext.backend_instance_id`), when it is about that pin.
    pub fn with_worker_param(mut self, param: &str) -> Self {
        if self.param.as_deref() == Some("nvext.backend_instance_id") {
            self.param = Some(param.to_owned());
        }
        self
    }

    /// A failure of the response stream before anything was sent to the client.
    ///
    /// A timeout before the first token (on every worker tried) is a 504 `timeout`; a lost or
    /// unreachable worker a retryable 503; an engine's failure a 502.
    pub fn from_stream(error: &RequestError, retry_after: Duration) -> Self {
        if error.is_timeout() {
            Self::timeout(error.to_string())
        } else if error.is_worker_unavailable() {
            Self::unavailable(error.to_string(), retry_after)
        } else if matches!(error, RequestError::Engine { .. }) {
            Self::bad_gateway(error.to_string())
        } else {
            Self::internal(error.to_string())
        }
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, axum::Json(self.body())).into_response();
        if let Some(after) = self.retry_after {
            let secs = after.as_secs().max(1);
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        if self.close_connection {
            response
                .headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lost_worker_past_the_migration_budget_is_a_retryable_503() {
        let lost = PrefillError::WorkerLost {
            phase: kvroute_protocols::RequestPhase::Decode,
            worker_id: 7,
            message: "connection reset".to_owned(),
        };
        let error = ApiError::from_prefill(&lost, Duration::from_secs(2));
        assert_eq!(error.status, StatusCode::SERVICE_UNAVAILABLE);
        let response = error.into_response();
        assert_eq!(
            response.headers().get("retry-after").map(|v| v.as_bytes()),
            Some(&b"2"[..])
        );
    }
}
