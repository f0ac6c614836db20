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
    /// The load-adaptive cost: the reference's terms, with a prefill weight that rises from 1
    /// with no prefill backlog to 8 decode blocks once the eligible workers' outstanding
    /// prefill fills a batch each ([`CostWeights::load_adaptive`]). Light load is routed as
    /// [`Policy::Kv`] routes it; under load, prefill queues and cache hits dominate. The default
    /// before [`Policy::KvLocality`].
    KvAdaptive,
    /// The locality cost (the default): the reference's terms with prefill weighing 4 decode
    /// blocks (8 once the fleet's prefill backlog fills a batch on every worker), a decode
    /// block weighing a quarter while the worker's decode load is within twice the eligible
    /// workers' mean, and a cached block crediting up to 1.5 blocks of prefill, falling with
    /// the square of the prompt's cached share ([`CostWeights::locality`]): a long context
    /// stays with its cache, a burst for one prefix queues behind it, small differences in
    /// decode load do not move a prompt off its cache, while a preamble shared by every request
    /// does not pull traffic onto one worker and a worker decoding far more than the rest is
    /// spread.
    #[default]
    KvLocality,
    /// No selection: the request must name its worker for its phase (a backend instance, a
    /// prefill or decode worker id); without one routing fails with
    /// [`crate::RouteError::NoWorkerId`].
    Direct,
}

impl Policy {
    /// Every policy a replay can compare (all but [`Policy::Direct`]).
    pub const COMPARABLE: [Policy; 5] = [
        Policy::RoundRobin,
        Policy::Random,
        Policy::Kv,
        Policy::KvAdaptive,
        Policy::KvLocality,
    ];

    /// The policy's name on the command line and in reports.
    pub const fn name(self) -> &'static str {
        match self {
            Policy::RoundRobin => "round-robin",
            Policy::Random => "random",
            Policy::Kv => "kv",
            Policy::KvAdaptive => "kv-adaptive",
            Policy::KvLocality => "kv-locality",
            Policy::Direct => "direct",
        }
    }

    /// The cost weights this policy scores with instead of the configured ones
    /// (`RouterConfig::scheduler.cost`): [`CostWeights::load_adaptive`] for
    /// [`Policy::KvAdaptive`], [`CostWeights::locality`] for [`Policy::KvLocality`]; `None` for
    /// the others, which use the configured weights (the
    /// reference's unless changed, so [`Policy::Kv`] with tuned `scheduler.cost` is the way to
    /// try other weights). Per-request overrides apply on top either way.
    pub const fn cost_weights(self) -> Option<CostWeights> {
        match self {
            Policy::KvAdaptive => Some(CostWeights::load_adaptive()),
            Policy::KvLocality => Some(CostWeights::locality()),
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
    "unknown routing policy {0:?}; expected one of round-robin, random, kv, kv-adaptive, kv-locality, direct"
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
            "kv-locality" | "kv_locality" => Ok(Policy::KvLocality),
            "direct" => Ok(Policy::Direct),
            other => Err(UnknownPolicy(other.to_owned())),
        }
    }
}
