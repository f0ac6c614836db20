//! What a worker says about its own load, so the router can hold its prediction against it.
//!
//! [`WorkerLoadReport`] follows the reference's `ActiveLoad` (`worker_id`, `dp_rank`,
//! `kv_used_blocks`) and adds the engine's running and waiting request counts (vLLM's
//! `vllm:num_requests_running` / `_waiting`). Every figure is optional, since engines know
//! different things, but a report must carry at least one, and the two request counts come
//! together or not at all: the router compares their sum with the requests it tracks on the
//! worker, and half of a queue would make a worker look emptier than it is.

use serde::{Deserialize, Serialize, Serializer};

use crate::wire::WireStruct;
use crate::{DpRank, ProtocolError, WorkerId, WorkerWithDpRank};

/// One (worker, dp rank)'s load as its engine sees it, at the moment the report was taken.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
pub struct WorkerLoadReport {
    /// The reporting worker instance.
    pub worker_id: WorkerId,
    /// The data-parallel rank the figures are for (0 without data parallelism).
    #[serde(default)]
    pub dp_rank: DpRank,
    /// KV cache blocks in use on this rank.
    #[serde(default)]
    pub kv_used_blocks: Option<u64>,
    /// Requests the engine is running (scheduled in its batch).
    #[serde(default)]
    pub requests_running: Option<u64>,
    /// Requests the engine holds in its queue, not yet running.
    #[serde(default)]
    pub requests_waiting: Option<u64>,
    /// KV cache blocks this rank has in all (its capacity), in the same blocks. The router's cost
    /// credits a worker's cached blocks only as far as this capacity lets it keep them. Last,
    /// since bincode writes the fields in order (request-plane protocol version 5).
    #[serde(default)]
    pub kv_total_blocks: Option<u64>,
}

impl Serialize for WorkerLoadReport {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut w = WireStruct::new(serializer, "WorkerLoadReport", 6)?;
        w.field("worker_id", &self.worker_id)?;
        w.field("dp_rank", &self.dp_rank)?;
        w.opt("kv_used_blocks", &self.kv_used_blocks)?;
        w.opt("requests_running", &self.requests_running)?;
        w.opt("requests_waiting", &self.requests_waiting)?;
        w.opt("kv_total_blocks", &self.kv_total_blocks)?;
        w.end()
    }
}

impl WorkerLoadReport {
    /// A report from rank 0 of `worker_id` with nothing in it yet (it does not validate until
    /// a figure is set).
    pub const fn new(worker_id: WorkerId) -> Self {
        Self {
            worker_id,
            dp_rank: 0,
            kv_used_blocks: None,
            kv_total_blocks: None,
            requests_running: None,
            requests_waiting: None,
        }
    }

    /// The same report for rank `dp_rank`.
    pub const fn with_dp_rank(mut self, dp_rank: DpRank) -> Self {
        self.dp_rank = dp_rank;
        self
    }

    /// The same report with `running` requests in the batch and `waiting` in the queue.
    pub const fn with_requests(mut self, running: u64, waiting: u64) -> Self {
        self.requests_running = Some(running);
        self.requests_waiting = Some(waiting);
        self
    }

    /// The same report with `blocks` KV blocks in use.
    pub const fn with_kv_used_blocks(mut self, blocks: u64) -> Self {
        self.kv_used_blocks = Some(blocks);
        self
    }

    /// The same report with a capacity of `blocks` KV blocks in all.
    pub const fn with_kv_total_blocks(mut self, blocks: u64) -> Self {
        self.kv_total_blocks = Some(blocks);
        self
    }

    /// The (worker, dp rank) the report is about.
    pub const fn worker(&self) -> WorkerWithDpRank {
        WorkerWithDpRank::new(self.worker_id, self.dp_rank)
    }

    /// Requests the engine holds, running plus waiting: `None` unless both counts were
    /// reported (or if their sum overflows, which [`Self::validate`] rejects).
    pub fn requests(&self) -> Option<u64> {
        self.requests_running?.checked_add(self.requests_waiting?)
    }

    /// Decodes a report from JSON and validates it.
    pub fn from_json(bytes: &[u8]) -> Result<Self, ProtocolError> {
        let report: Self = crate::from_json(bytes)?;
        report.validate()?;
        Ok(report)
    }

    /// Checks that the report says something (at least one figure), that the request counts
    /// come as a pair, that their sum fits in a `u64`, and that a stated capacity is at least
    /// one block and at least the blocks in use.
    pub fn validate(&self) -> Result<(), ProtocolError> {
        if let Some(total) = self.kv_total_blocks {
            if total == 0 {
                return Err(ProtocolError::invalid(
                    "kv_total_blocks",
                    "at least 1",
                    total,
                ));
            }
            if let Some(used) = self.kv_used_blocks.filter(|&used| used > total) {
                return Err(ProtocolError::invalid(
                    "kv_used_blocks",
                    format!("at most kv_total_blocks ({total})"),
                    used,
                ));
            }
        }
        match (self.requests_running, self.requests_waiting) {
            (None, None) if self.kv_used_blocks.is_none() && self.kv_total_blocks.is_none() => {
                Err(ProtocolError::invalid(
                    "worker load report",
                    "at least one of kv_used_blocks, kv_total_blocks, requests_running + \
                     requests_waiting",
                    "no figure",
                ))
            }
            (None, None) => Ok(()),
            (Some(running), Some(waiting)) => match running.checked_add(waiting) {
                Some(_) => Ok(()),
                None => Err(ProtocolError::invalid(
                    "requests_running + requests_waiting",
                    format!("at most {}", u64::MAX),
                    format!("{running} + {waiting}"),
                )),
            },
            (Some(_), None) => Err(ProtocolError::invalid(
                "requests_waiting",
                "present when requests_running is",
                "nothing",
            )),
            (None, Some(_)) => Err(ProtocolError::invalid(
                "requests_running",
                "present when requests_waiting is",
                "nothing",
            )),
        }
    }
}
