//! Disaggregated serving for kvroute: the prefill router sends each request to a prefill worker
//! first (with `max_tokens = 1`) and then to a decode worker, handing the prefilled KV over either
//! through the prefill worker's result (`prefill_result`, the decode waits for prefill) or through
//! a bootstrap room (`bootstrap_info`, decode starts at once while prefill runs in the
//! background). It activates while discovery lists prefill workers and falls back to aggregated
//! serving (or fails clearly, when disaggregation is enforced) when none is left. Under
//! conditional disaggregation it asks the [`PhaseRouter`] per request whether the prefill is
//! cheaper on the decode worker, and serves the request aggregated when it is.
//!
//! Entry types: [`PrefillRouter`] (with [`PrefillRouterConfig`]), the [`PhaseRouter`] trait that
//! the KV router implements to place each phase, the [`DisaggStream`] it returns, and
//! [`PrefillError`]. [`request`] holds the pure request transformations; [`fleet`] reads
//! prefill workers and their bootstrap endpoints from discovery.
//!
//! This crate sits below the router: it depends on kvroute-protocols and kvroute-runtime (for
//! discovery snapshots) only, and knows nothing of HTTP, the KV index or the cost model.

pub mod config;
pub mod error;
pub mod fleet;
pub mod phase;
pub mod request;
mod router;
mod stream;

pub use config::{DisaggMode, PrefillRouterConfig, TopologyAffinity, TopologyMode};
pub use error::PrefillError;
pub use fleet::{BootstrapEndpoint, PrefillFleet};
pub use phase::{PhaseRouteError, PhaseRouter, PhaseStream, PrefillSite, Routed};
pub use router::{PrefillRouter, RouteQuery};
pub use stream::{DisaggStream, PREFILL_DETAILS_GRACE, Served};

#[cfg(test)]
mod tests;
