//! A mock engine: an in-process axum server on loopback that records each request and answers
//! with a scripted reply (a recorded exchange, a status, a stream that hangs or is cut), and
//! reports when a client walks away from a response before its end.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use futures::{Stream, StreamExt};
use kvroute_engines::{EngineKind, HttpEngine, HttpEngineConfig};
use kvroute_protocols::{LLMEngineOutput, PreprocessedRequest};
use kvroute_runtime::{Engine, EngineError, LlmResponse, RequestContext, ResponseStream};
use serde_json::Value;
use tokio::sync::mpsc;

/// How long a test waits for something that must happen; only a guard against hanging forever,
/// never an assertion about timing.
pub(crate) const HANG_GUARD: Duration = Duration::from_secs(20);

/// What the mock answers one request with.
#[derive(Debug, Clone)]
pub(crate) enum Reply {
    /// `status` with `content_type`, the body sent in `pieces` (`gap` apart), then `after`.
    Stream {
        status: u16,
        content_type: String,
        pieces: Vec<Bytes>,
        gap: Duration,
        after: After,
    },
    /// Never answer (not even headers).
    Stall,
}

/// What a streamed reply does after its pieces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum After {
    /// Ends the body.
    End,
    /// Sends nothing more and keeps the connection open.
    Hang,
    /// Breaks the connection mid-body once the test calls [`MockEngine::cut`] (so that the
    /// pieces before it are surely delivered first).
    Cut,
}

impl Reply {
    /// An event stream of `events` (each sent as one piece, `\n\n` appended), then `after`.
    pub(crate) fn sse(events: &[String], after: After) -> Self {
        Self::paced(events, Duration::ZERO, after)
    }

    /// Like [`Reply::sse`], with `gap` between one event and the next.
    pub(crate) fn paced(events: &[String], gap: Duration, after: After) -> Self {
        Reply::Stream {
            status: 200,
            content_type: "text/event-stream".to_owned(),
            pieces: events
                .iter()
                .map(|e| Bytes::from(format!("{e}\n\n")))
                .collect(),
            gap,
            after,
        }
    }

    /// A complete JSON answer with `status`.
    pub(crate) fn json(status: u16, body: &Value) -> Self {
        Reply::Stream {
            status,
            content_type: "application/json".to_owned(),
            pieces: vec![Bytes::from(body.to_string())],
            gap: Duration::ZERO,
            after: After::End,
        }
    }
}

/// One request the mock received.
#[derive(Debug, Clone)]
pub(crate) struct Recorded {
    pub(crate) method: String,
    pub(crate) path: String,
    pub(crate) headers: HeaderMap,
    /// The body as JSON (`Null` when empty).
    pub(crate) body: Value,
}

struct Shared {
    replies: Mutex<VecDeque<Reply>>,
    cut: tokio::sync::Notify,
    requests: mpsc::UnboundedSender<Recorded>,
    abandoned: mpsc::UnboundedSender<()>,
}

/// A running mock engine.
pub(crate) struct MockEngine {
    pub(crate) base_url: String,
    shared: Arc<Shared>,
    requests: mpsc::UnboundedReceiver<Recorded>,
    abandoned: mpsc::UnboundedReceiver<()>,
}

impl MockEngine {
    /// Starts a mock that answers its requests with `replies`, in order (the last one repeats).
    pub(crate) async fn start(replies: Vec<Reply>) -> Self {
        let (requests_tx, requests) = mpsc::unbounded_channel();
        let (abandoned_tx, abandoned) = mpsc::unbounded_channel();
        let shared = Arc::new(Shared {
            replies: Mutex::new(replies.into()),
            cut: tokio::sync::Notify::new(),
            requests: requests_tx,
            abandoned: abandoned_tx,
        });
        let app = axum::Router::new()
            .fallback(handle)
            .with_state(Arc::clone(&shared));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Self {
            base_url: format!("http://{addr}"),
            shared,
            requests,
            abandoned,
        }
    }

    /// The next request received.
    pub(crate) async fn request(&mut self) -> Recorded {
        tokio::time::timeout(HANG_GUARD, self.requests.recv())
            .await
            .expect("the engine got no request")
            .expect("mock alive")
    }

    /// Waits until a client abandons a response (drops the connection before the body ended,
    /// or before the answer was sent).
    pub(crate) async fn abandoned(&mut self) {
        tokio::time::timeout(HANG_GUARD, self.abandoned.recv())
            .await
            .expect("the client never dropped the connection")
            .expect("mock alive");
    }

    /// Breaks the connection of a reply that ends with [`After::Cut`].
    pub(crate) fn cut(&self) {
        self.shared.cut.notify_one();
    }

    /// Whether a response was abandoned so far.
    pub(crate) fn was_abandoned(&mut self) -> bool {
        self.abandoned.try_recv().is_ok()
    }
}

/// Reports an abandoned response when dropped before [`Watch::done`].
struct Watch {
    shared: Arc<Shared>,
    done: bool,
}

impl Watch {
    fn done(mut self) {
        self.done = true;
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        if !self.done {
            let _ = self.shared.abandoned.send(());
        }
    }
}

async fn handle(State(shared): State<Arc<Shared>>, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    let bytes = axum::body::to_bytes(body, usize::MAX)
        .await
        .unwrap_or_default();
    let body = if bytes.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&bytes)
            .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()))
    };
    let _ = shared.requests.send(Recorded {
        method: parts.method.to_string(),
        path: parts.uri.path().to_owned(),
        headers: parts.headers,
        body,
    });
    let reply = {
        let mut replies = shared.replies.lock().unwrap();
        if replies.len() > 1 {
            replies.pop_front()
        } else {
            replies.front().cloned()
        }
    }
    .expect("a reply for every request");
    let watch = Watch {
        shared: Arc::clone(&shared),
        done: false,
    };
    match reply {
        Reply::Stall => {
            // Dropped (and so reported) when the client goes away.
            let _watch = watch;
            futures::future::pending::<()>().await;
            unreachable!()
        }
        Reply::Stream {
            status,
            content_type,
            pieces,
            gap,
            after,
        } => {
            let body = Body::from_stream(body_stream(pieces, gap, after, watch));
            Response::builder()
                .status(StatusCode::from_u16(status).expect("status"))
                .header("content-type", content_type)
                .body(body)
                .expect("response")
        }
    }
}

fn body_stream(
    pieces: Vec<Bytes>,
    gap: Duration,
    after: After,
    watch: Watch,
) -> impl Stream<Item = Result<Bytes, std::io::Error>> + Send {
    async_stream::stream! {
        let watch = watch;
        for (i, piece) in pieces.into_iter().enumerate() {
            if i > 0 && !gap.is_zero() {
                tokio::time::sleep(gap).await;
            }
            yield Ok(piece);
        }
        match after {
            After::End => watch.done(),
            After::Hang => {
                let _watch = watch;
                futures::future::pending::<()>().await;
            }
            After::Cut => {
                watch.shared.cut.notified().await;
                watch.done();
                yield Err(std::io::Error::other("cut by the test"));
            }
        }
    }
}

/// An engine of `kind` in front of `mock`.
pub(crate) fn engine(kind: EngineKind, mock: &MockEngine) -> HttpEngine {
    HttpEngine::new(HttpEngineConfig::new(kind, &mock.base_url)).expect("valid config")
}

/// Everything one request produced: its items and the context's failure.
#[derive(Debug)]
pub(crate) struct Outcome {
    pub(crate) items: Vec<LlmResponse>,
    pub(crate) failure: Option<EngineError>,
}

impl Outcome {
    /// The data of every item, in order (panics on an error item).
    pub(crate) fn outputs(&self) -> Vec<&LLMEngineOutput> {
        self.items
            .iter()
            .map(|i| i.data.as_ref().unwrap_or_else(|| panic!("not data: {i:?}")))
            .collect()
    }

    /// All output token ids, concatenated.
    pub(crate) fn token_ids(&self) -> Vec<u32> {
        self.outputs()
            .iter()
            .flat_map(|o| o.token_ids.iter().copied())
            .collect()
    }

    /// The last item's output.
    pub(crate) fn last(&self) -> &LLMEngineOutput {
        self.outputs().last().copied().expect("an item")
    }

    /// The only item, which must be an error item; its message.
    pub(crate) fn error_message(&self) -> &str {
        assert_eq!(
            self.items.len(),
            1,
            "one error item expected: {:?}",
            self.items
        );
        assert!(
            self.failure.is_none(),
            "no context failure expected: {:?}",
            self.failure
        );
        self.items[0].error_message().expect("an error item")
    }

    /// The context's failure, which must be `Unreachable` (nothing reached the engine); its
    /// message.
    pub(crate) fn unreachable(&self) -> &str {
        match &self.failure {
            Some(EngineError::Unreachable { message }) => message,
            other => panic!(
                "expected an Unreachable failure, got {other:?} ({:?})",
                self.items
            ),
        }
    }

    /// The context's failure, which must be `Timeout` (nothing within the first-byte limit);
    /// its message.
    pub(crate) fn timed_out(&self) -> &str {
        match &self.failure {
            Some(EngineError::Timeout { message }) => message,
            other => panic!(
                "expected a Timeout failure, got {other:?} ({:?})",
                self.items
            ),
        }
    }

    /// The context's failure, which must be `Unavailable`; its message.
    pub(crate) fn unavailable(&self) -> &str {
        match &self.failure {
            Some(EngineError::Unavailable { message }) => message,
            other => panic!(
                "expected an Unavailable failure, got {other:?} ({:?})",
                self.items
            ),
        }
    }
}

/// Runs `request` through `engine` to the end of its stream.
pub(crate) async fn run(engine: &HttpEngine, request: PreprocessedRequest) -> Outcome {
    let context = RequestContext::new("req-1");
    let stream = engine
        .generate(request, context.clone())
        .expect("generate accepts the request");
    let items = tokio::time::timeout(HANG_GUARD, stream.collect::<Vec<_>>())
        .await
        .expect("the stream ended");
    Outcome {
        items,
        failure: context.failure(),
    }
}

/// Starts `request` and returns its stream and context.
pub(crate) fn start(
    engine: &HttpEngine,
    request: PreprocessedRequest,
) -> (ResponseStream<LlmResponse>, RequestContext) {
    let context = RequestContext::new("req-1");
    let stream = engine
        .generate(request, context.clone())
        .expect("generate accepts the request");
    (stream, context)
}

/// The next item of `stream` (`None` at its end).
pub(crate) async fn next(stream: &mut ResponseStream<LlmResponse>) -> Option<LlmResponse> {
    tokio::time::timeout(HANG_GUARD, stream.next())
        .await
        .expect("an item or the end")
}

/// A URL nothing listens on.
pub(crate) async fn refused_url() -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    drop(listener);
    format!("http://{addr}")
}

/// A recorded exchange: what kvroute asked, what the engine received and answered, and what
/// kvroute made of it. See `tests/fixtures/README.md`.
#[derive(Debug, Clone)]
pub(crate) struct Fixture {
    pub(crate) path: PathBuf,
    pub(crate) kind: EngineKind,
    pub(crate) input: PreprocessedRequest,
    pub(crate) served_model_name: Option<String>,
    pub(crate) request_path: String,
    pub(crate) request_headers: Vec<(String, String)>,
    pub(crate) request_body: Value,
    pub(crate) reply: Reply,
    pub(crate) expect: Value,
}

/// The fixtures directory of this crate.
pub(crate) fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// Every `*.json` fixture under `fixtures/<dir>`, sorted.
pub(crate) fn fixtures(dir: &str) -> Vec<Fixture> {
    let dir = fixtures_dir().join(dir);
    let mut paths: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("dir entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    paths.sort();
    assert!(!paths.is_empty(), "no fixtures in {}", dir.display());
    paths.iter().map(|p| load(p)).collect()
}

fn load(path: &Path) -> Fixture {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let v: Value =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let field = |name: &str| {
        v.get(name)
            .unwrap_or_else(|| panic!("{}: no `{name}`", path.display()))
            .clone()
    };
    let kind = serde_json::from_value(field("kind")).expect("kind");
    let input = serde_json::from_value(field("kvroute_request"))
        .unwrap_or_else(|e| panic!("{}: kvroute_request: {e}", path.display()));
    let request = field("request");
    let response = field("response");
    let status = response["status"].as_u64().expect("response.status") as u16;
    let reply = match response.get("events") {
        Some(Value::Array(events)) => {
            let events: Vec<String> = events
                .iter()
                .map(|e| match e {
                    Value::String(line) => line.clone(),
                    other => format!("data: {other}"),
                })
                .collect();
            let after = match response.get("after").and_then(Value::as_str) {
                None | Some("end") => After::End,
                Some("cut") => After::Cut,
                Some("hang") => After::Hang,
                Some(other) => panic!("{}: after = {other}", path.display()),
            };
            let mut reply = Reply::sse(&events, after);
            if let Reply::Stream { status: s, .. } = &mut reply {
                *s = status;
            }
            reply
        }
        _ => Reply::json(status, &response["body"]),
    };
    Fixture {
        path: path.to_owned(),
        kind,
        input,
        served_model_name: v
            .get("served_model_name")
            .and_then(Value::as_str)
            .map(str::to_owned),
        request_path: request["path"].as_str().expect("request.path").to_owned(),
        request_headers: request
            .get("headers")
            .and_then(Value::as_object)
            .map(|h| {
                h.iter()
                    .map(|(k, v)| (k.clone(), v.as_str().expect("header value").to_owned()))
                    .collect()
            })
            .unwrap_or_default(),
        request_body: request["body"].clone(),
        reply,
        expect: field("expect"),
    }
}

/// Replays `fixture` against a mock engine and checks the request sent and the outcome against
/// its `expect`: `token_ids`, `text`, `finish_reason`, `usage` (`prompt_tokens`,
/// `completion_tokens`, `cached_tokens`), `items` (the number of items), `error` (a substring of
/// the one error item) or `unavailable` (a substring of the context failure).
pub(crate) async fn check_fixture(fixture: &Fixture) {
    let name = fixture.path.display();
    let mut mock = MockEngine::start(vec![fixture.reply.clone()]).await;
    let mut config = HttpEngineConfig::new(fixture.kind, &mock.base_url);
    config.served_model_name = fixture.served_model_name.clone();
    let engine = HttpEngine::new(config).expect("valid config");
    let outcome = run(&engine, fixture.input.clone()).await;
    let got = mock.request().await;
    assert_eq!(got.method, "POST", "{name}");
    assert_eq!(got.path, fixture.request_path, "{name}: path");
    assert_eq!(got.body, fixture.request_body, "{name}: request body");
    for (header, value) in &fixture.request_headers {
        let sent = got.headers.get(header).and_then(|v| v.to_str().ok());
        assert_eq!(sent, Some(value.as_str()), "{name}: header {header}");
    }
    let expect = &fixture.expect;
    if let Some(error) = expect.get("error").and_then(Value::as_str) {
        // Output may precede the error item, which ends the stream.
        let (last, before) = outcome.items.split_last().expect("items");
        let message = last
            .error_message()
            .unwrap_or_else(|| panic!("{name}: {last:?}"));
        assert!(
            message.contains(error),
            "{name}: error item {message:?} lacks {error:?}"
        );
        assert!(
            outcome.failure.is_none(),
            "{name}: failure {:?}",
            outcome.failure
        );
        let ids: Vec<u32> = before
            .iter()
            .flat_map(|i| {
                i.data
                    .as_ref()
                    .expect("data before the error")
                    .token_ids
                    .clone()
            })
            .collect();
        let want = expect.get("token_ids").map(json_ids).unwrap_or_default();
        assert_eq!(ids, want, "{name}: token ids before the error");
        return;
    }
    if let Some(unavailable) = expect.get("unavailable").and_then(Value::as_str) {
        let message = outcome.unavailable();
        assert!(
            message.contains(unavailable),
            "{name}: failure {message:?} lacks {unavailable:?}"
        );
        if let Some(ids) = expect.get("token_ids") {
            assert_eq!(
                json_ids(ids),
                outcome.token_ids(),
                "{name}: token ids before the failure"
            );
        }
        return;
    }
    assert!(
        outcome.failure.is_none(),
        "{name}: failure {:?}",
        outcome.failure
    );
    let last = outcome.last();
    if let Some(ids) = expect.get("token_ids") {
        assert_eq!(outcome.token_ids(), json_ids(ids), "{name}: token ids");
        // With ids known, text comes with every output's ids (an engine that detokenizes
        // itself: vLLM, whose text the router relays and the fixture then checks) or with
        // none (the router detokenizes).
        let with_ids: Vec<_> = outcome
            .outputs()
            .into_iter()
            .filter(|o| !o.token_ids.is_empty())
            .collect();
        let with_text = with_ids.iter().filter(|o| o.text.is_some()).count();
        assert!(
            with_text == 0 || with_text == with_ids.len(),
            "{name}: {with_text} of {} outputs with ids carry text; expected all or none",
            with_ids.len()
        );
        assert!(
            with_text == 0 || expect.get("text").is_some(),
            "{name}: the engine's text is relayed, so the fixture must say which"
        );
    }
    if let Some(text) = expect.get("text").and_then(Value::as_str) {
        let got: String = outcome
            .outputs()
            .iter()
            .filter_map(|o| o.text.as_deref())
            .collect();
        assert_eq!(got, text, "{name}: text");
    }
    if let Some(reason) = expect.get("finish_reason") {
        let want = serde_json::from_value(reason.clone()).expect("finish_reason");
        assert_eq!(
            last.finish_reason.as_ref(),
            Some(&want),
            "{name}: finish reason"
        );
        let finished = outcome
            .outputs()
            .iter()
            .filter(|o| o.finish_reason.is_some())
            .count();
        assert_eq!(finished, 1, "{name}: exactly the last item finishes");
    }
    if let Some(usage) = expect.get("usage") {
        let got = last
            .completion_usage
            .as_ref()
            .unwrap_or_else(|| panic!("{name}: no usage"));
        assert_eq!(
            Some(u64::from(got.prompt_tokens)),
            usage["prompt_tokens"].as_u64(),
            "{name}"
        );
        assert_eq!(
            Some(u64::from(got.completion_tokens)),
            usage["completion_tokens"].as_u64(),
            "{name}"
        );
        let cached = got.prompt_tokens_details.and_then(|d| d.cached_tokens);
        assert_eq!(
            cached.map(u64::from),
            usage["cached_tokens"].as_u64(),
            "{name}: cached tokens"
        );
    }
    if let Some(items) = expect.get("items").and_then(Value::as_u64) {
        assert_eq!(
            outcome.items.len() as u64,
            items,
            "{name}: items {:?}",
            outcome.items
        );
    }
    if let Some(log_probs) = expect.get("log_probs") {
        let got: Vec<f64> = outcome
            .outputs()
            .iter()
            .flat_map(|o| o.log_probs.clone().unwrap_or_default())
            .collect();
        let want: Vec<f64> = serde_json::from_value(log_probs.clone()).expect("log_probs");
        assert_eq!(got, want, "{name}: log probs");
    }
}

fn json_ids(v: &Value) -> Vec<u32> {
    serde_json::from_value(v.clone()).expect("token id list")
}
