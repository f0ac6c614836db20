//! The preprocessed request: what a router sends a worker over the request plane.

use derive_builder::Builder;
use serde::{Deserialize, Serialize, Serializer};

use crate::output::PromptTokensDetails;
use crate::routing::{RouterConfigOverride, RoutingHints};
use crate::wire::{JsonBlob, WireStruct, blob};

/// The `extra_args` key carrying a request's cache salt (see [`PreprocessedRequest::cache_salt`]).
pub const CACHE_SALT_EXTRA_ARG: &str = "cache_salt";

/// The internal form of an LLM request: tokenized prompt plus generation options and routing data.
#[derive(Debug, Clone, PartialEq, Deserialize, Builder)]
#[builder(setter(into))]
pub struct PreprocessedRequest {
    /// The model name (may be empty for health-check canaries).
    #[serde(default)]
    #[builder(default)]
    pub model: String,

    /// The prompt's token ids.
    pub token_ids: Vec<u32>,

    /// Multimodal routing data: an alternate token sequence and per-block media hashes.
    #[serde(default)]
    #[builder(default, setter(strip_option))]
    pub mm_routing_info: Option<MmRoutingInfo>,

    /// When the engine stops generating.
    #[serde(default)]
    #[builder(default)]
    pub stop_conditions: StopConditions,

    /// How the engine samples.
    #[serde(default)]
    #[builder(default)]
    pub sampling_options: SamplingOptions,

    /// What the engine returns besides tokens.
    #[serde(default)]
    #[builder(default)]
    pub output_options: OutputOptions,

    /// The model's end-of-sequence token ids.
    #[serde(default)]
    #[builder(default)]
    pub eos_token_ids: Vec<u32>,

    /// Checksum of the model deployment card the request was preprocessed with.
    #[serde(default)]
    #[builder(default, setter(strip_option))]
    pub mdc_sum: Option<String>,

    /// Requested annotations (see [`crate::NvExt::annotations`]).
    #[serde(default)]
    #[builder(default)]
    pub annotations: Vec<String>,

    /// Worker pins and hints for the router.
    #[serde(default)]
    #[builder(default, setter(strip_option))]
    pub routing: Option<RoutingHints>,

    /// Per-request overrides of the router's configuration.
    #[serde(default)]
    #[builder(default, setter(strip_option))]
    pub router_config_override: Option<RouterConfigOverride>,

    /// The prefill worker's result, carried to the decode worker (disaggregated serving).
    #[serde(default)]
    #[builder(default, setter(strip_option))]
    pub prefill_result: Option<PrefillResult>,

    /// Where the decode worker meets the prefill worker for the KV transfer.
    #[serde(default)]
    #[builder(default, setter(strip_option))]
    pub bootstrap_info: Option<BootstrapInfo>,

    /// Engine-specific extra arguments, passed through untouched (JSON text on bincode).
    #[serde(default, deserialize_with = "crate::wire::de_opt_json")]
    #[builder(default, setter(strip_option))]
    pub extra_args: Option<serde_json::Value>,

    /// Request timestamp in milliseconds, for trace replay in virtual time.
    #[serde(default)]
    #[builder(default, setter(strip_option))]
    pub request_timestamp_ms: Option<f64>,
}

impl PreprocessedRequest {
    /// A builder; `token_ids` is required, everything else defaults.
    pub fn builder() -> PreprocessedRequestBuilder {
        PreprocessedRequestBuilder::default()
    }

    /// A request for `model` with `token_ids` and every option at its default.
    pub fn new(model: impl Into<String>, token_ids: Vec<u32>) -> Self {
        Self {
            model: model.into(),
            token_ids,
            mm_routing_info: None,
            stop_conditions: StopConditions::default(),
            sampling_options: SamplingOptions::default(),
            output_options: OutputOptions::default(),
            eos_token_ids: Vec::new(),
            mdc_sum: None,
            annotations: Vec::new(),
            routing: None,
            router_config_override: None,
            prefill_result: None,
            bootstrap_info: None,
            extra_args: None,
            request_timestamp_ms: None,
        }
    }

    /// Whether `annotation` was requested.
    pub fn has_annotation(&self, annotation: &str) -> bool {
        self.annotations.iter().any(|a| a == annotation)
    }

    /// The value of a `key:value` annotation, if present.
    pub fn annotation_value(&self, key: &str) -> Option<&str> {
        self.annotations
            .iter()
            .find_map(|a| a.strip_prefix(key).and_then(|rest| rest.strip_prefix(':')))
    }

    /// Mutable routing hints, created empty if absent.
    pub fn routing_mut(&mut self) -> &mut RoutingHints {
        self.routing.get_or_insert_with(RoutingHints::default)
    }

    /// The request's cache salt (vLLM's `cache_salt`): the `"cache_salt"` string of
    /// `extra_args` ([`CACHE_SALT_EXTRA_ARG`]), if any. Engines never share cached blocks between
    /// requests with different salts, so the router hashes the prompt under it too.
    pub fn cache_salt(&self) -> Option<&str> {
        self.extra_args
            .as_ref()?
            .get(CACHE_SALT_EXTRA_ARG)?
            .as_str()
            .filter(|s| !s.is_empty())
    }

    /// Sets the cache salt (see [`Self::cache_salt`]), keeping any other `extra_args`.
    pub fn set_cache_salt(&mut self, salt: impl Into<String>) {
        let args = self
            .extra_args
            .get_or_insert_with(|| serde_json::Value::Object(serde_json::Map::new()));
        if !args.is_object() {
            *args = serde_json::Value::Object(serde_json::Map::new());
        }
        if let Some(map) = args.as_object_mut() {
            map.insert(
                CACHE_SALT_EXTRA_ARG.to_owned(),
                serde_json::Value::String(salt.into()),
            );
        }
    }

    /// The tokens to match against the KV index: the multimodal routing tokens when present,
    /// else the prompt.
    pub fn routing_token_ids(&self) -> &[u32] {
        match &self.mm_routing_info {
            Some(mm) if !mm.routing_token_ids.is_empty() => &mm.routing_token_ids,
            _ => &self.token_ids,
        }
    }
}

impl Serialize for PreprocessedRequest {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut w = WireStruct::new(serializer, "PreprocessedRequest", 15)?;
        w.field("model", &self.model)?;
        w.field("token_ids", &self.token_ids)?;
        w.opt("mm_routing_info", &self.mm_routing_info)?;
        w.field("stop_conditions", &self.stop_conditions)?;
        w.field("sampling_options", &self.sampling_options)?;
        w.field("output_options", &self.output_options)?;
        w.field("eos_token_ids", &self.eos_token_ids)?;
        w.opt("mdc_sum", &self.mdc_sum)?;
        w.field("annotations", &self.annotations)?;
        w.opt("routing", &self.routing)?;
        w.opt("router_config_override", &self.router_config_override)?;
        w.opt("prefill_result", &self.prefill_result)?;
        w.opt("bootstrap_info", &self.bootstrap_info)?;
        w.opt("extra_args", &blob(&self.extra_args))?;
        w.opt("request_timestamp_ms", &self.request_timestamp_ms)?;
        w.end()
    }
}

/// Discovery metadata key under which a prefill worker advertises the host of its bootstrap
/// (KV transfer rendezvous) server; with [`BOOTSTRAP_PORT_KEY`] it offers the bootstrap path,
/// whose rooms travel to the decode worker as [`BootstrapInfo`].
pub const BOOTSTRAP_HOST_KEY: &str = "bootstrap_host";

/// Discovery metadata key under which a prefill worker advertises the port of its bootstrap
/// server (decimal, 1..=65535).
pub const BOOTSTRAP_PORT_KEY: &str = "bootstrap_port";

/// Where the decode worker connects to the prefill worker for the KV transfer.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BootstrapInfo {
    /// Host of the prefill worker's bootstrap server.
    pub bootstrap_host: String,
    /// Port of the prefill worker's bootstrap server.
    pub bootstrap_port: u16,
    /// Unique room id of this request's transfer.
    pub bootstrap_room: u64,
}

/// What a prefill worker hands to the decode worker.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct PrefillResult {
    /// Engine-owned transfer parameters, passed through uninterpreted.
    #[serde(deserialize_with = "crate::wire::de_json")]
    pub disaggregated_params: serde_json::Value,
    /// Prompt token details produced by prefill (e.g. cached tokens).
    #[serde(default)]
    pub prompt_tokens_details: Option<PromptTokensDetails>,
}

impl Serialize for PrefillResult {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut w = WireStruct::new(serializer, "PrefillResult", 2)?;
        w.field(
            "disaggregated_params",
            &JsonBlob(&self.disaggregated_params),
        )?;
        w.opt("prompt_tokens_details", &self.prompt_tokens_details)?;
        w.end()
    }
}

/// Multimodal routing data: routing runs on an expanded token sequence without changing the
/// tokens the engine executes.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MmRoutingInfo {
    /// Tokens to compute KV overlap on (media placeholders expanded).
    pub routing_token_ids: Vec<u32>,
    /// Per block of `routing_token_ids`, the media it contains (`None` for text-only blocks).
    pub block_mm_infos: Vec<Option<BlockExtraInfo>>,
    /// Unpadded length of the expanded prompt.
    #[serde(default)]
    pub expanded_prompt_len: u64,
}

/// The media objects overlapping one block; their hashes enter the block's hash.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct BlockExtraInfo {
    /// Media objects in this block.
    pub mm_objects: Vec<BlockMmObjectInfo>,
}

/// One media object within a block.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct BlockMmObjectInfo {
    /// Content hash of the media object.
    pub mm_hash: u64,
    /// Token ranges `(start, end)` of the object within the block.
    pub offsets: Vec<(u32, u32)>,
}

/// Conditions under which the engine stops generating.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
pub struct StopConditions {
    /// Maximum number of tokens to generate.
    #[serde(default)]
    pub max_tokens: Option<u32>,
    /// Strings that end generation (not included in the output).
    #[serde(default)]
    pub stop: Option<Vec<String>>,
    /// Token ids that end generation (not included in the output).
    #[serde(default)]
    pub stop_token_ids: Option<Vec<u32>>,
    /// Hidden token ids that end generation.
    #[serde(default)]
    pub stop_token_ids_hidden: Option<Vec<u32>>,
    /// Minimum number of tokens to generate.
    #[serde(default)]
    pub min_tokens: Option<u32>,
    /// Keep generating past the end-of-sequence token.
    #[serde(default)]
    pub ignore_eos: Option<bool>,
    /// Maximum number of thinking tokens.
    #[serde(default)]
    pub max_thinking_tokens: Option<u32>,
}

impl Serialize for StopConditions {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut w = WireStruct::new(serializer, "StopConditions", 7)?;
        w.opt("max_tokens", &self.max_tokens)?;
        w.opt("stop", &self.stop)?;
        w.opt("stop_token_ids", &self.stop_token_ids)?;
        w.opt("stop_token_ids_hidden", &self.stop_token_ids_hidden)?;
        w.opt("min_tokens", &self.min_tokens)?;
        w.opt("ignore_eos", &self.ignore_eos)?;
        w.opt("max_thinking_tokens", &self.max_thinking_tokens)?;
        w.end()
    }
}

/// How the engine samples tokens.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct SamplingOptions {
    /// Number of sequences to return.
    #[serde(default)]
    pub n: Option<u8>,
    /// Number of sequences to generate, of which the best `n` are returned.
    #[serde(default)]
    pub best_of: Option<u8>,
    /// Penalty on tokens already present.
    #[serde(default)]
    pub presence_penalty: Option<f32>,
    /// Penalty proportional to a token's frequency so far.
    #[serde(default)]
    pub frequency_penalty: Option<f32>,
    /// Multiplicative repetition penalty.
    #[serde(default)]
    pub repetition_penalty: Option<f32>,
    /// Sampling temperature (0 is greedy).
    #[serde(default)]
    pub temperature: Option<f32>,
    /// Nucleus sampling mass.
    #[serde(default)]
    pub top_p: Option<f32>,
    /// Number of top tokens considered (-1 for all).
    #[serde(default)]
    pub top_k: Option<i32>,
    /// Minimum probability relative to the most likely token.
    #[serde(default)]
    pub min_p: Option<f32>,
    /// Use beam search instead of sampling.
    #[serde(default)]
    pub use_beam_search: Option<bool>,
    /// Length penalty for beam search.
    #[serde(default)]
    pub length_penalty: Option<f32>,
    /// Sampling seed.
    #[serde(default)]
    pub seed: Option<i64>,
    /// Include the matched stop string in the output.
    #[serde(default)]
    pub include_stop_str_in_output: Option<bool>,
}

impl Serialize for SamplingOptions {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut w = WireStruct::new(serializer, "SamplingOptions", 13)?;
        w.opt("n", &self.n)?;
        w.opt("best_of", &self.best_of)?;
        w.opt("presence_penalty", &self.presence_penalty)?;
        w.opt("frequency_penalty", &self.frequency_penalty)?;
        w.opt("repetition_penalty", &self.repetition_penalty)?;
        w.opt("temperature", &self.temperature)?;
        w.opt("top_p", &self.top_p)?;
        w.opt("top_k", &self.top_k)?;
        w.opt("min_p", &self.min_p)?;
        w.opt("use_beam_search", &self.use_beam_search)?;
        w.opt("length_penalty", &self.length_penalty)?;
        w.opt("seed", &self.seed)?;
        w.opt(
            "include_stop_str_in_output",
            &self.include_stop_str_in_output,
        )?;
        w.end()
    }
}

/// What the engine returns besides the generated tokens.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
pub struct OutputOptions {
    /// Number of log probabilities per generated token.
    #[serde(default)]
    pub logprobs: Option<u32>,
    /// Number of log probabilities per prompt token.
    #[serde(default)]
    pub prompt_logprobs: Option<u32>,
    /// Omit special tokens from the decoded text.
    #[serde(default)]
    pub skip_special_tokens: Option<bool>,
    /// Return the formatted prompt.
    #[serde(default)]
    pub formatted_prompt: Option<bool>,
}

impl Serialize for OutputOptions {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut w = WireStruct::new(serializer, "OutputOptions", 4)?;
        w.opt("logprobs", &self.logprobs)?;
        w.opt("prompt_logprobs", &self.prompt_logprobs)?;
        w.opt("skip_special_tokens", &self.skip_special_tokens)?;
        w.opt("formatted_prompt", &self.formatted_prompt)?;
        w.end()
    }
}
