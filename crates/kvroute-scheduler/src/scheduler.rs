//! The [`Scheduler`]: registered workers, their active load, and the metrics counters.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use kvroute_protocols::{WorkerId, WorkerWithDpRank};

use crate::config::{ConfigError, SchedulerConfig};
use crate::load::{LoadError, NewRequest, RequestId, RequestLoad, Requests};
use crate::scratch::Scratch;
use crate::slot_load::WorkerLoad;
use crate::workers::{WorkerError, WorkerSpec, Workers};

/// Load tracking, cost model and selection over a fleet of (worker, dp rank) slots.
///
/// Synchronous and deterministic: the caller passes `now` (time since any fixed epoch) and the
/// RNG, so the same code serves the live router and trace replay in virtual time. One instance is
/// meant to be owned by one task (wrap it in a mutex to share it).
#[derive(Debug)]
pub struct Scheduler {
    pub(crate) config: SchedulerConfig,
    pub(crate) workers: Workers,
    pub(crate) requests: Requests,
    pub(crate) scratch: Scratch,
    metrics: Arc<SchedulerMetrics>,
}

impl Scheduler {
    /// A scheduler with no workers; fails if `config` does not validate.
    pub fn new(config: SchedulerConfig) -> Result<Self, ConfigError> {
        config.validate()?;
        Ok(Self {
            config,
            workers: Workers::default(),
            requests: Requests::default(),
            scratch: Scratch::default(),
            metrics: Arc::default(),
        })
    }

    /// The validated configuration.
    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// Registers a worker and all of its dp ranks with zero load.
    pub fn add_worker(&mut self, spec: &WorkerSpec) -> Result<(), WorkerError> {
        self.workers.add(spec)
    }

    /// Unregisters a worker, dropping the load of every request still routed to it; returns those
    /// requests (the caller fails or re-routes them). Unknown workers return an empty list.
    pub fn remove_worker(&mut self, worker_id: WorkerId) -> Vec<RequestId> {
        let Some(ranks) = self.workers.ranks_of.get(&worker_id).cloned() else {
            return Vec::new();
        };
        let mut dropped = Vec::new();
        for idx in ranks {
            for id in self.requests.on_slot(idx) {
                if self.requests.free(&mut self.workers, id).is_ok() {
                    self.metrics.requests_freed.fetch_add(1, Ordering::Relaxed);
                    dropped.push(id);
                }
            }
        }
        self.workers.remove(worker_id);
        dropped
    }

    /// Every registered (worker, dp rank).
    pub fn workers(&self) -> impl Iterator<Item = WorkerWithDpRank> + '_ {
        self.workers
            .live
            .iter()
            .filter_map(|&i| self.workers.slot(i))
            .map(|s| s.key)
    }

    /// Records a routed request's load on its worker; its outstanding prefill is the prompt
    /// less its `overlap_blocks` of device-cached tokens.
    pub fn add_request(&mut self, req: &NewRequest<'_>, now: Duration) -> Result<(), LoadError> {
        let cached_tokens = u64::from(req.overlap_blocks) * u64::from(self.config.block_size);
        self.add_request_with_cached_tokens(req, cached_tokens, now)
    }

    /// [`Scheduler::add_request`] with the prompt tokens expected cached given directly (capped
    /// at the prompt length): the chosen candidate's [`CandidateCost::cached_tokens`], whose
    /// slower-tier blocks count at their weights, as the reference tracks prefill load. The
    /// request keeps this integer, so freeing it returns the load exactly.
    ///
    /// [`CandidateCost::cached_tokens`]: crate::CandidateCost::cached_tokens
    pub fn add_request_with_cached_tokens(
        &mut self,
        req: &NewRequest<'_>,
        cached_tokens: u64,
        now: Duration,
    ) -> Result<(), LoadError> {
        self.requests
            .add(&mut self.workers, req, cached_tokens, now)?;
        self.metrics.requests_added.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// The request's prompt is prefilled: its tokens stop counting as prefill load.
    pub fn mark_prefill_completed(&mut self, id: RequestId) -> Result<(), LoadError> {
        self.requests.mark_prefill_completed(&mut self.workers, id)
    }

    /// The request generated `tokens` more output tokens, which implies its prefill completed.
    /// With [`SchedulerConfig::track_output_blocks`] each full block of output also adds a decode
    /// block, and with an expected length the request's exclusive blocks decay to
    /// `1 - generated / expected`.
    pub fn add_output_tokens(&mut self, id: RequestId, tokens: u64) -> Result<(), LoadError> {
        if !self.config.track_output_blocks {
            return self.requests.mark_prefill_completed(&mut self.workers, id);
        }
        self.requests
            .add_output_tokens(&mut self.workers, self.config.block_size, id, tokens)
    }

    /// What the active request `id` adds to its worker's load (`None` when it is not active).
    pub fn request_load(&self, id: RequestId) -> Option<RequestLoad> {
        self.requests.load_of(&self.workers, id)
    }

    /// Where the active request `id` runs and its prompt's sequence hashes, without copying
    /// them as [`Self::request_load`] does (`None` when it is not active).
    pub fn request_prompt(&self, id: RequestId) -> Option<(WorkerWithDpRank, &[u64])> {
        self.requests.prompt_of(&self.workers, id)
    }

    /// The request ended (success, error, cancellation): all of its load is released.
    pub fn free(&mut self, id: RequestId) -> Result<(), LoadError> {
        self.requests.free(&mut self.workers, id)?;
        self.metrics.requests_freed.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Frees requests older than the configured expiry at `now` (time must not go backwards);
    /// returns them. Call it periodically: it costs O(1) when nothing expired.
    pub fn expire(&mut self, now: Duration) -> Vec<RequestId> {
        self.expire_unowned(now, |_| false)
    }

    /// Like [`Self::expire`], but a request `owned` says is still owned (its caller will free
    /// it: a live stream, a request still queued in an engine) is kept, whatever its age, and
    /// looked at again one expiry later. Only what nobody owns any more is freed (and counted).
    pub fn expire_unowned(
        &mut self,
        now: Duration,
        owned: impl FnMut(RequestId) -> bool,
    ) -> Vec<RequestId> {
        let expired =
            self.requests
                .expire(&mut self.workers, now, self.config.request_expiry, owned);
        self.metrics
            .requests_expired
            .fetch_add(expired.len() as u64, Ordering::Relaxed);
        expired
    }

    /// Holds the load tracked on `worker` against the `reported_requests` (running plus
    /// waiting) its engine says it holds at `now`. When more are tracked there, the oldest
    /// requests that `owned` says nobody owns and that started more than
    /// [`SchedulerConfig::report_grace`] before `now` are freed, at most as many as the excess,
    /// and counted as reconciled; their ids are returned. The grace keeps requests routed in the
    /// last moments, which the engine may not have received when it reported. An owned request
    /// is never freed here: its caller ends it, and one waiting in the engine's queue is load.
    /// Costs O(1) when the engine holds at least as many requests as are tracked.
    pub fn reconcile_reported(
        &mut self,
        worker: WorkerWithDpRank,
        reported_requests: u64,
        now: Duration,
        owned: impl FnMut(RequestId) -> bool,
    ) -> Result<Vec<RequestId>, LoadError> {
        let Some(&idx) = self.workers.slot_of.get(&worker) else {
            return Err(LoadError::UnknownWorker(worker));
        };
        let Some(slot) = self.workers.slot(idx) else {
            return Err(LoadError::UnknownWorker(worker));
        };
        let excess = slot.load.active_requests.saturating_sub(reported_requests);
        // Nothing started before the epoch plus the grace can be older than the grace.
        let Some(started_before) = now.checked_sub(self.config.report_grace) else {
            return Ok(Vec::new());
        };
        if excess == 0 {
            return Ok(Vec::new());
        }
        let freed = self
            .requests
            .reconcile(&mut self.workers, idx, excess, started_before, owned);
        self.metrics
            .requests_reconciled
            .fetch_add(freed.len() as u64, Ordering::Relaxed);
        Ok(freed)
    }

    /// Sets the KV capacity of one (worker, dp rank), in blocks, as its engine states it (a load
    /// report); `None` forgets it. Read by the busy threshold on decode blocks and by
    /// [`CostWeights::capacity_credit`](crate::CostWeights::capacity_credit).
    pub fn set_kv_capacity(
        &mut self,
        worker: WorkerWithDpRank,
        blocks: Option<u64>,
    ) -> Result<(), LoadError> {
        let idx = self.workers.slot_of.get(&worker).copied();
        if idx.is_some_and(|idx| self.workers.set_kv_capacity(idx, blocks)) {
            Ok(())
        } else {
            Err(LoadError::UnknownWorker(worker))
        }
    }

    /// The KV capacity of one (worker, dp rank), in blocks, when it is known.
    pub fn kv_capacity(&self, worker: WorkerWithDpRank) -> Option<u64> {
        let idx = *self.workers.slot_of.get(&worker)?;
        self.workers.slot(idx)?.kv_capacity_blocks
    }

    /// Number of active requests across all workers.
    pub fn active_requests(&self) -> usize {
        self.requests.len()
    }

    /// The load of one (worker, dp rank), or `None` if it is not registered.
    pub fn worker_load(&self, worker: WorkerWithDpRank) -> Option<WorkerLoad> {
        let idx = *self.workers.slot_of.get(&worker)?;
        self.workers.slot(idx).map(|s| s.load.snapshot())
    }

    /// The shared metrics counters (cheap to clone and read from another thread).
    pub fn metrics(&self) -> Arc<SchedulerMetrics> {
        Arc::clone(&self.metrics)
    }

    pub(crate) fn metrics_ref(&self) -> &SchedulerMetrics {
        &self.metrics
    }
}

/// Monotonic counters, readable while the scheduler runs (exported by the router).
#[derive(Debug, Default)]
pub struct SchedulerMetrics {
    pub(crate) requests_added: AtomicU64,
    pub(crate) requests_freed: AtomicU64,
    pub(crate) requests_expired: AtomicU64,
    pub(crate) requests_reconciled: AtomicU64,
    pub(crate) decisions: AtomicU64,
    pub(crate) selection_errors: AtomicU64,
}

/// A point-in-time copy of [`SchedulerMetrics`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MetricsSnapshot {
    /// Requests whose load was recorded.
    pub requests_added: u64,
    /// Requests freed by the caller (or by their worker's removal).
    pub requests_freed: u64,
    /// Requests nobody freed, dropped after the expiry time.
    pub requests_expired: u64,
    /// Requests nobody owned that a worker's report showed it no longer held, dropped
    /// ([`Scheduler::reconcile_reported`]).
    pub requests_reconciled: u64,
    /// Successful selections.
    pub decisions: u64,
    /// Selections that returned an error.
    pub selection_errors: u64,
}

impl SchedulerMetrics {
    /// Reads every counter.
    pub fn snapshot(&self) -> MetricsSnapshot {
        MetricsSnapshot {
            requests_added: self.requests_added.load(Ordering::Relaxed),
            requests_freed: self.requests_freed.load(Ordering::Relaxed),
            requests_expired: self.requests_expired.load(Ordering::Relaxed),
            requests_reconciled: self.requests_reconciled.load(Ordering::Relaxed),
            decisions: self.decisions.load(Ordering::Relaxed),
            selection_errors: self.selection_errors.load(Ordering::Relaxed),
        }
    }
}
