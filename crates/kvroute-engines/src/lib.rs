//! Real engines behind a kvroute worker. [`HttpEngine`] implements the runtime's
//! [`kvroute_runtime::Engine`] for LLM requests by calling an inference engine's HTTP API: vLLM,
//! SGLang, TensorRT-LLM (`trtllm-serve`), llama.cpp (`llama-server`) or any OpenAI completions
//! server, chosen by [`EngineKind`] in an [`HttpEngineConfig`]. The prompt is sent as token ids,
//! exactly as the router tokenized it, and output comes back as token ids, so the router's
//! block hashes, load accounting and migration see the tokens the engine saw. Each dialect is one
//! small module under `dialect`; adding an engine is adding a module.
//!
//! Entry types: [`HttpEngine`] (with [`HttpEngine::health`] and [`HttpEngine::load`]),
//! [`HttpEngineConfig`], [`EngineKind`], [`EngineLoad`], and the errors [`EngineConfigError`],
//! [`HealthError`] and [`LoadError`]; [`write_token_ids`] writes a prompt's ids as the JSON
//! numbers the request bodies carry. Serving it is the runtime's job:
//! `WorkerServer::bind(addr, Arc::new(engine), config)`.
//!
//! Load reading: [`HttpEngine::load`] reads the engine's own Prometheus `/metrics` and gives,
//! per data-parallel rank, the requests it runs and holds waiting and the KV blocks in use, which
//! [`EngineLoad::report`] turns into the `WorkerLoadReport` a worker's `LoadReporter` sends to
//! the router. A figure is given only as the engine states it; KV use it does not state exactly is
//! `None`. Supported, with the metrics read (names checked against vLLM 0.33.0's and SGLang
//! 0.5.23's sources and a real llama.cpp server):
//!
//! | engine | running | waiting | KV in use | ranks |
//! | --- | --- | --- | --- | --- |
//! | vLLM | `vllm:num_requests_running` | `vllm:num_requests_waiting` | `vllm:kv_cache_usage_perc` (or `vllm:gpu_cache_usage_perc`) × `num_gpu_blocks - 1` of `vllm:cache_config_info`, only on a server with one engine | `engine` label |
//! | SGLang (`--enable-metrics`) | `sglang:num_running_reqs` | `sglang:num_queue_reqs` + `sglang:num_grammar_queue_reqs` | `sglang:kv_used_tokens` (or `sglang:num_used_tokens`) | `dp_rank` label |
//! | llama.cpp (`--metrics`) | `llamacpp:requests_processing` | `llamacpp:requests_deferred` | not stated (`None`) | one |
//!
//! The KV capacity, in the same blocks: vLLM's `num_gpu_blocks - 1` (one engine only, as above),
//! SGLang's `sglang:max_total_num_tokens`; the router credits cached blocks only as far as it
//! lets a worker keep them.
//!
//! TensorRT-LLM and plain OpenAI servers publish no request gauges to read: [`LoadError::Unsupported`].
//!
//! This crate holds no routing policy (it serves whatever request reaches its worker) and no
//! HTTP server: it is an HTTP client only. It depends on kvroute-protocols and kvroute-runtime,
//! nothing above them.

mod config;
mod dialect;
mod engine;
mod error;
mod exposition;
mod identify;
mod load;
mod sse;
mod stream;

pub use config::{EngineConfigError, EngineKind, HttpEngineConfig, ParseEngineKindError};
pub use dialect::write_token_ids;
pub use engine::HttpEngine;
pub use error::HealthError;
pub use identify::{EngineIdentity, IdentifyError};
pub use load::{EngineLoad, LoadError};
