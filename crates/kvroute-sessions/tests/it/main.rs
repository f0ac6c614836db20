//! Integration tests of sticky sessions: the phase table, the lifecycle semantics, expiry in
//! virtual time, worker loss, and concurrent use of the store.

mod concurrency;
mod coordinator;
mod phase_table;
