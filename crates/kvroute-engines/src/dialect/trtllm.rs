//! TensorRT-LLM's `trtllm-serve` (its `tensorrt_llm/serve/openai_protocol.py` and
//! `postprocess_handlers.py`).
//!
//! `POST /v1/completions` with the prompt as token ids and `detokenize: false`, which makes each
//! chunk carry `choices[0].token_ids` (the new ids) and empty text. The server forbids unknown
//! fields and requires `model`, so exactly its fields are sent. Usage, with
//! `prompt_tokens_details.cached_tokens`, arrives in a last chunk with no choices.

use kvroute_protocols::PreprocessedRequest;
use kvroute_runtime::EngineError;

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
        Built::json(&Body::new(Flavor::Trtllm, request, target))
    }

    fn parser(&self, request: &PreprocessedRequest) -> Box<dyn StreamParser> {
        Box::new(Parser::new(Flavor::Trtllm, request))
    }
}
