//! Load the core learns from outside its own decisions: what workers report of themselves, and
//! the requests and predictions of other router replicas.

use std::time::Duration;

use kvroute_protocols::kv_events::LocalBlockHash;
use kvroute_protocols::{ProtocolError, WorkerLoadReport, WorkerWithDpRank};
use kvroute_scheduler::{LoadError, NewRequest, RequestId, RequestLoad};
use kvroute_sessions::AffinityStore;

use super::KvRouterCore;
use crate::config::KvMode;

impl<S: AffinityStore> KvRouterCore<S> {
    // ----- load the workers report -----

    /// Records what a (worker, dp rank) reports of its own load at `now` and, when it reports
    /// its request counts, holds the load tracked on it against them
    /// ([`Scheduler::reconcile_reported`](kvroute_scheduler::Scheduler::reconcile_reported)):
    /// if the engine holds fewer requests than are tracked, the oldest requests other replicas
    /// routed there (older than the scheduler's `report_grace`) are freed, as many as the
    /// excess, and returned. A request this core
    /// routed is never freed here, whatever the report says: its guard ends it.
    ///
    /// A report that states the rank's KV capacity (`kv_total_blocks`) sets it for the cost
    /// ([`CostWeights::capacity_credit`](kvroute_scheduler::CostWeights::capacity_credit)).
    ///
    /// A report that does not validate is an error and changes nothing; one from a (worker,
    /// dp rank) not registered here is skipped and counted (like its events).
    pub fn on_load_report(
        &mut self,
        report: &WorkerLoadReport,
        now: Duration,
    ) -> Result<Vec<RequestId>, ProtocolError> {
        report.validate()?;
        let worker = report.worker();
        if self.scheduler.worker_load(worker).is_none() {
            self.stats.load_reports_unregistered += 1;
            return Ok(Vec::new());
        }
        self.stats.load_reports_applied += 1;
        self.reports.insert(worker, (*report, now));
        if let Some(total) = report.kv_total_blocks
            && self.scheduler.kv_capacity(worker) != Some(total)
        {
            // Registered just above, so this cannot fail.
            let _ = self.scheduler.set_kv_capacity(worker, Some(total));
            tracing::debug!(%worker, blocks = total, "worker states its KV capacity");
        }
        let Some(reported) = report.requests() else {
            return Ok(Vec::new());
        };
        let active = &self.active;
        let freed = self
            .scheduler
            .reconcile_reported(worker, reported, now, |id| active.contains_key(&id))
            .unwrap_or_default();
        if !freed.is_empty() {
            tracing::info!(
                %worker,
                reported,
                freed = freed.len(),
                "freed other replicas' requests the worker no longer holds"
            );
        }
        Ok(freed)
    }

    /// The last load `worker` reported of itself, if it reported any since it was registered
    /// and within the configured `report_ttl` (as of the last [`Self::expire`]).
    pub fn reported_load(&self, worker: WorkerWithDpRank) -> Option<&WorkerLoadReport> {
        self.reports.get(&worker).map(|(report, _)| report)
    }

    // ----- load of other router replicas -----

    /// Records the load of a request another router replica routed (kvroute-router's load
    /// sync): it counts on its worker exactly as a local one, but has no session and is never
    /// sent from here. End it with [`Self::on_first_token`] and [`Self::on_finished`] like a
    /// local one.
    pub fn add_remote_request(
        &mut self,
        id: RequestId,
        load: &RequestLoad,
        now: Duration,
    ) -> Result<(), LoadError> {
        self.scheduler.add_request_with_cached_tokens(
            &NewRequest {
                id,
                worker: load.worker,
                isl_tokens: load.prefill_tokens,
                block_hashes: &load.block_hashes,
                overlap_blocks: 0,
                expected_output_tokens: load.expected_output_tokens,
            },
            0,
            now,
        )
    }

    /// The prompt blocks (local hashes, in order) the last [`Self::route`] predicted cached on
    /// its worker from now on, when that route was request `id`'s and its worker is in
    /// approximate mode; `None` otherwise (another decision came since, or the worker publishes
    /// events). A live router sends them to its replicas, which record the same prediction with
    /// [`Self::record_remote_prediction`], so that N routers predict as one.
    pub fn predicted_blocks(&self, id: RequestId) -> Option<&[LocalBlockHash]> {
        (self.last_prediction == Some(id)).then_some(self.scratch.local.as_slice())
    }

    /// Records a prediction another router replica made (see [`Self::predicted_blocks`]): the
    /// prompt `blocks` are now expected cached on `worker`, for this core's prediction TTL from
    /// `now`. Ignored (returns false) unless `worker` is registered here in approximate mode.
    pub fn record_remote_prediction(
        &mut self,
        worker: WorkerWithDpRank,
        blocks: &[LocalBlockHash],
        now: Duration,
    ) -> bool {
        if self.modes.get(&worker.worker_id) != Some(&KvMode::Approximate)
            || self.scheduler.worker_load(worker).is_none()
        {
            return false;
        }
        self.approx.record(worker, blocks, now);
        true
    }

    /// What a request in flight adds to its worker's load, to share with other replicas.
    pub fn request_load(&self, id: RequestId) -> Option<RequestLoad> {
        self.scheduler.request_load(id)
    }
}
