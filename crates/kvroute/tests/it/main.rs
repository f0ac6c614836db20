//! Integration tests of the `kvroute` binary: each test runs the built binary, on a small trace
//! generated into cargo's per-test temporary directory (`replay`) or as a router and worker
//! processes on loopback (`e2e`; `engine_sim` puts `worker --engine vllm` sidecars in front of
//! `kvroute engine-sim`'s simulated vLLM servers), except `prefill`, which composes the prefill router with
//! simulated prefill and decode workers in-process (over TCP on loopback).

mod conditional;
mod demo;
mod dialect_migration;
mod disagg_replay;
mod disagg_support;
mod e2e;
mod engine_sim;
mod envoy;
mod errors;
mod llamacpp;
mod nats;
mod prefill;
mod replay;
mod security;
mod sglang_disagg;
mod soak;
mod support;
mod vllm_disagg;
