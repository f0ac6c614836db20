//! A simulated vLLM-like engine for kvroute: it behaves like a worker (paged KV cache with prefix
//! caching and LRU eviction, continuous batching with chunked prefill and preemption, engine
//! sessions) and emits the KV events a real engine would, so that the router, the indexer and
//! whole fleets can be tested and benchmarked without a GPU.
//!
//! Entry types: [`Engine`] (the core: `add_request`, `advance_to(now)`, `next_wakeup`),
//! [`MockerConfig`] (JSON or TOML, defaults model an 8B model on one H100), [`sim::Simulation`]
//! (several engines in virtual time), [`trace`] (Mooncake traces), [`live::LiveMocker`] (the
//! core served as a kvroute-runtime worker in real time) and [`disagg`] (its prefill and decode
//! roles for disaggregated serving, with the bootstrap rendezvous).
//!
//! The core (everything but [`live`] and [`disagg`]) is synchronous and deterministic: it never
//! reads a clock, sleeps or touches the network; time comes in as `now` arguments. Only [`live`]
//! and [`disagg`] use tokio (and only [`live`] kvroute-runtime). The crate must not depend on
//! routing policy (scheduler, sessions, router).

pub mod config;
pub mod disagg;
mod engine;
mod kv;
pub mod live;
mod request;
pub mod sim;
pub mod timing;
pub mod trace;

pub use config::{
    Admission, ConfigError, MockerConfig, PolynomialTiming, RooflineTiming, TimingConfig,
};
pub use engine::Engine;
pub use request::{
    EngineStats, FinishReason, Finished, KvUsage, Request, RequestError, RequestId, StepOutput,
    TokenOutput,
};
