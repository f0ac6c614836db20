//! [`AppState`]: what the handlers share (the migrator over the KV router, the served models,
//! the configuration, admission and the body budget), and [`Disagg`], disaggregated serving.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use kvroute_prefill::{PrefillRouter, PrefillRouterConfig};
use kvroute_protocols::RequestPhase;
use kvroute_runtime::InstanceSet;
use tokio::sync::watch;

use super::admission;
use super::auth::ApiKeys;
use super::body::{BodyBudget, BodySource};
use super::config::HttpConfig;
use crate::migration::Migrator;
use crate::model::ModelRegistry;
use crate::phase::KvPhaseRouter;
use crate::push::KvPushRouter;

/// Everything the handlers share. Cheap to clone.
#[derive(Clone)]
pub struct AppState {
    pub(super) inner: Arc<Shared>,
    disagg: Option<Disagg>,
    extra_metrics: Option<ExtraMetrics>,
    api_keys: Option<ApiKeys>,
}

/// Produces OpenMetrics families (no `# EOF`) that `/metrics` appends to the router's own: the
/// state of the services around the router (the NATS connection, ...).
pub type ExtraMetrics = Arc<dyn Fn() -> String + Send + Sync>;

/// Disaggregated serving: the prefill router over the KV routers of both phases. Cheap to clone.
#[derive(Clone)]
pub struct Disagg {
    router: PrefillRouter<KvPhaseRouter>,
    prefill: KvPushRouter,
}

impl std::fmt::Debug for Disagg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Disagg")
            .field("mode", &self.router.config().mode)
            .finish_non_exhaustive()
    }
}

impl Disagg {
    /// Routes each phase with `phases`; active while `instances` (the unfiltered discovery
    /// watch) lists a prefill worker.
    pub fn new(
        phases: KvPhaseRouter,
        instances: watch::Receiver<InstanceSet>,
        config: PrefillRouterConfig,
    ) -> Self {
        let prefill = phases.router(RequestPhase::Prefill).clone();
        Self {
            router: PrefillRouter::new(Arc::new(phases), instances, config),
            prefill,
        }
    }

    /// The prefill router.
    pub fn router(&self) -> &PrefillRouter<KvPhaseRouter> {
        &self.router
    }

    /// The KV router of the prefill phase.
    pub fn prefill_router(&self) -> &KvPushRouter {
        &self.prefill
    }
}

/// The part of [`AppState`] every clone shares.
pub(super) struct Shared {
    pub(super) migrator: Migrator,
    models: ModelRegistry,
    config: HttpConfig,
    pub(super) admission: admission::Admission,
    bodies: BodyBudget,
    pub(super) block_size: u32,
    pub(super) next_id: AtomicU64,
    pub(super) id_salt: u64,
}

impl std::fmt::Debug for AppState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AppState")
            .field("models", &self.inner.models.names().collect::<Vec<_>>())
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

impl AppState {
    /// The state of a frontend serving `models` through `router` (in disaggregated serving, the
    /// router of the decode phase, which also serves requests aggregated).
    pub fn new(router: KvPushRouter, models: ModelRegistry, config: HttpConfig) -> Self {
        let block_size = router.with_core(|c| c.block_size());
        let id_salt = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        Self {
            inner: Arc::new(Shared {
                migrator: Migrator::new(router, config.max_migrations),
                models,
                admission: admission::Admission::new(config.admission),
                bodies: BodyBudget::new(config.max_body_bytes, config.max_body_memory_bytes),
                config,
                block_size,
                next_id: AtomicU64::new(1),
                id_salt,
            }),
            disagg: None,
            extra_metrics: None,
            api_keys: None,
        }
    }

    /// This state, answering `/v1/*` only to clients that send one of `keys` as
    /// `Authorization: Bearer KEY` (401 otherwise); `/health`, `/live` and `/metrics` stay open.
    pub fn with_api_keys(mut self, keys: ApiKeys) -> Self {
        self.api_keys = Some(keys);
        self
    }

    /// The client keys, when authentication is on.
    pub fn api_keys(&self) -> Option<&ApiKeys> {
        self.api_keys.as_ref()
    }

    /// This state, with `metrics` appended to `/metrics` (OpenMetrics families whose names do
    /// not clash with the router's; counters named without `_total` in `# TYPE`, as OpenMetrics
    /// wants, since the Prometheus text format is derived from it).
    pub fn with_extra_metrics(mut self, metrics: ExtraMetrics) -> Self {
        self.extra_metrics = Some(metrics);
        self
    }

    /// The extra metrics' text, empty without any.
    pub(crate) fn extra_metrics_text(&self) -> String {
        self.extra_metrics.as_ref().map(|f| f()).unwrap_or_default()
    }

    /// This state, serving disaggregated through `disagg` while it is active (or always, when
    /// disaggregation is enforced).
    pub fn with_disagg(mut self, disagg: Disagg) -> Self {
        self.disagg = Some(disagg);
        self
    }

    /// Disaggregated serving, when configured.
    pub fn disagg(&self) -> Option<&Disagg> {
        self.disagg.as_ref()
    }

    /// The KV router underneath (of the decode phase when serving disaggregated).
    pub fn router(&self) -> &KvPushRouter {
        self.inner.migrator.router()
    }

    /// The served models.
    pub fn models(&self) -> &ModelRegistry {
        &self.inner.models
    }

    /// The configuration.
    pub fn config(&self) -> &HttpConfig {
        &self.inner.config
    }

    /// Requests admitted and not yet finished.
    pub fn in_flight(&self) -> usize {
        self.inner.admission.in_flight()
    }

    /// Bytes taken from the body budget ([`HttpConfig::max_body_memory_bytes`]) by bodies being
    /// read or parsed (and, in part, by a read waiting for the rest of its reservation).
    pub fn body_bytes_reserved(&self) -> usize {
        self.inner.bodies.reserved()
    }

    /// Requests waiting for the body budget before reading their body.
    pub fn body_reads_waiting(&self) -> usize {
        self.inner.bodies.waiting()
    }
}

impl BodySource for AppState {
    fn config(&self) -> &HttpConfig {
        &self.inner.config
    }

    fn bodies(&self) -> &BodyBudget {
        &self.inner.bodies
    }
}
