//! Integration tests of kvroute-router: the sync core is unit-tested beside it; here the KV push
//! router runs against fake LLM workers over loopback TCP.

mod guard;
mod routing;
mod support;
