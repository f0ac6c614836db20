//! Integration tests of kvroute-mocker: engine invariants under random workloads, KV event replay
//! into kvroute-indexer, pressure (preemption, eviction), sessions, and the simulation driver.

mod disagg;
mod invariants;
mod live;
mod pressure;
mod sessions;
mod sim;
mod support;
