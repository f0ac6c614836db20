//! Engine dialects: how a [`PreprocessedRequest`] becomes an HTTP request body, and how the
//! engine's streamed chunks become output steps. One module per dialect; adding an engine is
//! adding a module and a line in [`for_kind`].

use kvroute_protocols::{CompletionUsage, FinishReason, PreprocessedRequest};
use kvroute_runtime::{EngineError, WorkerRole};

use crate::config::EngineKind;
use crate::error::Failure;
use crate::sse::SseEvent;

mod completions;
mod llamacpp;
mod openai;
mod sglang;
mod trtllm;
mod vllm;

/// One engine's HTTP dialect.
pub(crate) trait Dialect: Send + Sync + 'static {
    /// The generation endpoint, relative to the base URL.
    fn generate_path(&self) -> &'static str;

    /// The endpoint [`crate::HttpEngine::health`] queries, relative to the base URL.
    fn health_path(&self) -> &'static str {
        "health"
    }

    /// The HTTP request serving `request`, or why the dialect cannot express it.
    fn build(
        &self,
        request: &PreprocessedRequest,
        target: &Target<'_>,
    ) -> Result<Built, EngineError>;

    /// A reader for the response stream of `request`.
    fn parser(&self, request: &PreprocessedRequest) -> Box<dyn StreamParser>;
}

/// What a request is sent as, beyond its own fields.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Target<'a> {
    /// The `model` to name (the request's, or the configured served name).
    pub(crate) model: &'a str,
    /// The output budget (the request's, or the configured default).
    pub(crate) max_tokens: Option<u32>,
    /// The engine's part in disaggregated serving.
    pub(crate) role: WorkerRole,
}

/// An HTTP request body and its extra headers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Built {
    /// The JSON body.
    pub(crate) body: Vec<u8>,
    /// Extra headers (besides content type and authorization).
    pub(crate) headers: Vec<(&'static str, String)>,
    /// Whether the answer is one JSON document (`stream: false`) instead of an event stream.
    pub(crate) whole: bool,
}

impl Built {
    /// `request`'s body: its prompt's token ids under `ids_key`, then `body`'s own fields
    /// (`body` serializes as a JSON object without the ids).
    ///
    /// The ids are written by [`write_token_ids`] rather than through serde: a prompt of 13,000
    /// tokens went number by number through serde's serializer (a call, an `itoa`, and a copy
    /// of one to six bytes each), which was 5-6% of `kvroute serve`'s CPU in the peers bench's
    /// `agentic` cells. The ids come first so that the fields after them are copied as they are.
    fn json(
        ids_key: &str,
        body: &impl serde::Serialize,
        request: &PreprocessedRequest,
    ) -> Result<Self, EngineError> {
        let fields = serde_json::to_vec(body).map_err(|e| EngineError::Rejected {
            message: format!("cannot encode the engine request: {e}"),
        })?;
        let Some(fields) = fields.strip_prefix(b"{") else {
            return Err(EngineError::Rejected {
                message: "cannot encode the engine request: its fields are not a JSON object"
                    .to_owned(),
            });
        };
        let ids = &request.token_ids;
        let mut out = Vec::with_capacity(ids.len() * 7 + ids_key.len() + fields.len() + 8);
        out.extend_from_slice(b"{\"");
        out.extend_from_slice(ids_key.as_bytes());
        out.extend_from_slice(b"\":[");
        write_token_ids(&mut out, ids);
        out.push(b']');
        if fields != b"}" {
            out.push(b',');
        }
        out.extend_from_slice(fields);
        Ok(Self {
            body: out,
            headers: Vec::new(),
            whole: false,
        })
    }
}

/// Appends `ids` to `out` as JSON numbers separated by commas (what serde_json writes for the
/// numbers of a `[u32]`, without the brackets). Each number is written into a fixed window of a
/// buffer on the stack, and the buffer is copied out whenever it is nearly full, so that no
/// number costs a call (`cargo bench -p kvroute-engines --bench token_ids`).
pub fn write_token_ids(out: &mut Vec<u8>, ids: &[u32]) {
    /// A comma and ten digits (`u32::MAX`).
    const WINDOW: usize = 11;
    /// The two digits of every number below 100.
    const PAIRS: &[u8; 200] = b"0001020304050607080910111213141516171819\
                                2021222324252627282930313233343536373839\
                                4041424344454647484950515253545556575859\
                                6061626364656667686970717273747576777879\
                                8081828384858687888990919293949596979899";
    let mut buf = [0u8; 2048];
    let mut at = 0;
    for (i, &id) in ids.iter().enumerate() {
        if at > buf.len() - WINDOW {
            out.extend_from_slice(&buf[..at]);
            at = 0;
        }
        let window: &mut [u8; WINDOW] = (&mut buf[at..at + WINDOW])
            .try_into()
            .expect("the window is WINDOW bytes");
        // A comma before every number but the first.
        let sep = usize::from(i > 0);
        window[0] = b',';
        let digits = id.checked_ilog10().unwrap_or(0) as usize + 1;
        let (mut n, mut end) = (id, sep + digits);
        while end >= sep + 2 {
            let pair = (n % 100) as usize * 2;
            window[end - 2] = PAIRS[pair];
            window[end - 1] = PAIRS[pair + 1];
            n /= 100;
            end -= 2;
        }
        if end == sep + 1 {
            window[sep] = b'0' + n as u8;
        }
        at += sep + digits;
    }
    out.extend_from_slice(&buf[..at]);
}

/// Reads one response stream, chunk by chunk. Parsers keep state (tokens already emitted), so
/// each request gets its own.
pub(crate) trait StreamParser: Send {
    /// What one event of the stream means.
    fn parse(&mut self, event: SseEvent) -> Parsed;
}

/// The meaning of one stream event.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Parsed {
    /// Nothing to report (an empty chunk).
    Nothing,
    /// Output, a finish, usage, or any of them. After a finish the stream still waits for its
    /// end (`[DONE]` or the end of the body), taking any usage that comes before it.
    Step(Step),
    /// The last step: the engine sends nothing more that matters, so the stream ends at once.
    Last(Step),
    /// The end-of-stream marker (`data: [DONE]`).
    Done,
    /// The request failed.
    Failed(Failure),
}

/// What one chunk carries.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Step {
    /// New output token ids.
    pub(crate) token_ids: Vec<u32>,
    /// New text: from engines that return no ids, and beside the ids from engines that
    /// detokenize them themselves (vLLM), whose text the router then relays as it is.
    pub(crate) text: Option<String>,
    /// Log probability of each new token, when requested.
    pub(crate) log_probs: Option<Vec<f64>>,
    /// Set when generation ended.
    pub(crate) finish: Option<FinishReason>,
    /// Token usage, when the chunk reports it.
    pub(crate) usage: Option<CompletionUsage>,
    /// What the engine hands over for another engine to continue from (vLLM's
    /// `kv_transfer_params` of a prefill for remote decode), verbatim.
    pub(crate) disaggregated_params: Option<serde_json::Value>,
}

impl Step {
    fn is_empty(&self) -> bool {
        self.token_ids.is_empty()
            && self.text.as_deref().is_none_or(str::is_empty)
            && self.finish.is_none()
            && self.usage.is_none()
            && self.disaggregated_params.is_none()
    }

    fn into_parsed(self) -> Parsed {
        if self.is_empty() {
            Parsed::Nothing
        } else {
            Parsed::Step(self)
        }
    }
}

/// The dialect of `kind`.
pub(crate) fn for_kind(kind: EngineKind) -> &'static dyn Dialect {
    match kind {
        EngineKind::Vllm => &vllm::Vllm,
        EngineKind::Sglang => &sglang::Sglang,
        EngineKind::Trtllm => &trtllm::Trtllm,
        EngineKind::Llamacpp => &llamacpp::Llamacpp,
        EngineKind::Openai => &openai::Openai,
    }
}

/// Refuses what no dialect here can serve: one sequence per request, no beam search.
pub(crate) fn check_supported(request: &PreprocessedRequest) -> Result<(), EngineError> {
    let s = &request.sampling_options;
    let refuse = |message: String| Err(EngineError::Rejected { message });
    if let Some(n) = s.n.filter(|&n| n > 1) {
        return refuse(format!(
            "sampling_options.n = {n} is not supported by the HTTP engines; expected 1"
        ));
    }
    if let Some(best_of) = s.best_of.filter(|&b| b > 1) {
        return refuse(format!(
            "sampling_options.best_of = {best_of} is not supported by the HTTP engines; expected 1"
        ));
    }
    if s.use_beam_search == Some(true) {
        return refuse(
            "sampling_options.use_beam_search is not supported by the HTTP engines; expected \
             sampling"
                .to_owned(),
        );
    }
    Ok(())
}

/// The stop token ids to send: the request's visible and hidden ones (the hidden ones are the
/// model's end tokens the router hides from the client), without duplicates. With `ignore_eos`
/// the hidden ones are left out, or they would end generation where the client asked it not to.
pub(crate) fn stop_token_ids(request: &PreprocessedRequest) -> Option<Vec<u32>> {
    let stop = &request.stop_conditions;
    let mut ids: Vec<u32> = stop.stop_token_ids.clone().unwrap_or_default();
    if stop.ignore_eos != Some(true) {
        for &id in stop.stop_token_ids_hidden.iter().flatten() {
            if !ids.contains(&id) {
                ids.push(id);
            }
        }
    }
    (!ids.is_empty()).then_some(ids)
}

/// The finish reason of a stop on token `id`: the end of sequence when `id` is one of the
/// model's end tokens, a stop condition otherwise.
pub(crate) fn stopped_on_token(eos_token_ids: &[u32], id: u64) -> FinishReason {
    if u32::try_from(id).is_ok_and(|id| eos_token_ids.contains(&id)) {
        FinishReason::Eos
    } else {
        FinishReason::Stop
    }
}

/// Usage counted from the request and the ids streamed, for engines that report none.
pub(crate) fn counted_usage(prompt_tokens: usize, completion_tokens: usize) -> CompletionUsage {
    let prompt_tokens = u32::try_from(prompt_tokens).unwrap_or(u32::MAX);
    let completion_tokens = u32::try_from(completion_tokens).unwrap_or(u32::MAX);
    CompletionUsage {
        prompt_tokens,
        completion_tokens,
        total_tokens: prompt_tokens.saturating_add(completion_tokens),
        prompt_tokens_details: None,
    }
}

/// The log probability the engines use for "none reported" (TensorRT-LLM's floor).
pub(crate) const MISSING_LOGPROB: f64 = -9999.0;

#[cfg(test)]
mod tests;
