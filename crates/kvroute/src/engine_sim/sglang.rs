//! SGLang's native API for the simulated engines (`--dialect sglang`), with its prefill/decode
//! disaggregation (`--disaggregation-mode prefill|decode`, as SGLang's own flag): a request to a
//! prefill engine carries `bootstrap_host`, `bootstrap_port` and `bootstrap_room` and, once
//! prefilled, fills its room; the same request to a decode engine fetches the room from the
//! prefill engine's bootstrap server (here the prefill engine's own HTTP port, `GET
//! /bootstrap/{room}`, a simulator-only stand-in for SGLang's KV transfer) and streams.
//!
//! Shapes as kvroute-engines' SGLang dialect reads them (SGLang 0.5:
//! `sglang/srt/entrypoints/http_server.py`, `managers/io_struct.py`): `POST /generate` with
//! `input_ids`, `sampling_params.max_new_tokens`, `stream`; each SSE chunk `{"text",
//! "output_ids" (cumulative), "meta_info": {"id", "prompt_tokens", "completion_tokens",
//! "cached_tokens", "finish_reason"}}`, then `data: [DONE]`; `GET /get_model_info` with
//! `model_path`; `GET /metrics` with `sglang:num_running_reqs`, `sglang:num_queue_reqs` and
//! `sglang:kv_used_tokens`.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures::StreamExt;
use kvroute_mocker::disagg::prefill_params;
use kvroute_protocols::{PrefillResult, PreprocessedRequest, PromptTokensDetails};
use kvroute_runtime::{Engine as _, RequestContext};
use parking_lot::Mutex;
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::sync::{Notify, mpsc};

use super::openai::error_response;
use super::state::Sim;

/// `--disaggregation-mode`: the part every engine of the process plays.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(super) enum Mode {
    /// Ordinary engines (SGLang's `null`).
    Null,
    /// Prefill engines: a request must name its bootstrap room, which it fills.
    Prefill,
    /// Decode engines: a request must name the room it fetches its KV from.
    Decode,
}

/// How long a decode request waits for its room to be filled.
const ROOM_WAIT: Duration = Duration::from_secs(30);

/// The rooms a prefill engine filled: room → prompt tokens prefilled (full blocks).
#[derive(Debug, Default)]
pub(super) struct Rooms {
    filled: Mutex<HashMap<u64, u32>>,
    changed: Notify,
}

impl Rooms {
    fn fill(&self, room: u64, tokens: u32) {
        self.filled.lock().insert(room, tokens);
        self.changed.notify_waiters();
    }

    /// The room's tokens once filled (taken once), or `None` after [`ROOM_WAIT`].
    async fn take(&self, room: u64) -> Option<u32> {
        let wait = async {
            loop {
                let changed = self.changed.notified();
                if let Some(tokens) = self.filled.lock().remove(&room) {
                    return tokens;
                }
                changed.await;
            }
        };
        tokio::time::timeout(ROOM_WAIT, wait).await.ok()
    }
}

/// One engine's SGLang routes.
pub(super) fn app(sim: Arc<Sim>, mode: Mode, rooms: Arc<Rooms>) -> Router {
    let state = Arc::new(Engine { sim, mode, rooms });
    Router::new()
        .route("/health", get(|| async { StatusCode::OK }))
        .route("/get_model_info", get(model_info))
        .route("/generate", post(generate))
        .route("/bootstrap/{room}", get(bootstrap))
        .route("/metrics", get(metrics))
        .with_state(state)
}

struct Engine {
    sim: Arc<Sim>,
    mode: Mode,
    rooms: Arc<Rooms>,
}

#[derive(Debug, Deserialize)]
struct GenerateRequest {
    input_ids: Vec<u32>,
    #[serde(default)]
    sampling_params: SamplingParams,
    #[serde(default)]
    stream: bool,
    bootstrap_host: Option<String>,
    bootstrap_port: Option<u16>,
    bootstrap_room: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
struct SamplingParams {
    max_new_tokens: Option<u32>,
}

async fn model_info(State(engine): State<Arc<Engine>>) -> Response {
    axum::Json(json!({
        "model_path": engine.sim.model,
        "tokenizer_path": engine.sim.model,
        "is_generation": true,
    }))
    .into_response()
}

/// SGLang's request gauges (`--enable-metrics`), for the adapter's load reports.
async fn metrics(State(engine): State<Arc<Engine>>) -> Response {
    let load = engine.sim.engine.load_report();
    let model = engine.sim.model.replace('"', "\\\"");
    let mut text = String::new();
    for (name, value) in [
        ("sglang:num_running_reqs", load.requests_running),
        ("sglang:num_queue_reqs", load.requests_waiting),
    ] {
        let value = value.unwrap_or(0);
        text.push_str(&format!(
            "# TYPE {name} gauge\n{name}{{model_name=\"{model}\",dp_rank=\"0\"}} {value}\n"
        ));
    }
    let used = load.kv_used_blocks.unwrap_or(0) * u64::from(engine.sim.cache.block_size);
    text.push_str(&format!(
        "# TYPE sglang:kv_used_tokens gauge\nsglang:kv_used_tokens{{model_name=\"{model}\",dp_rank=\"0\"}} {used}\n"
    ));
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

fn bad_request(message: &str) -> Response {
    error_response(StatusCode::BAD_REQUEST, "BadRequestError", message)
}

/// `GET /bootstrap/{room}`: a decode engine fetches the room this prefill engine filled.
async fn bootstrap(State(engine): State<Arc<Engine>>, Path(room): Path<u64>) -> Response {
    match engine.rooms.take(room).await {
        Some(tokens) => axum::Json(json!({"transferred_tokens": tokens})).into_response(),
        None => error_response(
            StatusCode::NOT_FOUND,
            "NotFoundError",
            &format!("bootstrap room {room} was not filled within {ROOM_WAIT:?}"),
        ),
    }
}

async fn generate(State(engine): State<Arc<Engine>>, body: Bytes) -> Response {
    let request: GenerateRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return bad_request(&format!("invalid request body: {e}")),
    };
    if request.input_ids.is_empty() {
        return bad_request("input_ids is empty; expected at least one token");
    }
    let room = request.bootstrap_room;
    let bootstrap = (&request.bootstrap_host, request.bootstrap_port, room);
    let transferred = match (engine.mode, bootstrap) {
        (Mode::Null, _) => None,
        (_, (Some(_), Some(_), Some(_))) if engine.mode == Mode::Prefill => None,
        (Mode::Decode, (Some(host), Some(port), Some(room))) => {
            match fetch(&engine.sim.client, host, port, room).await {
                Ok(tokens) => Some(tokens),
                Err(message) => return bad_request(&message),
            }
        }
        (mode, _) => {
            return bad_request(&format!(
                "a {mode:?} engine needs bootstrap_host, bootstrap_port and bootstrap_room"
            ));
        }
    };
    let sim = Arc::clone(&engine.sim);
    let prompt = request.input_ids;
    let mut engine_request = PreprocessedRequest::new(sim.model.clone(), prompt.clone());
    engine_request.stop_conditions.max_tokens = request.sampling_params.max_new_tokens.or(Some(16));
    if let Some(tokens) = transferred {
        engine_request.prefill_result = Some(PrefillResult {
            disaggregated_params: prefill_params(0, 0, &prompt, sim.cache.block_size),
            prompt_tokens_details: Some(PromptTokensDetails {
                audio_tokens: None,
                cached_tokens: Some(tokens),
            }),
        });
    }
    let id = format!(
        "{:032x}",
        sim.next_id
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    );
    let stream = match sim
        .engine
        .generate(engine_request, RequestContext::new(id.clone()))
    {
        Ok(stream) => stream,
        Err(error) => return bad_request(&error.to_string()),
    };
    let fill = (engine.mode == Mode::Prefill)
        .then_some(room)
        .flatten()
        .map(|room| (Arc::clone(&engine.rooms), room));
    let run = Run {
        sim,
        id,
        prompt,
        stream,
        fill,
    };
    if request.stream {
        let (tx, rx) = mpsc::channel::<Bytes>(64);
        tokio::spawn(run.stream_to(tx));
        let body = futures::stream::unfold(rx, |mut rx| async move {
            rx.recv().await.map(|b| (Ok::<_, Infallible>(b), rx))
        });
        Response::builder()
            .header(header::CONTENT_TYPE, "text/event-stream")
            .body(Body::from_stream(body))
            .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
    } else {
        let (tx, mut rx) = mpsc::channel::<Bytes>(64);
        tokio::spawn(run.stream_to(tx));
        let mut last = Value::Null;
        while let Some(chunk) = rx.recv().await {
            let text = String::from_utf8_lossy(&chunk);
            if let Some(data) = text.strip_prefix("data: ").map(str::trim)
                && let Ok(value) = serde_json::from_str::<Value>(data)
            {
                last = value;
            }
        }
        axum::Json(last).into_response()
    }
}

/// Fetches `room` from the prefill engine's bootstrap server.
async fn fetch(client: &reqwest::Client, host: &str, port: u16, room: u64) -> Result<u32, String> {
    let url = format!("http://{host}:{port}/bootstrap/{room}");
    let response = client
        .get(&url)
        .send()
        .await
        .map_err(|e| format!("cannot fetch bootstrap room {room} from {host}:{port}: {e}"))?;
    let status = response.status();
    let answer: Value = response.json().await.unwrap_or(Value::Null);
    match answer["transferred_tokens"].as_u64() {
        Some(tokens) if status.is_success() => Ok(tokens as u32),
        _ => Err(format!(
            "bootstrap room {room} at {host}:{port} answered HTTP {status}: {answer}"
        )),
    }
}

/// One request's output, as SGLang streams it.
struct Run {
    sim: Arc<Sim>,
    id: String,
    prompt: Vec<u32>,
    stream: kvroute_runtime::ResponseStream<
        kvroute_protocols::Annotated<kvroute_protocols::LLMEngineOutput>,
    >,
    /// The bootstrap room a prefill fills when it is done.
    fill: Option<(Arc<Rooms>, u64)>,
}

impl Run {
    async fn stream_to(mut self, tx: mpsc::Sender<Bytes>) {
        let send = |value: &Value| Bytes::from(format!("data: {value}\n\n"));
        let mut output: Vec<u32> = Vec::new();
        while let Some(item) = self.stream.next().await {
            if let Some(error) = item.error {
                let body = json!({"error": {"message": error}});
                let _ = tx.send(send(&body)).await;
                return;
            }
            let Some(out) = item.data else { continue };
            output.extend_from_slice(&out.token_ids);
            let finish = out
                .finish_reason
                .as_ref()
                .map(|_| json!({"type": "length", "length": output.len()}));
            let cached = out
                .completion_usage
                .and_then(|u| u.prompt_tokens_details)
                .and_then(|d| d.cached_tokens)
                .unwrap_or(0);
            let finished = finish.is_some();
            if finished {
                self.sim
                    .counters
                    .finished(self.prompt.len() as u32, cached, output.len() as u32);
                if let Some((rooms, room)) = self.fill.take() {
                    let block = self.sim.cache.block_size as usize;
                    rooms.fill(room, (self.prompt.len() / block * block) as u32);
                }
            }
            let chunk = json!({
                "text": "",
                "output_ids": output,
                "meta_info": {
                    "id": self.id,
                    "prompt_tokens": self.prompt.len(),
                    "completion_tokens": output.len(),
                    "cached_tokens": cached,
                    "finish_reason": finish,
                },
            });
            if tx.send(send(&chunk)).await.is_err() {
                return;
            }
            if finished {
                break;
            }
        }
        let _ = tx.send(Bytes::from_static(b"data: [DONE]\n\n")).await;
    }
}
