//! Integration tests of the HTTP engines against an in-process mock engine on loopback: each
//! dialect's recorded exchanges (request body sent, tokens, finish reasons and usage read), the
//! typing of failures, cancellation as the engine sees it (a dropped connection), health checks
//! and configuration, and reading each engine's load from its `/metrics`.

mod cancel;
mod errors;
mod fixtures;
mod health;
mod llamacpp;
mod load;
mod support;
