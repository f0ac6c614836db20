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
//!
//! Disaggregated serving follows vLLM's KV connector handshake, as vLLM's own proxy
//! (`tests/v1/kv_connector/nixl_integration/toy_proxy_server.py`, `send_request_to_service`)
//! drives it:
//! - A prefill engine (role prefill, `--kv-transfer-config` with a connector such as
//!   `NixlConnector`) gets the request with `stream: false` (no `stream_options`),
//!   `max_tokens: 1`, no `min_tokens`, and [`remote_decode`]'s `kv_transfer_params`. Its whole
//!   JSON answer carries, top level, the `kv_transfer_params` its connector returned from
//!   `request_finished` (NixlConnector, `vllm/distributed/kv_transfer/kv_connector/v1/
//!   nixl_connector.py`: `do_remote_prefill: true`, `do_remote_decode: false`,
//!   `remote_block_ids`, `remote_engine_id`, `remote_host`, `remote_port`, and in newer versions
//!   more keys such as `remote_request_id` and `tp_size`), kept verbatim as the output's
//!   `disaggregated_params`.
//! - A decode engine (role decode) gets the client's request, streamed, with those parameters
//!   verbatim as its `kv_transfer_params` (the prefill result the prefill router carries), so
//!   its connector pulls the blocks instead of computing them. Without a prefill result (a
//!   request served aggregated) it is an ordinary request.

use kvroute_protocols::PreprocessedRequest;
use kvroute_runtime::{EngineError, WorkerRole};
use serde_json::{Value, json};

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
        let mut body = Body::new(Flavor::Vllm, request, target);
        let whole = match target.role {
            WorkerRole::Prefill => {
                body.one_whole_token();
                body.kv_transfer_params = Some(remote_decode());
                true
            }
            WorkerRole::Decode => {
                body.kv_transfer_params = request
                    .prefill_result
                    .as_ref()
                    .map(|r| r.disaggregated_params.clone());
                false
            }
            WorkerRole::Aggregated => false,
        };
        let mut built = Built::json("prompt", &body, request)?;
        built.whole = whole;
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

/// The `kv_transfer_params` of a prefill whose KV a decode engine will pull: exactly the keys
/// vLLM's proxy sends (`toy_proxy_server.py`), the remote ones unknown until the prefill ends.
pub(crate) fn remote_decode() -> Value {
    json!({
        "do_remote_decode": true,
        "do_remote_prefill": false,
        "remote_engine_id": null,
        "remote_block_ids": null,
        "remote_host": null,
        "remote_port": null,
    })
}

#[cfg(test)]
mod tests;
