//! Workloads for kvroute's benchmarks and replays: Mooncake traces as they are published, seeded
//! synthetic workloads in the same shape (the evaluation set), and the recorded stream a simulated
//! fleet produces from them, with the index's expected answer to every query.
//!
//! Entry types: [`trace::TraceRecord`] (read by [`trace::parse_jsonl`] and
//! [`trace::parse_jsonl_with_sessions`]), [`synth::Workload`] (the evaluation set by name, each
//! generating [`synth::SynthRequest`]s from a seed) and [`fleet::Recorded`] (events, queries and
//! expected answers, from [`fleet::Recorded::simulate`] over a [`fleet::Fleet`]).
//!
//! It sits above kvroute-protocols and kvroute-indexer (whose block hashing the simulated fleet
//! uses) and must not depend on tokio, the network, the mocker or any routing crate: it is data
//! generation and file formats, deterministic and synchronous. How a record becomes a prompt for an
//! engine is the consumer's business (the mocker's `trace` module synthesizes tokens).

pub mod fleet;
pub mod synth;
pub mod trace;
