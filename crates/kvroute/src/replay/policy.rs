//! The policies replay compares: the router core's own policies plus cost-weight presets of its
//! [`Policy::Kv`], all run by the same [`kvroute_router::KvRouterCore`] code.

use std::fmt;

use kvroute_router::{Policy, RouterConfig};

/// A routing policy as named on the command line and in reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ReplayPolicy {
    /// [`Policy::RoundRobin`].
    RoundRobin,
    /// [`Policy::Random`].
    Random,
    /// [`Policy::Kv`] with the reference's default cost weights
    /// (`prefill_load_scale = 1`, `overlap_score_credit = 1`).
    Kv,
    /// [`Policy::Kv`] with `prefill_load_scale = 4` and `overlap_score_credit = 2`: prefill work
    /// (what TTFT waits for) weighs four times a decode block, and a cached block counts double,
    /// once for the prefill it saves now and once for keeping the conversation where its next
    /// turn will hit. On the Mooncake conversation trace it beats the reference weights on hit
    /// rate and on TTFT p50 and p99, at 1x and 2x speed (see docs/benchmarks.md).
    KvAffinity,
}

impl ReplayPolicy {
    /// Every policy, in table order; also the default set.
    pub(crate) const ALL: [ReplayPolicy; 4] = [
        ReplayPolicy::RoundRobin,
        ReplayPolicy::Random,
        ReplayPolicy::Kv,
        ReplayPolicy::KvAffinity,
    ];

    /// The name on the command line and in reports.
    pub(crate) const fn name(self) -> &'static str {
        match self {
            ReplayPolicy::RoundRobin => "round-robin",
            ReplayPolicy::Random => "random",
            ReplayPolicy::Kv => "kv",
            ReplayPolicy::KvAffinity => "kv-affinity",
        }
    }

    /// Parses a name of [`Self::ALL`].
    pub(crate) fn parse(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = Self::ALL.iter().map(|p| p.name()).collect();
                format!(
                    "unknown routing policy {s:?}; expected one of {}",
                    names.join(", ")
                )
            })
    }

    /// The router configuration that implements this policy for `block_size`-token blocks.
    pub(crate) fn router_config(self, block_size: u32) -> RouterConfig {
        let base = RouterConfig::new(block_size);
        match self {
            ReplayPolicy::RoundRobin => base.with_policy(Policy::RoundRobin),
            ReplayPolicy::Random => base.with_policy(Policy::Random),
            ReplayPolicy::Kv => base.with_policy(Policy::Kv),
            ReplayPolicy::KvAffinity => {
                let mut config = base.with_policy(Policy::Kv);
                config.scheduler.cost.prefill_load_scale = 4.0;
                config.scheduler.cost.overlap_credit = 2.0;
                config
            }
        }
    }
}

impl fmt::Display for ReplayPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
