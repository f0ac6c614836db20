//! Request bodies: the body budget ([`BodyBudget`], the bytes of bodies being read and parsed
//! at once) and the extractor that reads a body within the frontend's limits ([`ReadBody`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::{StatusCode, header};
use futures::StreamExt;
use kvroute_protocols::from_json;
use serde::de::DeserializeOwned;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::config::HttpConfig;
use super::error::ApiError;

/// What reading a body needs of the frontend's state: its limits and the body budget.
pub(crate) trait BodySource {
    /// The frontend's configuration (`max_body_bytes`, `body_timeout`, the `Retry-After`).
    fn config(&self) -> &HttpConfig;
    /// The budget a body reserves its size from before it is read.
    fn bodies(&self) -> &BodyBudget;
}

/// The body budget of [`HttpConfig::max_body_memory_bytes`]: a semaphore of
/// bytes a body reserves before it is read and holds until it is parsed.
#[derive(Debug)]
pub(crate) struct BodyBudget {
    bytes: Arc<Semaphore>,
    total: usize,
    waiting: AtomicUsize,
}

impl BodyBudget {
    /// A budget of `max_memory` bytes, at least `max_body` (one largest body fits), at most
    /// `u32::MAX` (what a reservation can take at once).
    pub(crate) fn new(max_body: usize, max_memory: usize) -> Self {
        let total = max_memory.max(max_body).min(u32::MAX as usize);
        Self {
            bytes: Arc::new(Semaphore::new(total)),
            total,
            waiting: AtomicUsize::new(0),
        }
    }

    /// Bytes reserved now.
    pub(crate) fn reserved(&self) -> usize {
        self.total - self.bytes.available_permits()
    }

    /// Reservations waiting now.
    pub(crate) fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Relaxed)
    }

    /// Reserves `bytes` (at most the whole budget), waiting for them to be free.
    async fn reserve(&self, bytes: usize) -> OwnedSemaphorePermit {
        struct Waiting<'a>(&'a AtomicUsize);
        impl Drop for Waiting<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::Relaxed);
            }
        }
        self.waiting.fetch_add(1, Ordering::Relaxed);
        let _waiting = Waiting(&self.waiting);
        let n = u32::try_from(bytes.min(self.total)).unwrap_or(u32::MAX);
        self.bytes
            .clone()
            .acquire_many_owned(n)
            .await
            .expect("the body budget is never closed")
    }
}

/// A request body read within the frontend's limits, with its reservation of the body budget
/// (released when this is dropped, after parsing).
pub(crate) struct ReadBody {
    bytes: Bytes,
    _reservation: OwnedSemaphorePermit,
}

impl<S: BodySource + Send + Sync> FromRequest<S> for ReadBody {
    type Rejection = ApiError;

    /// 413 when `Content-Length` exceeds `max_body_bytes`, before anything is buffered; else
    /// reserves the body's size (`max_body_bytes` without a `Content-Length`) from the budget,
    /// waiting up to `body_timeout` (503 after that), then reads the body within `body_timeout`
    /// (408 after that; 413 when a body without `Content-Length` passes the limit).
    ///
    /// A refused body is discarded (never buffered) up to [`DRAIN_FACTOR`] times the limit
    /// within `body_timeout` before the 413 goes out, so the client, which is usually still
    /// writing it, reads the answer instead of a reset, and the connection stays usable. A larger
    /// one is answered at once with `Connection: close`.
    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        let config = state.config();
        let limit = config.max_body_bytes;
        let declared = req
            .headers()
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok());
        let drain_limit = limit.saturating_mul(DRAIN_FACTOR);
        if let Some(len) = declared
            && len > limit as u64
        {
            let error = body_too_large(&format!("Content-Length {len}"), limit);
            if len > drain_limit as u64 {
                return Err(error.closing());
            }
            let drained = discard_body(req, 0, drain_limit, config.body_timeout).await;
            return Err(if drained { error } else { error.closing() });
        }
        // `declared` fits in usize here: it is at most `limit`.
        let expected = declared.map_or(limit, |len| len as usize);
        let reservation =
            tokio::time::timeout(config.body_timeout, state.bodies().reserve(expected))
                .await
                .map_err(|_| {
                    ApiError::unavailable(
                        "too many request bodies are being read; retry later",
                        config.admission.retry_after,
                    )
                })?;
        let mut body = req.into_body().into_data_stream();
        let read = async {
            let mut bytes = Vec::with_capacity(declared.map_or(0, |_| expected));
            while let Some(chunk) = body.next().await {
                let chunk = chunk.map_err(|e| {
                    ApiError::invalid(format!("failed to read the request body: {e}"), None)
                        .closing()
                })?;
                if bytes.len() + chunk.len() > limit {
                    let seen = bytes.len() + chunk.len();
                    drop(bytes);
                    let error = body_too_large("the body", limit);
                    let drained =
                        discard_stream(&mut body, seen, drain_limit, config.body_timeout).await;
                    return Err(if drained { error } else { error.closing() });
                }
                bytes.extend_from_slice(&chunk);
            }
            Ok(Bytes::from(bytes))
        };
        let bytes = tokio::time::timeout(config.body_timeout, read)
            .await
            .map_err(|_| ApiError {
                status: StatusCode::REQUEST_TIMEOUT,
                message: format!(
                    "the request body was not received within body_timeout ({:?})",
                    config.body_timeout
                ),
                kind: "invalid_request_error",
                param: None,
                code: Some("request_timeout"),
                retry_after: None,
                close_connection: true,
            })??;
        Ok(Self {
            bytes,
            _reservation: reservation,
        })
    }
}

/// How far past `max_body_bytes` a refused body is still read (and thrown away) so that its
/// client gets the 413 cleanly; see [`ReadBody`].
const DRAIN_FACTOR: usize = 4;

/// Reads and throws away `req`'s body; see [`discard_stream`].
async fn discard_body(req: Request, seen: usize, limit: usize, timeout: Duration) -> bool {
    let mut body = req.into_body().into_data_stream();
    discard_stream(&mut body, seen, limit, timeout).await
}

/// Reads and throws away the rest of a body of which `seen` bytes were read: true when it
/// ended within `limit` bytes in all and within `timeout`, so the connection can carry the
/// answer and the next request.
async fn discard_stream(
    body: &mut axum::body::BodyDataStream,
    mut seen: usize,
    limit: usize,
    timeout: Duration,
) -> bool {
    let drain = async {
        while let Some(chunk) = body.next().await {
            let Ok(chunk) = chunk else { return false };
            seen = seen.saturating_add(chunk.len());
            if seen > limit {
                return false;
            }
        }
        true
    };
    tokio::time::timeout(timeout, drain).await.unwrap_or(false)
}

/// 413 naming the `max_body_bytes` limit `what` exceeds.
fn body_too_large(what: &str, limit: usize) -> ApiError {
    ApiError::too_large(
        format!("request body too large: {what} exceeds max_body_bytes ({limit} bytes)"),
        "request_too_large",
    )
}

/// The typed request of a body; its reservation of the body budget ends with this call.
pub(super) fn parse_body<T: DeserializeOwned>(
    body: Result<ReadBody, ApiError>,
) -> Result<T, ApiError> {
    let body = body?;
    from_json(&body.bytes).map_err(|e| ApiError::from_protocol(&e, false))
}
