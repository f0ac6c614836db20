//! [`Picker`]: what every ext_proc stream shares (the router's front-door state, the endpoint
//! table, the protocol's names, the metrics); the gRPC service over it is in `server`.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use kvroute_router::http::AppState;

use crate::endpoints::Endpoints;
use crate::metrics::EppMetrics;

/// The header (and dynamic metadata key) naming the destination, as the protocol defines it.
pub const DESTINATION_ENDPOINT_KEY: &str = "x-gateway-destination-endpoint";
/// The dynamic metadata namespace of the destination.
pub const DESTINATION_NAMESPACE: &str = "envoy.lb";
/// The filter metadata namespace of the subset hint.
pub const SUBSET_HINT_NAMESPACE: &str = "envoy.lb.subset_hint";
/// The key of the subset hint (the endpoints the picker may choose from).
pub const SUBSET_HINT_KEY: &str = "x-gateway-destination-endpoint-subset";
/// The key (under [`DESTINATION_NAMESPACE`]) where Envoy reports the endpoint that served.
pub const SERVED_ENDPOINT_KEY: &str = "x-gateway-destination-endpoint-served";

/// The protocol's names and the picker's choices. The defaults are the endpoint picker
/// protocol's (Gateway API Inference Extension, proposal 004).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EppConfig {
    /// The destination header and metadata key.
    pub destination_key: String,
    /// The dynamic metadata namespace of the destination.
    pub destination_namespace: String,
    /// The filter metadata namespace of the subset hint.
    pub subset_namespace: String,
    /// The subset hint's key.
    pub subset_key: String,
    /// The served-endpoint key (under `destination_namespace`).
    pub served_key: String,
    /// Endpoints named per request, best first: 1 (the default) names the picked one only, as
    /// an `ORIGINAL_DST` cluster needs; more give a data plane that falls back down the list
    /// the next best.
    pub fallback_endpoints: usize,
}

impl Default for EppConfig {
    fn default() -> Self {
        Self {
            destination_key: DESTINATION_ENDPOINT_KEY.to_owned(),
            destination_namespace: DESTINATION_NAMESPACE.to_owned(),
            subset_namespace: SUBSET_HINT_NAMESPACE.to_owned(),
            subset_key: SUBSET_HINT_KEY.to_owned(),
            served_key: SERVED_ENDPOINT_KEY.to_owned(),
            fallback_endpoints: 1,
        }
    }
}

/// The endpoint picker: an Envoy `ext_proc` service over kvroute's router. Cheap to clone.
#[derive(Clone)]
pub struct Picker {
    inner: Arc<Shared>,
}

struct Shared {
    state: AppState,
    endpoints: Endpoints,
    config: EppConfig,
    metrics: EppMetrics,
    turn: AtomicUsize,
}

impl std::fmt::Debug for Picker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Picker")
            .field("endpoints", &self.inner.endpoints.table().len())
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

impl Picker {
    /// A picker routing with `state`'s router, models and limits (the HTTP frontend's state,
    /// unserved) over the workers of `endpoints`.
    pub fn new(state: AppState, endpoints: Endpoints, config: EppConfig) -> Self {
        Self {
            inner: Arc::new(Shared {
                state,
                endpoints,
                config,
                metrics: EppMetrics::new(),
                turn: AtomicUsize::new(0),
            }),
        }
    }

    /// The router's front-door state.
    pub fn state(&self) -> &AppState {
        &self.inner.state
    }

    /// The endpoint table.
    pub fn endpoints(&self) -> &Endpoints {
        &self.inner.endpoints
    }

    /// The protocol's names and the picker's choices.
    pub fn config(&self) -> &EppConfig {
        &self.inner.config
    }

    pub(crate) fn metrics(&self) -> &EppMetrics {
        &self.inner.metrics
    }

    /// The next turn of the round-robin over endpoints (requests not routed by prompt).
    pub(crate) fn next_turn(&self) -> usize {
        self.inner.turn.fetch_add(1, Ordering::Relaxed)
    }

    /// The router's metrics and the picker's, as one OpenMetrics text.
    pub fn metrics_text(&self) -> String {
        let router = self.state().router().metrics_text();
        let own = self.metrics().encode_text();
        let cut = router.rfind("# EOF").unwrap_or(router.len());
        let mut text = router[..cut].to_owned();
        text.push_str(&own);
        text
    }

    /// Requests routed by their prompt so far (tests and benches).
    pub fn routed_requests(&self) -> u64 {
        self.metrics().handled(crate::metrics::Handled::Routed)
    }
}
