//! Any OpenAI-compatible completions server (the OpenAI API reference for `POST /v1/completions`).
//!
//! Only standard fields are sent (such servers may reject others), so `top_k`, `min_p`,
//! `repetition_penalty`, stop token ids, `min_tokens`, `ignore_eos`,
//! `include_stop_str_in_output` and `skip_special_tokens` are dropped. The server streams text
//! only: outputs carry `text` and empty `token_ids`. The router counts and migrates requests by
//! token ids, so behind such a server it cannot count generated tokens per step (only the final
//! usage, if the server reports it) and a migrated request starts over instead of resuming.
//! Health is `GET /v1/models`, which every OpenAI server has.

use kvroute_protocols::PreprocessedRequest;
use kvroute_runtime::EngineError;

use super::completions::{Body, Flavor, Parser};
use super::{Built, Dialect, StreamParser, Target};

/// The plain OpenAI dialect.
pub(super) struct Openai;

impl Dialect for Openai {
    fn generate_path(&self) -> &'static str {
        "v1/completions"
    }

    fn health_path(&self) -> &'static str {
        "v1/models"
    }

    fn build(
        &self,
        request: &PreprocessedRequest,
        target: &Target<'_>,
    ) -> Result<Built, EngineError> {
        Built::json(
            "prompt",
            &Body::new(Flavor::Openai, request, target),
            request,
        )
    }

    fn parser(&self, request: &PreprocessedRequest) -> Box<dyn StreamParser> {
        Box::new(Parser::new(Flavor::Openai, request))
    }
}
