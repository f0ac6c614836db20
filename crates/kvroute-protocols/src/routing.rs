//! What the router is told about a request beyond its tokens: worker pins and hints (extracted
//! from `nvext` and headers), per-request overrides of the router's configuration, and the phase
//! of serving a decision is for. The client-facing pieces the hints carry (session control, taint
//! constraints) are `nvext`'s, so this module imports from [`crate::nvext`] and never the reverse.

use derive_builder::Builder;
use serde::{Deserialize, Serialize, Serializer};

use crate::nvext::{RoutingConstraints, SessionControl};
use crate::wire::WireStruct;
use crate::{DpRank, WorkerId};

/// Which phase of serving a routing decision is for.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RequestPhase {
    /// The prefill-only phase (disaggregated serving).
    Prefill,
    /// The decode phase (disaggregated serving).
    Decode,
    /// One worker does both phases.
    #[default]
    Aggregated,
}

impl std::fmt::Display for RequestPhase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RequestPhase::Prefill => "prefill",
            RequestPhase::Decode => "decode",
            RequestPhase::Aggregated => "aggregated",
        })
    }
}

/// Routing hints carried on a [`crate::PreprocessedRequest`], extracted from `nvext` and headers.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Builder)]
#[builder(default, setter(strip_option))]
pub struct RoutingHints {
    /// Direct routing to one worker (aggregated mode, or both phases).
    #[serde(default)]
    pub backend_instance_id: Option<WorkerId>,
    /// Pins the prefill phase to this worker.
    #[serde(default)]
    pub prefill_worker_id: Option<WorkerId>,
    /// Pins the decode phase to this worker.
    #[serde(default)]
    pub decode_worker_id: Option<WorkerId>,
    /// Data-parallel rank of the decode (or aggregated) worker.
    #[serde(default)]
    pub dp_rank: Option<DpRank>,
    /// Data-parallel rank of the prefill worker.
    #[serde(default)]
    pub prefill_dp_rank: Option<DpRank>,
    /// Expected number of output tokens (from `agent_hints.osl`).
    #[serde(default)]
    pub expected_output_tokens: Option<u32>,
    /// Queue priority; higher is more important (from `agent_hints.priority`).
    #[serde(default)]
    pub priority: Option<i32>,
    /// LoRA adapter name, for LoRA-aware routing.
    #[serde(default)]
    pub lora_name: Option<String>,
    /// When set, only these workers are considered.
    #[serde(default)]
    pub allowed_worker_ids: Option<Vec<WorkerId>>,
    /// Sticky-session control for this request.
    #[serde(default)]
    pub session_control: Option<SessionControl>,
    /// Taints a worker must carry, or is preferred to carry.
    #[serde(default)]
    pub routing_constraints: Option<RoutingConstraints>,
}

impl RoutingHints {
    /// Whether `phase` has an explicitly pinned worker, in which case session stickiness is
    /// skipped for it (the pin wins). Matches the reference: prefill is pinned by a prefill worker,
    /// a prefill dp rank or a backend instance; decode by a decode worker, a dp rank or a backend
    /// instance; aggregated by a backend instance or a dp rank.
    pub fn is_pinned(&self, phase: RequestPhase) -> bool {
        match phase {
            RequestPhase::Prefill => {
                self.prefill_worker_id.is_some()
                    || self.prefill_dp_rank.is_some()
                    || self.backend_instance_id.is_some()
            }
            RequestPhase::Decode => {
                self.decode_worker_id.is_some()
                    || self.dp_rank.is_some()
                    || self.backend_instance_id.is_some()
            }
            RequestPhase::Aggregated => {
                self.backend_instance_id.is_some() || self.dp_rank.is_some()
            }
        }
    }

    /// The worker pinned for `phase`, if any (a phase-specific pin beats the backend instance).
    pub fn pinned_worker(&self, phase: RequestPhase) -> Option<WorkerId> {
        match phase {
            RequestPhase::Prefill => self.prefill_worker_id.or(self.backend_instance_id),
            RequestPhase::Decode => self.decode_worker_id.or(self.backend_instance_id),
            RequestPhase::Aggregated => self.backend_instance_id,
        }
    }

    /// The data-parallel rank pinned for `phase`, if any.
    pub fn pinned_dp_rank(&self, phase: RequestPhase) -> Option<DpRank> {
        match phase {
            RequestPhase::Prefill => self.prefill_dp_rank,
            RequestPhase::Decode | RequestPhase::Aggregated => self.dp_rank,
        }
    }
}

impl Serialize for RoutingHints {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut w = WireStruct::new(serializer, "RoutingHints", 11)?;
        w.opt("backend_instance_id", &self.backend_instance_id)?;
        w.opt("prefill_worker_id", &self.prefill_worker_id)?;
        w.opt("decode_worker_id", &self.decode_worker_id)?;
        w.opt("dp_rank", &self.dp_rank)?;
        w.opt("prefill_dp_rank", &self.prefill_dp_rank)?;
        w.opt("expected_output_tokens", &self.expected_output_tokens)?;
        w.opt("priority", &self.priority)?;
        w.opt("lora_name", &self.lora_name)?;
        w.opt("allowed_worker_ids", &self.allowed_worker_ids)?;
        w.opt("session_control", &self.session_control)?;
        w.opt("routing_constraints", &self.routing_constraints)?;
        w.end()
    }
}

/// Per-request overrides of the router's configuration; `None` keeps the configured value.
#[derive(Debug, Clone, Copy, Default, PartialEq, Deserialize, Builder)]
#[builder(default, setter(strip_option))]
pub struct RouterConfigOverride {
    /// Credit given to cached prefix blocks in the cost (0.0 ignores the cache). Accepts the
    /// reference's older name `overlap_score_weight`.
    #[serde(default, alias = "overlap_score_weight")]
    pub overlap_score_credit: Option<f64>,
    /// Scale applied to the prefill load after the overlap credit.
    #[serde(default)]
    pub prefill_load_scale: Option<f64>,
    /// Softmax temperature of worker selection (0.0 picks the cheapest).
    #[serde(default)]
    pub router_temperature: Option<f64>,
    /// Whether to assume KV reuse when tracking the request's blocks.
    #[serde(default)]
    pub assume_kv_reuse: Option<bool>,
    /// Whether to count this request's prefill tokens in the worker's load.
    #[serde(default)]
    pub track_prefill_tokens: Option<bool>,
}

impl Serialize for RouterConfigOverride {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut w = WireStruct::new(serializer, "RouterConfigOverride", 5)?;
        w.opt("overlap_score_credit", &self.overlap_score_credit)?;
        w.opt("prefill_load_scale", &self.prefill_load_scale)?;
        w.opt("router_temperature", &self.router_temperature)?;
        w.opt("assume_kv_reuse", &self.assume_kv_reuse)?;
        w.opt("track_prefill_tokens", &self.track_prefill_tokens)?;
        w.end()
    }
}
