//! kvroute as an endpoint picker (EPP) for Kubernetes inference gateways: an Envoy `ext_proc`
//! gRPC service that picks, for each OpenAI request passing through Envoy, the model-server
//! endpoint holding its prompt's KV cache, with kvroute's router. Envoy then sends the request
//! to that engine itself.
//!
//! It speaks version 1 of the endpoint picker protocol of the Gateway API Inference Extension
//! (proposal 004): the chosen endpoint goes back both as the header
//! `x-gateway-destination-endpoint` and as the dynamic metadata `envoy.lb` /
//! `x-gateway-destination-endpoint` (`ip:port`, or a list best first with
//! [`EppConfig::fallback_endpoints`]); the filter metadata `envoy.lb.subset_hint` /
//! `x-gateway-destination-endpoint-subset` limits the choice; no ready endpoint is an immediate
//! 503 and shedding an immediate 429, in OpenAI's error shape; Envoy's report of the endpoint
//! that served (`x-gateway-destination-endpoint-served`) is read. The gRPC health service
//! answers `liveness`, `readiness` and `envoy.service.ext_proc.v3.ExternalProcessor`.
//!
//! Where it sits: above `kvroute-router`, beside its HTTP frontend. A request's body is
//! prepared exactly as the frontend prepares it ([`kvroute_router::http::AppState::prepare_openai`]:
//! the same checks, `nvext`, routing headers, model lookup, chat template and tokenizer),
//! routed by [`kvroute_router::KvPushRouter::pick`] (load, sessions, approximate-mode
//! predictions, replicas, as for `serve`), and the response is followed through Envoy to free
//! the request's load when it ends or is cancelled, and to read the engine's reported cached
//! tokens. Workers are the engines themselves: each names the address Envoy sends to in its
//! discovery metadata ([`kvroute_runtime::ENDPOINT_METADATA`]); see [`Endpoints`].
//!
//! Envoy must run the filter with the request body in `FULL_DUPLEX_STREAMED` mode (request
//! trailers `SEND`) or `BUFFERED`, and, to free load at the response's end, the response body
//! in `FULL_DUPLEX_STREAMED` (or `STREAMED`/`BUFFERED`) mode; the user guide shows the whole
//! configuration.
//!
//! ```no_run
//! # async fn run(state: kvroute_router::http::AppState,
//! #              instances: tokio::sync::watch::Receiver<kvroute_runtime::InstanceSet>)
//! #              -> Result<(), kvroute_epp::ServeError> {
//! use kvroute_epp::{Endpoints, EppConfig, Picker};
//!
//! let picker = Picker::new(state, Endpoints::follow(instances), EppConfig::default());
//! let grpc = tokio::net::TcpListener::bind("0.0.0.0:9002").await?;
//! kvroute_epp::serve(grpc, picker, std::future::pending()).await
//! # }
//! ```

mod endpoints;
mod exchange;
mod follow;
mod messages;
mod metrics;
mod picker;
mod server;

pub use endpoints::{EndpointTable, Endpoints};
pub use metrics::EPP_METRIC_PREFIX;
pub use picker::{
    DESTINATION_ENDPOINT_KEY, DESTINATION_NAMESPACE, EppConfig, Picker, SERVED_ENDPOINT_KEY,
    SUBSET_HINT_KEY, SUBSET_HINT_NAMESPACE,
};
pub use server::{EXT_PROC_SERVICE, ServeError, metrics_app, serve};
