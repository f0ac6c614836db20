//! Responses: the one place that decides what a response says and writes it. [`Tracker`]
//! follows the engine's output (text, finish reason, usage, timing), [`ResponseMeta`] writes it
//! in OpenAI's shapes, whole ([`respond`] without streaming) or as server-sent events; a
//! query-only request gets [`query_response`].

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;

use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use kvroute_protocols::{
    FinishReason, LLMEngineOutput, NvExtResponse, PreprocessedRequest, TimingInfo, WorkerIdInfo,
    WorkerWithDpRank,
};
use kvroute_runtime::{LlmResponse, RequestError};
use serde_json::{Value, json};

use super::admission::Permit;
use super::error::ApiError;
use super::state::AppState;
use super::stop::StopMatcher;
use crate::migration::{MigratingDisaggStream, MigratingStream};
use crate::model::Model;
use crate::push::QueryAnswer;
use crate::tokenizer::IncrementalDetokenizer;

/// What the response of one request needs to know, fixed when the request was prepared.
pub(super) struct Reply {
    pub(super) model: Arc<Model>,
    pub(super) stream: bool,
    pub(super) include_usage: bool,
    pub(super) want_worker_id: bool,
    pub(super) want_timing: bool,
    pub(super) meta: ResponseMeta,
    pub(super) received: Instant,
    pub(super) received_unix_ms: u64,
}

/// Answers a request routed and sent, whose output is `stream`, streaming or whole as
/// `reply` says; `permit` (its admission) is held until the response ends.
pub(super) async fn respond(
    state: &AppState,
    reply: Reply,
    request: &PreprocessedRequest,
    stream: Output,
    permit: Permit,
) -> Response {
    let retry = state.config().admission.retry_after;
    let prompt_len = request.token_ids.len();
    let hit_rate = match &stream {
        Output::Migrating(s) => Some(
            s.first_decision()
                .predicted_hit_rate(state.inner.block_size),
        ),
        Output::Disagg(_) => None,
    };
    let track = Tracker::new(&reply, request, hit_rate, prompt_len);
    if reply.stream {
        // The status line waits for the first item (engines send nothing before their first
        // token either), so that a request failed before any output gets its real status (an
        // engine's 4xx, a 503, a 504) instead of a 200 whose stream carries the error.
        let mut stream = stream;
        let first = stream.next().await;
        match &first {
            Some(Err(e)) => return ApiError::from_stream(e, retry).into_response(),
            Some(Ok(item)) => {
                if let Some(failure) = EngineFailure::of(item) {
                    return failure.api_error().into_response();
                }
            }
            None => {}
        }
        sse_response(state, reply, (first, stream), track, permit)
    } else {
        let response = whole_response(state, reply, stream, track).await;
        drop(permit);
        response
    }
}

/// The answer to a query-only request (of `prompt_tokens` tokens): where it would go.
pub(super) fn query_response(reply: &Reply, prompt_tokens: usize, answer: QueryAnswer) -> Response {
    let ext = NvExtResponse {
        worker_id: Some(worker_info(answer.worker)),
        timing: None,
        token_ids: Some(answer.token_ids),
    };
    let ext = serde_json::to_value(ext).ok();
    if reply.stream {
        let chunk = reply.meta.chunk(Some(""), true, Some("stop"), ext);
        let events = futures::stream::iter([
            Ok::<_, Infallible>(Event::default().data(chunk.to_string())),
            Ok(Event::default().data("[DONE]")),
        ]);
        Sse::new(events).into_response()
    } else {
        axum::Json(
            reply
                .meta
                .response("", "stop", usage(prompt_tokens, 0, None), ext),
        )
        .into_response()
    }
}

/// The response stream of one request, however it was routed.
pub(super) enum Output {
    /// Aggregated, through the migrator.
    Migrating(Box<MigratingStream>),
    /// Through the prefill router (disaggregated, or its aggregated fallback).
    Disagg(Box<MigratingDisaggStream>),
}

impl Output {
    /// Asks the worker to finish gracefully (a stop string ended the text). Disaggregated, the
    /// decode worker is left to finish by itself: engines apply `stop` themselves too, and the
    /// rest of its output is neither sent nor counted.
    fn stop_generating(&mut self) {
        if let Output::Migrating(s) = self {
            s.stop_generating();
        }
    }

    async fn next(&mut self) -> Option<Result<LlmResponse, RequestError>> {
        match self {
            Output::Migrating(s) => s.next().await,
            Output::Disagg(s) => s.next().await,
        }
    }

    /// The workers serving the request: the prefill worker is the decode worker when prefill
    /// did not run on a worker of its own.
    fn workers(&self) -> WorkerIdInfo {
        match self {
            Output::Migrating(s) => worker_info(s.worker()),
            Output::Disagg(s) => {
                let decode = s.worker();
                let prefill = s.prefill_worker().unwrap_or(decode);
                WorkerIdInfo {
                    prefill_worker_id: Some(prefill.worker_id),
                    prefill_dp_rank: Some(prefill.dp_rank),
                    decode_worker_id: Some(decode.worker_id),
                    decode_dp_rank: Some(decode.dp_rank),
                }
            }
        }
    }

    /// The cached prompt tokens the prefill worker reported, when prefill ran on one (read once
    /// the stream has ended, when they are known on every path).
    fn prefill_cached_tokens(&self) -> Option<u32> {
        match self {
            Output::Migrating(_) => None,
            Output::Disagg(s) => s.prefill_tokens_details().and_then(|d| d.cached_tokens),
        }
    }
}

fn worker_info(w: WorkerWithDpRank) -> WorkerIdInfo {
    WorkerIdInfo {
        prefill_worker_id: Some(w.worker_id),
        prefill_dp_rank: Some(w.dp_rank),
        decode_worker_id: Some(w.worker_id),
        decode_dp_rank: Some(w.dp_rank),
    }
}

/// What one request has produced so far, for text, usage, timing and the finish reason.
///
/// `prompt_tokens` and `completion_tokens` are the router's own counts (it tokenized the prompt
/// and counts the tokens it relays); from the engines it takes only the cached prompt tokens
/// (`completion_usage.prompt_tokens_details.cached_tokens`), which it cannot know itself.
struct Tracker {
    model: Arc<Model>,
    detok: IncrementalDetokenizer,
    prompt_tokens: usize,
    completion_tokens: usize,
    /// The first cached-token count an engine streaming the output reported, if any did.
    cached_tokens: Option<u32>,
    finish: Option<FinishReason>,
    received: Instant,
    received_unix_ms: u64,
    sent: Instant,
    first: Option<Instant>,
    last: Option<Instant>,
    hit_rate: Option<f64>,
    max_tokens: Option<u32>,
    /// The request's stop strings, applied to the text sent.
    stop: StopMatcher,
    /// Text that came without token ids (an `openai`-dialect engine), for counting its tokens
    /// when the engine reports no usage.
    untokenized: String,
    /// The output tokens the engine last reported in its usage.
    reported_completion_tokens: Option<u32>,
}

/// What one engine item became.
enum Step {
    /// Text to send (possibly empty).
    Text(String),
    /// The engine failed the request.
    Failed(EngineFailure),
}

/// An engine's failure of a request, as an error item said it.
struct EngineFailure {
    message: String,
    /// The HTTP status the engine answered with, when it refused the request over HTTP.
    status: Option<u16>,
    /// The OpenAI error code it implies (`context_length_exceeded`).
    code: Option<String>,
}

impl EngineFailure {
    /// The failure `item` reports: an error item, or an output finished with an error.
    fn of(item: &LlmResponse) -> Option<Self> {
        if item.is_error() {
            return Some(Self {
                message: item.error_message().unwrap_or("engine error").to_owned(),
                status: item.error_status(),
                code: item.error_code().map(str::to_owned),
            });
        }
        match item.data.as_ref().and_then(|d| d.finish_reason.as_ref()) {
            Some(FinishReason::Error(message)) => Some(Self {
                message: message.clone(),
                status: None,
                code: None,
            }),
            _ => None,
        }
    }

    /// The client's answer: an engine's 4xx keeps its status (the request is at fault, and
    /// clients must not retry it); anything else the engine failed is a 502.
    fn api_error(&self) -> ApiError {
        let message = format!("the engine failed the request: {}", self.message);
        match self.status {
            Some(status) if (400..500).contains(&status) && status != 429 => {
                ApiError::engine_refused(status, message, self.code.clone())
            }
            _ => ApiError::bad_gateway(message),
        }
    }
}

impl Tracker {
    fn new(
        reply: &Reply,
        request: &PreprocessedRequest,
        hit_rate: Option<f64>,
        prompt_tokens: usize,
    ) -> Self {
        Self {
            model: reply.model.clone(),
            detok: IncrementalDetokenizer::new(),
            prompt_tokens,
            completion_tokens: 0,
            untokenized: String::new(),
            reported_completion_tokens: None,
            cached_tokens: None,
            finish: None,
            received: reply.received,
            received_unix_ms: reply.received_unix_ms,
            sent: Instant::now(),
            first: None,
            last: None,
            hit_rate,
            max_tokens: request.stop_conditions.max_tokens,
            stop: StopMatcher::new(
                request.stop_conditions.stop.as_deref().unwrap_or_default(),
                request
                    .sampling_options
                    .include_stop_str_in_output
                    .unwrap_or(false),
            ),
        }
    }

    /// Whether a stop string ended the text (the worker should be asked to stop).
    fn stopped(&self) -> bool {
        self.stop.matched()
    }

    /// The text held back in case it began a stop string, once the output has ended.
    fn finish_text(&mut self) -> String {
        self.stop.finish()
    }

    fn on_item(&mut self, item: &kvroute_runtime::LlmResponse) -> Step {
        if let Some(failure) = EngineFailure::of(item) {
            return Step::Failed(failure);
        }
        let Some(data) = &item.data else {
            return Step::Text(String::new());
        };
        Step::Text(self.on_output(data))
    }

    fn on_output(&mut self, data: &LLMEngineOutput) -> String {
        // After a stop string, the engine's further output is neither sent nor counted, and the
        // request has finished with `stop` whatever the engine says.
        let stopped = self.stop.matched();
        let text_only =
            data.token_ids.is_empty() && data.text.as_deref().is_some_and(|t| !t.is_empty());
        if (!data.token_ids.is_empty() || text_only) && !stopped {
            let now = Instant::now();
            self.first.get_or_insert(now);
            self.last = Some(now);
            self.completion_tokens += data.token_ids.len();
        }
        if let Some(usage) = data.completion_usage {
            self.reported_completion_tokens = Some(usage.completion_tokens);
        }
        if data.finish_reason.is_some() && !stopped {
            self.finish = data.finish_reason.clone();
        }
        // The first report wins. Engines report usage on their last item, and across a migration
        // the worker that took over reports over its continuation prompt (the client's prompt
        // plus the tokens generated before the move), while `cached_tokens` means cached tokens
        // of the client's prompt: a first worker that did report (on an earlier item) measured
        // exactly that. A later worker's count is used when no earlier one reported (the usual
        // case: a lost worker sends no last item) and is capped at the prompt's length in
        // `usage`; since prefix caching hits a prefix, the cap leaves exactly the client's
        // prompt tokens found cached. Disaggregated, the items are the decode worker's, whose
        // count `usage` uses only when the prefill worker reported none: the prompt's cache
        // hits happen on the prefill worker.
        if self.cached_tokens.is_none() {
            self.cached_tokens = data
                .completion_usage
                .and_then(|u| u.prompt_tokens_details)
                .and_then(|d| d.cached_tokens);
        }
        if stopped {
            return String::new();
        }
        // An engine's own text wins (text-only engines, and vLLM, which detokenizes in the
        // prompt's context beside its ids); ids alone are detokenized here.
        let text = match &data.text {
            Some(text) => {
                if data.token_ids.is_empty() {
                    self.untokenized.push_str(text);
                } else {
                    self.detok.skip(&data.token_ids);
                }
                text.clone()
            }
            None => self
                .detok
                .push(self.model.tokenizer.as_ref(), &data.token_ids)
                .unwrap_or_default(),
        };
        let text = self.stop.push(&text);
        if self.stop.matched() {
            self.finish = Some(FinishReason::Stop);
        }
        text
    }

    /// The output tokens: those relayed as ids, plus, for text that came without ids, the
    /// engine's own count (its usage), else the text tokenized with the model's tokenizer.
    fn output_tokens(&self) -> usize {
        if self.untokenized.is_empty() {
            return self.completion_tokens;
        }
        let text_tokens = match self.reported_completion_tokens {
            Some(n) => usize::try_from(n).unwrap_or(usize::MAX),
            None => self
                .model
                .tokenizer
                .encode(&self.untokenized)
                .map_or(0, |ids| ids.len()),
        };
        self.completion_tokens.max(text_tokens)
    }

    fn finish_reason(&self) -> &'static str {
        match &self.finish {
            Some(reason) => finish_reason_str(reason),
            None if self
                .max_tokens
                .is_some_and(|m| self.output_tokens() >= m as usize) =>
            {
                "length"
            }
            None => "stop",
        }
    }

    /// The usage to report, given the cached tokens the prefill worker reported (`prefill`),
    /// which win over the output's engine's: in disaggregated serving the prompt is computed,
    /// and its cache hit, on the prefill worker (Dynamo's decode workers, too, report the
    /// prefill's details). The first prefill's count wins across migrations, and either count
    /// is capped at the prompt's length, for the reasons given in `on_output`.
    fn usage(&self, prefill: Option<u32>) -> Value {
        let cached = prefill.or(self.cached_tokens).map(|c| {
            usize::try_from(c)
                .unwrap_or(usize::MAX)
                .min(self.prompt_tokens)
        });
        usage(self.prompt_tokens, self.output_tokens(), cached)
    }

    fn timing(&self) -> TimingInfo {
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
        let end = self.last.unwrap_or_else(Instant::now);
        TimingInfo {
            request_received_ms: Some(self.received_unix_ms),
            prefill_wait_time_ms: Some(ms(self.sent - self.received)),
            prefill_time_ms: self.first.map(|f| ms(f - self.sent)),
            ttft_ms: self.first.map(|f| ms(f - self.received)),
            total_time_ms: Some(ms(end - self.received)),
            avg_itl_ms: match (self.first, self.output_tokens()) {
                (Some(first), n) if n > 1 => Some(ms(end - first) / (n - 1) as f64),
                _ => None,
            },
            kv_hit_rate: self.hit_rate,
        }
    }
}

fn nvext_value(worker: Option<WorkerIdInfo>, timing: Option<TimingInfo>) -> Option<Value> {
    if worker.is_none() && timing.is_none() {
        return None;
    }
    serde_json::to_value(NvExtResponse {
        worker_id: worker,
        timing,
        token_ids: None,
    })
    .ok()
}

async fn whole_response(
    state: &AppState,
    p: Reply,
    mut stream: Output,
    mut track: Tracker,
) -> Response {
    let retry = state.config().admission.retry_after;
    let grace = state.config().stop_grace;
    let mut text = String::new();
    let mut stop_deadline = None;
    while let Some(item) = next_within(&mut stream, stop_deadline).await {
        match item {
            Ok(item) => match track.on_item(&item) {
                Step::Text(t) => {
                    text.push_str(&t);
                    if track.stopped() && stop_deadline.is_none() {
                        stop_deadline = Some(tokio::time::Instant::now() + grace);
                        stream.stop_generating();
                    }
                }
                Step::Failed(failure) => return failure.api_error().into_response(),
            },
            Err(e) => return ApiError::from_stream(&e, retry).into_response(),
        }
    }
    text.push_str(&track.finish_text());
    let ext = nvext_value(
        p.want_worker_id.then(|| stream.workers()),
        p.want_timing.then(|| track.timing()),
    );
    axum::Json(p.meta.response(
        &text,
        track.finish_reason(),
        track.usage(stream.prefill_cached_tokens()),
        ext,
    ))
    .into_response()
}

/// The stream's next item; `None` at its end, or once `deadline` (the grace after a graceful
/// stop) passed: the worker ignored the stop, and dropping the stream then cancels the request.
async fn next_within(
    stream: &mut Output,
    deadline: Option<tokio::time::Instant>,
) -> Option<Result<LlmResponse, RequestError>> {
    let Some(deadline) = deadline else {
        return stream.next().await;
    };
    match tokio::time::timeout_at(deadline, stream.next()).await {
        Ok(item) => item,
        Err(_) => {
            tracing::warn!("the worker did not stop after a stop string; cancelling the request");
            None
        }
    }
}

fn data(value: &Value) -> Result<Event, Infallible> {
    Ok(Event::default().data(value.to_string()))
}

/// Streams the response; `first` is the item already taken from `stream` (or its end).
fn sse_response(
    state: &AppState,
    p: Reply,
    (first, mut stream): (Option<Result<LlmResponse, RequestError>>, Output),
    mut track: Tracker,
    permit: Permit,
) -> Response {
    let keep_alive = state.config().keep_alive;
    let grace = state.config().stop_grace;
    let events = async_stream::stream! {
        // The permit and the routed stream live as long as this body: a client that goes away
        // drops both, cancelling the request on its worker and freeing its slot.
        let _permit = permit;
        let worker = p.want_worker_id.then(|| stream.workers());
        let text_chunk = TextChunk::new(&p.meta);
        let opening = p.meta.chunk(
            (p.meta.endpoint == Endpoint::Chat).then_some(""),
            true,
            None,
            nvext_value(worker, None),
        );
        if p.meta.endpoint == Endpoint::Chat {
            yield data(&opening);
        }
        let mut stop_deadline = None;
        let mut first = Some(first);
        loop {
            let item = match first.take() {
                Some(item) => item,
                None => next_within(&mut stream, stop_deadline).await,
            };
            let Some(item) = item else { break };
            let failure = match item {
                Ok(item) => match track.on_item(&item) {
                    Step::Text(t) => {
                        if !t.is_empty() {
                            yield Ok(Event::default().data(text_chunk.render(&p.meta, &t)));
                        }
                        if track.stopped() && stop_deadline.is_none() {
                            stop_deadline = Some(tokio::time::Instant::now() + grace);
                            stream.stop_generating();
                        }
                        continue;
                    }
                    Step::Failed(failure) => failure.api_error(),
                },
                Err(e) => ApiError::from_stream(&e, std::time::Duration::ZERO),
            };
            yield data(&failure.body());
            return;
        }
        let rest = track.finish_text();
        if !rest.is_empty() {
            yield data(&p.meta.chunk(Some(&rest), false, None, None));
        }
        let ext = nvext_value(
            p.want_worker_id.then(|| stream.workers()),
            p.want_timing.then(|| track.timing()),
        );
        yield data(&p.meta.chunk(None, false, Some(track.finish_reason()), ext));
        if p.include_usage {
            yield data(&p.meta.usage_chunk(track.usage(stream.prefill_cached_tokens())));
        }
        yield Ok(Event::default().data("[DONE]"));
    };
    Sse::new(events)
        .keep_alive(KeepAlive::new().interval(keep_alive))
        .into_response()
}

/// A streamed text chunk rendered from a template: the JSON of
/// [`ResponseMeta::chunk`]`(Some(text), false, None, None)` is the same for every text but the
/// text, so it is rendered once per response around a marker, and each token's chunk is the two
/// halves around the JSON-escaped text (byte for byte what the full rendering gives: the tests
/// compare them). Saves building and printing a `Value` tree for every token.
pub(crate) struct TextChunk {
    /// The JSON before and after the text's string literal; `None` renders each chunk whole.
    halves: Option<(String, String)>,
}

impl TextChunk {
    /// A text no response carries: a control character around a name.
    const MARKER: &'static str = "\u{1}kvroute-text\u{1}";

    pub(crate) fn new(meta: &ResponseMeta) -> Self {
        let whole = meta
            .chunk(Some(Self::MARKER), false, None, None)
            .to_string();
        let marker = Value::from(Self::MARKER).to_string();
        let halves = match whole.split_once(&marker) {
            Some((before, after)) if !after.contains(&marker) => {
                Some((before.to_owned(), after.to_owned()))
            }
            _ => None,
        };
        Self { halves }
    }

    /// The chunk's JSON for `text`.
    pub(crate) fn render(&self, meta: &ResponseMeta, text: &str) -> String {
        if let Some((before, after)) = &self.halves {
            let mut out = Vec::with_capacity(before.len() + text.len() + after.len() + 8);
            out.extend_from_slice(before.as_bytes());
            if serde_json::to_writer(&mut out, text).is_ok() {
                out.extend_from_slice(after.as_bytes());
                // Both halves and the escaped text are UTF-8.
                if let Ok(out) = String::from_utf8(out) {
                    return out;
                }
            }
        }
        meta.chunk(Some(text), false, None, None).to_string()
    }
}

/// Which endpoint a response is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Endpoint {
    Chat,
    Completion,
}

/// The fixed fields of every response and chunk of one request.
#[derive(Debug, Clone)]
pub(crate) struct ResponseMeta {
    pub(crate) id: String,
    pub(crate) created: u64,
    pub(crate) model: String,
    pub(crate) endpoint: Endpoint,
}

/// The OpenAI name of a finish reason (errors are reported as errors, not finish reasons).
pub(crate) fn finish_reason_str(reason: &FinishReason) -> &'static str {
    match reason {
        FinishReason::Length => "length",
        FinishReason::ContentFilter => "content_filter",
        FinishReason::Eos
        | FinishReason::Stop
        | FinishReason::Cancelled
        | FinishReason::Error(_) => "stop",
    }
}

impl ResponseMeta {
    /// A streaming chunk: a text delta (chat: the first carries the role), a finish reason.
    pub(crate) fn chunk(
        &self,
        text: Option<&str>,
        first: bool,
        finish: Option<&str>,
        nvext: Option<Value>,
    ) -> Value {
        let choice = match self.endpoint {
            Endpoint::Chat => {
                let mut delta = serde_json::Map::new();
                if first {
                    delta.insert("role".into(), json!("assistant"));
                }
                if let Some(t) = text {
                    delta.insert("content".into(), json!(t));
                }
                json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish})
            }
            Endpoint::Completion => {
                json!({"index": 0, "text": text.unwrap_or(""), "logprobs": null, "finish_reason": finish})
            }
        };
        let mut chunk = json!({
            "id": self.id,
            "object": self.chunk_object(),
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        });
        if let Some(ext) = nvext {
            chunk["nvext"] = ext;
        }
        chunk
    }

    /// The last streaming chunk when usage is asked for: no choices, the usage.
    pub(crate) fn usage_chunk(&self, usage: Value) -> Value {
        json!({
            "id": self.id,
            "object": self.chunk_object(),
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": usage,
        })
    }

    /// A whole (non-streaming) response.
    pub(crate) fn response(
        &self,
        text: &str,
        finish: &str,
        usage: Value,
        nvext: Option<Value>,
    ) -> Value {
        let (object, choice) = match self.endpoint {
            Endpoint::Chat => (
                "chat.completion",
                json!({
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": null,
                    "finish_reason": finish,
                }),
            ),
            Endpoint::Completion => (
                "text_completion",
                json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish}),
            ),
        };
        let mut out = json!({
            "id": self.id,
            "object": object,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage,
        });
        if let Some(ext) = nvext {
            out["nvext"] = ext;
        }
        out
    }

    fn chunk_object(&self) -> &'static str {
        match self.endpoint {
            Endpoint::Chat => "chat.completion.chunk",
            Endpoint::Completion => "text_completion",
        }
    }
}

/// OpenAI's `usage` object. `prompt_tokens_details.cached_tokens` is written only when a worker
/// reported it (`cached_tokens` is `Some`): a missing report is not a zero.
pub(crate) fn usage(
    prompt_tokens: usize,
    completion_tokens: usize,
    cached_tokens: Option<usize>,
) -> Value {
    let mut usage = json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    });
    if let Some(cached) = cached_tokens {
        usage["prompt_tokens_details"] = json!({"cached_tokens": cached});
    }
    usage
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_text_chunk_from_the_template_is_the_full_rendering_byte_for_byte() {
        for endpoint in [Endpoint::Chat, Endpoint::Completion] {
            let meta = ResponseMeta {
                id: "chatcmpl-\"q\"\\1".to_owned(),
                created: 1_700_000_000,
                model: "a/model \u{e9}".to_owned(),
                endpoint,
            };
            let template = TextChunk::new(&meta);
            assert!(template.halves.is_some(), "{endpoint:?}");
            for text in [
                "",
                "hello",
                " world\n",
                "\"quoted\" \\ back",
                "tab\tcr\r\u{1}\u{1f}",
                "\u{e9}\u{4e2d}\u{1f600}",
                "</script>",
                TextChunk::MARKER,
            ] {
                assert_eq!(
                    template.render(&meta, text),
                    meta.chunk(Some(text), false, None, None).to_string(),
                    "{endpoint:?} {text:?}"
                );
            }
        }
    }
}
