//! The picker's own metrics (`kvroute_epp_*`), served on `/metrics` beside the router's.

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

type Labels = Vec<(&'static str, String)>;

/// The metric name prefix.
pub const EPP_METRIC_PREFIX: &str = "kvroute_epp";

/// How the picker handled a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Handled {
    /// Routed by its prompt (chat or completions).
    Routed,
    /// A routing query (`query_instance_id`), answered by the picker.
    Query,
    /// Another path or a bodyless request, sent to an endpoint without prompt routing.
    Passthrough,
    /// Answered by the picker with an error (4xx, 429, 503).
    Refused,
}

impl Handled {
    fn label(self) -> &'static str {
        match self {
            Handled::Routed => "routed",
            Handled::Query => "query",
            Handled::Passthrough => "passthrough",
            Handled::Refused => "refused",
        }
    }
}

/// The picker's counters.
#[derive(Debug)]
pub(crate) struct EppMetrics {
    registry: Registry,
    requests: Family<Labels, Counter>,
    immediate: Family<Labels, Counter>,
    responses: Family<Labels, Counter>,
    served_elsewhere: Counter,
    streams: Gauge,
}

impl EppMetrics {
    pub(crate) fn new() -> Self {
        let mut registry = Registry::with_prefix(EPP_METRIC_PREFIX);
        let requests = Family::<Labels, Counter>::default();
        let immediate = Family::<Labels, Counter>::default();
        let responses = Family::<Labels, Counter>::default();
        let served_elsewhere = Counter::default();
        let streams = Gauge::default();
        registry.register(
            "requests",
            "Requests the endpoint picker handled, by how (routed, query, passthrough, refused).",
            requests.clone(),
        );
        registry.register(
            "immediate_responses",
            "Requests the endpoint picker answered itself, by HTTP status.",
            immediate.clone(),
        );
        registry.register(
            "responses",
            "Routed requests' responses as they ended, by class (2xx, 4xx, 5xx, cancelled).",
            responses.clone(),
        );
        registry.register(
            "served_elsewhere",
            "Responses Envoy reported served by another endpoint than the one picked first (a fallback).",
            served_elsewhere.clone(),
        );
        registry.register(
            "streams",
            "ext_proc streams (requests passing through Envoy) open now.",
            streams.clone(),
        );
        Self {
            registry,
            requests,
            immediate,
            responses,
            served_elsewhere,
            streams,
        }
    }

    pub(crate) fn on_handled(&self, how: Handled) {
        self.requests
            .get_or_create(&vec![("result", how.label().to_owned())])
            .inc();
    }

    pub(crate) fn on_immediate(&self, status: u16) {
        self.immediate
            .get_or_create(&vec![("status", status.to_string())])
            .inc();
    }

    pub(crate) fn on_response(&self, class: &str) {
        self.responses
            .get_or_create(&vec![("class", class.to_owned())])
            .inc();
    }

    pub(crate) fn on_served_elsewhere(&self) {
        self.served_elsewhere.inc();
    }

    pub(crate) fn stream_opened(&self) {
        self.streams.inc();
    }

    pub(crate) fn stream_closed(&self) {
        self.streams.dec();
    }

    /// Counter `requests{result}` now (tests).
    pub(crate) fn handled(&self, how: Handled) -> u64 {
        self.requests
            .get_or_create(&vec![("result", how.label().to_owned())])
            .get()
    }

    /// OpenMetrics text, ending with `# EOF`.
    pub(crate) fn encode_text(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}
