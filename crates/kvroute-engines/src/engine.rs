//! [`HttpEngine`]: the runtime's [`Engine`] served by an inference engine's HTTP API.

use std::error::Error as _;
use std::num::NonZeroU32;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::stream::BoxStream;
use futures::{Stream, StreamExt};
use kvroute_protocols::{Annotated, PreprocessedRequest};
use kvroute_runtime::{Engine, EngineError, LlmResponse, RequestContext, ResponseStream};
use reqwest::header::{ACCEPT, AUTHORIZATION, CONTENT_TYPE, HeaderValue};
use reqwest::{Response, StatusCode, Url};
use serde_json::Value;
use tokio::time::Instant;

use crate::config::{EngineConfigError, EngineKind, HttpEngineConfig};
use crate::dialect::{self, Built, Dialect, Target};
use crate::error::{HealthError, error_message, is_unavailable_status, refusal_code};
use crate::identify::{self, Answers, EngineIdentity, IdentifyError, PROBES};
use crate::load::{self, EngineLoad, LoadError};
use crate::stream::{Action, StreamState};

/// An [`Engine`] that serves each [`PreprocessedRequest`] through an inference engine's HTTP
/// API: the prompt goes as token ids (never re-tokenized), the answer streams back as output
/// token ids (text only from a plain OpenAI server), one
/// [`kvroute_protocols::LLMEngineOutput`] per chunk, the last with the finish reason and usage.
///
/// Failures are typed. An engine that cannot serve now (connection refused or lost, a timeout,
/// HTTP 429, 502, 503 or 504) fails the request's context with
/// [`EngineError::Unavailable`], which the worker reports as a worker loss the router may
/// migrate. An engine that refuses the request (another 4xx, 500, an error in the stream) or a
/// chunk that cannot be read gives one error item. Stopping the request or dropping its
/// stream drops the HTTP connection, which vLLM, SGLang and llama.cpp take as an abort; a stopped
/// stream ends with a `cancelled` output.
///
/// Cheap to clone: clones share one connection pool.
#[derive(Clone)]
pub struct HttpEngine {
    inner: Arc<Inner>,
}

struct Inner {
    config: HttpEngineConfig,
    client: reqwest::Client,
    /// The base URL, ending in `/`: endpoint paths join below it.
    base: Url,
    generate_url: Url,
    health_url: Url,
    metrics_url: Url,
    dialect: &'static dyn Dialect,
    auth: Option<HeaderValue>,
    /// The engine's context length, once [`HttpEngine::identify`] learned it: a prompt that
    /// cannot fit is refused without being sent.
    context_length: std::sync::OnceLock<u32>,
}

impl std::fmt::Debug for HttpEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpEngine")
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

/// The most of an error body read to quote it.
const MAX_ERROR_BODY: usize = 64 << 10;

/// How long the end of a stream (`[DONE]`, usage) may take after the finish before the finished
/// output goes out without it. Engines send it at once.
const FINISH_GRACE: Duration = Duration::from_secs(2);

/// The largest `/metrics` body read (vLLM's is some 100 KiB).
const MAX_METRICS_BODY: usize = 16 << 20;

/// How long an error body may take to arrive once its status is known.
const ERROR_BODY_TIMEOUT: Duration = Duration::from_secs(5);

impl HttpEngine {
    /// An engine client for `config`, validated: `base_url` must be an `http` URL without query,
    /// fragment or credentials, timeouts must be positive, a served model name non-empty.
    pub fn new(config: HttpEngineConfig) -> Result<Self, EngineConfigError> {
        let base = base_url(&config.base_url)?;
        for (field, timeout) in [
            ("connect_timeout_ms", Some(config.connect_timeout)),
            ("first_byte_timeout_ms", config.first_byte_timeout),
            ("idle_timeout_ms", config.idle_timeout),
            ("request_timeout_ms", config.request_timeout),
            ("health_timeout_ms", Some(config.health_timeout)),
        ] {
            if timeout.is_some_and(|t| t.is_zero()) {
                return Err(EngineConfigError::ZeroTimeout { field });
            }
        }
        if config.served_model_name.as_deref() == Some("") {
            return Err(EngineConfigError::EmptyServedModelName);
        }
        let auth = match &config.api_key {
            Some(key) => {
                let mut value = HeaderValue::from_str(&format!("Bearer {key}"))
                    .map_err(|_| EngineConfigError::InvalidApiKey)?;
                value.set_sensitive(true);
                Some(value)
            }
            None => None,
        };
        let dialect = dialect::for_kind(config.kind);
        let join = |path: &str| {
            base.join(path)
                .map_err(|e| EngineConfigError::InvalidBaseUrl {
                    url: config.base_url.clone(),
                    reason: e.to_string(),
                })
        };
        let generate_url = join(dialect.generate_path())?;
        let health_url = join(dialect.health_path())?;
        let metrics_url = join("metrics")?;
        // Engines are addressed directly: no proxy from the environment.
        let client = reqwest::Client::builder()
            .connect_timeout(config.connect_timeout)
            .tcp_nodelay(true)
            .no_proxy()
            .build()
            .map_err(|e| EngineConfigError::Client {
                message: error_chain(&e),
            })?;
        Ok(Self {
            inner: Arc::new(Inner {
                config,
                client,
                base,
                generate_url,
                health_url,
                metrics_url,
                dialect,
                auth,
                context_length: std::sync::OnceLock::new(),
            }),
        })
    }

    /// The configuration this engine was built from.
    pub fn config(&self) -> &HttpEngineConfig {
        &self.inner.config
    }

    /// The engine's dialect.
    pub fn kind(&self) -> EngineKind {
        self.inner.config.kind
    }

    /// The URL requests are sent to.
    pub fn generate_url(&self) -> &str {
        self.inner.generate_url.as_str()
    }

    /// Asks the engine whether it can serve: `GET /health` (vLLM, SGLang, TensorRT-LLM,
    /// llama.cpp, which answers 503 while its model loads) or `GET /v1/models` (OpenAI), within
    /// the configured health timeout.
    pub async fn health(&self) -> Result<(), HealthError> {
        let inner = &self.inner;
        let url = inner.health_url.to_string();
        let mut request = inner
            .client
            .get(inner.health_url.clone())
            .timeout(inner.config.health_timeout);
        if let Some(auth) = &inner.auth {
            request = request.header(AUTHORIZATION, auth.clone());
        }
        let response = request.send().await.map_err(|e| HealthError::Unreachable {
            url: url.clone(),
            message: error_chain(&e),
        })?;
        let status = response.status();
        if status.is_success() {
            return Ok(());
        }
        let body = read_error_body(response).await;
        Err(HealthError::Unhealthy {
            url,
            status: status.as_u16(),
            message: error_message(&body),
        })
    }

    /// Asks the engine what it is (see the table in `identify`): refuses an engine that answers
    /// like another kind than configured, or not like its kind at all, and learns its context
    /// length, from then on refusing prompts that cannot fit before sending them (an HTTP 400
    /// `context_length_exceeded` error item, as the engine itself would answer).
    pub async fn identify(&self) -> Result<EngineIdentity, IdentifyError> {
        let inner = &self.inner;
        let mut answers = Answers::default();
        for (slot, path) in [
            &mut answers.props,
            &mut answers.model_info,
            &mut answers.models,
        ]
        .into_iter()
        .zip(PROBES)
        {
            *slot = self.probe(path).await;
        }
        let identity = identify::check(&inner.config.base_url, inner.config.kind, &answers)?;
        if let Some(n) = identity.context_length {
            let _ = inner.context_length.set(n);
        }
        Ok(identity)
    }

    /// `GET path` on the engine: its JSON body, or `None` for anything else.
    async fn probe(&self, path: &str) -> Option<Value> {
        let inner = &self.inner;
        let url = inner.base.join(path).ok()?;
        let mut request = inner
            .client
            .get(url)
            .header(ACCEPT, "application/json")
            .timeout(inner.config.health_timeout);
        if let Some(auth) = &inner.auth {
            request = request.header(AUTHORIZATION, auth.clone());
        }
        let response = request.send().await.ok()?;
        if !response.status().is_success() {
            return None;
        }
        response.json().await.ok()
    }

    /// The engine's context length, once [`Self::identify`] learned it.
    pub fn context_length(&self) -> Option<u32> {
        self.inner.context_length.get().copied()
    }

    /// The engine's own load, one [`EngineLoad`] per data-parallel rank, read from its
    /// Prometheus `GET /metrics` (on the base URL, with the API key, within the configured
    /// health timeout). `block_size` is the KV block size the router counts in: KV use stated
    /// in tokens, or in blocks of another size, is given in blocks of `block_size`, rounded up.
    ///
    /// vLLM and llama.cpp (`--metrics`) and SGLang (`--enable-metrics`) are read; TensorRT-LLM
    /// and plain OpenAI servers give [`LoadError::Unsupported`] without a request. Which
    /// metrics are read, and when KV use is `None`, is in the crate documentation.
    pub async fn load(&self, block_size: NonZeroU32) -> Result<Vec<EngineLoad>, LoadError> {
        let inner = &self.inner;
        let kind = inner.config.kind;
        if !kind.publishes_load() {
            return Err(LoadError::Unsupported { kind });
        }
        let url = inner.metrics_url.to_string();
        let mut request = inner
            .client
            .get(inner.metrics_url.clone())
            .header(ACCEPT, "text/plain")
            .timeout(inner.config.health_timeout);
        if let Some(auth) = &inner.auth {
            request = request.header(AUTHORIZATION, auth.clone());
        }
        let unreachable = |e: reqwest::Error| LoadError::Unreachable {
            url: url.clone(),
            message: error_chain(&e),
        };
        let response = request.send().await.map_err(unreachable)?;
        let status = response.status();
        if !status.is_success() {
            let body = read_error_body(response).await;
            return Err(LoadError::Status {
                url,
                status: status.as_u16(),
                message: error_message(&body),
            });
        }
        let mut body = Vec::new();
        let mut stream = response.bytes_stream();
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(unreachable)?;
            if body.len() + chunk.len() > MAX_METRICS_BODY {
                return Err(LoadError::Malformed {
                    url,
                    message: format!("the body is larger than {MAX_METRICS_BODY} bytes"),
                });
            }
            body.extend_from_slice(&chunk);
        }
        let text = std::str::from_utf8(&body).map_err(|e| LoadError::Malformed {
            url: url.clone(),
            message: format!("the body is not UTF-8 ({e})"),
        })?;
        load::read(kind, text, block_size, &url)
    }
}

impl Engine for HttpEngine {
    type Request = PreprocessedRequest;
    type Response = LlmResponse;

    fn generate(
        &self,
        request: PreprocessedRequest,
        context: RequestContext,
    ) -> Result<ResponseStream<LlmResponse>, EngineError> {
        let inner = &self.inner;
        dialect::check_supported(&request)?;
        if let Some(&context) = inner.context_length.get()
            && request.token_ids.len() >= context as usize
        {
            let message = format!(
                "{} engine at {} refused the request: the prompt has {} tokens and the engine's \
                 context holds {context}",
                inner.config.kind,
                inner.config.base_url,
                request.token_ids.len()
            );
            let refusal =
                Annotated::from_engine_error(message, 400, Some("context_length_exceeded"));
            return Ok(Box::pin(futures::stream::iter([refusal])));
        }
        let model = inner
            .config
            .served_model_name
            .as_deref()
            .unwrap_or(&request.model);
        let target = Target {
            model,
            max_tokens: request
                .stop_conditions
                .max_tokens
                .or(inner.config.default_max_tokens),
            role: inner.config.role,
        };
        let built = inner.dialect.build(&request, &target)?;
        let parser = inner.dialect.parser(&request);
        let mut state = StreamState::new(inner.config.kind, parser, request.token_ids.len());
        if built.whole {
            state = state.whole();
        }
        let driver = Driver::new(Arc::clone(inner), built, state, context.clone());
        Ok(Box::pin(drive(driver, context)))
    }
}

/// The response stream: runs the driver and carries out its actions.
fn drive(mut driver: Driver, context: RequestContext) -> impl Stream<Item = LlmResponse> + Send {
    async_stream::stream! {
        loop {
            for action in driver.next().await {
                match action {
                    Action::Emit(item) => {
                        if let Some(error) = &item.error {
                            tracing::debug!(request = context.id(), %error, "engine refused");
                        }
                        yield *item;
                    }
                    Action::Fail(error) => {
                        match &error {
                            EngineError::Timeout { .. } => tracing::warn!(
                                request = context.id(),
                                %error,
                                "engine sent nothing within its first-byte limit; the request \
                                 goes back to the router (raise first_byte_timeout_ms / \
                                 --first-byte-timeout for longer prefills)"
                            ),
                            _ => tracing::warn!(request = context.id(), %error, "engine unavailable"),
                        }
                        context.fail(error);
                    }
                    Action::End => return,
                }
            }
        }
    }
}

/// One request's HTTP exchange, step by step. Dropping it drops the connection.
struct Driver {
    inner: Arc<Inner>,
    context: RequestContext,
    state: StreamState,
    phase: Phase,
    request_deadline: Option<Instant>,
    first_byte_deadline: Option<Instant>,
    started_body: bool,
    /// The body's read deadline, re-armed lazily (see [`Deadline`]).
    deadline: Deadline,
}

enum Phase {
    Send(Built),
    Body(BoxStream<'static, reqwest::Result<Bytes>>),
    Ended,
}

/// What the send step came to.
enum Sent {
    Stopped,
    TimedOut,
    Failed(reqwest::Error),
    Response(Response),
}

/// What one read of the body came to.
enum Read {
    Stopped,
    TimedOut,
    Chunk(Bytes),
    Failed(reqwest::Error),
    Eof,
}

impl Driver {
    fn new(inner: Arc<Inner>, built: Built, state: StreamState, context: RequestContext) -> Self {
        let start = Instant::now();
        let request_deadline = inner.config.request_timeout.map(|t| start + t);
        let first_byte_deadline = earliest(
            inner.config.first_byte_timeout.map(|t| start + t),
            request_deadline,
        );
        Self {
            inner,
            context,
            state,
            phase: Phase::Send(built),
            request_deadline,
            first_byte_deadline,
            started_body: false,
            deadline: Deadline::default(),
        }
    }

    /// The next actions; the last batch ends with [`Action::End`].
    async fn next(&mut self) -> Vec<Action> {
        let actions = match std::mem::replace(&mut self.phase, Phase::Ended) {
            Phase::Send(built) => self.send(built).await,
            Phase::Body(body) => self.read(body).await,
            Phase::Ended => vec![Action::End],
        };
        if self.state.is_ended() || matches!(actions.last(), Some(Action::End)) {
            // Drop the connection now, not when the consumer drops the stream.
            self.phase = Phase::Ended;
        }
        actions
    }

    async fn send(&mut self, built: Built) -> Vec<Action> {
        if self.context.is_stopped() {
            return self.state.stopped();
        }
        let inner = &self.inner;
        let accept = if built.whole {
            "application/json"
        } else {
            "text/event-stream"
        };
        let mut request = inner
            .client
            .post(inner.generate_url.clone())
            .header(CONTENT_TYPE, "application/json")
            .header(ACCEPT, accept)
            .body(built.body);
        for (name, value) in built.headers {
            request = request.header(name, value);
        }
        if let Some(auth) = &inner.auth {
            request = request.header(AUTHORIZATION, auth.clone());
        }
        let sent = tokio::select! {
            biased;
            () = self.context.stopped() => Sent::Stopped,
            r = until(self.first_byte_deadline, request.send()) => match r {
                None => Sent::TimedOut,
                Some(Ok(response)) => Sent::Response(response),
                Some(Err(e)) => Sent::Failed(e),
            },
        };
        match sent {
            Sent::Stopped => self.state.stopped(),
            Sent::TimedOut => self.timed_out(),
            // Nothing reached the engine: the router may send the request elsewhere for free.
            Sent::Failed(e) if e.is_connect() => {
                let message = format!(
                    "{} engine at {} cannot be reached: {}",
                    self.inner.config.kind,
                    self.inner.generate_url,
                    error_chain(&e)
                );
                vec![
                    Action::Fail(EngineError::Unreachable { message }),
                    Action::End,
                ]
            }
            Sent::Failed(e) => self.unavailable(error_chain(&e)),
            Sent::Response(response) => self.respond(response).await,
        }
    }

    async fn respond(&mut self, response: Response) -> Vec<Action> {
        let status = response.status();
        if !status.is_success() {
            return self.status_error(status, response).await;
        }
        let (expected, what) = if self.state.reads_whole() {
            ("application/json", "a JSON document")
        } else {
            ("text/event-stream", "an event stream")
        };
        let content_type = response
            .headers()
            .get(CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or(expected)
            .to_owned();
        if !content_type.starts_with(expected) {
            let body = read_error_body(response).await;
            let message = format!(
                "{} engine at {} answered `{content_type}` instead of {what}: {}",
                self.inner.config.kind,
                self.inner.generate_url,
                crate::error::excerpt(&body)
            );
            return vec![
                Action::Emit(Box::new(Annotated::from_error(message))),
                Action::End,
            ];
        }
        self.phase = Phase::Body(response.bytes_stream().boxed());
        Vec::new()
    }

    async fn status_error(&mut self, status: StatusCode, response: Response) -> Vec<Action> {
        let body = tokio::select! {
            biased;
            () = self.context.stopped() => None,
            body = read_error_body(response) => Some(body),
        };
        let Some(body) = body else {
            return self.state.stopped();
        };
        let message = error_message(&body);
        let kind = self.inner.config.kind;
        let url = &self.inner.generate_url;
        if is_unavailable_status(status.as_u16()) {
            self.unavailable(format!("HTTP {status}: {message}"))
        } else {
            let code = refusal_code(&body);
            let message =
                format!("{kind} engine at {url} refused the request: HTTP {status}: {message}");
            vec![
                Action::Emit(Box::new(Annotated::from_engine_error(
                    message,
                    status.as_u16(),
                    code,
                ))),
                Action::End,
            ]
        }
    }

    async fn read(&mut self, mut body: BoxStream<'static, reqwest::Result<Bytes>>) -> Vec<Action> {
        let mut deadline = if self.started_body {
            earliest(
                self.inner.config.idle_timeout.map(|t| Instant::now() + t),
                self.request_deadline,
            )
        } else {
            self.first_byte_deadline
        };
        if self.state.is_finishing() {
            // The output is complete; a server that never ends its stream must not hold it.
            deadline = earliest(deadline, Some(Instant::now() + FINISH_GRACE));
        }
        let read = tokio::select! {
            biased;
            () = self.context.stopped() => Read::Stopped,
            r = body.next() => match r {
                Some(Ok(chunk)) => Read::Chunk(chunk),
                Some(Err(e)) => Read::Failed(e),
                None => Read::Eof,
            },
            () = self.deadline.passes(deadline) => Read::TimedOut,
        };
        match read {
            Read::Stopped => self.state.stopped(),
            Read::TimedOut if !self.started_body => self.timed_out(),
            Read::TimedOut => self
                .state
                .body_error("timed out waiting for the next piece of the stream".to_owned()),
            Read::Failed(e) => self.state.body_error(error_chain(&e)),
            Read::Eof => self.state.end_of_body(),
            Read::Chunk(chunk) => {
                self.started_body = true;
                let actions = self.state.feed(&chunk);
                if !self.state.is_ended() {
                    self.phase = Phase::Body(body);
                }
                actions
            }
        }
    }

    fn unavailable(&self, what: String) -> Vec<Action> {
        let message = format!(
            "{} engine at {} is unavailable: {what}",
            self.inner.config.kind, self.inner.generate_url
        );
        vec![
            Action::Fail(EngineError::Unavailable { message }),
            Action::End,
        ]
    }

    /// Nothing arrived within the first-byte limit: the request is abandoned before any output.
    fn timed_out(&self) -> Vec<Action> {
        let message = format!(
            "{} engine at {} sent nothing within the first-byte limit of {:?}",
            self.inner.config.kind,
            self.inner.generate_url,
            self.first_byte_limit()
        );
        vec![Action::Fail(EngineError::Timeout { message }), Action::End]
    }

    /// The time allowed until the first byte of the body.
    fn first_byte_limit(&self) -> Duration {
        let config = &self.inner.config;
        match (config.first_byte_timeout, config.request_timeout) {
            (Some(a), Some(b)) => a.min(b),
            (a, b) => a.or(b).unwrap_or_default(),
        }
    }
}

/// A read deadline that moves with every piece of a stream without touching the timer each
/// time: the idle limit pushes the deadline later on every chunk, and re-arming a tokio timer
/// per chunk (one timer-wheel removal and insertion per token) was 3% of `kvroute serve`'s CPU
/// on a streaming workload. The timer stays armed at the deadline it was last set to; when that
/// passes before the current deadline, it is re-armed once, so it fires at most once per idle
/// limit unless the deadline moves earlier.
#[derive(Default)]
struct Deadline {
    timer: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl Deadline {
    /// Completes once `deadline` has passed; never without one.
    async fn passes(&mut self, deadline: Option<Instant>) {
        let Some(deadline) = deadline else {
            return std::future::pending().await;
        };
        let timer = match &mut self.timer {
            Some(timer) => {
                if timer.deadline() > deadline {
                    timer.as_mut().reset(deadline);
                }
                timer
            }
            None => self
                .timer
                .insert(Box::pin(tokio::time::sleep_until(deadline))),
        };
        loop {
            timer.as_mut().await;
            if Instant::now() >= deadline {
                return;
            }
            timer.as_mut().reset(deadline);
        }
    }
}

/// `future`, or `None` once `deadline` passes.
async fn until<F: Future>(deadline: Option<Instant>, future: F) -> Option<F::Output> {
    match deadline {
        Some(deadline) => tokio::time::timeout_at(deadline, future).await.ok(),
        None => Some(future.await),
    }
}

fn earliest(a: Option<Instant>, b: Option<Instant>) -> Option<Instant> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// Up to [`MAX_ERROR_BODY`] bytes of an error response, as text; whatever arrived if the body
/// fails or takes longer than [`ERROR_BODY_TIMEOUT`].
async fn read_error_body(response: Response) -> String {
    let mut body = Vec::new();
    let mut stream = response.bytes_stream();
    let read = async {
        while let Some(Ok(chunk)) = stream.next().await {
            let room = MAX_ERROR_BODY.saturating_sub(body.len());
            body.extend_from_slice(&chunk[..chunk.len().min(room)]);
            if body.len() >= MAX_ERROR_BODY {
                break;
            }
        }
    };
    let _ = tokio::time::timeout(ERROR_BODY_TIMEOUT, read).await;
    String::from_utf8_lossy(&body).into_owned()
}

/// An error and its sources, joined (reqwest's own message names only the outermost layer).
fn error_chain(e: &reqwest::Error) -> String {
    let mut message = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !message.contains(&text) {
            message.push_str(": ");
            message.push_str(&text);
        }
        source = s.source();
    }
    message
}

/// `url` checked and made a directory (ending in `/`), so endpoint paths join below it.
fn base_url(url: &str) -> Result<Url, EngineConfigError> {
    let mut parsed = Url::parse(url.trim()).map_err(|e| EngineConfigError::InvalidBaseUrl {
        url: url.to_owned(),
        reason: e.to_string(),
    })?;
    if parsed.cannot_be_a_base() {
        // `localhost:8000` parses as scheme `localhost`.
        return Err(EngineConfigError::InvalidBaseUrl {
            url: url.to_owned(),
            reason: "no `http://` before the host".to_owned(),
        });
    }
    if parsed.scheme() != "http" {
        return Err(EngineConfigError::UnsupportedScheme {
            url: url.to_owned(),
            scheme: parsed.scheme().to_owned(),
        });
    }
    if parsed.host_str().is_none_or(str::is_empty) {
        return Err(EngineConfigError::InvalidBaseUrl {
            url: url.to_owned(),
            reason: "no host".to_owned(),
        });
    }
    let part = if parsed.query().is_some() {
        Some("a query")
    } else if parsed.fragment().is_some() {
        Some("a fragment")
    } else if !parsed.username().is_empty() || parsed.password().is_some() {
        Some("credentials")
    } else {
        None
    };
    if let Some(part) = part {
        return Err(EngineConfigError::UnexpectedUrlPart {
            url: url.to_owned(),
            part,
        });
    }
    if !parsed.path().ends_with('/') {
        let path = format!("{}/", parsed.path());
        parsed.set_path(&path);
    }
    Ok(parsed)
}

#[cfg(test)]
mod tests;
