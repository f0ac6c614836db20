//! The kvroute router: serves the routing core of kvroute-router-core over kvroute-runtime and
//! HTTP.
//!
//! The core is re-exported here: [`KvRouterCore`], the synchronous, deterministic core (time and
//! the RNG come in as arguments), configured by [`RouterConfig`] with a [`Policy`]; it routes a
//! [`RouteRequest`] into a [`Routed`] decision carrying the cost breakdown and per-phase timings,
//! and tracks the request until [`KvRouterCore::on_finished`] or [`KvRouterCore::on_failed`].
//! [`KvPushRouter`] is the live layer: it feeds the core from the event plane and discovery,
//! sends requests over the request plane, and wraps each response in a [`KvRoutedStream`] whose
//! [`RequestGuard`] frees the request however it ends. [`metrics`] names every Prometheus metric.
//!
//! [`Migrator`] wraps [`KvPushRouter::generate`] so that a request whose worker dies mid-stream
//! continues on another worker ([`MigratingStream`]), and kvroute-prefill's `PrefillRouter` so
//! that a disaggregated one does too, prefilled again and decoded elsewhere
//! ([`MigratingDisaggStream`]); [`KvPhaseRouter`] places each phase for the `PrefillRouter`.
//! [`http`] is the OpenAI-compatible frontend (axum) over a [`Migrator`], with [`tokenizer`] and
//! the served models ([`ModelRegistry`]).
//!
//! The core ([`KvRouterCore`] and the types around it) lives in its own crate, which depends on
//! no async runtime, network, HTTP or tokenizer crate (a tidy check of its dependency closure):
//! `kvroute replay` drives it in virtual time against simulated engines, the live router behind
//! a mutex. Everything in this crate is a live layer ([`KvPushRouter`], the guard, migration,
//! [`http`]) and may touch tokio; only [`http`] knows axum.
//!
//! # Example
//!
//! ```
//! use std::time::Duration;
//! use kvroute_router::{KvMode, KvRouterCore, Policy, RouteRequest, RouterConfig};
//! use kvroute_scheduler::{RequestId, WorkerSpec};
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

mod background;
mod error;
mod guard;
pub mod health;
pub mod http;
mod load_sync;
pub mod metrics;
mod migration;
mod model;
mod phase;
mod pick;
mod push;
mod push_config;
mod shared;
mod snapshots;
mod state;
pub mod tokenizer;

pub use error::{KvRouterError, StartError};
pub use guard::{KvRoutedStream, RequestGuard};
pub use load_sync::{DEFAULT_LOAD_SCOPE, LOAD_SUBJECT_PREFIX, LoadSyncConfig};
pub use metrics::RouterMetrics;
pub use migration::{
    DEFAULT_MAX_MIGRATIONS, MigratingDisaggStream, MigratingResponse, MigratingStream, Migrator,
};
pub use model::{Model, ModelConfig, ModelRegistry};
pub use phase::{KvPhaseRouter, role_filtered};
pub use pick::{Pick, PickedRequest};
pub use push::{
    KvPushRouter, KvResponse, LoadSyncStats, QUERY_INSTANCE_ID, QueryAnswer, SnapshotStats,
};
pub use push_config::{KV_EVENTS_METADATA_KEY, KvPushRouterConfig};
pub use state::SharedAffinityStore;

// The routing core (kvroute-router-core), and the lower crates' types it re-exports, so callers
// of the router need not depend on every lower crate.
pub use kvroute_prefill::{DisaggMode, PrefillRouterConfig};
pub use kvroute_router_core::{
    ApproxConfig, CandidateCost, ConditionalDisagg, CoreStats, DEFAULT_INFLIGHT_TTL,
    DEFAULT_REPORT_TTL, EventGap, Expired, HashSalt, InMemoryAffinityStore, IndexSnapshot, KvMode,
    KvRouterCore, LaneSnapshot, LoadError, PhaseTimings, Policy, PreparedRoute, RequestId,
    RequestLoad, RouteError, RoutePreparer, RouteRequest, RouteSource, Routed, RouterConfig,
    SchedulerConfig, SessionCommand, SnapshotCut, SnapshotError, UnknownPolicy, WorkerLoad,
    WorkerLossMode, WorkerSnapshot, WorkerSpec,
};
