//! Following the response: its status, its first bytes (the prefill is done), its output
//! tokens and the engine's cached-token report, and its end, which frees the request's load.

use envoy_types::pb::envoy::config::core::v3::{HeaderValue, HeaderValueOption};
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    CommonResponse, HeaderMutation, HeadersResponse, HttpBody, HttpHeaders, ProcessingResponse,
};
use kvroute_router::Pick;
use kvroute_router::health::HealthFailure;

use super::route::WORKER_HEADER;
use super::{BodyMode, Exchange};
use crate::follow::Follower;
use crate::messages::{
    self, Side, body_continue, headers_continue, streamed_body, trailers_continue,
};

/// The header Envoy's router adds to responses that came from upstream; a response without it
/// is Envoy's own reply (the engine could not be reached, or timed out).
const UPSTREAM_TIME_HEADER: &str = "x-envoy-upstream-service-time";

impl Exchange {
    pub(super) fn on_response_headers(&mut self, headers: HttpHeaders) -> Vec<ProcessingResponse> {
        let map = headers.headers.as_ref();
        let status = messages::pseudo(map, ":status").and_then(|s| s.trim().parse::<u16>().ok());
        let http = messages::http_headers(map);
        let content_type = http
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let Some(live) = self.live.as_mut() else {
            return vec![headers_continue(Side::Response)];
        };
        // Envoy reports the endpoint that served with the response's headers at the latest
        // (`on_served` ran before this): no fallback can follow.
        live.request = None;
        live.status = status;
        live.local_reply = !http.contains_key(UPSTREAM_TIME_HEADER);
        live.follower = Some(Follower::new(content_type.as_deref()));
        let worker = live
            .picked
            .as_ref()
            .map(|p| p.worker().worker_id.to_string());
        if headers.end_of_stream {
            self.end();
        }
        match worker {
            // Tell the client which worker served it (as `nvext.worker_id` does on serve).
            Some(worker) => vec![ProcessingResponse {
                response: Some(Response::ResponseHeaders(HeadersResponse {
                    response: Some(CommonResponse {
                        header_mutation: Some(HeaderMutation {
                            set_headers: vec![HeaderValueOption {
                                header: Some(HeaderValue {
                                    key: WORKER_HEADER.to_owned(),
                                    raw_value: worker.into_bytes(),
                                    ..HeaderValue::default()
                                }),
                                append_action: 2,
                                ..HeaderValueOption::default()
                            }],
                            ..HeaderMutation::default()
                        }),
                        ..CommonResponse::default()
                    }),
                })),
                ..ProcessingResponse::default()
            }],
            None => vec![headers_continue(Side::Response)],
        }
    }

    pub(super) fn on_response_body(&mut self, body: HttpBody) -> Vec<ProcessingResponse> {
        if let Some(live) = self.live.as_mut() {
            let follower = live.follower.get_or_insert_with(|| Follower::new(None));
            let mut seen = follower.feed(&body.body);
            if body.end_of_stream {
                let last = follower.finish();
                seen.cached_tokens = seen.cached_tokens.or(last.cached_tokens);
            }
            if let Some(picked) = live.picked.as_mut() {
                if !live.first_bytes && !body.body.is_empty() {
                    live.first_bytes = true;
                    picked.on_first_bytes();
                }
                if seen.events > 0 {
                    picked.on_tokens(seen.events);
                }
                if let Some(cached) = seen.cached_tokens
                    && live.status.is_some_and(|s| (200..300).contains(&s))
                {
                    picked.on_cache_report(cached);
                }
            }
        }
        if body.end_of_stream {
            self.end();
        }
        match self.response_mode {
            BodyMode::FullDuplex => streamed_body(Side::Response, &body.body, body.end_of_stream),
            _ => vec![body_continue(Side::Response)],
        }
    }

    pub(super) fn on_response_trailers(&mut self) -> Vec<ProcessingResponse> {
        self.end();
        vec![trailers_continue(Side::Response)]
    }

    /// Envoy says the response came from `served` (after a fallback down the list, another
    /// endpoint than the one picked first): the first one could not be reached, and the
    /// request's load belongs to the one that served it. The first pick fails (its worker is
    /// marked unreachable) and the request is recorded again on the serving endpoint's worker,
    /// pinned there, so that its load, its predicted cache and the engine's cached-token report
    /// land where it runs. The session command, if any, is not run again.
    pub(super) async fn on_served(&mut self, served: Vec<String>) {
        let Some(live) = self.live.as_mut() else {
            return;
        };
        let Some(served) = served.first() else { return };
        if *served == live.endpoint || live.picked.is_none() {
            return;
        }
        self.picker.metrics().on_served_elsewhere();
        let table = self.picker.endpoints().table();
        let worker = served.parse().ok().and_then(|e| table.worker(e));
        if let Some(picked) = live.picked.take() {
            let detail = format!("Envoy fell back from {} to {served}", live.endpoint);
            picked.fail(Some(HealthFailure::Unreachable), &detail);
        }
        live.endpoint = served.clone();
        tracing::info!(endpoint = %served, ?worker, "request served by a fallback endpoint");
        let (Some(worker), Some(mut request)) = (worker, live.request.take()) else {
            return;
        };
        let hints = request.routing_mut();
        hints.backend_instance_id = Some(worker);
        hints.dp_rank = None;
        hints.session_control = None;
        match self.picker.state().router().pick(&request).await {
            Ok(Pick::Picked(picked)) => live.picked = Some(picked),
            Ok(Pick::Query(_)) => {}
            Err(e) => tracing::warn!(
                worker,
                error = %e,
                "could not record a request on the fallback endpoint that served it"
            ),
        }
    }

    /// The response ended (its last body piece, its trailers, or headers with no body): the
    /// request leaves the router, counted by its status.
    pub(super) fn end(&mut self) {
        let Some(mut live) = self.live.take() else {
            return;
        };
        let Some(picked) = live.picked.take() else {
            return;
        };
        let status = live.status.unwrap_or(0);
        let metrics = self.picker.metrics();
        match status {
            200..=399 => {
                metrics.on_response("2xx");
                picked.finish();
            }
            400..=499 => {
                metrics.on_response("4xx");
                picked.reject();
            }
            _ => {
                metrics.on_response("5xx");
                // Envoy's own 503 means the engine could not be reached, its 504 that it did
                // not answer in time; an engine's own 5xx says nothing of reachability.
                let health = match (live.local_reply, status) {
                    (true, 503) => Some(HealthFailure::Unreachable),
                    (true, 504) => Some(HealthFailure::Timeout),
                    _ => None,
                };
                let detail = format!("status {status} from {}", live.endpoint);
                picked.fail(health, &detail);
            }
        }
    }
}
