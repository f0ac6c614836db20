//! Integration tests of the `kvroute` binary: each test runs the built binary, on a small trace
//! generated into cargo's per-test temporary directory (`replay`) or as a router and worker
//! processes on loopback (`e2e`).

mod demo;
mod e2e;
mod errors;
mod replay;
mod support;
