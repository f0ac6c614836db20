//! Decoding JSON with the path of any error, and the rules a decoded value must follow.
//!
//! Decoding and validation are separate steps: [`from_json`] rejects values of the wrong type
//! (naming the JSON path) and ignores unknown fields; `validate` methods then check ranges and
//! lengths. [`parse_nvext_json`] does both.

use serde::de::DeserializeOwned;

use crate::ProtocolError;
use crate::nvext::{NvExt, SessionControl};
use crate::request::PreprocessedRequest;
use crate::routing::RoutingHints;

/// Longest accepted `session_control.session_id`, in bytes.
pub const MAX_SESSION_ID_LEN: usize = 256;
/// Longest accepted `session_control.timeout`, in seconds (one year).
pub const MAX_SESSION_TIMEOUT_SECS: u64 = 31_536_000;
/// Default limit on `nvext.token_data`, in tokens.
pub const DEFAULT_MAX_TOKEN_DATA_LEN: usize = 1 << 20;

/// Configurable limits applied by validation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Longest accepted `nvext.token_data`, in tokens.
    pub max_token_data_len: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_token_data_len: DEFAULT_MAX_TOKEN_DATA_LEN,
        }
    }
}

/// Decodes JSON into `T`; a wrong type names its path (e.g. `session_control.timeout`).
/// Unknown fields are ignored; trailing non-whitespace is an error.
pub fn from_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ProtocolError> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let value: T = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        // A syntax error belongs to the document, not to the half-read value it interrupted.
        let path = if e.inner().is_syntax() || e.inner().is_eof() {
            ".".to_owned()
        } else {
            e.path().to_string()
        };
        ProtocolError::Json {
            path,
            message: e.inner().to_string(),
        }
    })?;
    de.end().map_err(|e| ProtocolError::Json {
        path: ".".to_owned(),
        message: e.to_string(),
    })?;
    Ok(value)
}

/// Decodes and validates an `nvext` object.
pub fn parse_nvext_json(bytes: &[u8], limits: &Limits) -> Result<NvExt, ProtocolError> {
    let ext: NvExt = from_json(bytes)?;
    ext.validate(limits)?;
    Ok(ext)
}

/// Decodes and validates a [`PreprocessedRequest`].
pub fn parse_request_json(bytes: &[u8]) -> Result<PreprocessedRequest, ProtocolError> {
    let req: PreprocessedRequest = from_json(bytes)?;
    req.validate()?;
    Ok(req)
}

impl NvExt {
    /// Decodes an `nvext` object from JSON (without validating it; see [`NvExt::validate`]).
    pub fn from_json(bytes: &[u8]) -> Result<Self, ProtocolError> {
        from_json(bytes)
    }

    /// Checks `token_data` against `limits` and the session control's rules.
    pub fn validate(&self, limits: &Limits) -> Result<(), ProtocolError> {
        if let Some(tokens) = &self.token_data
            && tokens.len() > limits.max_token_data_len
        {
            return Err(ProtocolError::invalid(
                "token_data",
                format!("at most {} tokens", limits.max_token_data_len),
                format!("{} tokens", tokens.len()),
            ));
        }
        if let Some(sc) = &self.session_control {
            sc.validate()?;
        }
        Ok(())
    }
}

impl SessionControl {
    /// Checks the session id's length (1..=256 bytes) and the timeout's range (1..=31536000 s).
    pub fn validate(&self) -> Result<(), ProtocolError> {
        let len = self.session_id.len();
        if len == 0 || len > MAX_SESSION_ID_LEN {
            return Err(ProtocolError::invalid(
                "session_control.session_id",
                format!("1..={MAX_SESSION_ID_LEN} bytes"),
                format!("{len} bytes"),
            ));
        }
        if !(1..=MAX_SESSION_TIMEOUT_SECS).contains(&self.timeout) {
            return Err(ProtocolError::invalid(
                "session_control.timeout",
                format!("1..={MAX_SESSION_TIMEOUT_SECS} seconds"),
                self.timeout,
            ));
        }
        Ok(())
    }
}

impl RoutingHints {
    /// Checks the session control, if any.
    pub fn validate(&self) -> Result<(), ProtocolError> {
        self.session_control
            .as_ref()
            .map_or(Ok(()), SessionControl::validate)
    }
}

impl PreprocessedRequest {
    /// Checks the routing hints, if any.
    pub fn validate(&self) -> Result<(), ProtocolError> {
        self.routing.as_ref().map_or(Ok(()), RoutingHints::validate)
    }
}
