//! Which engine an [`crate::HttpEngine`] talks to, where, and how long it waits.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use kvroute_runtime::WorkerRole;
use serde::{Deserialize, Serialize};

/// The HTTP dialect of the engine behind a worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EngineKind {
    /// vLLM's OpenAI server: `POST /v1/completions` with `return_token_ids`.
    Vllm,
    /// SGLang's native API: `POST /generate` with `input_ids`.
    Sglang,
    /// TensorRT-LLM's `trtllm-serve`: `POST /v1/completions` with `detokenize: false`.
    Trtllm,
    /// llama.cpp's `llama-server` native API: `POST /completion` with `return_tokens`.
    Llamacpp,
    /// Any OpenAI-compatible completions server: `POST /v1/completions`, text only.
    Openai,
}

impl EngineKind {
    /// Every kind, in the order error messages list them.
    pub const ALL: [EngineKind; 5] = [
        EngineKind::Vllm,
        EngineKind::Sglang,
        EngineKind::Trtllm,
        EngineKind::Llamacpp,
        EngineKind::Openai,
    ];

    /// The lowercase name used in config files and on the command line.
    pub const fn as_str(self) -> &'static str {
        match self {
            EngineKind::Vllm => "vllm",
            EngineKind::Sglang => "sglang",
            EngineKind::Trtllm => "trtllm",
            EngineKind::Llamacpp => "llamacpp",
            EngineKind::Openai => "openai",
        }
    }

    /// Whether kvroute can read the engine's own load (requests running and waiting) from its
    /// Prometheus `/metrics` ([`crate::HttpEngine::load`]): vLLM, SGLang and llama.cpp can;
    /// TensorRT-LLM and plain OpenAI servers publish no request gauges.
    pub const fn publishes_load(self) -> bool {
        !matches!(self, EngineKind::Trtllm | EngineKind::Openai)
    }

    /// Whether kvroute speaks the engine's disaggregation exchange, so that it can serve as a
    /// prefill or a decode engine ([`HttpEngineConfig::role`]): vLLM (its KV connector
    /// handshake), SGLang (its bootstrap rooms) and TensorRT-LLM (its context and generation
    /// `disaggregated_params`).
    pub const fn disaggregates(self) -> bool {
        matches!(
            self,
            EngineKind::Vllm | EngineKind::Sglang | EngineKind::Trtllm
        )
    }

    /// Whether the engine's prefill side is met through a bootstrap server (SGLang): a prefill
    /// engine must then advertise its bootstrap endpoint, and the router starts prefill and
    /// decode together.
    pub const fn bootstraps(self) -> bool {
        matches!(self, EngineKind::Sglang)
    }

    /// Whether the engine streams output token ids. A plain OpenAI server streams text only: its
    /// outputs carry `text` and no `token_ids`, so the router can neither count nor migrate them
    /// by token.
    pub const fn returns_token_ids(self) -> bool {
        !matches!(self, EngineKind::Openai)
    }
}

impl fmt::Display for EngineKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for EngineKind {
    type Err = ParseEngineKindError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        EngineKind::ALL
            .into_iter()
            .find(|kind| kind.as_str() == s)
            .ok_or_else(|| ParseEngineKindError { got: s.to_owned() })
    }
}

/// A string that names no [`EngineKind`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown engine kind `{got}`, expected one of: vllm, sglang, trtllm, llamacpp, openai")]
pub struct ParseEngineKindError {
    /// The string given.
    pub got: String,
}

/// How an [`crate::HttpEngine`] reaches its engine. Field names are the config file's keys
/// (durations in milliseconds, `*_ms`); [`crate::HttpEngine::new`] validates it.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpEngineConfig {
    /// The engine's HTTP dialect.
    pub kind: EngineKind,
    /// Where the engine listens: `http://host:port`, optionally with a path prefix.
    pub base_url: String,
    /// The `model` sent to the engine instead of each request's own. Leave it unset when the
    /// router's model names are the engine's served names, which keeps LoRA adapters selectable
    /// by name (vLLM).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub served_model_name: Option<String>,
    /// Sent as `Authorization: Bearer <key>` when set (an OpenAI server, `vllm serve --api-key`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key: Option<String>,
    /// The output budget sent for a request that states no `max_tokens`. Unset leaves the
    /// engine's own default in force (vLLM and OpenAI: 16, SGLang: 128, llama.cpp: unlimited).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_max_tokens: Option<u32>,
    /// How long the TCP connect may take.
    #[serde(rename = "connect_timeout_ms", default = "default_connect_timeout")]
    #[serde(with = "millis")]
    pub connect_timeout: Duration,
    /// How long a request may wait for the first byte of its response body (queueing plus
    /// prefill, since the engines send nothing before the first token). `None` waits forever.
    #[serde(
        rename = "first_byte_timeout_ms",
        default = "default_first_byte_timeout"
    )]
    #[serde(with = "opt_millis")]
    pub first_byte_timeout: Option<Duration>,
    /// The longest silence allowed between two pieces of a response body once it has started
    /// (default 60 s: an engine that stops mid-stream, frozen or cut off without a reset, is
    /// given up on and the request migrates with what it generated). `None` waits forever.
    #[serde(rename = "idle_timeout_ms", default = "default_idle_timeout")]
    #[serde(with = "opt_millis")]
    pub idle_timeout: Option<Duration>,
    /// The longest a whole request may take. `None` has no bound.
    #[serde(rename = "request_timeout_ms", default, with = "opt_millis")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub request_timeout: Option<Duration>,
    /// How long [`crate::HttpEngine::health`] and [`crate::HttpEngine::load`] wait for an answer.
    #[serde(rename = "health_timeout_ms", default = "default_health_timeout")]
    #[serde(with = "millis")]
    pub health_timeout: Duration,
    /// The engine's part in disaggregated serving (default aggregated): a prefill engine
    /// prefills and hands its KV over, a decode engine continues from a handed-over KV (see
    /// each dialect's module for the exchange; vLLM's is its KV connector handshake).
    #[serde(default, skip_serializing_if = "is_aggregated")]
    pub role: WorkerRole,
}

fn is_aggregated(role: &WorkerRole) -> bool {
    *role == WorkerRole::Aggregated
}

impl HttpEngineConfig {
    /// A config for a `kind` engine at `base_url` with every other field at its default.
    pub fn new(kind: EngineKind, base_url: impl Into<String>) -> Self {
        Self {
            kind,
            base_url: base_url.into(),
            served_model_name: None,
            api_key: None,
            default_max_tokens: None,
            connect_timeout: default_connect_timeout(),
            first_byte_timeout: default_first_byte_timeout(),
            idle_timeout: default_idle_timeout(),
            request_timeout: None,
            health_timeout: default_health_timeout(),
            role: WorkerRole::Aggregated,
        }
    }

    /// The same configuration for an engine with `role` in disaggregated serving.
    pub fn with_role(mut self, role: WorkerRole) -> Self {
        self.role = role;
        self
    }
}

// Hand-written so that the API key never reaches a log.
impl fmt::Debug for HttpEngineConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HttpEngineConfig")
            .field("kind", &self.kind)
            .field("base_url", &self.base_url)
            .field("served_model_name", &self.served_model_name)
            .field("api_key", &self.api_key.as_ref().map(|_| "<redacted>"))
            .field("default_max_tokens", &self.default_max_tokens)
            .field("connect_timeout", &self.connect_timeout)
            .field("first_byte_timeout", &self.first_byte_timeout)
            .field("idle_timeout", &self.idle_timeout)
            .field("request_timeout", &self.request_timeout)
            .field("health_timeout", &self.health_timeout)
            .field("role", &self.role)
            .finish()
    }
}

fn default_connect_timeout() -> Duration {
    Duration::from_secs(5)
}

fn default_first_byte_timeout() -> Option<Duration> {
    Some(Duration::from_secs(300))
}

fn default_idle_timeout() -> Option<Duration> {
    Some(Duration::from_secs(60))
}

fn default_health_timeout() -> Duration {
    Duration::from_secs(5)
}

/// Why an [`HttpEngineConfig`] was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EngineConfigError {
    /// `base_url` does not parse as a URL.
    #[error("base_url `{url}` is not a valid URL ({reason}); expected e.g. http://127.0.0.1:8000")]
    InvalidBaseUrl {
        /// The value given.
        url: String,
        /// What the URL parser said.
        reason: String,
    },
    /// `base_url` is not plain `http` (this crate is built without TLS: engines are reached
    /// over loopback or a private network).
    #[error("base_url `{url}` has scheme `{scheme}`; expected http")]
    UnsupportedScheme {
        /// The value given.
        url: String,
        /// Its scheme.
        scheme: String,
    },
    /// `base_url` carries a part an engine address has no use for.
    #[error("base_url `{url}` has {part}; expected only scheme, host, port and a path prefix")]
    UnexpectedUrlPart {
        /// The value given.
        url: String,
        /// Which part (`a query`, `a fragment`, `credentials`).
        part: &'static str,
    },
    /// A timeout is zero.
    #[error("{field} must be greater than zero")]
    ZeroTimeout {
        /// The config key.
        field: &'static str,
    },
    /// `served_model_name` is set but empty.
    #[error("served_model_name must not be empty; leave it unset to send each request's model")]
    EmptyServedModelName,
    /// `api_key` cannot be sent as an HTTP header value.
    #[error("api_key must be visible ASCII without line breaks")]
    InvalidApiKey,
    /// The HTTP client could not be built.
    #[error("cannot build the HTTP client: {message}")]
    Client {
        /// The client library's message.
        message: String,
    },
}

/// `Duration` as integer milliseconds.
mod millis {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        u64::deserialize(d).map(Duration::from_millis)
    }
}

/// `Option<Duration>` as integer milliseconds or null.
mod opt_millis {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        match d {
            Some(d) => super::millis::serialize(d, s),
            None => s.serialize_none(),
        }
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Option<Duration>, D::Error> {
        Option::<u64>::deserialize(d).map(|ms| ms.map(Duration::from_millis))
    }
}
