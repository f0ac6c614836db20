//! The policies replay compares: the router core's own policies plus a cost-weight preset of its
//! [`Policy::Kv`], all run by the same [`kvroute_router_core::KvRouterCore`] code.

use std::fmt;

use kvroute_router_core::{CostTuning, Policy, RouterConfig};

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
    /// [`Policy::KvLocality`], the router's default: prefill weighs 4 decode blocks (8 under a
    /// full prefill backlog) and a cached block credits up to 1.5 blocks of prefill, falling
    /// with the square of the cached share (see docs/benchmarks.md, "The default policy against the reference").
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

    /// The router configuration that implements this policy for `block_size`-token blocks;
    /// `kv` scores with `weights` where given.
    pub(crate) fn router_config(self, block_size: u32, weights: &CostTuning) -> RouterConfig {
        let base = RouterConfig::new(block_size);
        match self {
            ReplayPolicy::RoundRobin => base.with_policy(Policy::RoundRobin),
            ReplayPolicy::Random => base.with_policy(Policy::Random),
            ReplayPolicy::Kv => {
                let mut config = base.with_policy(Policy::Kv);
                config.scheduler.cost = config.scheduler.cost.with_tuning(weights);
                config
            }
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

/// Checks policy `kv`'s cost weights given on the command line (`None` keeps the reference's;
/// `kvroute serve --policy kv` takes the same): each finite and at least 0, a balanced decode
/// weight at most 1, and policy kv among `policies`, since no other policy would read them.
/// `kv-locality` is `kv` with an overlap credit of 1.5, a prefill load scale of 4 rising to 8
/// under backlog, a cached share exponent of 2, a balanced decode weight of 0.25 within a
/// decode tolerance of 1, and the capacity credit on.
pub(crate) fn validate_kv_weights(
    weights: &CostTuning,
    policies: &[ReplayPolicy],
) -> anyhow::Result<()> {
    let given = [
        ("--overlap-credit", weights.overlap_credit),
        ("--prefill-load-scale", weights.prefill_load_scale),
        (
            "--loaded-prefill-load-scale",
            weights.loaded_prefill_load_scale,
        ),
        ("--cached-share-exponent", weights.cached_share_exponent),
        ("--balanced-decode-weight", weights.balanced_decode_weight),
        ("--decode-tolerance", weights.decode_tolerance),
        ("--eviction-weight", weights.eviction_weight),
        ("--churn-eviction-weight", weights.churn_eviction_weight),
        ("--occupancy-weight", weights.occupancy_weight),
    ];
    if weights.capacity_credit.is_some() && !policies.contains(&ReplayPolicy::Kv) {
        anyhow::bail!(
            "--capacity-credit sets a weight of policy kv, which is not replayed: add --policy \
             kv (the other policies score with fixed weights)"
        );
    }
    for (flag, value) in given {
        let Some(v) = value else { continue };
        if !(v.is_finite() && v >= 0.0) {
            anyhow::bail!("{flag} must be a finite number >= 0, got {v}");
        }
        if flag == "--balanced-decode-weight" && v > 1.0 {
            anyhow::bail!("{flag} must be at most 1 (the weight of an unbalanced block), got {v}");
        }
        if !policies.contains(&ReplayPolicy::Kv) {
            anyhow::bail!(
                "{flag} sets a weight of policy kv, which is not replayed: add --policy kv \
                 (the other policies score with fixed weights)"
            );
        }
    }
    Ok(())
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
            default.router_config(16, &CostTuning::default()).policy,
            RouterConfig::new(16).policy,
            "replay's default runs exactly the router's default policy"
        );
        let error = ReplayPolicy::parse("best").unwrap_err();
        assert!(error.contains("or default"), "{error}");
    }

    #[test]
    fn kv_with_kv_localitys_weights_scores_as_kv_locality() {
        let weights = CostTuning {
            overlap_credit: Some(1.5),
            prefill_load_scale: Some(4.0),
            loaded_prefill_load_scale: Some(8.0),
            cached_share_exponent: Some(2.0),
            balanced_decode_weight: Some(0.25),
            decode_tolerance: Some(1.0),
            capacity_credit: Some(true),
            eviction_weight: Some(1.0),
            churn_eviction_weight: Some(0.0),
            occupancy_weight: Some(0.0),
        };
        let kv = ReplayPolicy::Kv.router_config(16, &weights);
        let locality = ReplayPolicy::KvLocality.router_config(16, &weights);
        assert_eq!(Some(kv.scheduler.cost), locality.policy.cost_weights());
        // Without weights kv keeps the reference's; the presets ignore them.
        let plain = ReplayPolicy::Kv.router_config(16, &CostTuning::default());
        assert_eq!(plain.scheduler.cost.prefill_load_scale, 1.0);
        assert_eq!(locality.scheduler.cost, plain.scheduler.cost);
        let error = validate_kv_weights(&weights, &[ReplayPolicy::KvLocality]).unwrap_err();
        assert!(error.to_string().contains("add --policy kv"), "{error}");
        assert!(validate_kv_weights(&weights, &[ReplayPolicy::Kv]).is_ok());
        let negative = CostTuning {
            prefill_load_scale: Some(-1.0),
            ..CostTuning::default()
        };
        let error = validate_kv_weights(&negative, &[ReplayPolicy::Kv]).unwrap_err();
        assert!(
            error.to_string().contains("--prefill-load-scale must be"),
            "{error}"
        );
        let capacity = CostTuning {
            capacity_credit: Some(false),
            ..CostTuning::default()
        };
        let error = validate_kv_weights(&capacity, &[ReplayPolicy::KvLocality]).unwrap_err();
        assert!(error.to_string().contains("--capacity-credit"), "{error}");
        let kv = ReplayPolicy::Kv.router_config(
            16,
            &CostTuning {
                capacity_credit: Some(true),
                ..CostTuning::default()
            },
        );
        assert!(kv.scheduler.cost.capacity_credit && !plain.scheduler.cost.capacity_credit);
    }

    #[test]
    fn a_loaded_scale_sets_only_the_backlogged_end_of_the_range() {
        let weights = CostTuning {
            prefill_load_scale: Some(4.0),
            loaded_prefill_load_scale: Some(16.0),
            ..CostTuning::default()
        };
        let cost = ReplayPolicy::Kv.router_config(16, &weights).scheduler.cost;
        assert_eq!(
            (cost.prefill_load_scale, cost.loaded_prefill_load_scale),
            (4.0, 16.0)
        );
        assert_eq!(cost.prefill_scale_at(0.5), 10.0);
        let nan = CostTuning {
            loaded_prefill_load_scale: Some(f64::NAN),
            ..CostTuning::default()
        };
        let error = validate_kv_weights(&nan, &[ReplayPolicy::Kv]).unwrap_err();
        assert!(
            error
                .to_string()
                .contains("--loaded-prefill-load-scale must be"),
            "{error}"
        );
    }
}
