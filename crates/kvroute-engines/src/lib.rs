//! Real engines behind a kvroute worker. [`HttpEngine`] implements the runtime's
//! [`kvroute_runtime::Engine`] for LLM requests by calling an inference engine's HTTP API: vLLM,
//! SGLang, TensorRT-LLM (`trtllm-serve`), llama.cpp (`llama-server`) or any OpenAI completions
//! server, chosen by [`EngineKind`] in an [`HttpEngineConfig`]. The prompt is sent as token ids,
//! exactly as the router tokenized it, and output comes back as token ids, so the router's
//! block hashes, load accounting and migration see the tokens the engine saw. Each dialect is one
//! small module under `dialect`; adding an engine is adding a module.
//!
//! Entry types: [`HttpEngine`] (with [`HttpEngine::health`]), [`HttpEngineConfig`],
//! [`EngineKind`], and the errors [`EngineConfigError`] and [`HealthError`]. Serving it is the
//! runtime's job: `WorkerServer::bind(addr, Arc::new(engine), config)`.
//!
//! This crate holds no routing policy (it serves whatever request reaches its worker) and no
//! HTTP server: it is an HTTP client only. It depends on kvroute-protocols and kvroute-runtime,
//! nothing above them.

mod config;
mod dialect;
mod engine;
mod error;
mod sse;
mod stream;

pub use config::{EngineConfigError, EngineKind, HttpEngineConfig, ParseEngineKindError};
pub use engine::HttpEngine;
pub use error::HealthError;
