//! Workloads for kvroute's benchmarks and replays: the recorded stream a simulated fleet produces
//! from a trace, with the index's expected answer to every query.
//!
//! Entry types: [`fleet::Recorded`] (events, queries and expected answers, from
//! [`fleet::Recorded::simulate`] over a [`fleet::Fleet`]).
//!
//! It sits above kvroute-protocols and kvroute-indexer (whose block hashing the simulated fleet
//! uses) and must not depend on tokio, the network, the mocker or any routing crate: it is data
//! generation, deterministic and synchronous.

pub mod fleet;
