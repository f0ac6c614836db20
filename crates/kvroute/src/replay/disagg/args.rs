//! `kvroute replay`'s disaggregation flags: how requests use the --prefill-workers engines.

use anyhow::bail;
use kvroute_router_core::ConditionalDisagg;

/// How a disaggregated replay uses its prefill engines.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum ReplayDisagg {
    /// Every request is prefilled on a prefill engine, then decoded on a decode engine.
    Enforced,
    /// Per request, as `kvroute serve --disagg conditional` decides: prefilled on its decode
    /// engine (served aggregated) when that is cheaper, on a prefill engine otherwise.
    Conditional,
    /// The same engines (prefill and decode) all serve aggregated: the baseline.
    Never,
}

impl ReplayDisagg {
    /// The flag's spelling.
    pub(crate) fn name(self) -> &'static str {
        match self {
            ReplayDisagg::Enforced => "enforced",
            ReplayDisagg::Conditional => "conditional",
            ReplayDisagg::Never => "never",
        }
    }
}

/// The flags, flattened into `ReplayArgs`.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct DisaggArgs {
    /// With --prefill-workers: enforced (every request prefilled on a prefill engine),
    /// conditional (per request: on its decode engine when cheaper, see
    /// --max-local-prefill-tokens) or never (the --prefill-workers and --workers engines all
    /// serve aggregated, to compare with).
    #[arg(long, value_enum, default_value_t = ReplayDisagg::Enforced, value_name = "MODE")]
    pub(crate) disagg: ReplayDisagg,
    /// With --disagg conditional: prefill on the decode engine when at most this many prompt
    /// tokens are uncached there [default: 1000].
    #[arg(long, value_name = "TOKENS")]
    pub(crate) max_local_prefill_tokens: Option<u64>,
    /// With --disagg conditional: prefill on the decode engine when at least this share of the
    /// prompt is cached there; above 1 turns the rule off [default: 0.8].
    #[arg(long, value_name = "SHARE")]
    pub(crate) min_local_cached_share: Option<f64>,
    /// With --disagg conditional: prefill on the decode engine when the prefill engines' queue
    /// is at least this many times the decode engine's [default: 2].
    #[arg(long, value_name = "RATIO")]
    pub(crate) prefill_queue_ratio: Option<f64>,
}

/// The flags checked: the mode and, when conditional, its rule.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum DisaggPlan {
    Enforced,
    Conditional(ConditionalDisagg),
    Never,
}

impl DisaggArgs {
    /// The checked plan; `prefill_workers` says whether --prefill-workers was given.
    pub(crate) fn plan(&self, prefill_workers: bool) -> anyhow::Result<DisaggPlan> {
        let thresholds = self.max_local_prefill_tokens.is_some()
            || self.min_local_cached_share.is_some()
            || self.prefill_queue_ratio.is_some();
        if thresholds && self.disagg != ReplayDisagg::Conditional {
            bail!(
                "--max-local-prefill-tokens, --min-local-cached-share and --prefill-queue-ratio \
                 apply to --disagg conditional only, got --disagg {}",
                self.disagg.name()
            );
        }
        if !prefill_workers && self.disagg != ReplayDisagg::Enforced {
            bail!(
                "--disagg {} needs --prefill-workers N (the prefill engines it places \
                 prefills on)",
                self.disagg.name()
            );
        }
        Ok(match self.disagg {
            ReplayDisagg::Enforced => DisaggPlan::Enforced,
            ReplayDisagg::Never => DisaggPlan::Never,
            ReplayDisagg::Conditional => {
                let d = ConditionalDisagg::default();
                let rule = ConditionalDisagg {
                    max_local_prefill_tokens: self
                        .max_local_prefill_tokens
                        .unwrap_or(d.max_local_prefill_tokens),
                    min_local_cached_share: self
                        .min_local_cached_share
                        .unwrap_or(d.min_local_cached_share),
                    prefill_queue_ratio: self.prefill_queue_ratio.unwrap_or(d.prefill_queue_ratio),
                };
                DisaggPlan::Conditional(rule.validated()?)
            }
        })
    }
}
