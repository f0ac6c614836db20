//! The OpenAI request bodies the frontend accepts (the fields it uses, and those of
//! [`UNSUPPORTED_PARAMETERS`] to refuse them; other unknown fields are ignored). The response and
//! chunk shapes it writes are the response module's.

use kvroute_protocols::NvExt;
use serde::Deserialize;
use serde_json::Value;

// The request bodies list the shared parameters inline rather than through
// `#[serde(flatten)]`: flattening buffers the fields and loses the JSON path of a type error
// (`nvext.backend_instance_id` would be reported as the whole document).
macro_rules! with_params {
    ($(#[$meta:meta])* pub struct $name:ident { $($(#[$fmeta:meta])* pub $field:ident: $ty:ty,)* }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Deserialize)]
        pub struct $name {
            $($(#[$fmeta])* pub $field: $ty,)*
            /// Stream the response as server-sent events.
            #[serde(default)]
            pub stream: Option<bool>,
            /// Streaming options (`include_usage`).
            #[serde(default)]
            pub stream_options: Option<StreamOptions>,
            /// Most tokens to generate.
            #[serde(default)]
            pub max_tokens: Option<u32>,
            /// Fewest tokens to generate.
            #[serde(default)]
            pub min_tokens: Option<u32>,
            /// Sampling temperature.
            #[serde(default)]
            pub temperature: Option<f32>,
            /// Nucleus sampling mass.
            #[serde(default)]
            pub top_p: Option<f32>,
            /// Top-k sampling.
            #[serde(default)]
            pub top_k: Option<i32>,
            /// Sampling seed.
            #[serde(default)]
            pub seed: Option<i64>,
            /// Presence penalty.
            #[serde(default)]
            pub presence_penalty: Option<f32>,
            /// Frequency penalty.
            #[serde(default)]
            pub frequency_penalty: Option<f32>,
            /// Repetition penalty.
            #[serde(default)]
            pub repetition_penalty: Option<f32>,
            /// Stop strings.
            #[serde(default)]
            pub stop: Option<Stop>,
            /// Number of choices (only 1 is served).
            #[serde(default)]
            pub n: Option<u8>,
            /// Keep generating past end-of-sequence.
            #[serde(default)]
            pub ignore_eos: Option<bool>,
            /// Keep the matched stop string at the end of the text (vLLM's parameter).
            #[serde(default)]
            pub include_stop_str_in_output: Option<bool>,
            /// vLLM's `cache_salt`: requests with different salts never share cached blocks.
            /// The router hashes the prompt under it (as the engine does) and passes it on.
            #[serde(default)]
            pub cache_salt: Option<String>,
            /// NVIDIA extensions.
            #[serde(default)]
            pub nvext: Option<NvExt>,
            /// The parameters of [`UNSUPPORTED_PARAMETERS`], in its order, kept only to refuse
            /// them (see [`Self::unsupported_parameter`]).
            #[serde(default)]
            pub logprobs: Option<Value>,
            /// Refused unless inert (see [`UNSUPPORTED_PARAMETERS`]).
            #[serde(default)]
            pub top_logprobs: Option<Value>,
            /// Refused unless inert (see [`UNSUPPORTED_PARAMETERS`]).
            #[serde(default)]
            pub tools: Option<Value>,
            /// Refused unless inert (see [`UNSUPPORTED_PARAMETERS`]).
            #[serde(default)]
            pub tool_choice: Option<Value>,
            /// Refused unless inert (see [`UNSUPPORTED_PARAMETERS`]).
            #[serde(default)]
            pub functions: Option<Value>,
            /// Refused unless inert (see [`UNSUPPORTED_PARAMETERS`]).
            #[serde(default)]
            pub function_call: Option<Value>,
            /// Refused unless inert (see [`UNSUPPORTED_PARAMETERS`]).
            #[serde(default)]
            pub response_format: Option<Value>,
            /// Refused unless inert (see [`UNSUPPORTED_PARAMETERS`]).
            #[serde(default)]
            pub echo: Option<Value>,
            /// Refused unless inert (see [`UNSUPPORTED_PARAMETERS`]).
            #[serde(default)]
            pub best_of: Option<Value>,
            /// Refused unless inert (see [`UNSUPPORTED_PARAMETERS`]).
            #[serde(default)]
            pub suffix: Option<Value>,
            /// Refused unless inert (see [`UNSUPPORTED_PARAMETERS`]).
            #[serde(default)]
            pub logit_bias: Option<Value>,
        }

        impl $name {
            /// The first parameter of [`UNSUPPORTED_PARAMETERS`] the request sets to something
            /// other than its inert value ([`is_inert`]).
            pub fn unsupported_parameter(&self) -> Option<&'static str> {
                let values = [
                    &self.logprobs,
                    &self.top_logprobs,
                    &self.tools,
                    &self.tool_choice,
                    &self.functions,
                    &self.function_call,
                    &self.response_format,
                    &self.echo,
                    &self.best_of,
                    &self.suffix,
                    &self.logit_bias,
                ];
                UNSUPPORTED_PARAMETERS
                    .iter()
                    .zip(values)
                    .find(|(name, value)| value.as_ref().is_some_and(|v| !is_inert(name, v)))
                    .map(|(name, _)| *name)
            }

            /// The generation parameters.
            pub fn params(&self) -> Params {
                Params {
                    stream: self.stream.clone(),
                    stream_options: self.stream_options.clone(),
                    max_tokens: self.max_tokens.clone(),
                    min_tokens: self.min_tokens.clone(),
                    temperature: self.temperature.clone(),
                    top_p: self.top_p.clone(),
                    top_k: self.top_k.clone(),
                    seed: self.seed.clone(),
                    presence_penalty: self.presence_penalty.clone(),
                    frequency_penalty: self.frequency_penalty.clone(),
                    repetition_penalty: self.repetition_penalty.clone(),
                    stop: self.stop.clone(),
                    n: self.n.clone(),
                    ignore_eos: self.ignore_eos.clone(),
                    include_stop_str_in_output: self.include_stop_str_in_output.clone(),
                    cache_salt: self.cache_salt.clone(),
                    nvext: self.nvext.clone(),
                }
            }
        }
    };
}

with_params! {
    /// `POST /v1/chat/completions`.
    pub struct ChatCompletionRequest {
        /// The model name.
        pub model: String,
        /// The conversation.
        pub messages: Vec<ChatMessage>,
        /// `max_completion_tokens` (the newer name of `max_tokens`).
        #[serde(default)]
        pub max_completion_tokens: Option<u32>,
    }
}

with_params! {
    /// `POST /v1/completions`.
    pub struct CompletionRequest {
        /// The model name.
        pub model: String,
        /// The prompt: text or token ids.
        pub prompt: Prompt,
    }
}

/// The OpenAI parameters this router does not implement, refused with a 400
/// (`invalid_request_error`, `param` = the parameter, "`tools` is not supported by this router")
/// on both endpoints rather than silently ignored, unless the request sets them to their inert
/// value, as OpenAI clients do by default: `null`, `false`, `0`, `""`, `[]`, `{}`, plus
/// `best_of: 1`, `tool_choice: "none"` and `response_format: {"type": "text"}` (see
/// [`is_inert`]).
pub const UNSUPPORTED_PARAMETERS: [&str; 11] = [
    "logprobs",
    "top_logprobs",
    "tools",
    "tool_choice",
    "functions",
    "function_call",
    "response_format",
    "echo",
    "best_of",
    "suffix",
    "logit_bias",
];

/// Whether `value` of the unsupported parameter `name` asks for nothing (so it may be ignored).
pub fn is_inert(name: &str, value: &Value) -> bool {
    match value {
        Value::Null | Value::Bool(false) => true,
        Value::Number(n) => {
            n.as_f64() == Some(0.0) || (name == "best_of" && n.as_f64() == Some(1.0))
        }
        Value::String(s) => s.is_empty() || (name == "tool_choice" && s == "none"),
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => {
            o.is_empty()
                || (name == "response_format"
                    && o.len() == 1
                    && o.get("type").and_then(Value::as_str) == Some("text"))
        }
        Value::Bool(true) => false,
    }
}

/// The chat message roles served.
pub const CHAT_ROLES: [&str; 5] = ["system", "user", "assistant", "tool", "developer"];

/// Generation parameters common to both endpoints.
#[derive(Debug, Clone, Default)]
pub struct Params {
    /// Stream the response as server-sent events.
    pub stream: Option<bool>,
    /// Streaming options (`include_usage`).
    pub stream_options: Option<StreamOptions>,
    /// Most tokens to generate.
    pub max_tokens: Option<u32>,
    /// Fewest tokens to generate.
    pub min_tokens: Option<u32>,
    /// Sampling temperature.
    pub temperature: Option<f32>,
    /// Nucleus sampling mass.
    pub top_p: Option<f32>,
    /// Top-k sampling.
    pub top_k: Option<i32>,
    /// Sampling seed.
    pub seed: Option<i64>,
    /// Presence penalty.
    pub presence_penalty: Option<f32>,
    /// Frequency penalty.
    pub frequency_penalty: Option<f32>,
    /// Repetition penalty.
    pub repetition_penalty: Option<f32>,
    /// Stop strings.
    pub stop: Option<Stop>,
    /// Number of choices (only 1 is served).
    pub n: Option<u8>,
    /// Keep generating past end-of-sequence.
    pub ignore_eos: Option<bool>,
    /// Keep the matched stop string in the text.
    pub include_stop_str_in_output: Option<bool>,
    /// vLLM's cache salt.
    pub cache_salt: Option<String>,
    /// NVIDIA extensions.
    pub nvext: Option<NvExt>,
}

/// `stream_options`.
#[derive(Debug, Clone, Copy, Default, Deserialize)]
pub struct StreamOptions {
    /// Send a last chunk with the token usage.
    #[serde(default)]
    pub include_usage: bool,
}

/// `stop`: one string or several.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    /// One stop string.
    One(String),
    /// Several.
    Many(Vec<String>),
}

impl Stop {
    /// The stop strings.
    pub fn into_vec(self) -> Vec<String> {
        match self {
            Stop::One(s) => vec![s],
            Stop::Many(v) => v,
        }
    }
}

/// One chat message.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, `tool`, ...
    pub role: String,
    /// Its content (absent on some assistant tool-call messages).
    #[serde(default)]
    pub content: Option<Content>,
}

/// Message content: text, or an array of parts whose text parts are concatenated.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Content {
    /// Plain text.
    Text(String),
    /// Content parts.
    Parts(Vec<ContentPart>),
}

/// One content part (`{"type": "text", "text": "..."}`; other types are refused).
#[derive(Debug, Clone, Deserialize)]
pub struct ContentPart {
    /// The part's type.
    #[serde(rename = "type")]
    pub kind: String,
    /// The text of a text part.
    #[serde(default)]
    pub text: Option<String>,
}

/// A completion prompt.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    /// Text.
    Text(String),
    /// Token ids.
    Tokens(Vec<u32>),
    /// A batch of texts (only a batch of one is served).
    Texts(Vec<String>),
    /// A batch of token id lists (only a batch of one is served).
    TokenBatches(Vec<Vec<u32>>),
}
