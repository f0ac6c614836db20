//! vLLM's OpenAI-compatible request bodies (the fields the simulator reads; others are ignored,
//! as vLLM ignores unknown ones) and response shapes (checked against vLLM 0.33.0's
//! `entrypoints/openai/{completion,chat_completion}/protocol.py`).

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};

/// `stream_options`.
#[derive(Debug, Default, Deserialize)]
pub(super) struct StreamOptions {
    #[serde(default)]
    pub(super) include_usage: bool,
}

/// A completion prompt: text, token ids, or a batch of one of either.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub(super) enum Prompt {
    Text(String),
    Ids(Vec<u32>),
    Texts(Vec<String>),
    IdLists(Vec<Vec<u32>>),
}

/// `POST /v1/completions`.
#[derive(Debug, Deserialize)]
pub(super) struct CompletionRequest {
    pub(super) model: Option<String>,
    pub(super) prompt: Prompt,
    #[serde(flatten)]
    pub(super) common: Common,
}

/// One chat message; `content` is text or a list of parts, of which the text parts count.
#[derive(Debug, Deserialize)]
pub(super) struct ChatMessage {
    pub(super) role: String,
    #[serde(default)]
    pub(super) content: Option<Value>,
}

impl ChatMessage {
    /// The message's text: a string, or its text parts joined.
    pub(super) fn text(&self) -> String {
        match &self.content {
            Some(Value::String(text)) => text.clone(),
            Some(Value::Array(parts)) => parts
                .iter()
                .filter_map(|p| p.get("text").and_then(Value::as_str))
                .collect::<Vec<_>>()
                .join(""),
            _ => String::new(),
        }
    }
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Deserialize)]
pub(super) struct ChatRequest {
    pub(super) model: Option<String>,
    pub(super) messages: Vec<ChatMessage>,
    /// The newer name of `max_tokens`.
    pub(super) max_completion_tokens: Option<u32>,
    #[serde(flatten)]
    pub(super) common: Common,
}

/// What both endpoints share.
#[derive(Debug, Deserialize)]
pub(super) struct Common {
    pub(super) max_tokens: Option<u32>,
    #[serde(default)]
    pub(super) stream: bool,
    #[serde(default)]
    pub(super) stream_options: Option<StreamOptions>,
    /// vLLM's extension: echo prompt and output token ids.
    #[serde(default)]
    pub(super) return_token_ids: bool,
    /// vLLM's KV connector handshake (see `kv_transfer.rs`).
    #[serde(default)]
    pub(super) kv_transfer_params: Option<Value>,
}

impl Common {
    pub(super) fn include_usage(&self) -> bool {
        self.stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage)
    }
}

/// `POST /tokenize`: a prompt or chat messages.
#[derive(Debug, Deserialize)]
pub(super) struct TokenizeRequest {
    pub(super) prompt: Option<String>,
    pub(super) messages: Option<Vec<ChatMessage>>,
}

/// Which endpoint a response is shaped for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    Completion,
    Chat,
}

/// What every chunk and response of one request repeats.
pub(super) struct Envelope {
    pub(super) kind: Kind,
    pub(super) id: String,
    pub(super) created: u64,
    pub(super) model: String,
    pub(super) return_token_ids: bool,
}

/// The final figures of a request.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Usage {
    pub(super) prompt_tokens: u32,
    pub(super) completion_tokens: u32,
    pub(super) cached_tokens: u32,
}

impl Usage {
    pub(super) fn json(self) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "completion_tokens": self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        })
    }
}

impl Envelope {
    fn object(&self, chunk: bool) -> &'static str {
        match (self.kind, chunk) {
            (Kind::Completion, _) => "text_completion",
            (Kind::Chat, true) => "chat.completion.chunk",
            (Kind::Chat, false) => "chat.completion",
        }
    }

    fn wrap(&self, chunk: bool, choices: Value) -> Value {
        json!({
            "id": self.id,
            "object": self.object(chunk),
            "created": self.created,
            "model": self.model,
            "choices": choices,
        })
    }

    /// The chat stream's first chunk: the assistant's role, no content.
    pub(super) fn role_chunk(&self) -> Value {
        self.wrap(
            true,
            json!([{"index": 0, "delta": {"role": "assistant", "content": ""},
                "logprobs": null, "finish_reason": null}]),
        )
    }

    /// A streamed chunk of new output (`finish` set on the last one). `prompt_ids` is sent on
    /// a completion's first chunk when token ids are asked for.
    pub(super) fn chunk(
        &self,
        text: &str,
        ids: &[u32],
        finish: Option<&str>,
        prompt_ids: Option<&[u32]>,
    ) -> Value {
        let mut choice = match self.kind {
            Kind::Completion => json!({"index": 0, "text": text, "logprobs": null,
                "finish_reason": finish, "stop_reason": null}),
            Kind::Chat => {
                let delta = if finish.is_some() && text.is_empty() {
                    json!({})
                } else {
                    json!({"content": text})
                };
                json!({"index": 0, "delta": delta, "logprobs": null,
                    "finish_reason": finish, "stop_reason": null})
            }
        };
        if self.return_token_ids {
            if self.kind == Kind::Completion {
                choice["prompt_token_ids"] = json!(prompt_ids);
            }
            choice["token_ids"] = json!(ids);
        }
        self.wrap(true, json!([choice]))
    }

    /// The usage chunk that ends a stream with `include_usage`.
    pub(super) fn usage_chunk(&self, usage: Usage) -> Value {
        let mut chunk = self.wrap(true, json!([]));
        chunk["usage"] = usage.json();
        chunk
    }

    /// A whole (non-streamed) response.
    pub(super) fn whole(
        &self,
        text: &str,
        ids: &[u32],
        prompt_ids: &[u32],
        finish: &str,
        usage: Usage,
    ) -> Value {
        let mut choice = match self.kind {
            Kind::Completion => json!({"index": 0, "text": text, "logprobs": null,
                "finish_reason": finish, "stop_reason": null, "prompt_logprobs": null}),
            Kind::Chat => json!({"index": 0,
                "message": {"role": "assistant", "content": text, "tool_calls": []},
                "logprobs": null, "finish_reason": finish, "stop_reason": null}),
        };
        if self.return_token_ids {
            if self.kind == Kind::Completion {
                choice["prompt_token_ids"] = json!(prompt_ids);
            }
            choice["token_ids"] = json!(ids);
        }
        let mut response = self.wrap(false, json!([choice]));
        response["usage"] = usage.json();
        if self.kind == Kind::Chat && self.return_token_ids {
            response["prompt_token_ids"] = json!(prompt_ids);
        }
        response["kv_transfer_params"] = Value::Null;
        response
    }
}

/// vLLM's error body (`ErrorResponse`).
pub(super) fn error_body(message: &str, kind: &str, code: u16) -> Value {
    json!({"error": {"message": message, "type": kind, "param": null, "code": code}})
}

/// vLLM's error response.
pub(super) fn error_response(status: StatusCode, kind: &str, message: &str) -> Response {
    (
        status,
        axum::Json(error_body(message, kind, status.as_u16())),
    )
        .into_response()
}
