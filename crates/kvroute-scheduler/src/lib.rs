//! The scheduler core of kvroute: per-(worker, dp rank) active load, the routing cost model,
//! eligibility filters, worker selection with temperature, and the admission queue.
//!
//! Entry types: [`Scheduler`] (register workers with [`WorkerSpec`], [`Scheduler::select`] a
//! worker for a [`SelectRequest`], then track the request with [`Scheduler::add_request`],
//! [`Scheduler::mark_prefill_completed`], [`Scheduler::add_output_tokens`], [`Scheduler::free`]
//! and [`Scheduler::expire`], holding it against what a worker reports with
//! [`Scheduler::reconcile_reported`]) and [`AdmissionQueue`]. The cost has three presets of
//! [`CostWeights`]: [`CostWeights::reference`], the reference's default;
//! [`CostWeights::locality`], which weighs prefill and a prompt's own cache above decode load
//! (the router's default policy); and [`CostWeights::load_adaptive`], whose prefill weight rises
//! with the fleet's prefill backlog.
//!
//! It is a synchronous, deterministic core: time (`now` as a [`std::time::Duration`] since any
//! fixed epoch) and randomness (any [`rand::Rng`]) come in as arguments. It must not depend on
//! tokio, the network, or the indexer: overlap scores arrive as a plain slice of
//! `(WorkerWithDpRank, blocks)` that the router fills from the indexer, and blocks in slower
//! storage tiers (host, disk) as [`TierOverlap`]s, credited by the [`CacheHitWeights`].

mod config;
mod decision;
mod fxhash;
mod load;
mod queue;
mod scheduler;
mod scratch;
mod select;
mod slot_load;
mod workers;

pub use config::{
    CacheHitWeights, ConfigError, CostTuning, CostWeights, DEFAULT_BATCH_BUDGET_TOKENS,
    DEFAULT_REPORT_GRACE, DEFAULT_REQUEST_EXPIRY, LoadThresholds, PrefillThreshold,
    SchedulerConfig,
};
pub use decision::{CandidateCost, Decision, FilterStage, SelectError, SelectRequest, TierOverlap};
pub use load::{LoadError, NewRequest, RequestId, RequestLoad};
pub use queue::{AdmissionQueue, QueueMeta, QueuePolicy, TryPushError};
pub use scheduler::{MetricsSnapshot, Scheduler, SchedulerMetrics};
pub use slot_load::WorkerLoad;
pub use workers::{MAX_TAINTS, WorkerError, WorkerSpec};

#[cfg(test)]
mod tests;
