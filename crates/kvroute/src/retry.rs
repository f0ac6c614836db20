//! Start-up retries: a worker or router started together with what it connects to (the router's
//! registry, NATS) waits for it instead of exiting, the same way everywhere.

use std::time::Duration;

use tokio::time::Instant;

/// How long start-up keeps trying to reach a dependency.
pub(crate) const STARTUP_DEADLINE: Duration = Duration::from_secs(60);

/// Backoff for one start-up connection: 200 ms doubling to 5 s, for at most
/// [`STARTUP_DEADLINE`]. Each retry is logged once, with the attempt and the next delay.
#[derive(Debug)]
pub(crate) struct StartupRetry {
    what: String,
    deadline: Instant,
    delay: Duration,
    attempts: u32,
}

impl StartupRetry {
    /// Retries for reaching `what` (as a log line names it: "NATS at nats://...").
    pub(crate) fn new(what: impl Into<String>) -> Self {
        Self {
            what: what.into(),
            deadline: Instant::now() + STARTUP_DEADLINE,
            delay: Duration::from_millis(200),
            attempts: 0,
        }
    }

    /// After a failed attempt: logs it and sleeps until the next one, or returns false, without
    /// sleeping, when the next attempt would come after the deadline (the caller gives up).
    pub(crate) async fn wait(&mut self, error: &dyn std::fmt::Display) -> bool {
        if Instant::now() + self.delay >= self.deadline {
            return false;
        }
        self.attempts += 1;
        tracing::info!(
            attempt = self.attempts,
            next_in = ?self.delay,
            %error,
            "{} not reachable yet; retrying for up to {STARTUP_DEADLINE:?}",
            self.what
        );
        tokio::time::sleep(self.delay).await;
        self.delay = (self.delay * 2).min(Duration::from_secs(5));
        true
    }
}
