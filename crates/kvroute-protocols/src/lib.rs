//! Wire types shared by everything in kvroute: the OpenAI `nvext` extension and routing headers
//! (wire-compatible with NVIDIA Dynamo), the preprocessed request and engine output that travel on
//! the request plane, the `Annotated` stream envelope, worker identities, the load a worker
//! reports of itself, and KV cache events both as the router sees them (`RouterEvent`) and as
//! engines publish them over ZMQ.
//!
//! Entry types: [`NvExt`], [`PreprocessedRequest`], [`LLMEngineOutput`], [`Annotated`],
//! [`kv_events::RouterEvent`], [`WorkerWithDpRank`], [`WorkerLoadReport`]; every error is a
//! [`ProtocolError`].
//! JSON is for the HTTP edge, bincode (see [`codec`]) for the request plane: the same types speak
//! both, omitting `None` fields from JSON only.
//!
//! This crate is plain data plus validation: it must not depend on tokio, sockets, or any routing
//! logic, so every other crate (and every client) can depend on it cheaply.

pub mod annotated;
pub mod codec;
pub mod error;
pub mod headers;
pub mod kv_events;
pub mod load_report;
pub mod nvext;
pub mod output;
pub mod request;
pub mod routing;
pub mod validate;
mod wire;
mod worker;
pub mod zmq_events;

pub use annotated::Annotated;
pub use error::ProtocolError;
pub use headers::{HeaderOverrides, apply_header_routing_overrides};
pub use load_report::WorkerLoadReport;
pub use nvext::{
    AgentHints, NvExt, NvExtBuilder, NvExtResponse, RoutingConstraints, SessionAction,
    SessionControl, TimingInfo, WorkerIdInfo,
};
pub use output::{CompletionUsage, FinishReason, LLMEngineOutput, PromptTokensDetails};
pub use request::{
    BOOTSTRAP_HOST_KEY, BOOTSTRAP_PORT_KEY, BootstrapInfo, CACHE_SALT_EXTRA_ARG, MmRoutingInfo,
    OutputOptions, PrefillResult, PreprocessedRequest, PreprocessedRequestBuilder, SamplingOptions,
    StopConditions,
};
pub use routing::{RequestPhase, RouterConfigOverride, RoutingHints};
pub use validate::{Limits, from_json, parse_nvext_json, parse_request_json};
pub use worker::{DpRank, WorkerId, WorkerWithDpRank};
pub use zmq_events::{EngineEventBatch, EngineKvEvent, decode_event_batch, decode_zmq_frames};

#[cfg(test)]
mod tests;
