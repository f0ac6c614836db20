//! TensorRT-LLM's `trtllm-serve` (its `tensorrt_llm/serve/openai_protocol.py` and
//! `postprocess_handlers.py`).
//!
//! `POST /v1/completions` with the prompt as token ids and `detokenize: false`, which makes each
//! chunk carry `choices[0].token_ids` (the new ids) and empty text. The server forbids unknown
//! fields and requires `model`, so exactly its fields are sent. Usage, with
//! `prompt_tokens_details.cached_tokens`, arrives in a last chunk with no choices.
//!
//! Disaggregated serving follows `trtllm-serve`'s own disaggregated server
//! (`tensorrt_llm/serve/openai_disagg_server.py`): a context (prefill) engine gets the request
//! with `disaggregated_params: {"request_type": "context_only"}`, not streamed, one token; its
//! whole answer carries `choices[0].disaggregated_params` (`ctx_request_id`,
//! `first_gen_tokens`, `encoded_opaque_state`, `draft_tokens`, ...), kept verbatim as the
//! output's `disaggregated_params`; a generation (decode) engine gets those parameters with
//! `request_type` set to `"generation_only"`, as the disaggregated server does. Pinned from
//! sources only: kvroute has not run it against a real `trtllm-serve`.

use kvroute_protocols::PreprocessedRequest;
use kvroute_runtime::{EngineError, WorkerRole};
use serde_json::{Value, json};

use super::completions::{Body, Flavor, Parser};
use super::{Built, Dialect, StreamParser, Target};

/// The TensorRT-LLM dialect.
pub(super) struct Trtllm;

impl Dialect for Trtllm {
    fn generate_path(&self) -> &'static str {
        "v1/completions"
    }

    fn build(
        &self,
        request: &PreprocessedRequest,
        target: &Target<'_>,
    ) -> Result<Built, EngineError> {
        let mut body = Body::new(Flavor::Trtllm, request, target);
        let whole = match target.role {
            WorkerRole::Prefill => {
                body.one_whole_token();
                body.disaggregated_params = Some(json!({"request_type": "context_only"}));
                true
            }
            WorkerRole::Decode => {
                body.disaggregated_params = request
                    .prefill_result
                    .as_ref()
                    .map(|r| generation_only(&r.disaggregated_params));
                false
            }
            WorkerRole::Aggregated => false,
        };
        let mut built = Built::json("prompt", &body, request)?;
        built.whole = whole;
        Ok(built)
    }

    fn parser(&self, request: &PreprocessedRequest) -> Box<dyn StreamParser> {
        Box::new(Parser::new(Flavor::Trtllm, request))
    }
}

/// A context engine's `disaggregated_params` for its generation engine: the same, with
/// `request_type` `"generation_only"`.
fn generation_only(context: &Value) -> Value {
    let mut params = context.clone();
    if let Some(object) = params.as_object_mut() {
        object.insert("request_type".to_owned(), json!("generation_only"));
    }
    params
}

#[cfg(test)]
mod tests;
