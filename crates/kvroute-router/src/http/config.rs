//! [`HttpConfig`]: the frontend's limits and behaviour.

use std::time::Duration;

use kvroute_protocols::Limits;

use super::admission::AdmissionConfig;
use crate::migration::DEFAULT_MAX_MIGRATIONS;

/// The frontend's limits and behaviour.
///
/// Memory held by request bodies is bounded: a body is read only after reserving its size (its
/// `Content-Length`, or `max_body_bytes` when the client does not say) from a budget of
/// `max_body_memory_bytes` shared by all connections, and the reservation is held until the
/// body is parsed. So raw bodies being read or parsed take at most `max_body_memory_bytes`
/// (default 256 MiB, 16 bodies of the default 16 MiB limit) however many clients send at once;
/// a request that finds the budget exhausted waits for it (up to `body_timeout`, then 503 with
/// `Retry-After`). A body above `max_body_bytes` is refused with 413 as soon as its
/// `Content-Length` says so, without reading it (or when the read passes the limit, without a
/// `Content-Length`). A client that does not send its headers within `header_timeout` has its
/// connection closed; one that does not send its whole body within `body_timeout` gets 408 and
/// the connection is closed.
#[derive(Debug, Clone, PartialEq)]
pub struct HttpConfig {
    /// Largest request body, in bytes (a larger one is refused with 413).
    pub max_body_bytes: usize,
    /// Bytes of request bodies being read and parsed at once, over all connections (at least
    /// `max_body_bytes` is used).
    pub max_body_memory_bytes: usize,
    /// How long a client may take to send a request's headers before its connection is closed.
    pub header_timeout: Duration,
    /// How long a client may take to send a request's body (408 after that).
    pub body_timeout: Duration,
    /// Longest prompt, in tokens (a longer one is refused with 413).
    pub max_prompt_tokens: usize,
    /// Validation limits of `nvext`.
    pub limits: Limits,
    /// Requests in flight and waiting.
    pub admission: AdmissionConfig,
    /// Interval of SSE keep-alive comments (they also reveal a client that went away).
    pub keep_alive: Duration,
    /// How many times a request moves to another worker when its worker dies mid-stream.
    pub max_migrations: u32,
    /// After a stop string, how long the worker has to end the stream once asked to stop
    /// gracefully; an engine that ignores the request is then cancelled (the answer, cut at the
    /// stop string, is complete either way).
    pub stop_grace: Duration,
}

impl Default for HttpConfig {
    fn default() -> Self {
        Self {
            max_body_bytes: 16 << 20,
            max_body_memory_bytes: 256 << 20,
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(30),
            max_prompt_tokens: 128 * 1024,
            limits: Limits::default(),
            admission: AdmissionConfig::default(),
            keep_alive: Duration::from_secs(15),
            max_migrations: DEFAULT_MAX_MIGRATIONS,
            stop_grace: Duration::from_secs(2),
        }
    }
}
