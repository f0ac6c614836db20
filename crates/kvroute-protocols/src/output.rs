//! What an engine streams back for a request: one [`LLMEngineOutput`] per step.

use serde::{Deserialize, Serialize, Serializer};

use crate::wire::{WireStruct, blob};

/// One step of engine output.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct LLMEngineOutput {
    /// Token ids generated in this step.
    #[serde(default)]
    pub token_ids: Vec<u32>,
    /// Detokenized pieces, when the engine detokenizes.
    #[serde(default)]
    pub tokens: Option<Vec<Option<String>>>,
    /// Decoded text of this step, when the engine detokenizes.
    #[serde(default)]
    pub text: Option<String>,
    /// Cumulative log probability of the sequence so far.
    #[serde(default)]
    pub cum_log_probs: Option<f64>,
    /// Log probability of each generated token.
    #[serde(default)]
    pub log_probs: Option<Vec<f64>>,
    /// Set on the last step: why generation ended.
    #[serde(default)]
    pub finish_reason: Option<FinishReason>,
    /// Choice index, for `n > 1`.
    #[serde(default)]
    pub index: Option<u32>,
    /// Engine-owned transfer parameters from a prefill worker (JSON text on bincode).
    #[serde(default, deserialize_with = "crate::wire::de_opt_json")]
    pub disaggregated_params: Option<serde_json::Value>,
    /// Token usage, usually on the last step.
    #[serde(default)]
    pub completion_usage: Option<CompletionUsage>,
}

impl LLMEngineOutput {
    /// A final step with no tokens and `finish_reason`.
    pub fn finished(finish_reason: FinishReason) -> Self {
        Self {
            finish_reason: Some(finish_reason),
            ..Self::default()
        }
    }

    /// A final step reporting cancellation.
    pub fn cancelled() -> Self {
        Self::finished(FinishReason::Cancelled)
    }

    /// A final step reporting a stop condition.
    pub fn stop() -> Self {
        Self::finished(FinishReason::Stop)
    }

    /// A final step reporting the length limit.
    pub fn length() -> Self {
        Self::finished(FinishReason::Length)
    }

    /// A final step reporting an engine error.
    pub fn error(message: impl Into<String>) -> Self {
        Self::finished(FinishReason::Error(message.into()))
    }

    /// Whether this step ends the stream.
    pub fn is_finished(&self) -> bool {
        self.finish_reason.is_some()
    }
}

impl Serialize for LLMEngineOutput {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut w = WireStruct::new(serializer, "LLMEngineOutput", 9)?;
        w.field("token_ids", &self.token_ids)?;
        w.opt("tokens", &self.tokens)?;
        w.opt("text", &self.text)?;
        w.opt("cum_log_probs", &self.cum_log_probs)?;
        w.opt("log_probs", &self.log_probs)?;
        w.opt("finish_reason", &self.finish_reason)?;
        w.opt("index", &self.index)?;
        w.opt("disaggregated_params", &blob(&self.disaggregated_params))?;
        w.opt("completion_usage", &self.completion_usage)?;
        w.end()
    }
}

/// Why generation ended. Lowercase on the wire; `error` carries a message
/// (`{"error": "..."}`), and `abort` is accepted for `cancelled`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// The model produced its end-of-sequence token.
    Eos,
    /// The length limit was reached.
    Length,
    /// A stop string or token was produced.
    Stop,
    /// The engine failed.
    Error(String),
    /// The request was cancelled.
    #[serde(alias = "abort")]
    Cancelled,
    /// Output was withheld by a content filter.
    ContentFilter,
}

impl std::fmt::Display for FinishReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FinishReason::Eos => f.write_str("eos"),
            FinishReason::Length => f.write_str("length"),
            FinishReason::Stop => f.write_str("stop"),
            FinishReason::Error(msg) => write!(f, "error: {msg}"),
            FinishReason::Cancelled => f.write_str("cancelled"),
            FinishReason::ContentFilter => f.write_str("content_filter"),
        }
    }
}

/// Token usage of a request (OpenAI's `usage`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
pub struct CompletionUsage {
    /// Tokens in the prompt.
    #[serde(default)]
    pub prompt_tokens: u32,
    /// Tokens generated.
    #[serde(default)]
    pub completion_tokens: u32,
    /// Sum of the two.
    #[serde(default)]
    pub total_tokens: u32,
    /// Breakdown of the prompt tokens.
    #[serde(default)]
    pub prompt_tokens_details: Option<PromptTokensDetails>,
}

impl Serialize for CompletionUsage {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut w = WireStruct::new(serializer, "CompletionUsage", 4)?;
        w.field("prompt_tokens", &self.prompt_tokens)?;
        w.field("completion_tokens", &self.completion_tokens)?;
        w.field("total_tokens", &self.total_tokens)?;
        w.opt("prompt_tokens_details", &self.prompt_tokens_details)?;
        w.end()
    }
}

/// Breakdown of prompt tokens (OpenAI's `prompt_tokens_details`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
pub struct PromptTokensDetails {
    /// Audio input tokens.
    #[serde(default)]
    pub audio_tokens: Option<u32>,
    /// Prompt tokens served from the KV cache.
    #[serde(default)]
    pub cached_tokens: Option<u32>,
}

impl Serialize for PromptTokensDetails {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut w = WireStruct::new(serializer, "PromptTokensDetails", 2)?;
        w.opt("audio_tokens", &self.audio_tokens)?;
        w.opt("cached_tokens", &self.cached_tokens)?;
        w.end()
    }
}
