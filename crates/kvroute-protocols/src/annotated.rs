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
