//! SGLang's native API (checked against SGLang 0.5.23: `sglang/srt/entrypoints/http_server.py`,
//! `sglang/srt/managers/{io_struct,tokenizer_manager,schedule_batch}.py` and the request contract
//! `sglang/api/v1/api_types.py`).
//!
//! `POST /generate` with `input_ids`, `sampling_params` and `stream: true`. The contract rejects
//! unknown `sampling_params` keys, so exactly its names are used (`max_new_tokens`,
//! `min_new_tokens`, `sampling_seed`, `no_stop_trim` for `include_stop_str_in_output`).
//!
//! Each chunk is `{"text", "output_ids", "meta_info": {"prompt_tokens", "completion_tokens",
//! "cached_tokens", "finish_reason", ...}}`. By default `output_ids` (and `text`) are
//! cumulative: every chunk repeats the whole output so far. A server started with
//! `--incremental-streaming-output` sends only the new ids instead. `meta_info.completion_tokens`
//! is the total generated in both modes, so the new ids are always the last
//! `completion_tokens - emitted` of `output_ids`; that reads either mode without being told.
//! `finish_reason` is `{"type": "stop", "matched": id | string}`, `{"type": "length"}` or
//! `{"type": "abort", "message", "status_code"}`; an abort with an HTTP status is an error (a
//! 503 means overloaded), one without is a cancellation.
//!
//! Disaggregated serving is SGLang's bootstrap exchange: the router gives a request's prefill
//! and decode engines the same `bootstrap_host`, `bootstrap_port` (the prefill engine's
//! `--disaggregation-bootstrap-port`) and `bootstrap_room` (top-level fields of
//! `GenerateReqInput`, `sglang/srt/managers/io_struct.py`) and sends both at once; the decode
//! engine fetches the KV from the prefill engine's bootstrap server by room and streams. The
//! prefill router fills `bootstrap_info` for both; here it is only written out.

use kvroute_protocols::{CompletionUsage, FinishReason, PreprocessedRequest, PromptTokensDetails};
use kvroute_runtime::EngineError;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::{
    Built, Dialect, MISSING_LOGPROB, Parsed, Step, StreamParser, Target, stop_token_ids,
    stopped_on_token,
};
use crate::error::{Failure, error_value, excerpt, is_unavailable_status, stream_error};
use crate::sse::SseEvent;

/// The SGLang dialect.
pub(super) struct Sglang;

#[derive(Debug, Serialize)]
struct Body<'a> {
    sampling_params: SamplingParams<'a>,
    stream: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    return_logprob: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    top_logprobs_num: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    routed_dp_rank: Option<u32>,
    /// SGLang salts the request's cache (and its KV events) with it, as the router hashes it.
    #[serde(skip_serializing_if = "Option::is_none")]
    cache_salt: Option<&'a str>,
    /// The prefill engine's bootstrap server and the pair's room (disaggregated serving).
    #[serde(skip_serializing_if = "Option::is_none")]
    bootstrap_host: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    bootstrap_port: Option<u16>,
    #[serde(skip_serializing_if = "Option::is_none")]
    bootstrap_room: Option<u64>,
}

#[derive(Debug, Serialize)]
struct SamplingParams<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    max_new_tokens: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    min_new_tokens: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    stop: Option<&'a [String]>,
    #[serde(skip_serializing_if = "Option::is_none")]
    stop_token_ids: Option<Vec<u32>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    ignore_eos: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    no_stop_trim: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    temperature: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    top_p: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    top_k: Option<i32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    min_p: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    frequency_penalty: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    presence_penalty: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    repetition_penalty: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    sampling_seed: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    skip_special_tokens: Option<bool>,
}

impl Dialect for Sglang {
    fn generate_path(&self) -> &'static str {
        "generate"
    }

    fn build(
        &self,
        request: &PreprocessedRequest,
        target: &Target<'_>,
    ) -> Result<Built, EngineError> {
        let stop = &request.stop_conditions;
        let sampling = &request.sampling_options;
        let logprobs = request.output_options.logprobs;
        let bootstrap = request.bootstrap_info.as_ref();
        Built::json(
            "input_ids",
            &Body {
                sampling_params: SamplingParams {
                    max_new_tokens: target.max_tokens,
                    min_new_tokens: stop.min_tokens,
                    stop: stop.stop.as_deref().filter(|s| !s.is_empty()),
                    stop_token_ids: stop_token_ids(request),
                    ignore_eos: stop.ignore_eos,
                    no_stop_trim: sampling.include_stop_str_in_output,
                    temperature: sampling.temperature,
                    top_p: sampling.top_p,
                    top_k: sampling.top_k,
                    min_p: sampling.min_p,
                    frequency_penalty: sampling.frequency_penalty,
                    presence_penalty: sampling.presence_penalty,
                    repetition_penalty: sampling.repetition_penalty,
                    sampling_seed: sampling.seed,
                    skip_special_tokens: request.output_options.skip_special_tokens,
                },
                stream: true,
                return_logprob: logprobs.map(|_| true),
                top_logprobs_num: logprobs.filter(|&n| n > 0),
                routed_dp_rank: request
                    .routing
                    .as_ref()
                    .and_then(|r| r.dp_rank)
                    .filter(|&r| r != u32::MAX),
                cache_salt: request.cache_salt(),
                bootstrap_host: bootstrap.map(|b| b.bootstrap_host.as_str()),
                bootstrap_port: bootstrap.map(|b| b.bootstrap_port),
                bootstrap_room: bootstrap.map(|b| b.bootstrap_room),
            },
            request,
        )
    }

    fn parser(&self, request: &PreprocessedRequest) -> Box<dyn StreamParser> {
        Box::new(Parser {
            emitted: Vec::new(),
            eos_token_ids: request.eos_token_ids.clone(),
        })
    }
}

struct Parser {
    /// Every id streamed so far (to read cumulative chunks that lack `completion_tokens`).
    emitted: Vec<u32>,
    eos_token_ids: Vec<u32>,
}

#[derive(Debug, Deserialize)]
struct Chunk {
    #[serde(default)]
    output_ids: Option<Vec<u32>>,
    #[serde(default)]
    meta_info: Option<MetaInfo>,
    #[serde(default)]
    error: Option<Value>,
}

#[derive(Debug, Deserialize)]
struct MetaInfo {
    #[serde(default)]
    finish_reason: Option<Value>,
    #[serde(default)]
    prompt_tokens: Option<u32>,
    #[serde(default)]
    completion_tokens: Option<u32>,
    #[serde(default)]
    cached_tokens: Option<u32>,
    /// `[[logprob, token_id, text], ...]`, aligned with `output_ids`.
    #[serde(default)]
    output_token_logprobs: Option<Vec<Value>>,
}

impl Parser {
    fn chunk(&mut self, chunk: Chunk) -> Parsed {
        if let Some(error) = chunk.error {
            return Parsed::Failed(error_value("sglang", &error));
        }
        let Some(ids) = chunk.output_ids else {
            return malformed(
                "a chunk without `output_ids`; expected `output_ids` and `meta_info`",
            );
        };
        let meta = chunk.meta_info;
        let total = meta.as_ref().and_then(|m| m.completion_tokens);
        let fresh = match total.map(|t| t as usize) {
            Some(total) if total < self.emitted.len() => {
                return malformed(&format!(
                    "meta_info.completion_tokens = {total} after {} tokens were streamed; \
                     expected a running total",
                    self.emitted.len()
                ));
            }
            Some(total) => (total - self.emitted.len()).min(ids.len()),
            // No running total: a chunk that repeats what was streamed is cumulative.
            None if !self.emitted.is_empty() && ids.starts_with(&self.emitted) => {
                ids.len() - self.emitted.len()
            }
            None => ids.len(),
        };
        let new_ids = &ids[ids.len() - fresh..];
        let mut step = Step {
            token_ids: new_ids.to_vec(),
            ..Step::default()
        };
        self.emitted.extend_from_slice(new_ids);
        let Some(meta) = meta else {
            return step.into_parsed();
        };
        if let Some(entries) = &meta.output_token_logprobs {
            let take = fresh.min(entries.len());
            step.log_probs = Some(
                entries[entries.len() - take..]
                    .iter()
                    .map(|e| e.get(0).and_then(Value::as_f64).unwrap_or(MISSING_LOGPROB))
                    .collect(),
            );
        }
        match meta.finish_reason.as_ref() {
            None | Some(Value::Null) => {}
            Some(reason) => match self.finish(reason) {
                Ok(finish) => {
                    step.finish = Some(finish);
                    let prompt_tokens = meta.prompt_tokens.unwrap_or(0);
                    let completion_tokens = total.unwrap_or(self.emitted.len() as u32);
                    step.usage = Some(CompletionUsage {
                        prompt_tokens,
                        completion_tokens,
                        total_tokens: prompt_tokens.saturating_add(completion_tokens),
                        prompt_tokens_details: meta.cached_tokens.map(|cached| {
                            PromptTokensDetails {
                                audio_tokens: None,
                                cached_tokens: Some(cached),
                            }
                        }),
                    });
                }
                Err(failure) => return Parsed::Failed(failure),
            },
        }
        step.into_parsed()
    }

    fn finish(&self, reason: &Value) -> Result<FinishReason, Failure> {
        let kind = reason
            .get("type")
            .or(Some(reason))
            .and_then(Value::as_str)
            .unwrap_or_default();
        Ok(match kind {
            "length" => FinishReason::Length,
            "stop" => match reason.get("matched").and_then(Value::as_u64) {
                Some(id) => stopped_on_token(&self.eos_token_ids, id),
                None => FinishReason::Stop,
            },
            "abort" => {
                let status = reason
                    .get("status_code")
                    .and_then(Value::as_u64)
                    .and_then(|s| u16::try_from(s).ok());
                let message = reason
                    .get("message")
                    .and_then(Value::as_str)
                    .unwrap_or("aborted");
                match status {
                    Some(s) if is_unavailable_status(s) => {
                        return Err(Failure::Unavailable(format!(
                            "sglang engine aborted the request with status {s}: {message}"
                        )));
                    }
                    Some(s) if s >= 400 => {
                        return Err(Failure::Refused(format!(
                            "sglang engine aborted the request with status {s}: {message}"
                        )));
                    }
                    _ => FinishReason::Cancelled,
                }
            }
            _ => FinishReason::Stop,
        })
    }
}

impl StreamParser for Parser {
    fn parse(&mut self, event: SseEvent) -> Parsed {
        match event {
            SseEvent::Error(raw) => Parsed::Failed(stream_error("sglang", &raw)),
            SseEvent::Data(data) if data.trim() == "[DONE]" => Parsed::Done,
            SseEvent::Data(data) => match serde_json::from_str::<Chunk>(&data) {
                Ok(chunk) => self.chunk(chunk),
                Err(e) => malformed(&format!(
                    "{e}; expected a /generate chunk, got {}",
                    excerpt(&data)
                )),
            },
        }
    }
}

fn malformed(what: &str) -> Parsed {
    Parsed::Failed(Failure::Malformed(format!(
        "malformed sglang stream chunk: {what}"
    )))
}
