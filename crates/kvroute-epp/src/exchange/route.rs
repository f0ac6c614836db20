//! Choosing the destination: prepare the OpenAI body as the HTTP frontend does, admit it, and
//! pick among the endpoints the data plane allows.

use std::net::SocketAddr;

use kvroute_protocols::WorkerId;
use kvroute_protocols::headers::HEADER_WORKER_INSTANCE_ID;
use kvroute_router::http::{ApiError, OpenAiEndpoint};
use kvroute_router::{Pick, PickedRequest};
use serde_json::json;

use super::{BodyMode, Exchange};
use crate::endpoints::EndpointTable;
use crate::messages::{Destination, immediate, immediate_json};
use crate::metrics::Handled;

/// The header naming the worker that serves a request (set on the request to the engine and
/// on the response to the client).
pub(crate) const WORKER_HEADER: &str = "x-kvroute-worker-instance-id";

/// The header vLLM reads to place a request on one of its data-parallel ranks.
const DP_RANK_HEADER: &str = "x-data-parallel-rank";

impl Exchange {
    /// The workers this request may go to: those with an endpoint, within the subset hint.
    fn allowed(&self, table: &EndpointTable) -> Result<Vec<WorkerId>, ApiError> {
        let retry = self.picker.state().config().admission.retry_after;
        if table.is_empty() {
            return Err(ApiError::unavailable(
                "no endpoint is ready: no worker with an engine endpoint is registered",
                retry,
            ));
        }
        let Some(subset) = &self.subset else {
            return Ok(table.workers());
        };
        let mut ids: Vec<WorkerId> = subset
            .iter()
            .filter_map(|e| e.parse::<SocketAddr>().ok())
            .filter_map(|e| table.worker(e))
            .collect();
        ids.sort_unstable();
        ids.dedup();
        if ids.is_empty() {
            return Err(ApiError::unavailable(
                format!(
                    "none of the {} endpoint(s) of the subset hint is a ready kvroute worker",
                    subset.len()
                ),
                retry,
            ));
        }
        Ok(ids)
    }

    /// A request without a body, or on another path: sent to the endpoint the
    /// `x-worker-instance-id` header names, else to the allowed endpoints in turn. It holds no
    /// load in the router (nothing about it predicts engine work).
    pub(super) fn route_bodyless(&mut self) -> Result<Destination, ApiError> {
        if OpenAiEndpoint::from_path(&self.path).is_some() && self.method == "POST" {
            if self.request_mode == BodyMode::None {
                return Err(ApiError::internal(
                    "Envoy's ext_proc filter sends kvroute epp no request body \
                     (request_body_mode NONE), and the destination depends on the prompt: \
                     configure request_body_mode FULL_DUPLEX_STREAMED or BUFFERED",
                ));
            }
            return Err(ApiError::invalid(
                format!(
                    "POST {} needs an OpenAI JSON body; the request has none",
                    self.path
                ),
                None,
            ));
        }
        let table = self.picker.endpoints().table();
        let allowed = self.allowed(&table)?;
        let pinned = self
            .headers
            .get(HEADER_WORKER_INSTANCE_ID)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<WorkerId>().ok())
            .filter(|w| allowed.contains(w));
        let worker = pinned.unwrap_or_else(|| allowed[self.picker.next_turn() % allowed.len()]);
        let destination = self.destination(&table, &[worker], 0);
        self.picker.metrics().on_handled(Handled::Passthrough);
        self.start(&destination, None, None, None);
        Ok(destination)
    }

    /// Routes the buffered body: the destination, or the immediate response that refuses it.
    pub(super) async fn route_body(
        &mut self,
    ) -> Result<Destination, envoy_types::pb::envoy::service::ext_proc::v3::ProcessingResponse>
    {
        let refuse = |this: &mut Self, error: ApiError| {
            this.picker.metrics().on_handled(Handled::Refused);
            immediate(&error)
        };
        let Some(endpoint) =
            OpenAiEndpoint::from_path(&self.path).filter(|_| self.method == "POST")
        else {
            return self.route_bodyless().map_err(|e| refuse(self, e));
        };
        let state = self.picker.state().clone();
        let mut front = match state.prepare_openai(endpoint, &self.headers, &self.body) {
            Ok(front) => front,
            Err(error) => return Err(refuse(self, error)),
        };
        let table = self.picker.endpoints().table();
        let allowed = match self.allowed(&table) {
            Ok(allowed) => allowed,
            Err(error) => return Err(refuse(self, error)),
        };
        let hints = front.request.routing_mut();
        let allowed = match hints.allowed_worker_ids.take() {
            Some(asked) => allowed.into_iter().filter(|w| asked.contains(w)).collect(),
            None => allowed,
        };
        hints.allowed_worker_ids = Some(allowed);
        // The gateway sheds: a request that cannot get a slot is dropped with 429.
        let permit = match state.admit().await {
            Ok(permit) => permit,
            Err(error) => {
                let retry = state.config().admission.retry_after;
                let shed = ApiError::too_many_requests(error.message, retry);
                return Err(refuse(self, shed));
            }
        };
        let picked = match state.router().pick(&front.request).await {
            Ok(Pick::Picked(picked)) => picked,
            Ok(Pick::Query(answer)) => {
                self.picker.metrics().on_handled(Handled::Query);
                let worker = answer.worker;
                let body = json!({
                    "object": "kvroute.routing_query",
                    "model": front.model,
                    "nvext": {
                        "worker_id": {"worker_id": worker.worker_id, "dp_rank": worker.dp_rank},
                        "endpoint": table.endpoint(worker.worker_id).map(|e| e.to_string()),
                        "token_ids": answer.token_ids,
                    },
                });
                return Err(immediate_json(200, &body, "kvroute_epp_query"));
            }
            Err(error) => {
                let retry = state.config().admission.retry_after;
                return Err(refuse(self, ApiError::from_router(&error, retry)));
            }
        };
        let ranked = self.ranked(&picked, &table);
        if ranked.is_empty() {
            // The worker left between the table's read and the decision: `picked` is dropped
            // (freed as cancelled) with the refusal.
            let retry = state.config().admission.retry_after;
            let error = ApiError::unavailable("the chosen worker has no endpoint any more", retry);
            return Err(refuse(self, error));
        }
        let destination = self.destination(&table, &ranked, picked.worker().dp_rank);
        self.picker.metrics().on_handled(Handled::Routed);
        // With one endpoint Envoy cannot fall back; with more, the request is kept to record
        // its load on the endpoint that served it, should that be another.
        let keep = (ranked.len() > 1).then_some(front.request);
        self.start(&destination, Some(picked), Some(permit), keep);
        Ok(destination)
    }

    /// The picked worker, then (when the picker gives fallbacks) the next best, those with an
    /// endpoint only.
    fn ranked(&self, picked: &PickedRequest, table: &EndpointTable) -> Vec<WorkerId> {
        let wanted = self.picker.config().fallback_endpoints.max(1);
        let chosen = picked.worker().worker_id;
        if table.endpoint(chosen).is_none() {
            return Vec::new();
        }
        if wanted == 1 {
            return vec![chosen];
        }
        let mut ranked = Vec::with_capacity(wanted);
        for w in picked.ranked_workers() {
            if table.endpoint(w.worker_id).is_some() && !ranked.contains(&w.worker_id) {
                ranked.push(w.worker_id);
            }
            if ranked.len() == wanted {
                break;
            }
        }
        ranked
    }

    /// The destination of `workers` (best first), which all have endpoints in `table`.
    fn destination(
        &self,
        table: &EndpointTable,
        workers: &[WorkerId],
        dp_rank: u32,
    ) -> Destination {
        let config = self.picker.config();
        let value = workers
            .iter()
            .filter_map(|w| table.endpoint(*w))
            .map(|e| e.to_string())
            .collect::<Vec<_>>()
            .join(",");
        let mut extra = vec![(WORKER_HEADER.to_owned(), workers[0].to_string())];
        if dp_rank != 0 {
            extra.push((DP_RANK_HEADER.to_owned(), dp_rank.to_string()));
        }
        Destination {
            key: config.destination_key.clone(),
            namespace: config.destination_namespace.clone(),
            value,
            extra,
        }
    }
}
