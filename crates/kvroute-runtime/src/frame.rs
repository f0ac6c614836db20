//! The request plane's wire format.
//!
//! Every frame is `[u32 big-endian length][kind: u8][stream id: u64 little-endian][body]`. The
//! length prefix is handled by `tokio_util`'s `LengthDelimitedCodec`, which refuses any frame longer
//! than the configured maximum before reading it. The body is bincode (varint encoding, with a size
//! limit equal to the frame limit) of a kind-specific type. Keeping the kind and stream id outside
//! the bincode body lets a reader route or reject a frame without knowing the request and response
//! types, and lets a sender encode a request body once and reuse it when it retries elsewhere.

use bincode::Options;
use bytes::{BufMut, Bytes, BytesMut};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tokio_util::codec::LengthDelimitedCodec;

use crate::error::RequestError;

/// The protocol version this build speaks; the handshake refuses any other, so a router and a
/// worker from builds that frame things differently fail at connect time with a message naming
/// both versions instead of misreading each other's frames.
///
/// History: 1, the first request plane; 2 added the `SubscribeKvEvents` frame (workers stream KV
/// events over the request-plane connection), which a version-1 worker would answer with an
/// unknown-kind error mid-session; 3 added the `EngineUnavailable` error code (an engine adapter
/// whose HTTP engine went away), which a version-2 client could not decode; 4 added the fleet
/// secret's proofs (a nonce in the hello, a nonce and proof in the acknowledgement, the client's
/// `Auth` frame); 5 added the worker's KV capacity (`kv_total_blocks`) to the load reports it
/// streams, which bincode writes positionally.
pub const PROTOCOL_VERSION: u16 = 5;

/// The magic bytes that open a client's hello frame.
pub(crate) const MAGIC: [u8; 4] = *b"KVRT";

/// The default maximum frame size, `kvroute_protocols::codec`'s (64 MiB): room for a
/// million-token prompt.
pub const DEFAULT_MAX_FRAME_BYTES: usize = kvroute_protocols::codec::DEFAULT_MAX_FRAME_LEN;

/// The bytes of a frame before its body.
pub(crate) const HEADER_LEN: usize = 9;

/// What a frame carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Kind {
    /// Client hello: magic and protocol version.
    Hello = 0x01,
    /// A new request stream: `(request id, request)`.
    Request = 0x02,
    /// Cancel a stream: one byte, [`CancelKind`].
    Cancel = 0x03,
    /// A unary session-control call.
    SessionControl = 0x04,
    /// A unary "events `from..=to`" gap-recovery call.
    EventsRange = 0x05,
    /// A unary "dump everything you hold" call.
    KvDump = 0x06,
    /// Keepalive probe; the worker answers with [`Kind::Pong`].
    Ping = 0x07,
    /// A long-lived stream of the worker's KV events: `Option<u64>`, the first event id wanted
    /// (`None`: only events published from now on). Items are `RouterEvent`s.
    SubscribeKvEvents = 0x08,
    /// A long-lived stream of the worker's load reports (empty body `()`). Items are
    /// `WorkerLoadReport`s; only workers that state `load_reports = "true"` in their metadata
    /// know this kind.
    SubscribeLoadReports = 0x09,
    /// The client's proof of the fleet secret (32 bytes), right after the acknowledgement, when
    /// the worker asked for one; nothing else is accepted before it.
    Auth = 0x0A,
    /// Server hello acknowledgement: [`HelloAck`].
    HelloAck = 0x81,
    /// One response item of a stream.
    Item = 0x82,
    /// The stream finished normally.
    End = 0x83,
    /// The stream or call failed: [`WireError`].
    Error = 0x84,
    /// The reply to a unary call.
    Reply = 0x85,
    /// The connection is being closed because of a protocol violation: a message string.
    GoAway = 0x86,
    /// Keepalive answer.
    Pong = 0x87,
}

impl Kind {
    fn from_u8(byte: u8) -> Option<Self> {
        Some(match byte {
            0x01 => Kind::Hello,
            0x02 => Kind::Request,
            0x03 => Kind::Cancel,
            0x04 => Kind::SessionControl,
            0x05 => Kind::EventsRange,
            0x06 => Kind::KvDump,
            0x07 => Kind::Ping,
            0x08 => Kind::SubscribeKvEvents,
            0x09 => Kind::SubscribeLoadReports,
            0x0A => Kind::Auth,
            0x81 => Kind::HelloAck,
            0x82 => Kind::Item,
            0x83 => Kind::End,
            0x84 => Kind::Error,
            0x85 => Kind::Reply,
            0x86 => Kind::GoAway,
            0x87 => Kind::Pong,
            _ => return None,
        })
    }
}

/// How a caller cancels a stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum CancelKind {
    /// Finish gracefully: the engine ends the stream soon, the caller keeps reading until the end.
    Stop = 0,
    /// Drop now: the worker drops the engine's stream at once and sends nothing more.
    Kill = 1,
}

/// The server's answer to a hello.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct HelloAck {
    pub(crate) version: u16,
    pub(crate) worker_id: u64,
    pub(crate) max_frame_bytes: u64,
    /// The worker's nonce, for the client's proof.
    pub(crate) nonce: [u8; crate::fleet_secret::NONCE_LEN],
    /// With a fleet secret: the worker's proof of it, and a [`Kind::Auth`] is required.
    pub(crate) proof: Option<[u8; crate::fleet_secret::PROOF_LEN]>,
}

/// Why the worker failed a stream or call, as sent on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum WireErrorCode {
    /// The engine refused or failed the request.
    Engine,
    /// The request body could not be decoded as the worker's request type.
    BadRequest,
    /// A response item did not fit in a frame.
    TooLarge,
    /// The worker does not implement this call.
    Unsupported,
    /// The requested event range is not (or no longer) held by the worker.
    EventsUnavailable,
    /// The connection already carries the maximum number of concurrent streams.
    TooManyStreams,
    /// The engine behind the worker cannot serve (down, restarting, overloaded); the caller may
    /// migrate the request.
    EngineUnavailable,
    /// The engine behind the worker could not be reached: the request was never sent.
    EngineUnreachable,
    /// The engine sent nothing within its first-byte limit; the request was abandoned.
    EngineTimeout,
}

/// An error frame's body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct WireError {
    pub(crate) code: WireErrorCode,
    pub(crate) message: String,
}

/// A decoded frame whose body is still raw.
#[derive(Debug, Clone)]
pub(crate) struct Frame {
    pub(crate) kind: Kind,
    pub(crate) stream: u64,
    pub(crate) body: Bytes,
}

/// A frame that could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum FrameError {
    #[error("frame of {len} bytes is shorter than the {HEADER_LEN}-byte header")]
    Short { len: usize },
    #[error("unknown frame kind 0x{kind:02x}")]
    UnknownKind { kind: u8 },
}

impl Frame {
    /// Splits a length-delimited frame into kind, stream id and body.
    pub(crate) fn parse(mut raw: BytesMut) -> Result<Frame, FrameError> {
        if raw.len() < HEADER_LEN {
            return Err(FrameError::Short { len: raw.len() });
        }
        let kind = Kind::from_u8(raw[0]).ok_or(FrameError::UnknownKind { kind: raw[0] })?;
        let mut id = [0u8; 8];
        id.copy_from_slice(&raw[1..HEADER_LEN]);
        let body = raw.split_off(HEADER_LEN).freeze();
        Ok(Frame {
            kind,
            stream: u64::from_le_bytes(id),
            body,
        })
    }
}

/// The bincode configuration of every body, bounded by the frame limit. It is the one
/// `kvroute_protocols::codec` uses (fixed-width little-endian integers, trailing bytes rejected),
/// so a body encoded by either decodes with the other.
pub(crate) fn options(limit: usize) -> impl Options + Copy {
    bincode::DefaultOptions::new()
        .with_fixint_encoding()
        .with_little_endian()
        .reject_trailing_bytes()
        .with_limit(limit as u64)
}

/// The length-delimited codec for a connection, refusing frames over `max_frame_bytes`.
pub(crate) fn codec(max_frame_bytes: usize) -> LengthDelimitedCodec {
    LengthDelimitedCodec::builder()
        .length_field_length(4)
        .max_frame_length(max_frame_bytes)
        .new_codec()
}

/// Encodes a frame whose body is `value` in bincode, refusing bodies over `max_frame_bytes`.
pub(crate) fn encode<T: Serialize + ?Sized>(
    kind: Kind,
    stream: u64,
    value: &T,
    max_frame_bytes: usize,
) -> Result<Bytes, RequestError> {
    let opts = options(max_frame_bytes);
    let size = opts.serialized_size(value).map_err(|e| match *e {
        bincode::ErrorKind::SizeLimit => RequestError::FrameTooLarge {
            size: None,
            max: max_frame_bytes,
        },
        other => RequestError::Encode {
            message: other.to_string(),
        },
    })? as usize;
    if size + HEADER_LEN > max_frame_bytes {
        return Err(RequestError::FrameTooLarge {
            size: Some(size + HEADER_LEN),
            max: max_frame_bytes,
        });
    }
    let mut buf = BytesMut::with_capacity(HEADER_LEN + size);
    put_header(&mut buf, kind, stream);
    opts.serialize_into((&mut buf).writer(), value)
        .map_err(|e| RequestError::Encode {
            message: e.to_string(),
        })?;
    Ok(buf.freeze())
}

/// Encodes a frame with a raw body (already encoded, or empty). Cancel frames use this with the
/// one-byte body `[CancelKind as u8]`, which is not bincode's fixint enum tag (four bytes), so the
/// server reads it with [`cancel_kind`].
pub(crate) fn encode_raw(kind: Kind, stream: u64, body: &[u8]) -> Bytes {
    let mut buf = BytesMut::with_capacity(HEADER_LEN + body.len());
    put_header(&mut buf, kind, stream);
    buf.put_slice(body);
    buf.freeze()
}

/// Decodes a bincode body, refusing trailing bytes and anything over `limit`.
pub(crate) fn decode<T: DeserializeOwned>(body: &[u8], limit: usize) -> Result<T, String> {
    options(limit).deserialize(body).map_err(|e| e.to_string())
}

/// Reads a cancel frame's one-byte body.
pub(crate) fn cancel_kind(body: &[u8]) -> Result<CancelKind, String> {
    match body {
        [0] => Ok(CancelKind::Stop),
        [1] => Ok(CancelKind::Kill),
        other => Err(format!(
            "expected a one-byte cancel kind (0 stop, 1 kill), got {other:?}"
        )),
    }
}

fn put_header(buf: &mut BytesMut, kind: Kind, stream: u64) {
    buf.put_u8(kind as u8);
    buf.put_u64_le(stream);
}

/// The hello body: magic, version, then the client's nonce.
pub(crate) fn hello_body(nonce: &[u8; crate::fleet_secret::NONCE_LEN]) -> Vec<u8> {
    let mut body = Vec::with_capacity(6 + nonce.len());
    body.extend_from_slice(&MAGIC);
    body.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    body.extend_from_slice(nonce);
    body
}

/// Checks a hello body and returns the client's nonce; a message for the peer when it is not
/// ours.
pub(crate) fn check_hello(body: &[u8]) -> Result<[u8; crate::fleet_secret::NONCE_LEN], String> {
    if body.len() < 6 || body[..4] != MAGIC {
        return Err("expected a kvroute hello frame (magic \"KVRT\" and a u16 version)".to_owned());
    }
    let version = u16::from_le_bytes([body[4], body[5]]);
    if version != PROTOCOL_VERSION {
        return Err(format!(
            "unsupported request-plane protocol version {version}, this worker speaks {PROTOCOL_VERSION}"
        ));
    }
    body[6..]
        .try_into()
        .map_err(|_| "a version-4 hello carries a 16-byte nonce after the version".to_owned())
}

#[cfg(test)]
mod tests;
