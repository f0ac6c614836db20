//! Wire types shared by everything in kvroute: the OpenAI `nvext` extension and routing headers
//! (wire-compatible with NVIDIA Dynamo), the preprocessed request and engine output that travel on
//! the request plane, the `Annotated` stream envelope, worker identities, and KV cache events both
//! as the router sees them (`RouterEvent`) and as engines publish them over ZMQ.
//!
//! Entry types: [`kv_events::RouterEvent`], [`WorkerWithDpRank`].
//!
//! This crate is plain data plus validation: it must not depend on tokio, sockets, or any routing
//! logic, so every other crate (and every client) can depend on it cheaply.

pub mod kv_events;
mod worker;

pub use worker::{DpRank, WorkerId, WorkerWithDpRank};
