//! Errors of the request plane as a caller sees them.

use std::time::Duration;

/// Why a request, its stream, or a unary call failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RequestError {
    /// The worker cannot be reached, or its connection dropped while the request was in flight.
    /// Nothing more will arrive; the caller may migrate the request to another worker.
    #[error("worker at {addr} is unavailable: {reason}")]
    WorkerUnavailable {
        /// The worker's address.
        addr: String,
        /// What happened (connection refused, reset, closed, ...).
        reason: String,
    },
    /// The worker is alive but its engine could not be reached (connection refused): the
    /// request was never sent to an engine, so another worker may take it at no cost.
    #[error("the engine behind worker at {addr} is unreachable: {reason}")]
    EngineUnreachable {
        /// The worker's address.
        addr: String,
        /// What happened.
        reason: String,
    },
    /// The worker's engine sent nothing within its first-byte limit (the worker's
    /// `first_byte_timeout`); the request was abandoned there before any output.
    #[error("the engine behind worker at {addr} timed out: {reason}")]
    EngineTimeout {
        /// The worker's address.
        addr: String,
        /// What timed out, naming the limit.
        reason: String,
    },
    /// Connecting (TCP plus handshake) took longer than the configured connect timeout.
    #[error("connecting to worker at {addr} took longer than {after:?}")]
    ConnectTimeout {
        /// The worker's address.
        addr: String,
        /// The timeout that expired.
        after: Duration,
    },
    /// The worker answered the handshake with something other than a compatible hello.
    #[error("handshake with worker at {addr} failed: {message}")]
    Handshake {
        /// The worker's address.
        addr: String,
        /// What was wrong.
        message: String,
    },
    /// No response item arrived within the first-response timeout; the stream was killed.
    #[error("no response within {after:?} of sending the request")]
    FirstResponseTimeout {
        /// The timeout that expired.
        after: Duration,
    },
    /// A frame would exceed the maximum frame size; it was not sent.
    #[error("frame of {} bytes exceeds the maximum frame size of {max} bytes", size.map_or_else(|| "more than max".to_owned(), |s| s.to_string()))]
    FrameTooLarge {
        /// The frame's size, when known.
        size: Option<usize>,
        /// The maximum frame size.
        max: usize,
    },
    /// A value could not be encoded.
    #[error("could not encode a frame body: {message}")]
    Encode {
        /// The encoder's message.
        message: String,
    },
    /// A response body could not be decoded as the expected type.
    #[error("could not decode a response from the worker: {message}")]
    Decode {
        /// The decoder's message.
        message: String,
    },
    /// The worker refused the request as malformed (it could not decode it).
    #[error("the worker refused the request as malformed: {message}")]
    BadRequest {
        /// The worker's message.
        message: String,
    },
    /// The engine refused or failed the request.
    #[error("the engine failed the request: {message}")]
    Engine {
        /// The engine's message.
        message: String,
    },
    /// The worker does not implement the call.
    #[error("the worker does not support this call: {message}")]
    Unsupported {
        /// The worker's message.
        message: String,
    },
    /// The connection already carries as many concurrent streams as the worker allows; the
    /// request was not started (another connection or worker may take it).
    #[error("the worker refused the stream: {message}")]
    TooManyStreams {
        /// The worker's message, naming the limit.
        message: String,
    },
    /// The worker no longer (or does not yet) hold the requested KV events.
    #[error("the worker cannot serve the requested KV events: {message}")]
    EventsUnavailable {
        /// The worker's message, naming the range it holds.
        message: String,
    },
}

impl RequestError {
    /// Whether the request never reached a live engine or lost its worker, so that sending it to
    /// another worker is sound (connection refused, timed out, or dropped).
    ///
    /// Timeouts before any output count: the worker-side first-byte limit
    /// ([`RequestError::EngineTimeout`]) and this side's ([`RequestError::FirstResponseTimeout`],
    /// which killed the stream on the worker).
    pub fn is_worker_unavailable(&self) -> bool {
        matches!(
            self,
            RequestError::WorkerUnavailable { .. }
                | RequestError::ConnectTimeout { .. }
                | RequestError::EngineUnreachable { .. }
                | RequestError::EngineTimeout { .. }
                | RequestError::FirstResponseTimeout { .. }
        )
    }

    /// Whether nothing was sent to any engine because the worker's engine could not be reached
    /// (its connection was refused): moving the request elsewhere is free.
    pub fn is_unreachable(&self) -> bool {
        matches!(self, RequestError::EngineUnreachable { .. })
    }

    /// Whether the request timed out before any output (the worker's first-byte limit, or
    /// this side's first-response limit).
    pub fn is_timeout(&self) -> bool {
        matches!(
            self,
            RequestError::EngineTimeout { .. } | RequestError::FirstResponseTimeout { .. }
        )
    }
}
