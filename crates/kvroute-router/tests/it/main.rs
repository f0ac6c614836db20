//! Integration tests of kvroute-router: the sync core is unit-tested beside it; here the KV push
//! router, migration and the HTTP frontend run against fake LLM workers over loopback TCP.

mod guard;
mod http;
mod migration;
mod phase;
mod replicas;
mod routing;
mod support;
