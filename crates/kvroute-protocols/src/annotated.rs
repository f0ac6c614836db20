//! The stream envelope: every item of a response stream is an [`Annotated`] value, which carries
//! either data, an out-of-band event (SSE `event:` plus `comment:` lines), or an error.

use serde::{Deserialize, Serialize, Serializer};

use crate::wire::WireStruct;

/// The SSE event name that marks an error item.
pub const ERROR_EVENT: &str = "error";

/// One item of a response stream.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Annotated<T> {
    /// The payload, absent on pure events and errors.
    #[serde(default = "none")]
    pub data: Option<T>,
    /// SSE `id:` of the item.
    #[serde(default)]
    pub id: Option<String>,
    /// SSE `event:` name (e.g. an annotation name, or `error`).
    #[serde(default)]
    pub event: Option<String>,
    /// SSE `comment:` lines (e.g. an annotation's value).
    #[serde(default)]
    pub comment: Option<Vec<String>>,
    /// Error message, set on error items.
    #[serde(default)]
    pub error: Option<String>,
}

// `#[serde(default)]` on `data` would demand `T: Default`; this keeps `Annotated<T>` usable for any
// payload type.
fn none<T>() -> Option<T> {
    None
}

/// The comment line prefix carrying an engine error's HTTP status (see
/// [`Annotated::from_engine_error`]).
pub const ERROR_STATUS_COMMENT: &str = "http_status:";

/// The comment line prefix carrying an engine error's OpenAI error code (see
/// [`Annotated::from_engine_error`]).
pub const ERROR_CODE_COMMENT: &str = "error_code:";

impl<T> Annotated<T> {
    /// An item carrying `data`.
    pub fn from_data(data: T) -> Self {
        Self {
            data: Some(data),
            id: None,
            event: None,
            comment: None,
            error: None,
        }
    }

    /// An error item: event `error` with `message` as the error.
    pub fn from_error(message: impl Into<String>) -> Self {
        Self {
            data: None,
            id: None,
            event: Some(ERROR_EVENT.to_owned()),
            comment: None,
            error: Some(message.into()),
        }
    }

    /// An error item for an engine's refusal that came with an HTTP status (and, when the
    /// engine's answer names one, an OpenAI error code such as `context_length_exceeded`): the
    /// status and code travel as comment lines ([`ERROR_STATUS_COMMENT`], [`ERROR_CODE_COMMENT`])
    /// so that the router can answer the client with the engine's own status.
    pub fn from_engine_error(message: impl Into<String>, status: u16, code: Option<&str>) -> Self {
        let mut comment = vec![format!("{ERROR_STATUS_COMMENT}{status}")];
        if let Some(code) = code {
            comment.push(format!("{ERROR_CODE_COMMENT}{code}"));
        }
        Self {
            comment: Some(comment),
            ..Self::from_error(message)
        }
    }

    /// The HTTP status an error item made by [`Self::from_engine_error`] carries.
    pub fn error_status(&self) -> Option<u16> {
        self.error_comment(ERROR_STATUS_COMMENT)
            .and_then(|s| s.trim().parse().ok())
    }

    /// The OpenAI error code an error item made by [`Self::from_engine_error`] carries.
    pub fn error_code(&self) -> Option<&str> {
        self.error_comment(ERROR_CODE_COMMENT).map(str::trim)
    }

    fn error_comment(&self, prefix: &str) -> Option<&str> {
        if !self.is_error() {
            return None;
        }
        self.comment
            .iter()
            .flatten()
            .find_map(|line| line.strip_prefix(prefix))
    }

    /// An out-of-band event named `event` with `comment` lines and no data.
    pub fn from_annotation(event: impl Into<String>, comment: Vec<String>) -> Self {
        Self {
            data: None,
            id: None,
            event: Some(event.into()),
            comment: Some(comment),
            error: None,
        }
    }

    /// Whether this is an error item (an `error` field, or the `error` event).
    pub fn is_error(&self) -> bool {
        self.error.is_some() || self.event.as_deref() == Some(ERROR_EVENT)
    }

    /// The error message: the `error` field, else the first comment of an `error` event.
    pub fn error_message(&self) -> Option<&str> {
        if let Some(e) = &self.error {
            return Some(e);
        }
        if self.event.as_deref() == Some(ERROR_EVENT) {
            return self
                .comment
                .as_ref()
                .and_then(|c| c.first())
                .map(String::as_str);
        }
        None
    }

    /// The same envelope around `f(data)`.
    pub fn map_data<U>(self, f: impl FnOnce(T) -> U) -> Annotated<U> {
        Annotated {
            data: self.data.map(f),
            id: self.id,
            event: self.event,
            comment: self.comment,
            error: self.error,
        }
    }
}

impl<T: Serialize> Serialize for Annotated<T> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut w = WireStruct::new(serializer, "Annotated", 5)?;
        w.opt("data", &self.data)?;
        w.opt("id", &self.id)?;
        w.opt("event", &self.event)?;
        w.opt("comment", &self.comment)?;
        w.opt("error", &self.error)?;
        w.end()
    }
}
