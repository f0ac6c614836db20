//! The router core's configuration and the per-worker KV mode.

use std::time::Duration;

use kvroute_indexer::ApproxConfig;
use kvroute_scheduler::{CacheHitWeights, SchedulerConfig};
use kvroute_sessions::{DEFAULT_MAX_SESSIONS, WorkerLossMode};

use crate::policy::Policy;

/// Everything [`crate::KvRouterCore`] needs up front.
#[derive(Debug, Clone, PartialEq)]
pub struct RouterConfig {
    /// Load tracking and the cost model; its `block_size` is the router's block size (every
    /// worker of one model shares the engine's page size), and its `cache_hit_weights` the
    /// reference's `host_cache_hit_weight` / `disk_cache_hit_weight` (0.75 / 0.25 by default),
    /// which every policy's cost uses.
    pub scheduler: SchedulerConfig,
    /// How a worker is chosen among the eligible ones.
    pub policy: Policy,
    /// Approximate mode, for workers registered with [`KvMode::Approximate`].
    pub approx: ApproxConfig,
    /// What happens to a session whose bound worker left.
    pub session_loss: WorkerLossMode,
    /// Most sticky sessions held at once.
    pub max_sessions: usize,
    /// A worker's load report older than this is forgotten (its `worker_reported_*` gauges
    /// disappear): the worker stopped reporting. Workers repeat their reports every second by
    /// default (kvroute-runtime's `DEFAULT_REPORT_HEARTBEAT`).
    pub report_ttl: Duration,
    /// How long at most a prompt routed to a worker that publishes KV events counts as cached
    /// there before its events say so (the time of its prefill and of the events' trip): a
    /// burst of requests sharing a new prefix (a document, a system prompt) follows the first
    /// one instead of spreading over the fleet and prefilling it everywhere. The claim ends
    /// sooner when the request's first token (or its end) comes: its engine has published the
    /// blocks by then, and the events are the truth. Zero turns this off.
    pub inflight_ttl: Duration,
}

/// How long a load report is kept without a newer one, unless configured otherwise.
pub const DEFAULT_REPORT_TTL: Duration = Duration::from_secs(10);

/// How long a routed prompt counts as cached on an event worker before its events arrive,
/// unless configured otherwise.
pub const DEFAULT_INFLIGHT_TTL: Duration = Duration::from_secs(10);

impl RouterConfig {
    /// The defaults for engines with `block_size` tokens per KV block: the default policy
    /// ([`Policy::KvLocality`], whose weights are fixed) and the reference's defaults otherwise,
    /// including the cost weights that [`Policy::Kv`] scores with.
    pub fn new(block_size: u32) -> Self {
        Self {
            scheduler: SchedulerConfig::new(block_size),
            policy: Policy::default(),
            approx: ApproxConfig::default(),
            session_loss: WorkerLossMode::Soft,
            max_sessions: DEFAULT_MAX_SESSIONS,
            report_ttl: DEFAULT_REPORT_TTL,
            inflight_ttl: DEFAULT_INFLIGHT_TTL,
        }
    }

    /// The same configuration with `policy`.
    pub fn with_policy(mut self, policy: Policy) -> Self {
        self.policy = policy;
        self
    }

    /// The same configuration with these weights for blocks cached in slower tiers (checked,
    /// 0..=1 each, when the core is built).
    pub fn with_cache_hit_weights(mut self, weights: CacheHitWeights) -> Self {
        self.scheduler.cache_hit_weights = weights;
        self
    }

    /// The router's block size in tokens.
    pub fn block_size(&self) -> u32 {
        self.scheduler.block_size
    }
}

/// How the router learns what a worker caches.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum KvMode {
    /// The worker publishes KV events: its blocks are known exactly from them.
    #[default]
    Events,
    /// The worker publishes nothing: each routing decision is recorded as a prediction that the
    /// request's blocks are cached there, for the configured TTL.
    Approximate,
}
