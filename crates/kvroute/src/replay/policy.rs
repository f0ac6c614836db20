//! The policies replay compares: the router core's own policies plus a cost-weight preset of its
//! [`Policy::Kv`], all run by the same [`kvroute_router_core::KvRouterCore`] code.

use std::fmt;

use kvroute_router_core::{Policy, RouterConfig};

/// A routing policy as named on the command line and in reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ReplayPolicy {
    /// [`Policy::RoundRobin`].
    RoundRobin,
    /// [`Policy::Random`].
    Random,
    /// [`Policy::Kv`]: the reference's default cost weights
    /// (`prefill_load_scale = 1`, `overlap_score_credit = 1`).
    Kv,
    /// [`Policy::KvAdaptive`], the default before `kv-locality`: the reference's cost with a
    /// prefill weight that rises from 1 to 8 decode blocks as the fleet's prefill backlog
    /// builds; on a light load it routes exactly as `kv` does.
    KvAdaptive,
    /// [`Policy::KvLocality`], the router's default: prefill weighs 4 decode blocks and a
    /// cached block credits up to 1.5 blocks of prefill, falling with the square of the cached
    /// share (see docs/benchmarks.md, "The default policy against the reference").
    KvLocality,
    /// [`Policy::Kv`] with `prefill_load_scale = 4` and `overlap_score_credit = 2`: an earlier
    /// tuning kept for comparison, not in the default set. `kv-locality` is its successor: the
    /// same scale, a credit of 1.5 and one that falls with the cached share. Its credit exceeds the prefill a hit
    /// saves, so a prefix every request shares pulls all traffic to one worker under light load.
    KvAffinity,
}

impl ReplayPolicy {
    /// Every policy that can be named (the order of the error message's list).
    pub(crate) const ALL: [ReplayPolicy; 6] = [
        ReplayPolicy::RoundRobin,
        ReplayPolicy::Random,
        ReplayPolicy::Kv,
        ReplayPolicy::KvAffinity,
        ReplayPolicy::KvAdaptive,
        ReplayPolicy::KvLocality,
    ];

    /// The policies compared when none is named: the baselines, the reference and the default.
    pub(crate) const DEFAULT: [ReplayPolicy; 4] = [
        ReplayPolicy::RoundRobin,
        ReplayPolicy::Random,
        ReplayPolicy::Kv,
        ReplayPolicy::KvLocality,
    ];

    /// The name on the command line and in reports.
    pub(crate) const fn name(self) -> &'static str {
        match self {
            ReplayPolicy::RoundRobin => "round-robin",
            ReplayPolicy::Random => "random",
            ReplayPolicy::Kv => "kv",
            ReplayPolicy::KvAdaptive => "kv-adaptive",
            ReplayPolicy::KvLocality => "kv-locality",
            ReplayPolicy::KvAffinity => "kv-affinity",
        }
    }

    /// The policy `kvroute serve` (and the router library) uses when none is configured.
    pub(crate) fn serve_default() -> Self {
        match Policy::default() {
            Policy::RoundRobin => ReplayPolicy::RoundRobin,
            Policy::Random => ReplayPolicy::Random,
            Policy::Kv => ReplayPolicy::Kv,
            Policy::KvAdaptive => ReplayPolicy::KvAdaptive,
            Policy::KvLocality => ReplayPolicy::KvLocality,
            // `direct` cannot be a default (it routes nothing by itself); a new default policy
            // must be added here (the test below fails until it is).
            _ => ReplayPolicy::KvLocality,
        }
    }

    /// Parses a name of [`Self::ALL`], or `default`: whatever [`Self::serve_default`] is.
    pub(crate) fn parse(s: &str) -> Result<Self, String> {
        if s == "default" {
            return Ok(Self::serve_default());
        }
        Self::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = Self::ALL.iter().map(|p| p.name()).collect();
                format!(
                    "unknown routing policy {s:?}; expected one of {}, or default (what \
                     `kvroute serve` uses: {})",
                    names.join(", "),
                    Self::serve_default()
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
            ReplayPolicy::KvAdaptive => base.with_policy(Policy::KvAdaptive),
            ReplayPolicy::KvLocality => base.with_policy(Policy::KvLocality),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_names_the_policy_serve_uses() {
        let default = ReplayPolicy::parse("default").unwrap();
        assert_eq!(default, ReplayPolicy::serve_default());
        assert_eq!(
            default.router_config(16).policy,
            RouterConfig::new(16).policy,
            "replay's default runs exactly the router's default policy"
        );
        let error = ReplayPolicy::parse("best").unwrap_err();
        assert!(error.contains("or default"), "{error}");
    }
}
