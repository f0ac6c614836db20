//! Integration tests of the `kvroute` binary: each test runs the built binary on a small trace
//! generated into cargo's per-test temporary directory.

mod errors;
mod replay;
mod support;
