//! The OpenAI completions protocol (`POST /v1/completions`, streamed) that vLLM, TensorRT-LLM
//! and any OpenAI server speak, with the prompt as a list of token ids. The three differ only in
//! which extensions they accept and how they return output ids: see [`Flavor`].

use kvroute_protocols::{CompletionUsage, FinishReason, PreprocessedRequest, PromptTokensDetails};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::{
    MISSING_LOGPROB, Parsed, Step, StreamParser, Target, stop_token_ids, stopped_on_token,
};
use crate::error::{Failure, error_value, stream_error};
use crate::sse::SseEvent;

/// What a completions server accepts and returns beyond the OpenAI standard.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Flavor {
    /// vLLM: the sampling extensions, `return_token_ids`, `cache_salt`.
    Vllm,
    /// TensorRT-LLM: the sampling extensions and `detokenize: false` (ids instead of text).
    /// Its server forbids unknown fields, so nothing else is sent.
    Trtllm,
    /// The OpenAI standard only (an OpenAI server may reject unknown fields): text comes back,
    /// and `top_k`, `min_p`, `repetition_penalty`, `stop_token_ids`, `min_tokens`, `ignore_eos`,
    /// `include_stop_str_in_output` and `skip_special_tokens` are not sent.
    Openai,
}

impl Flavor {
    fn name(self) -> &'static str {
        match self {
            Flavor::Vllm => "vllm",
            Flavor::Trtllm => "trtllm",
            Flavor::Openai => "openai",
        }
    }

    fn extensions(self) -> bool {
        self != Flavor::Openai
    }

    /// Whether a chunk's `text` is the detokenized `token_ids` (vLLM); TensorRT-LLM's is empty
    /// with `detokenize: false`.
    fn returns_text_with_ids(self) -> bool {
        self == Flavor::Vllm
    }

    /// Whether `stop_reason` is meaningful (null for the end-of-sequence token).
    fn has_stop_reason(self) -> bool {
        self != Flavor::Openai
    }
}

/// The body of a streamed completions request.
#[derive(Debug, Serialize)]
pub(super) struct Body<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    model: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    max_tokens: Option<u32>,
    stream: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    stream_options: Option<StreamOptions>,
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
    frequency_penalty: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    presence_penalty: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    repetition_penalty: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    stop: Option<&'a [String]>,
    #[serde(skip_serializing_if = "Option::is_none")]
    stop_token_ids: Option<Vec<u32>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    min_tokens: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    ignore_eos: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    include_stop_str_in_output: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    skip_special_tokens: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    logprobs: Option<u32>,
    /// vLLM: stream each chunk's token ids (`choices[].token_ids`).
    #[serde(skip_serializing_if = "Option::is_none")]
    return_token_ids: Option<bool>,
    /// TensorRT-LLM: `false` streams `choices[].token_ids` and empty text.
    #[serde(skip_serializing_if = "Option::is_none")]
    detokenize: Option<bool>,
    /// vLLM: salts the prefix cache.
    #[serde(skip_serializing_if = "Option::is_none")]
    cache_salt: Option<&'a str>,
    /// vLLM's KV connector handshake (see `vllm.rs`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) kv_transfer_params: Option<Value>,
    /// TensorRT-LLM's context / generation exchange (see `trtllm.rs`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) disaggregated_params: Option<Value>,
}

#[derive(Debug, Serialize)]
struct StreamOptions {
    include_usage: bool,
}

impl<'a> Body<'a> {
    /// The body for `request` in `flavor`. TensorRT-LLM requires `model`; the others leave an
    /// empty one out (the server's default model).
    pub(super) fn new(
        flavor: Flavor,
        request: &'a PreprocessedRequest,
        target: &Target<'a>,
    ) -> Self {
        let stop = &request.stop_conditions;
        let sampling = &request.sampling_options;
        let ext = flavor.extensions();
        let model = (flavor == Flavor::Trtllm || !target.model.is_empty()).then_some(target.model);
        Self {
            model,
            max_tokens: target.max_tokens,
            stream: true,
            stream_options: Some(StreamOptions {
                include_usage: true,
            }),
            temperature: sampling.temperature,
            top_p: sampling.top_p,
            top_k: sampling.top_k.filter(|_| ext),
            min_p: sampling.min_p.filter(|_| ext),
            seed: sampling.seed,
            frequency_penalty: sampling.frequency_penalty,
            presence_penalty: sampling.presence_penalty,
            repetition_penalty: sampling.repetition_penalty.filter(|_| ext),
            stop: stop.stop.as_deref().filter(|s| !s.is_empty()),
            stop_token_ids: stop_token_ids(request).filter(|_| ext),
            min_tokens: stop.min_tokens.filter(|_| ext),
            ignore_eos: stop.ignore_eos.filter(|_| ext),
            include_stop_str_in_output: sampling.include_stop_str_in_output.filter(|_| ext),
            skip_special_tokens: request.output_options.skip_special_tokens.filter(|_| ext),
            logprobs: request.output_options.logprobs,
            return_token_ids: (flavor == Flavor::Vllm).then_some(true),
            detokenize: (flavor == Flavor::Trtllm).then_some(false),
            cache_salt: request.cache_salt().filter(|_| flavor == Flavor::Vllm),
            kv_transfer_params: None,
            disaggregated_params: None,
        }
    }

    /// The same body asking for one whole (non-streamed) answer of one token, as a prefill
    /// whose KV another engine continues from; `min_tokens` goes, since a prefill engine
    /// refuses it with one token.
    pub(super) fn one_whole_token(&mut self) {
        self.stream = false;
        self.stream_options = None;
        self.max_tokens = Some(1);
        self.min_tokens = None;
    }
}

/// Reads a completions stream.
pub(super) struct Parser {
    flavor: Flavor,
    eos_token_ids: Vec<u32>,
    /// No data event has come yet: vLLM echoes the prompt's ids in the first one only, so the
    /// later ones (one a token) are not searched for it.
    echo_pending: bool,
}

impl Parser {
    pub(super) fn new(flavor: Flavor, request: &PreprocessedRequest) -> Self {
        Self {
            flavor,
            eos_token_ids: request.eos_token_ids.clone(),
            echo_pending: true,
        }
    }

    fn chunk(&self, chunk: Chunk) -> Parsed {
        if let Some(error) = chunk.error {
            return Parsed::Failed(error_value(self.flavor.name(), &error));
        }
        let mut step = Step {
            usage: chunk.usage.map(Usage::into_usage),
            disaggregated_params: chunk.kv_transfer_params.filter(|p| !p.is_null()),
            ..Step::default()
        };
        let Some(choices) = chunk.choices else {
            if step.usage.is_some() {
                return Parsed::Step(step);
            }
            return self.malformed("a chunk with neither `choices`, `usage` nor `error`");
        };
        let mut choices = choices.into_iter();
        let choice = match (choices.next(), choices.next()) {
            (None, _) => return step.into_parsed(),
            (Some(choice), None) if choice.index == 0 => choice,
            (Some(choice), _) => {
                return self.malformed(&format!(
                    "a choice with index {} or several choices; expected one choice, index 0 (n = 1)",
                    choice.index
                ));
            }
        };
        if let Some(params) = choice.disaggregated_params.filter(|p| !p.is_null()) {
            step.disaggregated_params = Some(params);
        }
        match choice.token_ids {
            Some(ids) => {
                // vLLM detokenizes as it generates (in the prompt's context, holding back a
                // partial character): its text goes along with the ids, so that the router
                // relays it instead of detokenizing the ids again. TensorRT-LLM's is empty.
                if self.flavor.returns_text_with_ids() {
                    step.text = choice.text.filter(|t| !t.is_empty() || !ids.is_empty());
                }
                step.token_ids = ids;
            }
            None => step.text = choice.text.filter(|t| !t.is_empty()),
        }
        if let Some(logprobs) = choice.logprobs {
            step.log_probs = Some(
                logprobs
                    .token_logprobs
                    .into_iter()
                    .map(|lp| lp.unwrap_or(MISSING_LOGPROB))
                    .collect(),
            );
        }
        if let Some(reason) = choice.finish_reason {
            match self.finish(&reason, choice.stop_reason.as_ref()) {
                Ok(finish) => step.finish = Some(finish),
                Err(failure) => return Parsed::Failed(failure),
            }
        }
        step.into_parsed()
    }

    fn finish(&self, reason: &str, stop_reason: Option<&Value>) -> Result<FinishReason, Failure> {
        Ok(match reason {
            "length" => FinishReason::Length,
            "stop" if self.flavor.has_stop_reason() => match stop_reason {
                // vLLM and TensorRT-LLM leave `stop_reason` null for the end-of-sequence token;
                // vLLM names a generation-config end token as a stop token id.
                None | Some(Value::Null) => FinishReason::Eos,
                Some(Value::Number(n)) => match n.as_u64() {
                    Some(id) => stopped_on_token(&self.eos_token_ids, id),
                    None => FinishReason::Stop,
                },
                Some(_) => FinishReason::Stop,
            },
            "abort" | "cancelled" => FinishReason::Cancelled,
            "content_filter" => FinishReason::ContentFilter,
            "error" => {
                return Err(Failure::Refused(format!(
                    "{} engine finished the request with an error",
                    self.flavor.name()
                )));
            }
            // `stop`, `tool_calls`, vLLM's `repetition` and whatever else a server invents.
            _ => FinishReason::Stop,
        })
    }

    fn malformed(&self, what: &str) -> Parsed {
        Parsed::Failed(Failure::Malformed(format!(
            "malformed {} stream chunk: {what}",
            self.flavor.name()
        )))
    }
}

impl StreamParser for Parser {
    fn parse(&mut self, event: SseEvent) -> Parsed {
        match event {
            SseEvent::Error(raw) => Parsed::Failed(stream_error(self.flavor.name(), &raw)),
            SseEvent::Data(data) if data.trim() == "[DONE]" => Parsed::Done,
            SseEvent::Data(mut data) => match serde_json::from_str::<Chunk>({
                if std::mem::take(&mut self.echo_pending) {
                    skip_prompt_token_ids(&mut data);
                }
                &data
            }) {
                Ok(chunk) => self.chunk(chunk),
                Err(e) => self.malformed(&format!(
                    "{e}; expected a completions chunk, got {}",
                    crate::error::excerpt(&data)
                )),
            },
        }
    }
}

/// vLLM echoes the prompt's token ids (`prompt_token_ids`, which comes with `return_token_ids`)
/// in a stream's first chunk and in a whole response: as many numbers as the prompt has tokens,
/// which nothing here reads. serde skips them a byte at a time (4% of `kvroute serve`'s CPU with
/// prompts of 13,000 tokens); this finds the array's end with `memchr` instead and puts `null`
/// in its place. Only an array of plain numbers (digits, commas, white space) is replaced; any
/// other value is left for the parser, which reads or refuses it as before. A JSON string
/// cannot hold an unescaped `"`, so the quoted key found is a key, never text.
pub(super) fn skip_prompt_token_ids(data: &mut String) {
    const KEY: &[u8] = b"\"prompt_token_ids\"";
    // Built once: every chunk of every stream is searched.
    static FINDER: std::sync::LazyLock<memchr::memmem::Finder<'static>> =
        std::sync::LazyLock::new(|| memchr::memmem::Finder::new(KEY));
    let bytes = data.as_bytes();
    let Some(at) = FINDER.find(bytes) else {
        return;
    };
    let mut i = at + KEY.len();
    let skip_space = |mut i: usize| {
        while bytes.get(i).is_some_and(u8::is_ascii_whitespace) {
            i += 1;
        }
        i
    };
    i = skip_space(i);
    if bytes.get(i) != Some(&b':') {
        return;
    }
    i = skip_space(i + 1);
    if bytes.get(i) != Some(&b'[') {
        return;
    }
    let open = i;
    let Some(close) = memchr::memchr(b']', &bytes[open..]).map(|n| open + n) else {
        return;
    };
    // Branch-free per byte, so that it vectorizes; one verdict per 64 bytes.
    let plain = bytes[open + 1..close].chunks(64).all(|chunk| {
        chunk.iter().fold(true, |ok, &b| {
            ok & (b.is_ascii_digit()
                | (b == b',')
                | (b == b' ')
                | (b == b'\n')
                | (b == b'\r')
                | (b == b'\t'))
        })
    });
    if plain {
        data.replace_range(open..=close, "null");
    }
}

/// One chunk of a completions stream (only the fields read; others are ignored).
#[derive(Debug, Deserialize)]
struct Chunk {
    #[serde(default)]
    choices: Option<Vec<Choice>>,
    #[serde(default)]
    usage: Option<Usage>,
    #[serde(default)]
    error: Option<Value>,
    /// vLLM: a prefill for remote decode answers with its KV's whereabouts (whole responses
    /// only).
    #[serde(default)]
    kv_transfer_params: Option<Value>,
}

#[derive(Debug, Deserialize)]
struct Choice {
    #[serde(default)]
    index: u32,
    #[serde(default)]
    text: Option<String>,
    #[serde(default)]
    token_ids: Option<Vec<u32>>,
    #[serde(default)]
    logprobs: Option<Logprobs>,
    #[serde(default)]
    finish_reason: Option<String>,
    #[serde(default)]
    stop_reason: Option<Value>,
    /// TensorRT-LLM: a context (prefill) engine's handover (whole responses).
    #[serde(default)]
    disaggregated_params: Option<Value>,
}

#[derive(Debug, Deserialize)]
struct Logprobs {
    #[serde(default)]
    token_logprobs: Vec<Option<f64>>,
}

#[derive(Debug, Deserialize)]
struct Usage {
    #[serde(default)]
    prompt_tokens: u32,
    #[serde(default)]
    completion_tokens: Option<u32>,
    #[serde(default)]
    total_tokens: u32,
    #[serde(default)]
    prompt_tokens_details: Option<Details>,
}

#[derive(Debug, Deserialize)]
struct Details {
    #[serde(default)]
    cached_tokens: Option<u32>,
}

impl Usage {
    fn into_usage(self) -> CompletionUsage {
        let completion_tokens = self.completion_tokens.unwrap_or(0);
        CompletionUsage {
            prompt_tokens: self.prompt_tokens,
            completion_tokens,
            total_tokens: self
                .total_tokens
                .max(self.prompt_tokens.saturating_add(completion_tokens)),
            prompt_tokens_details: self
                .prompt_tokens_details
                .and_then(|d| d.cached_tokens)
                .map(|cached| PromptTokensDetails {
                    audio_tokens: None,
                    cached_tokens: Some(cached),
                }),
        }
    }
}
