//! The `nvext` extension of OpenAI requests and responses, wire-compatible with NVIDIA Dynamo.
//!
//! Every optional field is omitted from JSON when `None` (so responses look exactly like the
//! reference's) and unknown JSON fields are ignored (so newer clients keep working). See
//! [`crate::codec`] for how the same types also round-trip through bincode.

use std::collections::BTreeMap;

use derive_builder::Builder;
use serde::{Deserialize, Serialize, Serializer};

use crate::wire::WireStruct;
use crate::{DpRank, WorkerId};

/// Default session inactivity timeout, in seconds.
pub const DEFAULT_SESSION_TIMEOUT_SECS: u64 = 300;

/// NVIDIA extensions to an OpenAI request (`"nvext": {...}` in the request body).
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Builder)]
#[builder(default, setter(strip_option))]
pub struct NvExt {
    /// Forces greedy sampling; the backend picks its own options to implement it.
    #[serde(default)]
    pub greed_sampling: Option<bool>,

    /// Bypasses the prompt template and tokenizes the prompt as given.
    #[serde(default)]
    pub use_raw_prompt: Option<bool>,

    /// Requested out-of-band annotations, returned as SSE `event:` entries
    /// (e.g. `query_instance_id:` for a routing-only query).
    #[serde(default)]
    pub annotations: Option<Vec<String>>,

    /// Routes the request to this worker instance instead of letting the router choose.
    #[serde(default)]
    pub backend_instance_id: Option<WorkerId>,

    /// Pre-tokenized prompt used instead of tokenizing the text.
    #[serde(default)]
    pub token_data: Option<Vec<u32>>,

    /// Maximum number of thinking tokens (passed through to backends).
    #[serde(default)]
    pub max_thinking_tokens: Option<u32>,

    /// Names of `NvExtResponse` fields to populate in the response (`"worker_id"`, `"timing"`).
    #[serde(default)]
    pub extra_fields: Option<Vec<String>>,

    /// Pins the prefill phase to this worker (disaggregated serving).
    #[serde(default)]
    pub prefill_worker_id: Option<WorkerId>,

    /// Pins the decode phase to this worker (disaggregated serving).
    #[serde(default)]
    pub decode_worker_id: Option<WorkerId>,

    /// Data-parallel rank of the decode (or aggregated) worker.
    #[serde(default)]
    pub dp_rank: Option<DpRank>,

    /// Data-parallel rank of the prefill worker.
    #[serde(default)]
    pub prefill_dp_rank: Option<DpRank>,

    /// Caller hints about the request (priority, expected output length, ...).
    #[serde(default)]
    pub agent_hints: Option<AgentHints>,

    /// Request timestamp in milliseconds, for trace replay in virtual time.
    #[serde(default)]
    pub request_timestamp_ms: Option<f64>,

    /// Sticky-session control: the session id and its lifecycle action.
    #[serde(default)]
    pub session_control: Option<SessionControl>,

    /// Taints a worker must carry, or is preferred to carry.
    #[serde(default)]
    pub routing_constraints: Option<RoutingConstraints>,
}

impl NvExt {
    /// A builder with every field unset.
    pub fn builder() -> NvExtBuilder {
        NvExtBuilder::default()
    }

    /// Whether the request carries a `query_instance_id:` annotation (a routing-only query).
    pub fn has_query_instance_id_annotation(&self) -> bool {
        self.annotations
            .as_ref()
            .is_some_and(|a| a.iter().any(|s| s.starts_with("query_instance_id:")))
    }

    /// Whether the client asked for `field` in the response's nvext (via `extra_fields`).
    pub fn wants_extra_field(&self, field: &str) -> bool {
        self.extra_fields
            .as_ref()
            .is_some_and(|f| f.iter().any(|s| s == field))
    }
}

impl Serialize for NvExt {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut w = WireStruct::new(serializer, "NvExt", 15)?;
        w.opt("greed_sampling", &self.greed_sampling)?;
        w.opt("use_raw_prompt", &self.use_raw_prompt)?;
        w.opt("annotations", &self.annotations)?;
        w.opt("backend_instance_id", &self.backend_instance_id)?;
        w.opt("token_data", &self.token_data)?;
        w.opt("max_thinking_tokens", &self.max_thinking_tokens)?;
        w.opt("extra_fields", &self.extra_fields)?;
        w.opt("prefill_worker_id", &self.prefill_worker_id)?;
        w.opt("decode_worker_id", &self.decode_worker_id)?;
        w.opt("dp_rank", &self.dp_rank)?;
        w.opt("prefill_dp_rank", &self.prefill_dp_rank)?;
        w.opt("agent_hints", &self.agent_hints)?;
        w.opt("request_timestamp_ms", &self.request_timestamp_ms)?;
        w.opt("session_control", &self.session_control)?;
        w.opt("routing_constraints", &self.routing_constraints)?;
        w.end()
    }
}

/// Hints from the caller about the request's characteristics.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Builder)]
#[builder(default, setter(strip_option))]
pub struct AgentHints {
    /// Request priority; higher is more important (router queue ordering).
    #[serde(default)]
    pub priority: Option<i32>,

    /// Expected output sequence length, in tokens.
    #[serde(default)]
    pub osl: Option<u32>,

    /// Speculatively prefill the predicted next-turn prefix after this turn completes.
    #[serde(default)]
    pub speculative_prefill: Option<bool>,

    /// Deprecated alias for router-only priority, kept for older callers.
    #[serde(default)]
    pub latency_sensitivity: Option<f64>,
}

impl Serialize for AgentHints {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut w = WireStruct::new(serializer, "AgentHints", 4)?;
        w.opt("priority", &self.priority)?;
        w.opt("osl", &self.osl)?;
        w.opt("speculative_prefill", &self.speculative_prefill)?;
        w.opt("latency_sensitivity", &self.latency_sensitivity)?;
        w.end()
    }
}

/// Sticky-session control for subagent KV isolation.
///
/// `session_id` is present on every turn; `action` is `open` on the first turn, `close` on the
/// last, `bind` to attach an existing engine session, and omitted on intermediate turns.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct SessionControl {
    /// The session identifier (1..=256 bytes, see [`crate::validate`]).
    pub session_id: String,

    /// Lifecycle action; `None` on intermediate turns.
    #[serde(default)]
    pub action: Option<SessionAction>,

    /// Inactivity timeout in seconds (default 300; meaningful with `open`).
    #[serde(default = "default_session_timeout")]
    pub timeout: u64,
}

fn default_session_timeout() -> u64 {
    DEFAULT_SESSION_TIMEOUT_SECS
}

impl SessionControl {
    /// An intermediate-turn control (no action, default timeout).
    pub fn new(session_id: impl Into<String>) -> Self {
        Self {
            session_id: session_id.into(),
            action: None,
            timeout: DEFAULT_SESSION_TIMEOUT_SECS,
        }
    }

    /// The same control carrying `action`.
    pub fn with_action(mut self, action: SessionAction) -> Self {
        self.action = Some(action);
        self
    }

    /// The same control with a timeout of `secs` seconds.
    pub fn with_timeout(mut self, secs: u64) -> Self {
        self.timeout = secs;
        self
    }
}

impl Serialize for SessionControl {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut w = WireStruct::new(serializer, "SessionControl", 3)?;
        w.field("session_id", &self.session_id)?;
        w.opt("action", &self.action)?;
        w.field("timeout", &self.timeout)?;
        w.end()
    }
}

/// Session lifecycle actions, lowercase on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SessionAction {
    /// Create a session on the worker (first turn).
    Open,
    /// Attach to a session the engine already holds.
    Bind,
    /// Free the session's KV after this turn (last turn).
    Close,
}

impl SessionAction {
    /// Every action, in wire order.
    pub const ALL: [SessionAction; 3] = [
        SessionAction::Open,
        SessionAction::Bind,
        SessionAction::Close,
    ];

    /// The lowercase wire name.
    pub const fn as_str(self) -> &'static str {
        match self {
            SessionAction::Open => "open",
            SessionAction::Bind => "bind",
            SessionAction::Close => "close",
        }
    }
}

impl std::fmt::Display for SessionAction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// NVIDIA extensions to an OpenAI response (`"nvext": {...}` in a response chunk).
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct NvExtResponse {
    /// The workers that served the request (when `extra_fields` asks for `worker_id`).
    #[serde(default)]
    pub worker_id: Option<WorkerIdInfo>,

    /// Per-request timing (when `extra_fields` asks for `timing`; final chunk only).
    #[serde(default)]
    pub timing: Option<TimingInfo>,

    /// The tokenized prompt, returned by a routing-only query for reuse in a second stage.
    #[serde(default)]
    pub token_ids: Option<Vec<u32>>,
}

impl Serialize for NvExtResponse {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut w = WireStruct::new(serializer, "NvExtResponse", 3)?;
        w.opt("worker_id", &self.worker_id)?;
        w.opt("timing", &self.timing)?;
        w.opt("token_ids", &self.token_ids)?;
        w.end()
    }
}

/// Which workers (and data-parallel ranks) served a request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
pub struct WorkerIdInfo {
    /// The prefill worker (the only worker in aggregated mode as well).
    #[serde(default)]
    pub prefill_worker_id: Option<WorkerId>,
    /// The prefill worker's data-parallel rank.
    #[serde(default)]
    pub prefill_dp_rank: Option<DpRank>,
    /// The decode worker.
    #[serde(default)]
    pub decode_worker_id: Option<WorkerId>,
    /// The decode worker's data-parallel rank.
    #[serde(default)]
    pub decode_dp_rank: Option<DpRank>,
}

impl Serialize for WorkerIdInfo {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut w = WireStruct::new(serializer, "WorkerIdInfo", 4)?;
        w.opt("prefill_worker_id", &self.prefill_worker_id)?;
        w.opt("prefill_dp_rank", &self.prefill_dp_rank)?;
        w.opt("decode_worker_id", &self.decode_worker_id)?;
        w.opt("decode_dp_rank", &self.decode_dp_rank)?;
        w.end()
    }
}

/// Per-request timing, in milliseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Deserialize)]
pub struct TimingInfo {
    /// When the request was received (wall clock, milliseconds since the Unix epoch).
    #[serde(default)]
    pub request_received_ms: Option<u64>,
    /// Time from receipt to the start of prefill (queueing).
    #[serde(default)]
    pub prefill_wait_time_ms: Option<f64>,
    /// Time from the start of prefill to the first token.
    #[serde(default)]
    pub prefill_time_ms: Option<f64>,
    /// Time from receipt to the first token.
    #[serde(default)]
    pub ttft_ms: Option<f64>,
    /// Time from receipt to the last token.
    #[serde(default)]
    pub total_time_ms: Option<f64>,
    /// Average inter-token latency.
    #[serde(default)]
    pub avg_itl_ms: Option<f64>,
    /// Fraction of prompt blocks found in the chosen worker's cache (0.0..=1.0).
    #[serde(default)]
    pub kv_hit_rate: Option<f64>,
}

impl Serialize for TimingInfo {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut w = WireStruct::new(serializer, "TimingInfo", 7)?;
        w.opt("request_received_ms", &self.request_received_ms)?;
        w.opt("prefill_wait_time_ms", &self.prefill_wait_time_ms)?;
        w.opt("prefill_time_ms", &self.prefill_time_ms)?;
        w.opt("ttft_ms", &self.ttft_ms)?;
        w.opt("total_time_ms", &self.total_time_ms)?;
        w.opt("avg_itl_ms", &self.avg_itl_ms)?;
        w.opt("kv_hit_rate", &self.kv_hit_rate)?;
        w.end()
    }
}

/// Request-level taint constraints (`nvext.routing_constraints`).
///
/// As in the reference, `preferred_taints` maps a taint to a preference weight (a worker carrying
/// it is favoured by that much), while `required_taints` filters workers outright.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct RoutingConstraints {
    /// Taints a worker must carry to be eligible.
    #[serde(default)]
    pub required_taints: Vec<String>,
    /// Taints a worker is preferred to carry, with their weights.
    #[serde(default)]
    pub preferred_taints: BTreeMap<String, f32>,
}

impl RoutingConstraints {
    /// Whether there is nothing to enforce or prefer.
    pub fn is_empty(&self) -> bool {
        self.required_taints.is_empty() && self.preferred_taints.is_empty()
    }
}

impl Serialize for RoutingConstraints {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut w = WireStruct::new(serializer, "RoutingConstraints", 2)?;
        w.skip_if(
            "required_taints",
            &self.required_taints,
            self.required_taints.is_empty(),
        )?;
        w.skip_if(
            "preferred_taints",
            &self.preferred_taints,
            self.preferred_taints.is_empty(),
        )?;
        w.end()
    }
}
