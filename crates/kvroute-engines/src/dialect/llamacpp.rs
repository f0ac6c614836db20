//! llama.cpp's `llama-server`, native API (its `tools/server/README.md` and
//! `server-task.cpp`/`server-context.cpp`).
//!
//! `POST /completion` with the prompt as token ids, `stream`, `return_tokens` and
//! `cache_prompt`. The OpenAI-style `/v1/completions` of llama.cpp ignores `return_tokens`,
//! hence the native endpoint. Each chunk is `{"content", "tokens": [new ids], "stop": false}`;
//! the last has `"stop": true`, `stop_type` (`eos`, `limit`, `word`, `none`),
//! `tokens_evaluated` (the prompt), `tokens_predicted`, `truncated` and `timings.cache_n` (the
//! prompt tokens reused from the cache). Current servers send that last chunk with empty
//! `content` and `tokens`; older ones repeated the whole output there, which is recognised
//! (it starts with everything streamed) and not streamed twice. A failure mid-stream is
//! `data: {"error": {...}}` (older servers: an `error:` line).
//!
//! llama.cpp has no stop token ids: the engine stops them itself, client side. When a streamed
//! id is a stop id, the output ends before it (finish `stop`, or `eos` for an end token), and
//! the connection is dropped, which makes llama.cpp release the slot. `min_tokens` and
//! `include_stop_str_in_output` have no llama.cpp equivalent and are not sent.

use kvroute_protocols::{FinishReason, PreprocessedRequest, PromptTokensDetails};
use kvroute_runtime::EngineError;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::{
    Built, Dialect, MISSING_LOGPROB, Parsed, Step, StreamParser, Target, counted_usage,
    stop_token_ids, stopped_on_token,
};
use crate::error::{Failure, error_value, excerpt, stream_error};
use crate::sse::SseEvent;

/// The llama.cpp dialect.
pub(super) struct Llamacpp;

#[derive(Debug, Serialize)]
struct Body<'a> {
    /// Selects the model on a multi-model (router mode) server; a single-model one ignores it.
    #[serde(skip_serializing_if = "Option::is_none")]
    model: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    n_predict: Option<u32>,
    stream: bool,
    return_tokens: bool,
    cache_prompt: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    temperature: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    top_p: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    top_k: Option<i32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    min_p: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    seed: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    stop: Option<&'a [String]>,
    #[serde(skip_serializing_if = "Option::is_none")]
    ignore_eos: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    repeat_penalty: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    presence_penalty: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    frequency_penalty: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    n_probs: Option<u32>,
}

impl Dialect for Llamacpp {
    fn generate_path(&self) -> &'static str {
        "completion"
    }

    fn build(
        &self,
        request: &PreprocessedRequest,
        target: &Target<'_>,
    ) -> Result<Built, EngineError> {
        let stop = &request.stop_conditions;
        let sampling = &request.sampling_options;
        Built::json(
            "prompt",
            &Body {
                model: Some(target.model).filter(|m| !m.is_empty()),
                n_predict: target.max_tokens,
                stream: true,
                return_tokens: true,
                cache_prompt: true,
                temperature: sampling.temperature,
                top_p: sampling.top_p,
                top_k: sampling.top_k,
                min_p: sampling.min_p,
                seed: sampling.seed,
                stop: stop.stop.as_deref().filter(|s| !s.is_empty()),
                ignore_eos: stop.ignore_eos,
                repeat_penalty: sampling.repetition_penalty,
                presence_penalty: sampling.presence_penalty,
                frequency_penalty: sampling.frequency_penalty,
                // OpenAI's `logprobs: 0` still asks for the sampled token's log probability.
                n_probs: request.output_options.logprobs.map(|n| n.max(1)),
            },
            request,
        )
    }

    fn parser(&self, request: &PreprocessedRequest) -> Box<dyn StreamParser> {
        Box::new(Parser {
            emitted: Vec::new(),
            prompt_tokens: request.token_ids.len(),
            stop_ids: stop_token_ids(request).unwrap_or_default(),
            eos_token_ids: request.eos_token_ids.clone(),
        })
    }
}

struct Parser {
    /// Every id streamed so far.
    emitted: Vec<u32>,
    prompt_tokens: usize,
    /// Ids that end the output (enforced here: llama.cpp has no such option).
    stop_ids: Vec<u32>,
    eos_token_ids: Vec<u32>,
}

#[derive(Debug, Deserialize)]
struct Chunk {
    #[serde(default)]
    content: Option<String>,
    #[serde(default)]
    tokens: Option<Vec<u32>>,
    #[serde(default)]
    stop: bool,
    #[serde(default)]
    stop_type: Option<String>,
    #[serde(default)]
    tokens_predicted: Option<u32>,
    #[serde(default)]
    tokens_evaluated: Option<u32>,
    #[serde(default)]
    truncated: bool,
    #[serde(default)]
    timings: Option<Timings>,
    #[serde(default)]
    completion_probabilities: Option<Vec<Probability>>,
    #[serde(default)]
    error: Option<Value>,
}

#[derive(Debug, Deserialize)]
struct Timings {
    /// Prompt tokens taken from the cache.
    #[serde(default)]
    cache_n: Option<u32>,
}

#[derive(Debug, Deserialize)]
struct Probability {
    #[serde(default)]
    logprob: Option<f64>,
    /// With `post_sampling_probs`, a probability instead of a log probability.
    #[serde(default)]
    prob: Option<f64>,
}

impl Parser {
    fn chunk(&mut self, chunk: Chunk) -> Parsed {
        if let Some(error) = chunk.error {
            return Parsed::Failed(error_value("llamacpp", &error));
        }
        let mut step = Step::default();
        match chunk.tokens {
            Some(tokens) => {
                // A last chunk that starts with everything streamed repeats the whole output.
                let fresh = if chunk.stop && tokens.starts_with(&self.emitted) {
                    &tokens[self.emitted.len()..]
                } else {
                    &tokens[..]
                };
                step.token_ids = fresh.to_vec();
            }
            // A server that returns no ids at all: pass its text on.
            None => step.text = chunk.content.filter(|c| !c.is_empty()),
        }
        if let Some(probs) = chunk.completion_probabilities {
            step.log_probs = Some(
                probs
                    .iter()
                    .map(|p| match (p.logprob, p.prob) {
                        (Some(lp), _) => lp,
                        (None, Some(p)) if p > 0.0 => p.ln(),
                        _ => MISSING_LOGPROB,
                    })
                    .collect(),
            );
        }
        if let Some(at) = step
            .token_ids
            .iter()
            .position(|id| self.stop_ids.contains(id))
        {
            let hit = step.token_ids[at];
            step.token_ids.truncate(at);
            if let Some(lp) = step.log_probs.as_mut() {
                lp.truncate(at);
            }
            self.emitted.extend_from_slice(&step.token_ids);
            step.finish = Some(stopped_on_token(&self.eos_token_ids, u64::from(hit)));
            step.usage = Some(counted_usage(self.prompt_tokens, self.emitted.len()));
            // The engine would go on: end now, which drops the connection and frees the slot.
            return Parsed::Last(step);
        }
        self.emitted.extend_from_slice(&step.token_ids);
        if chunk.stop {
            step.finish = Some(match chunk.stop_type.as_deref() {
                Some("eos") => FinishReason::Eos,
                Some("limit") => FinishReason::Length,
                _ if chunk.truncated => FinishReason::Length,
                _ => FinishReason::Stop,
            });
            let mut usage = counted_usage(self.prompt_tokens, self.emitted.len());
            usage.prompt_tokens = chunk.tokens_evaluated.unwrap_or(usage.prompt_tokens);
            usage.completion_tokens = chunk.tokens_predicted.unwrap_or(usage.completion_tokens);
            usage.total_tokens = usage.prompt_tokens.saturating_add(usage.completion_tokens);
            usage.prompt_tokens_details =
                chunk
                    .timings
                    .and_then(|t| t.cache_n)
                    .map(|cached| PromptTokensDetails {
                        audio_tokens: None,
                        cached_tokens: Some(cached),
                    });
            step.usage = Some(usage);
            // No `[DONE]` follows: the body just ends.
            return Parsed::Last(step);
        }
        step.into_parsed()
    }
}

impl StreamParser for Parser {
    fn parse(&mut self, event: SseEvent) -> Parsed {
        match event {
            SseEvent::Error(raw) => Parsed::Failed(stream_error("llamacpp", &raw)),
            SseEvent::Data(data) if data.trim() == "[DONE]" => Parsed::Done,
            SseEvent::Data(data) => match serde_json::from_str::<Chunk>(&data) {
                Ok(chunk) => self.chunk(chunk),
                Err(e) => Parsed::Failed(Failure::Malformed(format!(
                    "malformed llamacpp stream chunk: {e}; expected a /completion chunk, got {}",
                    excerpt(&data)
                ))),
            },
        }
    }
}
