//! Selection policies: how a worker is chosen among those that pass the scheduler's filters.

use std::fmt;
use std::str::FromStr;

use kvroute_scheduler::CostWeights;

/// How [`crate::KvRouterCore`] picks a worker. Every policy runs the same filters (allowed
/// workers, pins, dp ranks, taints, busy thresholds) and tracks the same load, so replays
/// compare only the choice.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Policy {
    /// The next eligible worker in turn, ignoring cache and load.
    RoundRobin,
    /// A uniformly random eligible worker.
    Random,
    /// The reference's default cost,
    /// `prefill_load_scale * max(prefill_blocks - overlap_credit * overlap_blocks, 0) + decode_blocks`,
    /// with the configured weights (the reference's, [`CostWeights::reference`], unless changed)
    /// and temperature; blocks continuing the prefix in host or disk tiers add their
    /// `cache_hit_weights` to the credit (every policy that scores does).
    Kv,
    /// The load-adaptive cost (the default): the reference's terms, with a prefill weight that
    /// rises from 1 with no prefill backlog to 8 decode blocks once the eligible workers'
    /// outstanding prefill fills a batch each ([`CostWeights::load_adaptive`]). Light load is
    /// routed as [`Policy::Kv`] routes it; under load, prefill queues and cache hits dominate.
    #[default]
    KvAdaptive,
    /// No selection: the request must name its worker for its phase (a backend instance, a
    /// prefill or decode worker id); without one routing fails with
    /// [`crate::RouteError::NoWorkerId`].
    Direct,
}

impl Policy {
    /// Every policy a replay can compare (all but [`Policy::Direct`]).
    pub const COMPARABLE: [Policy; 4] = [
        Policy::RoundRobin,
        Policy::Random,
        Policy::Kv,
        Policy::KvAdaptive,
    ];

    /// The policy's name on the command line and in reports.
    pub const fn name(self) -> &'static str {
        match self {
            Policy::RoundRobin => "round-robin",
            Policy::Random => "random",
            Policy::Kv => "kv",
            Policy::KvAdaptive => "kv-adaptive",
            Policy::Direct => "direct",
        }
    }

    /// The cost weights this policy scores with instead of the configured ones
    /// (`RouterConfig::scheduler.cost`): [`CostWeights::load_adaptive`] for
    /// [`Policy::KvAdaptive`]; `None` for the others, which use the configured weights (the
    /// reference's unless changed, so [`Policy::Kv`] with tuned `scheduler.cost` is the way to
    /// try other weights). Per-request overrides apply on top either way.
    pub const fn cost_weights(self) -> Option<CostWeights> {
        match self {
            Policy::KvAdaptive => Some(CostWeights::load_adaptive()),
            Policy::RoundRobin | Policy::Random | Policy::Kv | Policy::Direct => None,
        }
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A policy name that is not one of [`Policy`]'s.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "unknown routing policy {0:?}; expected one of round-robin, random, kv, kv-adaptive, direct"
)]
pub struct UnknownPolicy(pub String);

impl FromStr for Policy {
    type Err = UnknownPolicy;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "round-robin" | "round_robin" | "rr" => Ok(Policy::RoundRobin),
            "random" => Ok(Policy::Random),
            "kv" => Ok(Policy::Kv),
            "kv-adaptive" | "kv_adaptive" => Ok(Policy::KvAdaptive),
            "direct" => Ok(Policy::Direct),
            other => Err(UnknownPolicy(other.to_owned())),
        }
    }
}
