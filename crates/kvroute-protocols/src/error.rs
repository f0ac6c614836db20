//! The one error type of this crate: every message names what was wrong and what was expected.

/// Why a wire value was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProtocolError {
    /// A decoded value breaks a rule (range, length, ...).
    #[error("{field} must be {expected}, got {got}")]
    Invalid {
        /// Dotted path of the field, e.g. `session_control.timeout`.
        field: &'static str,
        /// What the rule demands, e.g. `1..=31536000 seconds`.
        expected: String,
        /// What was found.
        got: String,
    },

    /// JSON that does not match the schema (wrong type, malformed syntax, unknown enum value).
    #[error("invalid JSON at `{path}`: {message}")]
    Json {
        /// Path of the offending value (`.` for the document itself).
        path: String,
        /// What serde found and expected.
        message: String,
    },

    /// A routing header whose value cannot be parsed.
    #[error("header {name} must be {expected}, got {value:?}")]
    Header {
        /// The header name, e.g. `x-dp-rank`.
        name: &'static str,
        /// The value as received (lossily decoded as UTF-8).
        value: String,
        /// What was expected, e.g. `an unsigned 32-bit integer`.
        expected: &'static str,
    },

    /// A bincode frame longer than the configured limit.
    #[error("bincode frame of {len} bytes exceeds the limit of {max} bytes")]
    FrameTooLarge {
        /// The frame's length.
        len: usize,
        /// The limit.
        max: usize,
    },

    /// A bincode frame that does not decode to the expected type.
    #[error("malformed bincode frame: {0}")]
    Bincode(String),

    /// A bincode encoding failure (e.g. a value too large for the limit).
    #[error("cannot encode bincode frame: {0}")]
    Encode(String),

    /// A ZMQ KV event payload that is not the expected msgpack shape.
    #[error("malformed KV event payload: {0}")]
    KvEvent(String),
}

impl ProtocolError {
    /// A rule violation on `field`.
    pub fn invalid(field: &'static str, expected: impl Into<String>, got: impl ToString) -> Self {
        ProtocolError::Invalid {
            field,
            expected: expected.into(),
            got: got.to_string(),
        }
    }
}
