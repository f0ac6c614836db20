//! The sans-IO KV routing core of kvroute: the KV indexes, the scheduler and sticky sessions
//! composed into one synchronous, deterministic state machine.
//!
//! Entry types: [`KvRouterCore`], configured by [`RouterConfig`] with a [`Policy`], learns what
//! each worker caches from KV events ([`KvRouterCore::apply_event`], or predictions for a worker
//! in [`KvMode::Approximate`]), routes a [`RouteRequest`] into a [`Routed`] decision carrying the
//! cost breakdown and per-phase timings ([`PhaseTimings`]), and tracks the request's load until
//! [`KvRouterCore::on_finished`] or [`KvRouterCore::on_failed`]; [`RoutePreparer`] hashes and
//! matches a prompt without the core's lock. [`ConditionalDisagg`] decides, from two query
//! decisions, whether a request's prefill runs on its decode worker or a prefill worker. [`IndexSnapshot`] saves and restores its exact
//! index; [`RouteError`] says why a request could not be routed (nothing changes then). The
//! lower crates' types a caller needs to drive it ([`WorkerSpec`], [`RequestId`], ...) are
//! re-exported.
//!
//! Invariants: time (`now`) and the RNG come in as arguments, so the same inputs give the same
//! decisions (the only clock read is for [`PhaseTimings`], which no decision depends on); every
//! request routed leaves the scheduler through `on_finished`, `on_failed` or `expire`. This crate
//! must not depend on an async runtime, the network, HTTP or a tokenizer (no `tokio`, `axum`,
//! `hyper`, `reqwest`, `async-nats`, `zeromq`, `tokenizers`, `minijinja` anywhere in its
//! dependency closure, which tidy checks): `kvroute replay` drives it in virtual time, and
//! kvroute-router's live layer behind a mutex.
//!
//! # Example
//!
//! ```
//! use std::time::Duration;
//! use kvroute_router_core::{
//!     KvMode, KvRouterCore, Policy, RequestId, RouteRequest, RouterConfig, WorkerSpec,
//! };
//! use rand::SeedableRng;
//!
//! let mut core = KvRouterCore::new(RouterConfig::new(4).with_policy(Policy::Kv)).unwrap();
//! core.add_worker(&WorkerSpec::new(1), KvMode::Events).unwrap();
//! core.add_worker(&WorkerSpec::new(2), KvMode::Approximate).unwrap();
//! let mut rng = rand::rngs::StdRng::seed_from_u64(7);
//! let now = Duration::ZERO;
//!
//! // Worker 2 publishes no events: the first decision is recorded as a prediction ...
//! let prompt: Vec<u32> = (0..16).collect();
//! let first = core.route(&RouteRequest::new(RequestId(1), &prompt), now, &mut rng).unwrap();
//! core.on_first_token(RequestId(1)).unwrap();
//! core.on_output_tokens(RequestId(1), 8).unwrap();
//! assert!(core.on_finished(RequestId(1)).is_empty()); // no session commands to run
//!
//! // ... so the same prompt later finds its 4 cached blocks on the same worker (if it was 2).
//! let again = core.query(&RouteRequest::new(RequestId(2), &prompt), now, &mut rng).unwrap();
//! if first.worker.worker_id == 2 {
//!     assert_eq!((again.worker.worker_id, again.overlap_blocks), (2, 4));
//! }
//! assert_eq!(core.active_requests(), 0);
//! ```

mod config;
mod core;
pub mod disagg;
mod error;
mod policy;
mod request;

pub use config::{DEFAULT_INFLIGHT_TTL, DEFAULT_REPORT_TTL, KvMode, RouterConfig};
pub use core::snapshot::{IndexSnapshot, LaneSnapshot, SnapshotCut, SnapshotError, WorkerSnapshot};
pub use core::{CoreStats, Expired, KvRouterCore};
pub use disagg::{ConditionalDisagg, LocalReason, PrefillPlacement, PrefillSide};
pub use error::RouteError;
pub use policy::{Policy, UnknownPolicy};
pub use request::{PhaseTimings, PreparedRoute, RoutePreparer, RouteRequest, RouteSource, Routed};

// The types callers need to drive the core, so they need not depend on every lower crate.
pub use kvroute_indexer::hash::HashSalt;
pub use kvroute_indexer::{ApproxConfig, EventGap, Retention};
pub use kvroute_scheduler::{
    CandidateCost, CostTuning, LoadError, RequestId, RequestLoad, SchedulerConfig, WorkerLoad,
    WorkerSpec,
};
pub use kvroute_sessions::{InMemoryAffinityStore, SessionCommand, WorkerLossMode};
