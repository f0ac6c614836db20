//! Integration tests of kvroute-indexer.

mod approx;
mod concurrent;
mod differential;
mod gaps;
mod hash_vectors;
mod soak;
