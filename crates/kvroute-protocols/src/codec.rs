//! Bounded bincode framing for the request plane.
//!
//! Every decode takes a byte limit, and bincode is told the same limit, so a hostile length prefix
//! inside the frame ("a vector of 2^60 elements follows") fails fast instead of allocating.
//! The options are fixed here (bincode 1.x defaults: fixed-width little-endian integers, trailing
//! bytes rejected) so every peer agrees on them.
//!
//! The wire types omit `None` fields from JSON, but bincode cannot skip a field (the reader expects
//! every field, in order), so their `Serialize` impls skip empty fields only for human-readable
//! formats and write every field otherwise. Opaque engine payloads (`serde_json::Value`, which
//! bincode cannot decode) travel as their JSON text on bincode.

use bincode::Options;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::ProtocolError;

/// Default limit for one request-plane frame: 64 MiB, room for a million-token prompt.
pub const DEFAULT_MAX_FRAME_LEN: usize = 64 * 1024 * 1024;

fn options(limit: usize) -> impl Options {
    bincode::DefaultOptions::new()
        .with_fixint_encoding()
        .with_little_endian()
        .reject_trailing_bytes()
        .with_limit(limit as u64)
}

/// Encodes `value` as one bincode frame of at most [`DEFAULT_MAX_FRAME_LEN`] bytes.
pub fn encode<T: Serialize + ?Sized>(value: &T) -> Result<Vec<u8>, ProtocolError> {
    encode_bounded(value, DEFAULT_MAX_FRAME_LEN)
}

/// Encodes `value` as one bincode frame of at most `max_len` bytes.
pub fn encode_bounded<T: Serialize + ?Sized>(
    value: &T,
    max_len: usize,
) -> Result<Vec<u8>, ProtocolError> {
    options(max_len).serialize(value).map_err(|e| match *e {
        bincode::ErrorKind::SizeLimit => ProtocolError::Encode(format!(
            "encoded value exceeds the limit of {max_len} bytes"
        )),
        other => ProtocolError::Encode(other.to_string()),
    })
}

/// Decodes one bincode frame of at most `max_len` bytes into a `T`.
///
/// Never panics and never allocates more than about `max_len` bytes, whatever `bytes` holds.
pub fn decode<T: DeserializeOwned>(bytes: &[u8], max_len: usize) -> Result<T, ProtocolError> {
    if bytes.len() > max_len {
        return Err(ProtocolError::FrameTooLarge {
            len: bytes.len(),
            max: max_len,
        });
    }
    options(max_len).deserialize(bytes).map_err(|e| match *e {
        bincode::ErrorKind::SizeLimit => ProtocolError::Bincode(format!(
            "frame declares more data than the limit of {max_len} bytes"
        )),
        // bincode reports a short read with an empty message; say what it means.
        bincode::ErrorKind::Io(io) if io.kind() == std::io::ErrorKind::UnexpectedEof => {
            ProtocolError::Bincode(
                "frame ends before the value does (truncated, or a corrupt length prefix)".into(),
            )
        }
        other => ProtocolError::Bincode(other.to_string()),
    })
}
