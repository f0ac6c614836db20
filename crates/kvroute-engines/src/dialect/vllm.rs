//! vLLM's OpenAI server (checked against vLLM 0.33.0,
//! `vllm/entrypoints/openai/completion/{protocol,serving}.py`).
//!
//! `POST /v1/completions` with the prompt as token ids and `return_token_ids: true`, so each
//! chunk's `choices[0].token_ids` holds the new output ids (the first chunk also echoes
//! `prompt_token_ids`, which is ignored). `stop_reason` tells the end-of-sequence token (null)
//! from a stop token id (a number) or string. Usage arrives in a last chunk with no choices;
//! its `prompt_tokens_details.cached_tokens` is filled when the server runs with
//! `--enable-prompt-tokens-details`. `cache_salt` comes from `extra_args.cache_salt`; the routed
//! data-parallel rank goes in the `X-data-parallel-rank` header, which vLLM's frontend reads.
//! The `model` selects a LoRA adapter by name.

use kvroute_protocols::PreprocessedRequest;
use kvroute_runtime::EngineError;

use super::completions::{Body, Flavor, Parser};
use super::{Built, Dialect, StreamParser, Target};

/// The vLLM dialect.
pub(super) struct Vllm;

impl Dialect for Vllm {
    fn generate_path(&self) -> &'static str {
        "v1/completions"
    }

    fn build(
        &self,
        request: &PreprocessedRequest,
        target: &Target<'_>,
    ) -> Result<Built, EngineError> {
        let mut built = Built::json(&Body::new(Flavor::Vllm, request, target))?;
        let dp_rank = request.routing.as_ref().and_then(|r| r.dp_rank);
        if let Some(rank) = dp_rank.filter(|&r| r != u32::MAX) {
            built
                .headers
                .push(("x-data-parallel-rank", rank.to_string()));
        }
        Ok(built)
    }

    fn parser(&self, request: &PreprocessedRequest) -> Box<dyn StreamParser> {
        Box::new(Parser::new(Flavor::Vllm, request))
    }
}
