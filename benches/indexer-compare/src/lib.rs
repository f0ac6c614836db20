//! Side-by-side comparison of kvroute's KV cache index with the reference's, the published crate
//! `dynamo-kv-router` 1.6.1: its single-threaded `RadixTree` and its router default,
//! `ThreadPoolIndexer<ConcurrentRadixTreeCompressed>`.
//!
//! [`workload`] turns a Mooncake trace or a seeded synthetic workload
//! ([`kvroute_workloads::synth`]) into one recorded stream of KV events and queries with the
//! expected answer of every query, from kvroute-workloads' simulated fleet with LRU caches (the
//! one `cargo xtask bench indexer` replays too). [`drivers`] puts each
//! indexer behind one small trait, and [`run`] replays the stream through each of them, checking
//! every answer and timing event application, queries over given local hashes, and hashing a
//! prompt plus the query.
//!
//! The reference crate is a dependency of this crate only, never of a library crate of kvroute;
//! this crate is its own workspace so that the reference's dependencies stay out of the main
//! build.

pub mod alloc;
pub mod drivers;
pub mod run;
pub mod workload;
