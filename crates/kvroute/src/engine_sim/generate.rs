//! One completion or chat request through the simulated engine: the prompt into the mocker's
//! live engine, its tokens out as vLLM's SSE chunks or one whole response.
//!
//! A streamed response is fed by a task that owns the engine's stream; when the client goes
//! away the body, and with it the channel, is dropped, the task's next send fails and it drops
//! the engine's stream, which cancels the request in the engine (as vLLM aborts it).

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures::{FutureExt as _, StreamExt};
use kvroute_mocker::disagg::prefill_params;
use kvroute_protocols::{
    FinishReason, LLMEngineOutput, PrefillResult, PreprocessedRequest, PromptTokensDetails,
};
use kvroute_router::tokenizer::IncrementalDetokenizer;
use kvroute_runtime::{Engine as _, RequestContext, ResponseStream};
use tokio::sync::mpsc;

use super::kv_events::RequestBlocks;
use super::kv_transfer::Handshake;
use super::openai::error_response;
use super::openai::{Envelope, Usage, sse_event};
use super::state::Sim;

/// One request, ready to run.
pub(super) struct Job {
    pub(super) envelope: Envelope,
    pub(super) prompt: Vec<u32>,
    pub(super) max_tokens: u32,
    pub(super) stream: bool,
    pub(super) include_usage: bool,
    /// What its `kv_transfer_params` ask.
    pub(super) handshake: Handshake,
}

/// Runs `job` and answers it, streamed or whole.
pub(super) async fn run(sim: Arc<Sim>, job: Job) -> Response {
    let arrived = Instant::now();
    let mut request = PreprocessedRequest::new(job.envelope.model.clone(), job.prompt.clone());
    request.stop_conditions.max_tokens = Some(job.max_tokens);
    if let Handshake::RemotePrefill { transferred_tokens } = job.handshake {
        // The mocker's decode role takes the prompt's KV as transferred (its own params shape)
        // and reports the transferred tokens as cached, as a vLLM decode engine does.
        let block_size = sim.cache.block_size;
        request.prefill_result = Some(PrefillResult {
            disaggregated_params: prefill_params(0, 0, &job.prompt, block_size),
            prompt_tokens_details: Some(PromptTokensDetails {
                audio_tokens: None,
                cached_tokens: Some(transferred_tokens),
            }),
        });
    }
    let mut blocks = sim
        .blocks
        .as_ref()
        .map(|store| RequestBlocks::new(Arc::clone(store), sim.cache.block_size));
    if let Some(blocks) = &mut blocks {
        blocks.push(&job.prompt);
    }
    let context = RequestContext::new(job.envelope.id.clone());
    let stream = match sim.engine.generate(request, context) {
        Ok(stream) => stream,
        Err(error) => {
            let message = error.to_string();
            return error_response(StatusCode::BAD_REQUEST, "BadRequestError", &message);
        }
    };
    let run = Running {
        sim,
        arrived,
        job,
        stream,
        blocks,
        detokenizer: IncrementalDetokenizer::new(),
        output: Vec::new(),
        text: String::new(),
    };
    if run.job.stream {
        let (tx, rx) = mpsc::channel::<Bytes>(64);
        tokio::spawn(run.stream_to(tx));
        let body = futures::stream::unfold(rx, |mut rx| async move {
            rx.recv().await.map(|b| (Ok::<_, Infallible>(b), rx))
        });
        Response::builder()
            .header(header::CONTENT_TYPE, "text/event-stream")
            .header(header::CACHE_CONTROL, "no-cache")
            .body(Body::from_stream(body))
            .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
    } else {
        run.whole().await
    }
}

/// What one step of the engine's stream said.
enum Step {
    /// New output tokens and their text.
    Tokens(Vec<u32>, String),
    /// The end, with vLLM's finish reason.
    Done(&'static str, Usage),
    /// The engine failed the request.
    Failed(String),
}

struct Running {
    sim: Arc<Sim>,
    /// When the engine took the request, for its time to first token.
    arrived: Instant,
    job: Job,
    stream: ResponseStream<kvroute_protocols::Annotated<LLMEngineOutput>>,
    blocks: Option<RequestBlocks>,
    detokenizer: IncrementalDetokenizer,
    output: Vec<u32>,
    text: String,
}

impl Running {
    /// The next step, or `None` when the stream ended without a finish.
    async fn next(&mut self) -> Option<Step> {
        loop {
            let item = self.stream.next().await?;
            if let Some(error) = item.error {
                return Some(Step::Failed(error));
            }
            let Some(out) = item.data else { continue };
            if let Some(reason) = &out.finish_reason {
                return Some(Step::Done(finish_name(reason), self.usage(&out)));
            }
            if out.token_ids.is_empty() {
                continue;
            }
            if let Some(blocks) = &mut self.blocks {
                blocks.push(&out.token_ids);
            }
            if self.output.is_empty() {
                self.sim.counters.first_token(self.arrived.elapsed());
            }
            self.output.extend_from_slice(&out.token_ids);
            let text = self
                .detokenizer
                .push(self.sim.text.tokenizer.as_ref(), &out.token_ids)
                .unwrap_or_default();
            return Some(Step::Tokens(out.token_ids, text));
        }
    }

    fn usage(&self, out: &LLMEngineOutput) -> Usage {
        let usage = out.completion_usage.as_ref();
        let usage = Usage {
            prompt_tokens: self.job.prompt.len() as u32,
            completion_tokens: usage.map_or(self.output.len() as u32, |u| u.completion_tokens),
            cached_tokens: usage
                .and_then(|u| u.prompt_tokens_details.as_ref())
                .and_then(|d| d.cached_tokens)
                .unwrap_or(0),
        };
        self.sim.counters.finished(
            usage.prompt_tokens,
            usage.cached_tokens,
            usage.completion_tokens,
        );
        usage
    }

    async fn whole(mut self) -> Response {
        loop {
            match self.next().await {
                Some(Step::Tokens(_, text)) => self.text.push_str(&text),
                Some(Step::Done(finish, usage)) => {
                    let env = &self.job.envelope;
                    let mut body =
                        env.whole(&self.text, &self.output, &self.job.prompt, finish, usage);
                    if self.job.handshake == Handshake::RemoteDecode {
                        let sim = &self.sim;
                        let params = sim.transfers.hold(
                            &sim.address,
                            &self.job.prompt,
                            sim.cache.block_size,
                        );
                        body["kv_transfer_params"] = params;
                    }
                    return axum::Json(body).into_response();
                }
                Some(Step::Failed(message)) => {
                    let status = StatusCode::INTERNAL_SERVER_ERROR;
                    return error_response(status, "InternalServerError", &message);
                }
                None => {
                    let status = StatusCode::INTERNAL_SERVER_ERROR;
                    let message = "the engine ended the request without finishing it";
                    return error_response(status, "InternalServerError", message);
                }
            }
        }
    }

    async fn stream_to(mut self, tx: mpsc::Sender<Bytes>) {
        if self.job.envelope.kind == super::openai::Kind::Chat
            && tx
                .send(sse_event(&self.job.envelope.role_chunk()))
                .await
                .is_err()
        {
            return;
        }
        let mut first = true;
        loop {
            let chunk = match self.next().await {
                Some(Step::Tokens(ids, text)) => {
                    let prompt = first.then_some(&self.job.prompt[..]);
                    first = false;
                    self.job.envelope.chunk(&text, &ids, None, prompt)
                }
                Some(Step::Done(finish, usage)) => {
                    let env = &self.job.envelope;
                    let last = env.chunk("", &[], Some(finish), None);
                    if tx.send(last).await.is_err() {
                        return;
                    }
                    if self.job.include_usage
                        && tx.send(sse_event(&env.usage_chunk(usage))).await.is_err()
                    {
                        return;
                    }
                    break;
                }
                Some(Step::Failed(message)) => {
                    let body = super::openai::error_body(&message, "InternalServerError", 500);
                    let _ = tx.send(sse_event(&body)).await;
                    break;
                }
                None => break,
            };
            if tx.send(chunk).await.is_err() {
                return;
            }
        }
        let _ = tx.send(Bytes::from_static(b"data: [DONE]\n\n")).await;
    }
}

impl Drop for Running {
    /// A request that ends early (its client went away) still registers the tokens already
    /// delivered to it: the engine may have stored blocks they complete, and the KV feed needs
    /// their tokens to publish those blocks.
    fn drop(&mut self) {
        let Some(blocks) = &mut self.blocks else {
            return;
        };
        while let Some(Some(item)) = self.stream.next().now_or_never() {
            if let Some(out) = item.data {
                blocks.push(&out.token_ids);
            }
        }
    }
}

/// vLLM's name of a finish reason.
fn finish_name(reason: &FinishReason) -> &'static str {
    match reason {
        FinishReason::Length => "length",
        FinishReason::Eos | FinishReason::Stop => "stop",
        FinishReason::Cancelled => "abort",
        FinishReason::Error(_) => "error",
        FinishReason::ContentFilter => "content_filter",
    }
}
