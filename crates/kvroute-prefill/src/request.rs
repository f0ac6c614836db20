//! The pure part of the prefill router: how the prefill and decode requests are derived from the
//! client's request, and how a prefill worker's answer becomes a [`PrefillResult`].

use kvroute_protocols::{
    Annotated, BootstrapInfo, FinishReason, LLMEngineOutput, PrefillResult, PreprocessedRequest,
    PromptTokensDetails, RouterConfigOverride, RoutingConstraints, WorkerId, WorkerWithDpRank,
};

use crate::config::TopologyMode;
use crate::error::PrefillError;

/// What the decode worker is given to find the prefilled KV.
#[derive(Debug, Clone, PartialEq)]
pub enum Handoff {
    /// Meet the prefill worker at this bootstrap room (prefill runs concurrently).
    Bootstrap(BootstrapInfo),
    /// The finished prefill's transfer parameters.
    Result(PrefillResult),
}

/// The prefill-phase request: exactly one output token, pinned to `target` when known, carrying
/// the bootstrap room when the bootstrap path is taken.
///
/// The backend instance pin is cleared: it names the decode (or aggregated) worker, and would
/// otherwise pin the prefill phase to a worker that does not prefill.
pub fn prefill_request(
    request: &PreprocessedRequest,
    target: Option<WorkerWithDpRank>,
    bootstrap: Option<BootstrapInfo>,
) -> PreprocessedRequest {
    let mut prefill = request.clone();
    prefill.stop_conditions.max_tokens = Some(1);
    // A minimum above one would make the prefill worker decode.
    prefill.stop_conditions.min_tokens = None;
    prefill.prefill_result = None;
    prefill.bootstrap_info = bootstrap;
    if let Some(routing) = prefill.routing.as_mut() {
        routing.backend_instance_id = None;
    }
    if let Some(target) = target {
        let routing = prefill.routing_mut();
        routing.prefill_worker_id = Some(target.worker_id);
        routing.prefill_dp_rank = Some(target.dp_rank);
    }
    prefill
}

/// The overrides every decode-phase routing decision uses: the prompt's KV arrives from the
/// prefill worker, so cached overlap earns no credit, no reuse is assumed, and the prompt is not
/// counted as prefill load. Values the client set for other fields are kept.
pub fn decode_override(existing: Option<RouterConfigOverride>) -> RouterConfigOverride {
    RouterConfigOverride {
        overlap_score_credit: Some(0.0),
        assume_kv_reuse: Some(false),
        track_prefill_tokens: Some(false),
        ..existing.unwrap_or_default()
    }
}

/// The decode-phase request: the client's request (its own `max_tokens`) plus the handoff, the
/// decode overrides, and the prefill worker's topology taints merged into its constraints.
/// Without a handoff (a routing query) only the routing changes are made.
pub fn decode_request(
    mut request: PreprocessedRequest,
    handoff: Option<Handoff>,
    topology: Option<(&[String], TopologyMode)>,
) -> PreprocessedRequest {
    match handoff {
        Some(Handoff::Bootstrap(info)) => {
            request.bootstrap_info = Some(info);
            request.prefill_result = None;
        }
        Some(Handoff::Result(result)) => {
            request.prefill_result = Some(result);
            request.bootstrap_info = None;
        }
        None => {}
    }
    request.router_config_override = Some(decode_override(request.router_config_override));
    if let Some((taints, mode)) = topology
        && !taints.is_empty()
    {
        let routing = request.routing_mut();
        let merged = merge_constraints(routing.routing_constraints.take(), taints, mode);
        routing.routing_constraints = Some(merged);
    }
    request
}

/// `existing` constraints plus `taints`: required taints are added once; a preferred taint keeps
/// the larger of the client's weight and the topology's.
pub fn merge_constraints(
    existing: Option<RoutingConstraints>,
    taints: &[String],
    mode: TopologyMode,
) -> RoutingConstraints {
    let mut merged = existing.unwrap_or_default();
    for taint in taints {
        match mode {
            TopologyMode::Require => {
                if !merged.required_taints.contains(taint) {
                    merged.required_taints.push(taint.clone());
                }
            }
            TopologyMode::Prefer { weight } => {
                let entry = merged
                    .preferred_taints
                    .entry(taint.clone())
                    .or_insert(weight);
                *entry = entry.max(weight);
            }
        }
    }
    merged
}

/// Reads a prefill worker's response stream item by item and turns it into a [`PrefillResult`].
///
/// The first data or error item decides: an error (item or finish reason) fails the prefill,
/// data without `disaggregated_params` has nothing to hand over. Prompt token details are taken
/// from the first item that reports usage, since engines usually report it on the last item.
#[derive(Debug)]
pub struct PrefillCollector {
    worker_id: WorkerId,
    first: Option<Result<serde_json::Value, PrefillError>>,
    details: Option<PromptTokensDetails>,
}

impl PrefillCollector {
    /// A collector for the answer of prefill worker `worker_id`.
    pub fn new(worker_id: WorkerId) -> Self {
        Self {
            worker_id,
            first: None,
            details: None,
        }
    }

    /// Takes one item of the stream.
    pub fn push(&mut self, item: Annotated<LLMEngineOutput>) {
        if self.details.is_none() {
            self.details = item
                .data
                .as_ref()
                .and_then(|d| d.completion_usage)
                .and_then(|u| u.prompt_tokens_details);
        }
        if self.first.is_some() {
            return;
        }
        let failed = |message: String| PrefillError::PrefillFailed {
            worker_id: self.worker_id,
            message,
        };
        if item.is_error() {
            let message = item
                .error_message()
                .unwrap_or("error item without a message");
            self.first = Some(Err(failed(message.to_owned())));
            return;
        }
        let Some(data) = item.data else {
            // Annotation events carry no output; keep waiting for the first real item.
            return;
        };
        self.first = Some(match (data.disaggregated_params, data.finish_reason) {
            (_, Some(FinishReason::Error(message))) => Err(failed(message)),
            (_, Some(FinishReason::Cancelled)) => Err(failed("the prefill was cancelled".into())),
            (Some(params), _) => Ok(params),
            (None, _) => Err(PrefillError::NoDisaggregatedParams {
                worker_id: self.worker_id,
            }),
        });
    }

    /// Whether the deciding item has been seen.
    pub fn decided(&self) -> bool {
        self.first.is_some()
    }

    /// The result once the stream has ended.
    pub fn finish(self) -> Result<PrefillResult, PrefillError> {
        let params = self.first.unwrap_or_else(|| {
            Err(PrefillError::PrefillFailed {
                worker_id: self.worker_id,
                message: "the response stream ended without any output".to_owned(),
            })
        })?;
        Ok(PrefillResult {
            disaggregated_params: params,
            prompt_tokens_details: self.details,
        })
    }
}
