//! Migration through every engine dialect (issue 29, item 3), the real stack in-process: two fake
//! HTTP engines of one dialect (axum on loopback, speaking that dialect's streaming format as
//! kvroute-engines reads it), each behind an `HttpEngine` served by a `WorkerServer` and listed
//! in discovery, a `KvPushRouter`, and the HTTP frontend, driven with a streamed
//! `/v1/completions` request whose prompt is token ids.
//!
//! The first engine to get a request streams three tokens and then breaks the connection
//! mid-body (a cut, not a clean end); the other serves whatever it gets. For the dialects that
//! return token ids (vllm, sglang, trtllm, llamacpp) the second engine must receive the original
//! prompt plus exactly the tokens already streamed, with the output budget reduced by them, and
//! the client must read one continuous answer (both engines' tokens in order, nothing repeated),
//! a finish reason, the usage of every output token, and `[DONE]`. For the text-only `openai`
//! dialect nothing can be continued: the client reads the first engine's text once, then an
//! error saying the answer cannot be continued. Either way every load gauge returns to zero.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::response::Response;
use futures::StreamExt;
use kvroute_engines::{EngineKind, HttpEngine, HttpEngineConfig};
use kvroute_protocols::WorkerWithDpRank;
use kvroute_router::http::{AppState, HttpConfig, serve};
use kvroute_router::tokenizer::{MockTokenizer, Tokenizer};
use kvroute_router::{
    KV_EVENTS_METADATA_KEY, KvPushRouter, KvPushRouterConfig, ModelRegistry, Policy,
};
use kvroute_runtime::{
    Discovery, EventPlane, InProcessDiscovery, InProcessEventPlane, InstanceInfo, Lease,
    WorkerServer, WorkerServerConfig,
};
use parking_lot::Mutex;
use serde_json::{Value, json};
use tokio::sync::{Notify, oneshot};

/// The longest any one wait may take: a guard against hanging, not a timing assertion.
const HANG_GUARD: Duration = Duration::from_secs(5);

const BLOCK: u32 = 4;

/// The client's prompt, as token ids (word ids of the mock tokenizer: 16 and above).
const PROMPT: [u32; 10] = [1000, 1001, 1002, 1003, 1004, 1005, 1006, 1007, 1008, 1009];

/// The client's output budget.
const MAX_TOKENS: u32 = 8;

/// What the first engine streams before its connection breaks (token dialects).
const FIRST_TOKENS: [u32; 3] = [501, 502, 503];

/// What the first engine streams before its connection breaks (`openai`: text only).
const FIRST_WORDS: [&str; 3] = ["alpha ", "beta ", "gamma "];

/// The `i`-th token a continuing engine generates.
fn second_token(i: u32) -> u32 {
    601 + i
}

/// The `i`-th word a continuing `openai` engine generates.
fn second_word(i: u32) -> String {
    format!("second{i} ")
}

/// The mock model's text of `ids`, as the router renders it.
fn decode(ids: &[u32]) -> String {
    MockTokenizer
        .decode(ids)
        .expect("the mock tokenizer decodes")
}

/// The answer's text as the client reads it for `ids`: vLLM's own text, which the router
/// relays (each token after the prompt, a space then its word, as vLLM detokenizes in the
/// prompt's context), or the router's detokenization of the ids for the dialects that return
/// ids alone.
fn answer_text(kind: EngineKind, ids: &[u32]) -> String {
    match kind {
        EngineKind::Vllm => ids
            .iter()
            .map(|&id| format!(" {}", MockTokenizer::render_id(id)))
            .collect(),
        _ => decode(ids),
    }
}

// --- The fake engines -------------------------------------------------------------------------

/// One generation request an engine received.
#[derive(Debug, Clone)]
struct Received {
    /// Which of the two engines (0 or 1).
    engine: usize,
    path: String,
    body: Value,
}

/// What the two engines of a case share: the dialect, every generation request in arrival
/// order, and the signal that breaks the first engine's connection.
struct Script {
    kind: EngineKind,
    received: Mutex<Vec<Received>>,
    cut: Notify,
}

impl Script {
    fn received(&self) -> Vec<Received> {
        self.received.lock().clone()
    }
}

fn generate_path(kind: EngineKind) -> &'static str {
    match kind {
        EngineKind::Sglang => "/generate",
        EngineKind::Llamacpp => "/completion",
        _ => "/v1/completions",
    }
}

/// The prompt ids of a generation request body, as the dialect sends them.
fn prompt_of(kind: EngineKind, body: &Value) -> Option<Vec<u32>> {
    let ids = match kind {
        EngineKind::Sglang => &body["input_ids"],
        _ => &body["prompt"],
    };
    serde_json::from_value(ids.clone()).ok()
}

/// The output budget of a generation request body, as the dialect sends it.
fn max_tokens_of(kind: EngineKind, body: &Value) -> Option<u32> {
    let max = match kind {
        EngineKind::Sglang => &body["sampling_params"]["max_new_tokens"],
        EngineKind::Llamacpp => &body["n_predict"],
        _ => &body["max_tokens"],
    };
    max.as_u64().and_then(|m| u32::try_from(m).ok())
}

/// The `data:` payloads an engine of `kind` streams for a prompt of `prompt` tokens: `ids` (or,
/// for `openai`, `words`), then, when `finished`, the finish (`length`), usage and end of stream
/// exactly as the engine sends them (see the fixtures under
/// crates/kvroute-engines/tests/fixtures/).
fn events(
    kind: EngineKind,
    prompt: &[u32],
    ids: &[u32],
    words: &[String],
    finished: bool,
) -> Vec<String> {
    let p = prompt.len();
    let mut out = Vec::new();
    match kind {
        EngineKind::Vllm | EngineKind::Trtllm => {
            let n = ids.len();
            for (k, &id) in ids.iter().enumerate() {
                let last = finished && k + 1 == n;
                let finish = if last { json!("length") } else { Value::Null };
                let choice = if kind == EngineKind::Vllm {
                    json!({
                        "index": 0, "text": format!(" {}", MockTokenizer::render_id(id)),
                        "logprobs": null, "finish_reason": finish, "stop_reason": null,
                        "prompt_token_ids": if k == 0 { json!(prompt) } else { Value::Null },
                        "token_ids": [id], "weight_versions": null
                    })
                } else {
                    json!({
                        "index": 0, "text": "", "token_ids": [id], "logprobs": null,
                        "finish_reason": finish, "stop_reason": null,
                        "avg_decoded_tokens_per_iter": null
                    })
                };
                let mut chunk = json!({
                    "id": "cmpl-1", "object": "text_completion", "created": 1767225600,
                    "model": "mock", "choices": [choice]
                });
                if kind == EngineKind::Trtllm {
                    chunk["usage"] = Value::Null;
                }
                out.push(chunk.to_string());
            }
            if finished {
                out.push(
                    json!({
                        "id": "cmpl-1", "object": "text_completion", "created": 1767225600,
                        "model": "mock", "choices": [],
                        "usage": {"prompt_tokens": p, "total_tokens": p + n, "completion_tokens": n}
                    })
                    .to_string(),
                );
                out.push("[DONE]".to_owned());
            }
        }
        EngineKind::Openai => {
            let n = words.len();
            for (k, word) in words.iter().enumerate() {
                let last = finished && k + 1 == n;
                out.push(
                    json!({
                        "id": "cmpl-1", "object": "text_completion", "created": 1767225600,
                        "choices": [{
                            "text": word, "index": 0, "logprobs": null,
                            "finish_reason": if last { json!("length") } else { Value::Null }
                        }],
                        "model": "mock", "usage": null
                    })
                    .to_string(),
                );
            }
            if finished {
                out.push(
                    json!({
                        "id": "cmpl-1", "object": "text_completion", "created": 1767225600,
                        "choices": [], "model": "mock",
                        "usage": {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}
                    })
                    .to_string(),
                );
                out.push("[DONE]".to_owned());
            }
        }
        EngineKind::Sglang => {
            // SGLang's default: every chunk repeats the whole output so far.
            let n = ids.len();
            for k in 0..n {
                let last = finished && k + 1 == n;
                let so_far = &ids[..=k];
                out.push(
                    json!({
                        "text": decode(so_far),
                        "output_ids": so_far,
                        "meta_info": {
                            "id": "5d2c0a9e7b3f4e21",
                            "finish_reason": if last {
                                json!({"type": "length", "length": n})
                            } else {
                                Value::Null
                            },
                            "prompt_tokens": p,
                            "weight_version": "default",
                            "completion_tokens": k + 1,
                            "cached_tokens": 0
                        }
                    })
                    .to_string(),
                );
            }
            if finished {
                out.push("[DONE]".to_owned());
            }
        }
        EngineKind::Llamacpp => {
            let n = ids.len();
            for (k, &id) in ids.iter().enumerate() {
                out.push(
                    json!({
                        "index": 0, "content": format!(" {}", MockTokenizer::render_id(id)),
                        "tokens": [id], "stop": false, "id_slot": -1,
                        "tokens_predicted": k + 1, "tokens_evaluated": p
                    })
                    .to_string(),
                );
            }
            if finished {
                // The last chunk ends the body; no `[DONE]` follows.
                out.push(
                    json!({
                        "index": 0, "content": "", "tokens": [], "stop": true, "id_slot": 0,
                        "tokens_predicted": n, "tokens_evaluated": p, "stop_type": "limit",
                        "stopping_word": "", "tokens_cached": p + n, "truncated": false,
                        "timings": {"cache_n": 0, "prompt_n": p, "predicted_n": n}
                    })
                    .to_string(),
                );
            }
        }
    }
    out
}

/// Answers one request to fake engine `engine`: health and model probes with `{}`; the first
/// generation request of the case with three tokens and then a broken connection (once the
/// test signals it, so that the tokens surely reached the client first); any later one with
/// its whole budget and a clean end.
async fn handle(
    State((script, engine)): State<(Arc<Script>, usize)>,
    request: Request,
) -> Response {
    let kind = script.kind;
    let (parts, body) = request.into_parts();
    let bytes = axum::body::to_bytes(body, 1 << 20)
        .await
        .unwrap_or_default();
    let path = parts.uri.path().to_owned();
    if path != generate_path(kind) {
        return Response::builder()
            .header("content-type", "application/json")
            .body(Body::from("{}"))
            .expect("response");
    }
    let body: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    let prompt = prompt_of(kind, &body).unwrap_or_default();
    let max = max_tokens_of(kind, &body).unwrap_or(16);
    let first = {
        let mut received = script.received.lock();
        received.push(Received { engine, path, body });
        received.len() == 1
    };
    let payloads = if first {
        let words: Vec<String> = FIRST_WORDS.iter().map(|w| (*w).to_owned()).collect();
        events(kind, &prompt, &FIRST_TOKENS, &words, false)
    } else {
        let ids: Vec<u32> = (0..max).map(second_token).collect();
        let words: Vec<String> = (0..max).map(second_word).collect();
        events(kind, &prompt, &ids, &words, true)
    };
    let pieces = futures::stream::iter(
        payloads
            .into_iter()
            .map(|p| Ok::<_, std::io::Error>(Bytes::from(format!("data: {p}\n\n")))),
    );
    let body = if first {
        let script = Arc::clone(&script);
        Body::from_stream(pieces.chain(futures::stream::once(async move {
            script.cut.notified().await;
            Err(std::io::Error::other("the engine dropped the connection"))
        })))
    } else {
        Body::from_stream(pieces)
    };
    Response::builder()
        .header("content-type", "text/event-stream")
        .body(body)
        .expect("response")
}

/// Starts fake engine `engine` of the case; its base URL.
async fn start_engine(script: &Arc<Script>, engine: usize) -> String {
    let app = axum::Router::new()
        .fallback(handle)
        .with_state((Arc::clone(script), engine));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind a fake engine");
    let addr = listener.local_addr().expect("the fake engine's address");
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    format!("http://{addr}")
}

// --- The stack --------------------------------------------------------------------------------

struct Stack {
    script: Arc<Script>,
    router: KvPushRouter,
    base: String,
    client: reqwest::Client,
    _workers: Vec<(WorkerServer, Lease)>,
    _stop: oneshot::Sender<()>,
}

impl Stack {
    /// Two fake engines of `kind` behind two workers (ids 1 and 2), a KV router over them and
    /// the HTTP frontend, all on loopback.
    async fn start(kind: EngineKind) -> Stack {
        let script = Arc::new(Script {
            kind,
            received: Mutex::new(Vec::new()),
            cut: Notify::new(),
        });
        let discovery = InProcessDiscovery::new(Duration::from_secs(30));
        let mut workers = Vec::new();
        for (engine, id) in [(0, 1), (1, 2)] {
            let base_url = start_engine(&script, engine).await;
            let http = HttpEngine::new(HttpEngineConfig::new(kind, base_url)).expect("config");
            let server =
                WorkerServer::bind("127.0.0.1:0", Arc::new(http), WorkerServerConfig::new(id))
                    .await
                    .expect("bind a worker");
            let mut info = InstanceInfo::new(id, server.local_addr().to_string(), BLOCK);
            info.metadata
                .insert(KV_EVENTS_METADATA_KEY.to_owned(), "false".to_owned());
            let lease = discovery.register(info).await.expect("register the worker");
            workers.push((server, lease));
        }
        let plane: Arc<dyn EventPlane> = Arc::new(InProcessEventPlane::new(4096));
        let mut config = KvPushRouterConfig::new(BLOCK);
        config.core.policy = Policy::Kv;
        let router = KvPushRouter::start(config, discovery.watch(), plane)
            .await
            .expect("start the router");
        eventually("the router knows both workers", || {
            router.with_core(|c| c.workers().count()) == 2
        })
        .await;
        let http_config = HttpConfig {
            keep_alive: Duration::from_millis(100),
            ..HttpConfig::default()
        };
        let state = AppState::new(router.clone(), ModelRegistry::mock("mock"), http_config);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the frontend");
        let base = format!(
            "http://{}",
            listener.local_addr().expect("frontend address")
        );
        let (stop, stopped) = oneshot::channel::<()>();
        tokio::spawn(serve(listener, state, async move {
            let _ = stopped.await;
        }));
        Stack {
            script,
            router,
            base,
            client: reqwest::Client::builder()
                .timeout(HANG_GUARD)
                .no_proxy()
                .build()
                .expect("HTTP client"),
            _workers: workers,
            _stop: stop,
        }
    }

    /// Sends the streamed completion request (the prompt as ids, usage asked for).
    async fn completion(&self) -> Sse {
        let body = json!({
            "model": "mock",
            "prompt": PROMPT,
            "max_tokens": MAX_TOKENS,
            "stream": true,
            "stream_options": {"include_usage": true}
        });
        let resp = bounded(
            "the frontend answers",
            self.client
                .post(format!("{}/v1/completions", self.base))
                .header("content-type", "application/json")
                .body(body.to_string())
                .send(),
        )
        .await
        .expect("send the request");
        Sse::new(resp)
    }
}

/// Reads the `data:` payloads of a server-sent event stream.
struct Sse {
    body: std::pin::Pin<Box<dyn futures::Stream<Item = reqwest::Result<Bytes>> + Send>>,
    buf: String,
}

impl Sse {
    fn new(resp: reqwest::Response) -> Sse {
        assert_eq!(resp.status(), 200, "the stream starts");
        Sse {
            body: Box::pin(resp.bytes_stream()),
            buf: String::new(),
        }
    }

    /// The next `data:` payload (comments and keep-alives skipped), or `None` at the end.
    async fn next(&mut self) -> Option<String> {
        loop {
            if let Some(end) = self.buf.find("\n\n") {
                let event: String = self.buf.drain(..end + 2).collect();
                let data: Vec<&str> = event
                    .lines()
                    .filter_map(|l| l.strip_prefix("data:"))
                    .map(str::trim_start)
                    .collect();
                if data.is_empty() {
                    continue;
                }
                return Some(data.join("\n"));
            }
            let chunk = bounded("the next piece of the client's stream", self.body.next()).await?;
            let chunk = chunk.expect("the client's stream is readable");
            self.buf
                .push_str(std::str::from_utf8(&chunk).expect("the stream is UTF-8"));
        }
    }

    /// Every remaining payload, `[DONE]` included.
    async fn rest(&mut self) -> Vec<String> {
        let mut out = Vec::new();
        while let Some(payload) = self.next().await {
            out.push(payload);
        }
        out
    }
}

/// The text a completion payload carries (none for `[DONE]`, errors and usage).
fn text_of(payload: &str) -> String {
    serde_json::from_str::<Value>(payload)
        .ok()
        .and_then(|v| v["choices"][0]["text"].as_str().map(str::to_owned))
        .unwrap_or_default()
}

/// The JSON payloads (everything but `[DONE]`).
fn chunks(payloads: &[String]) -> Vec<Value> {
    payloads
        .iter()
        .filter(|p| *p != "[DONE]")
        .map(|p| serde_json::from_str(p).unwrap_or_else(|e| panic!("{e}: {p}")))
        .collect()
}

/// Reads the client's stream until its text reaches `want` (the first engine's output), so that
/// the connection is cut only after the client has it; the payloads read.
async fn read_until_text(sse: &mut Sse, want: &str) -> Vec<String> {
    let mut payloads = Vec::new();
    let mut text = String::new();
    while text.len() < want.len() {
        let payload = sse
            .next()
            .await
            .unwrap_or_else(|| panic!("the stream ended at {text:?}, before {want:?}"));
        text.push_str(&text_of(&payload));
        payloads.push(payload);
    }
    assert_eq!(
        text, want,
        "the first engine's output, as the client reads it"
    );
    payloads
}

/// Whether every registered worker's load reads zero and nothing is in flight.
fn idle(router: &KvPushRouter) -> bool {
    router.with_core(|core| {
        let workers: Vec<WorkerWithDpRank> = core.workers().collect();
        core.active_requests() == 0
            && core.scheduler().active_requests() == 0
            && workers.iter().all(|&w| {
                core.worker_load(w).is_some_and(|l| {
                    l.active_requests == 0 && l.prefill_tokens == 0 && l.decode_blocks == 0.0
                })
            })
    })
}

/// Waits (bounded) until `cond` holds.
async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + HANG_GUARD;
    while !cond() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting until {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// `f`, or a panic naming `what` after [`HANG_GUARD`].
async fn bounded<T>(what: &str, f: impl Future<Output = T>) -> T {
    tokio::time::timeout(HANG_GUARD, f)
        .await
        .unwrap_or_else(|_| panic!("timed out waiting for {what}"))
}

fn run<F: Future<Output = ()>>(f: F) {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime")
        .block_on(f);
}

// --- The cases --------------------------------------------------------------------------------

/// A dialect that returns token ids: the continuation is the prompt plus exactly what was
/// streamed, and the client reads one continuous answer.
fn continues_exactly(kind: EngineKind) {
    run(async {
        let stack = Stack::start(kind).await;
        let mut sse = stack.completion().await;
        let mut payloads = read_until_text(&mut sse, &answer_text(kind, &FIRST_TOKENS)).await;
        let before = stack.script.received();
        assert_eq!(
            before.len(),
            1,
            "{kind}: one engine serves until the cut: {before:?}"
        );
        stack.script.cut.notify_one();
        payloads.extend(sse.rest().await);
        let received = stack.script.received();
        let client_text: String = payloads.iter().map(|p| text_of(p)).collect();
        let context = format!(
            "{kind}: requests the engines received: {received:#?}\nclient text: {client_text:?}\n\
             payloads: {payloads:#?}"
        );

        // The engines: the first got the client's request, the other its continuation.
        assert_eq!(received.len(), 2, "one request per engine; {context}");
        let (first, second) = (&received[0], &received[1]);
        assert_ne!(
            first.engine, second.engine,
            "the continuation moved; {context}"
        );
        assert_eq!(first.path, generate_path(kind), "{context}");
        assert_eq!(second.path, generate_path(kind), "{context}");
        assert_eq!(
            prompt_of(kind, &first.body),
            Some(PROMPT.to_vec()),
            "the first engine gets the client's prompt; {context}"
        );
        assert_eq!(
            max_tokens_of(kind, &first.body),
            Some(MAX_TOKENS),
            "the first engine gets the client's budget; {context}"
        );
        let continued: Vec<u32> = PROMPT.iter().chain(&FIRST_TOKENS).copied().collect();
        assert_eq!(
            prompt_of(kind, &second.body),
            Some(continued),
            "the continuation is the prompt plus exactly the tokens streamed; {context}"
        );
        let remaining = MAX_TOKENS - FIRST_TOKENS.len() as u32;
        assert_eq!(
            max_tokens_of(kind, &second.body),
            Some(remaining),
            "the continuation's budget is what is left; {context}"
        );

        // The client: one continuous answer, finished, counted, ended.
        let chunks = chunks(&payloads);
        let errors: Vec<&Value> = chunks.iter().filter(|c| c.get("error").is_some()).collect();
        assert!(errors.is_empty(), "no error reaches the client; {context}");
        let all: Vec<u32> = FIRST_TOKENS
            .iter()
            .copied()
            .chain((0..remaining).map(second_token))
            .collect();
        assert_eq!(
            client_text,
            answer_text(kind, &all),
            "the first engine's tokens then the second's, once each; {context}"
        );
        let finishes: Vec<&Value> = chunks
            .iter()
            .filter_map(|c| c["choices"].get(0))
            .map(|choice| &choice["finish_reason"])
            .filter(|f| !f.is_null())
            .collect();
        assert_eq!(finishes, [&json!("length")], "one finish reason; {context}");
        assert_eq!(
            payloads.last().map(String::as_str),
            Some("[DONE]"),
            "the stream ends with [DONE]; {context}"
        );
        let usage: Vec<&Value> = chunks
            .iter()
            .map(|c| &c["usage"])
            .filter(|u| !u.is_null())
            .collect();
        assert_eq!(usage.len(), 1, "one usage chunk; {context}");
        assert_eq!(
            usage[0]["completion_tokens"],
            json!(MAX_TOKENS),
            "every output token is counted, on both engines; {context}"
        );
        assert_eq!(
            usage[0]["prompt_tokens"],
            json!(PROMPT.len()),
            "the prompt is the client's; {context}"
        );

        eventually(&format!("{kind}: all load is freed"), || {
            idle(&stack.router)
        })
        .await;
    });
}

#[test]
fn vllm_migration_continues_the_answer_exactly() {
    continues_exactly(EngineKind::Vllm);
}

#[test]
fn sglang_migration_continues_the_answer_exactly() {
    continues_exactly(EngineKind::Sglang);
}

#[test]
fn trtllm_migration_continues_the_answer_exactly() {
    continues_exactly(EngineKind::Trtllm);
}

#[test]
fn llamacpp_migration_continues_the_answer_exactly() {
    continues_exactly(EngineKind::Llamacpp);
}

/// The text-only dialect: what was streamed cannot be continued, so the stream fails with a
/// clear error instead of starting over (which would repeat the text).
#[test]
fn openai_migration_fails_the_stream_instead_of_repeating_it() {
    run(async {
        let kind = EngineKind::Openai;
        let stack = Stack::start(kind).await;
        let mut sse = stack.completion().await;
        let first_text = FIRST_WORDS.concat();
        let mut payloads = read_until_text(&mut sse, &first_text).await;
        assert_eq!(
            stack.script.received().len(),
            1,
            "one engine serves until the cut"
        );
        stack.script.cut.notify_one();
        payloads.extend(sse.rest().await);
        let received = stack.script.received();
        let client_text: String = payloads.iter().map(|p| text_of(p)).collect();
        let context = format!(
            "requests the engines received: {received:#?}\nclient text: {client_text:?}\n\
             payloads: {payloads:#?}"
        );
        assert_eq!(
            prompt_of(kind, &received[0].body),
            Some(PROMPT.to_vec()),
            "{context}"
        );
        // No restart from the beginning: the first engine's text once, nothing from another.
        assert_eq!(
            client_text, first_text,
            "no repeat, no other engine's text; {context}"
        );
        assert!(received.len() <= 2, "{context}");
        let chunks = chunks(&payloads);
        let errors: Vec<&Value> = chunks.iter().filter(|c| c.get("error").is_some()).collect();
        assert_eq!(
            errors.len(),
            1,
            "the stream fails with one error; {context}"
        );
        let message = errors[0]["error"]["message"].as_str().unwrap_or_default();
        assert!(
            message.contains("cannot be continued"),
            "a clear error: {message:?}; {context}"
        );
        let error_at = chunks
            .iter()
            .position(|c| c.get("error").is_some())
            .expect("an error");
        assert!(
            chunks[error_at..]
                .iter()
                .all(|c| text_of(&c.to_string()).is_empty()),
            "nothing follows the error; {context}"
        );
        eventually("openai: all load is freed", || idle(&stack.router)).await;
    });
}
