//! Admission control: a bounded number of requests in flight and a bounded, time-limited wait for
//! a slot, so that a burst beyond capacity is refused at once (429) or after a short wait (503),
//! never left hanging.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::http::error::ApiError;

/// How many requests the frontend takes at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdmissionConfig {
    /// Requests in flight (routed and streaming) at most.
    pub max_in_flight: usize,
    /// Requests waiting for a slot at most; one more is refused with 429.
    pub max_queued: usize,
    /// How long a request waits for a slot before it is refused with 503.
    pub queue_timeout: Duration,
    /// The `Retry-After` advised on refusals.
    pub retry_after: Duration,
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        Self {
            max_in_flight: 4096,
            max_queued: 1024,
            queue_timeout: Duration::from_secs(5),
            retry_after: Duration::from_secs(1),
        }
    }
}

/// The in-flight slots and the waiting line.
#[derive(Debug)]
pub(crate) struct Admission {
    slots: Arc<Semaphore>,
    waiting: AtomicUsize,
    config: AdmissionConfig,
}

/// A slot: the request is in flight until this is dropped.
pub(crate) type Permit = OwnedSemaphorePermit;

impl Admission {
    pub(crate) fn new(config: AdmissionConfig) -> Self {
        Self {
            slots: Arc::new(Semaphore::new(config.max_in_flight)),
            waiting: AtomicUsize::new(0),
            config,
        }
    }

    /// Requests in flight now.
    pub(crate) fn in_flight(&self) -> usize {
        self.config.max_in_flight - self.slots.available_permits()
    }

    /// Takes a slot, waiting (bounded) for one when all are taken.
    pub(crate) async fn admit(&self) -> Result<Permit, ApiError> {
        if let Ok(permit) = self.slots.clone().try_acquire_owned() {
            return Ok(permit);
        }
        let retry = self.config.retry_after;
        // Count ourselves in the line first, so that concurrent arrivals see a full line.
        let position = self.waiting.fetch_add(1, Ordering::SeqCst);
        let _leave = Leave(&self.waiting);
        if position >= self.config.max_queued {
            return Err(ApiError::too_many_requests(
                format!(
                    "the router is at capacity ({} requests in flight, {} waiting); retry later",
                    self.config.max_in_flight, self.config.max_queued
                ),
                retry,
            ));
        }
        match tokio::time::timeout(
            self.config.queue_timeout,
            self.slots.clone().acquire_owned(),
        )
        .await
        {
            Ok(Ok(permit)) => Ok(permit),
            Ok(Err(_)) => Err(ApiError::unavailable("the router is shutting down", retry)),
            Err(_) => Err(ApiError::unavailable(
                format!(
                    "no request slot freed within {:?} ({} requests in flight); retry later",
                    self.config.queue_timeout, self.config.max_in_flight
                ),
                retry,
            )),
        }
    }
}

struct Leave<'a>(&'a AtomicUsize);

impl Drop for Leave<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}
