//! vLLM's OpenAI-compatible request bodies (the fields the simulator reads; others are ignored,
//! as vLLM ignores unknown ones) and response shapes (checked against vLLM 0.33.0's
//! `entrypoints/openai/{completion,chat_completion}/protocol.py`).

use std::fmt;

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

/// `stream_options`.
#[derive(Debug, Default, Deserialize)]
pub(super) struct StreamOptions {
    #[serde(default)]
    pub(super) include_usage: bool,
}

/// A completion prompt: text, token ids, or a batch of one of either.
///
/// Read by a visitor that looks at the first element of an array, not as an untagged enum:
/// serde buffers an untagged enum's whole input before trying each variant, which for a prompt
/// of thousands of token ids was most of the simulated engine's parsing time.
#[derive(Debug, PartialEq)]
pub(super) enum Prompt {
    Text(String),
    Ids(Vec<u32>),
    Texts(Vec<String>),
    IdLists(Vec<Vec<u32>>),
}

impl<'de> Deserialize<'de> for Prompt {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(PromptVisitor)
    }
}

struct PromptVisitor;

impl<'de> Visitor<'de> for PromptVisitor {
    type Value = Prompt;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(
            "a string, an array of token ids, an array of strings or an array of token id arrays",
        )
    }

    fn visit_str<E: de::Error>(self, text: &str) -> Result<Prompt, E> {
        Ok(Prompt::Text(text.to_owned()))
    }

    fn visit_string<E: de::Error>(self, text: String) -> Result<Prompt, E> {
        Ok(Prompt::Text(text))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Prompt, A::Error> {
        /// The first element, which decides what the rest must be.
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum First {
            Id(u32),
            Text(String),
            Ids(Vec<u32>),
        }
        fn rest<'de, A: SeqAccess<'de>, T: Deserialize<'de>>(
            first: T,
            mut seq: A,
        ) -> Result<Vec<T>, A::Error> {
            let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0) + 1);
            out.push(first);
            while let Some(item) = seq.next_element()? {
                out.push(item);
            }
            Ok(out)
        }
        Ok(match seq.next_element::<First>()? {
            None => Prompt::Ids(Vec::new()),
            Some(First::Id(id)) => Prompt::Ids(rest(id, seq)?),
            Some(First::Text(text)) => Prompt::Texts(rest(text, seq)?),
            Some(First::Ids(ids)) => Prompt::IdLists(rest(ids, seq)?),
        })
    }
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

    /// A streamed chunk of new output (`finish` set on the last one), as a server-sent event.
    /// `prompt_ids` is sent on a completion's first chunk when token ids are asked for.
    pub(super) fn chunk(
        &self,
        text: &str,
        ids: &[u32],
        finish: Option<&str>,
        prompt_ids: Option<&[u32]>,
    ) -> Bytes {
        let choice = match self.kind {
            // Serialized straight from the ids: the echo of a long prompt is the bulk of a
            // completion's first chunk, and building it as a `Value` cost the engine more than
            // the rest of the request.
            Kind::Completion => {
                return sse_event(&CompletionChunk {
                    id: &self.id,
                    object: self.object(true),
                    created: self.created,
                    model: &self.model,
                    choices: [CompletionChoice {
                        index: 0,
                        text,
                        logprobs: (),
                        finish_reason: finish,
                        stop_reason: (),
                        prompt_token_ids: self.return_token_ids.then_some(prompt_ids),
                        token_ids: self.return_token_ids.then_some(ids),
                    }],
                });
            }
            Kind::Chat => {
                let delta = if finish.is_some() && text.is_empty() {
                    json!({})
                } else {
                    json!({"content": text})
                };
                let mut choice = json!({"index": 0, "delta": delta, "logprobs": null,
                    "finish_reason": finish, "stop_reason": null});
                if self.return_token_ids {
                    choice["token_ids"] = json!(ids);
                }
                choice
            }
        };
        sse_event(&self.wrap(true, json!([choice])))
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

/// A streamed completion chunk (`CompletionStreamResponse`), with the fields in vLLM's order.
#[derive(Serialize)]
struct CompletionChunk<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: [CompletionChoice<'a>; 1],
}

/// Its one choice; `()` is JSON's `null`. The token id fields are left out unless asked for
/// (`return_token_ids`), and `prompt_token_ids` is `null` after the first chunk.
#[derive(Serialize)]
struct CompletionChoice<'a> {
    index: u32,
    text: &'a str,
    logprobs: (),
    finish_reason: Option<&'a str>,
    stop_reason: (),
    #[serde(skip_serializing_if = "Option::is_none")]
    prompt_token_ids: Option<Option<&'a [u32]>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    token_ids: Option<&'a [u32]>,
}

/// `value` as one server-sent event: `data: JSON` and a blank line.
pub(super) fn sse_event(value: &impl Serialize) -> Bytes {
    let mut out = Vec::with_capacity(256);
    out.extend_from_slice(b"data: ");
    // Serializing these types into memory cannot fail: no map has a non-string key.
    if serde_json::to_writer(&mut out, value).is_err() {
        out.truncate(6);
        out.extend_from_slice(b"{}");
    }
    out.extend_from_slice(b"\n\n");
    Bytes::from(out)
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

#[cfg(test)]
mod tests {
    use super::*;

    fn prompt(json: &str) -> Result<Prompt, String> {
        serde_json::from_str(json).map_err(|e| e.to_string())
    }

    #[test]
    fn every_prompt_form_vllm_takes_is_read() {
        assert_eq!(prompt(r#""hi there""#), Ok(Prompt::Text("hi there".into())));
        assert_eq!(prompt("[1, 2, 3]"), Ok(Prompt::Ids(vec![1, 2, 3])));
        assert_eq!(prompt("[]"), Ok(Prompt::Ids(Vec::new())));
        assert_eq!(
            prompt(r#"["a", "b"]"#),
            Ok(Prompt::Texts(vec!["a".into(), "b".into()]))
        );
        assert_eq!(
            prompt("[[1, 2], [3]]"),
            Ok(Prompt::IdLists(vec![vec![1, 2], vec![3]]))
        );
        // Mixed or wrong types are refused with what was expected.
        assert!(prompt(r#"[1, "a"]"#).is_err());
        assert!(prompt("[-1]").is_err());
        let error = prompt("7").unwrap_err();
        assert!(error.contains("an array of token ids"), "{error}");
    }

    fn envelope(return_token_ids: bool) -> Envelope {
        Envelope {
            kind: Kind::Completion,
            id: "cmpl-1".into(),
            created: 5,
            model: "m".into(),
            return_token_ids,
        }
    }

    #[test]
    fn a_completion_chunk_is_vllms_with_ids_only_when_asked() {
        let event = envelope(true).chunk("a b", &[7, 8], None, Some(&[1, 2]));
        assert_eq!(
            std::str::from_utf8(&event).unwrap(),
            "data: {\"id\":\"cmpl-1\",\"object\":\"text_completion\",\"created\":5,\"model\":\"m\",\
             \"choices\":[{\"index\":0,\"text\":\"a b\",\"logprobs\":null,\"finish_reason\":null,\
             \"stop_reason\":null,\"prompt_token_ids\":[1,2],\"token_ids\":[7,8]}]}\n\n"
        );
        let later = envelope(true).chunk("", &[], Some("length"), None);
        let later: Value = serde_json::from_slice(&later["data: ".len()..]).unwrap();
        assert_eq!(later["choices"][0]["prompt_token_ids"], Value::Null);
        assert_eq!(later["choices"][0]["finish_reason"], "length");
        let plain = envelope(false).chunk("x", &[9], None, Some(&[1]));
        let plain: Value = serde_json::from_slice(&plain["data: ".len()..]).unwrap();
        let choice = plain["choices"][0].as_object().unwrap();
        assert!(!choice.contains_key("token_ids") && !choice.contains_key("prompt_token_ids"));
        assert_eq!(choice["text"], "x");
    }
}
