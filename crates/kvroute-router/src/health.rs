//! Passive health: a worker whose requests keep failing at the transport (its engine refuses
//! connections, sends nothing within its first-byte limit, or drops streams) is ejected for a
//! while, so that new requests go elsewhere, and let back in on probation when the while is up.
//!
//! Sans-IO: time comes in as an argument, so tests drive it in virtual time. The router keeps one
//! [`PassiveHealth`] and routes around [`PassiveHealth::ejected`] workers (see
//! `kvroute_scheduler::SelectRequest::avoided_worker_ids`): an ejected worker is still chosen
//! when no other worker can take the request, and a request pinned to it still goes there.
//!
//! The rules, as an operator reads them on `/metrics`:
//! - a refused connection ejects at once (nothing can be served there now);
//! - timeouts and lost streams eject after [`HealthConfig::failures_to_eject`] in a row;
//! - an ejection lasts [`HealthConfig::base_ejection`], doubling with each ejection in a row up
//!   to [`HealthConfig::max_ejection`];
//! - when it ends the worker is on probation: its next request is the probe. One failure ejects
//!   it again (for twice as long), one success clears its record;
//! - engine refusals (a 4xx for a bad prompt) and client cancellations are neither.

use std::collections::HashMap;
use std::fmt;
use std::time::Duration;

use kvroute_protocols::WorkerId;

/// When [`PassiveHealth`] ejects a worker, and for how long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HealthConfig {
    /// Consecutive failures (timeouts, lost streams) that eject a worker. A refused
    /// connection ejects at once.
    pub failures_to_eject: u32,
    /// The first ejection's length.
    pub base_ejection: Duration,
    /// The longest ejection, however many follow one another.
    pub max_ejection: Duration,
}

impl Default for HealthConfig {
    fn default() -> Self {
        Self {
            failures_to_eject: 3,
            base_ejection: Duration::from_secs(2),
            max_ejection: Duration::from_secs(60),
        }
    }
}

/// How a request failed on its worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HealthFailure {
    /// The worker's engine refused the connection: nothing was sent.
    Unreachable,
    /// Nothing arrived within the first-byte (or first-response) limit.
    Timeout,
    /// The stream broke (the worker or its engine went away mid-request).
    Lost,
}

impl HealthFailure {
    /// The `reason` label on the metrics.
    pub const fn label(self) -> &'static str {
        match self {
            HealthFailure::Unreachable => "unreachable",
            HealthFailure::Timeout => "timeout",
            HealthFailure::Lost => "lost",
        }
    }
}

impl fmt::Display for HealthFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.label())
    }
}

/// What recording a failure did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The worker stays in (fewer failures in a row than the threshold).
    Counted {
        /// Failures in a row so far.
        in_a_row: u32,
    },
    /// The worker is ejected until `until` (router time).
    Ejected {
        /// When it comes back on probation.
        until: Duration,
        /// How long the ejection lasts.
        after: Duration,
    },
    /// The worker was already ejected (requests sent before the ejection finishing late).
    AlreadyEjected,
}

#[derive(Debug, Clone, Copy, Default)]
struct WorkerHealth {
    /// Failures in a row since the last success.
    in_a_row: u32,
    /// Ejections in a row since the last success: sets the next ejection's length, and a
    /// worker with any is on probation once its ejection ends.
    ejections: u32,
    /// While `Some(t)` and `now < t`, the worker is ejected.
    until: Option<Duration>,
}

/// Every worker's recent failures and ejections (only workers that failed are held).
#[derive(Debug, Clone, Default)]
pub struct PassiveHealth {
    config: HealthConfig,
    workers: HashMap<WorkerId, WorkerHealth>,
}

impl PassiveHealth {
    /// Health tracking under `config`.
    pub fn new(config: HealthConfig) -> Self {
        Self {
            config,
            workers: HashMap::new(),
        }
    }

    /// The configuration in force.
    pub fn config(&self) -> HealthConfig {
        self.config
    }

    /// Records a failure of a request on `worker` at `now`.
    pub fn on_failure(
        &mut self,
        worker: WorkerId,
        failure: HealthFailure,
        now: Duration,
    ) -> Verdict {
        let config = self.config;
        let health = self.workers.entry(worker).or_default();
        if health.until.is_some_and(|until| now < until) {
            return Verdict::AlreadyEjected;
        }
        health.in_a_row = health.in_a_row.saturating_add(1);
        let on_probation = health.ejections > 0;
        let eject = on_probation
            || failure == HealthFailure::Unreachable
            || health.in_a_row >= config.failures_to_eject.max(1);
        if !eject {
            return Verdict::Counted {
                in_a_row: health.in_a_row,
            };
        }
        let doublings = health.ejections.min(16);
        let after = config
            .base_ejection
            .saturating_mul(1 << doublings)
            .min(config.max_ejection);
        health.ejections = health.ejections.saturating_add(1);
        let until = now + after;
        health.until = Some(until);
        Verdict::Ejected { until, after }
    }

    /// Records a request that `worker` served to its end: clears its record. Says whether the
    /// worker was on probation (so this success let it back in for good).
    pub fn on_success(&mut self, worker: WorkerId) -> bool {
        self.workers
            .remove(&worker)
            .is_some_and(|health| health.ejections > 0)
    }

    /// Forgets `worker` (it left the fleet).
    pub fn remove(&mut self, worker: WorkerId) {
        self.workers.remove(&worker);
    }

    /// Whether `worker` is ejected at `now`.
    pub fn is_ejected(&self, worker: WorkerId, now: Duration) -> bool {
        self.workers
            .get(&worker)
            .and_then(|h| h.until)
            .is_some_and(|until| now < until)
    }

    /// The workers ejected at `now`, in ascending order.
    pub fn ejected(&self, now: Duration) -> Vec<WorkerId> {
        let mut ids: Vec<WorkerId> = self
            .workers
            .iter()
            .filter(|(_, h)| h.until.is_some_and(|until| now < until))
            .map(|(&id, _)| id)
            .collect();
        ids.sort_unstable();
        ids
    }
}

#[cfg(test)]
mod tests;
