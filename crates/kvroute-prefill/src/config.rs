//! How a [`crate::PrefillRouter`] behaves.

/// What happens while no prefill worker is registered, or when prefill fails.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum DisaggMode {
    /// Serve aggregated (decode workers prefill themselves) while no prefill worker exists, and
    /// fall back to aggregated serving when a prefill fails.
    #[default]
    Optional,
    /// Fail requests with a clear error instead of serving them aggregated
    /// (the reference's `enforce_disagg`).
    Enforced,
    /// Decide per request: ask the [`crate::PhaseRouter`] where the prefill is cheaper
    /// ([`crate::PhaseRouter::place`]) and serve the request aggregated on its decode worker or
    /// disaggregated accordingly. Without prefill workers, and when a prefill fails, it serves
    /// aggregated as [`DisaggMode::Optional`] does.
    Conditional,
}

impl DisaggMode {
    /// Whether requests are served aggregated while no prefill worker exists or a prefill
    /// failed (every mode but [`DisaggMode::Enforced`]).
    pub fn falls_back(self) -> bool {
        self != DisaggMode::Enforced
    }
}

/// How the decode worker is steered towards the prefill worker's topology (same rack, same
/// node, ...) so that the KV transfer stays local.
///
/// For each of `keys` that the chosen prefill worker's discovery metadata holds, the taint
/// `"key=value"` is merged into the decode request's routing constraints. The router must give
/// each worker the same `"key=value"` taints from its metadata for this to match anyone.
#[derive(Debug, Clone, PartialEq)]
pub struct TopologyAffinity {
    /// Metadata keys that describe topology, most specific last (e.g. `zone`, `rack`).
    pub keys: Vec<String>,
    /// Whether matching is preferred or required.
    pub mode: TopologyMode,
}

/// How strongly a topology taint binds the decode worker.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum TopologyMode {
    /// A preferred taint with this weight (the scheduler scales the cost by `exp(-tanh(sum))`).
    Prefer {
        /// The preference weight, > 0.
        weight: f32,
    },
    /// A required taint: only decode workers in the same topology are eligible.
    Require,
}

/// The prefill router's configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct PrefillRouterConfig {
    /// Fallback or error while disaggregation is unavailable.
    pub mode: DisaggMode,
    /// Steering of the decode worker towards the prefill worker, if any.
    pub topology: Option<TopologyAffinity>,
    /// Seed of the bootstrap room ids (for reproducible tests).
    pub seed: u64,
}

impl Default for PrefillRouterConfig {
    fn default() -> Self {
        Self {
            mode: DisaggMode::Optional,
            topology: None,
            seed: 0x7072_6566_696c_6c21,
        }
    }
}

impl PrefillRouterConfig {
    /// The default configuration with `mode`.
    pub fn with_mode(mut self, mode: DisaggMode) -> Self {
        self.mode = mode;
        self
    }

    /// The same configuration with topology steering.
    pub fn with_topology(mut self, topology: TopologyAffinity) -> Self {
        self.topology = Some(topology);
        self
    }
}
