//! The router's Prometheus metrics: every metric name is written here and nowhere else.
//!
//! Names (with the `kvroute_router_` prefix; counters get `_total`, histograms `_bucket`,
//! `_sum`, `_count`):
//!
//! | name | type | labels | meaning |
//! | --- | --- | --- | --- |
//! | `requests_total` | counter | | requests routed to a worker |
//! | `queries_total` | counter | | query-only requests answered (no routing) |
//! | `route_errors_total` | counter | | requests that could not be routed or sent |
//! | `requests_finished_total` | counter | `outcome` = ok, error (transport failure: a lost worker, an engine that timed out or could not be reached), rejected (the engine refused the request, e.g. a 4xx for a prompt over its context), cancelled (client left) | requests ended |
//! | `worker_failures_total` | counter | `worker`, `reason` = unreachable, timeout, lost | requests that failed on a worker at the transport (what passive health counts) |
//! | `worker_ejections_total` | counter | `worker`, `reason` | times passive health ejected a worker |
//! | `prediction_resets_total` | counter | `worker` | times an approximate-mode worker's predictions were dropped because its engine reported far fewer cached tokens than predicted (a restart, or evictions) |
//! | `http_auth_total` | counter | `outcome` = ok, missing (no `Authorization: Bearer`), invalid (a key not configured) | `/v1/*` requests judged by client authentication (only with API keys configured) |
//! | `prefill_placements_total` | counter | `site` = local, remote; `reason` = short_uncached, mostly_cached, prefill_queue_long (local), remote | conditional disaggregation's decisions: requests prefilled on their decode worker (aggregated) or on a prefill worker |
//! | `worker_ejected` | gauge | `worker` | 1 while passive health routes around the worker (workers never ejected have no sample) |
//! | `input_tokens_total` | counter | | prompt tokens of routed requests |
//! | `output_tokens_total` | counter | | tokens streamed back |
//! | `predicted_cached_tokens_total` | counter | | prompt tokens the index predicted cached |
//! | `predicted_kv_hit_rate` | histogram | | per request, predicted cached / prompt tokens |
//! | `routed_off_cache_total` | counter | | requests sent to a worker holding fewer of their prompt's blocks (device tier) than another eligible worker: the cost model judged that worker's load worth more than the hit |
//! | `forgone_cached_tokens_total` | counter | | for those requests, prompt tokens cached on the best eligible worker but not on the chosen one (against `predicted_cached_tokens_total`: the share of the fleet's hits the cost model traded for load) |
//! | `time_to_first_token_seconds` | histogram | | send to first token |
//! | `inter_token_latency_seconds` | histogram | | between tokens, per token |
//! | `routing_overhead_seconds` | histogram | `phase` = tokenizing, hashing, find_matches, scheduling | time in each routing phase (`tokenizing`: the HTTP frontend's chat template and tokenizer, for prompts sent as text) |
//! | `tokenizer_encoder` | gauge | `model`, `encoder` = fastokens, tokenizers, builtin | 1 for the encoder that tokenizes the served model's prompts (read at each scrape of the HTTP frontend's `/metrics`), 0 for one it fell back from (`fastokens`, once its ids differed from the `tokenizers` crate's) |
//! | `worker_active_blocks` | gauge | `worker`, `dp_rank` | active decode blocks (cost model view) |
//! | `worker_prefill_tokens` | gauge | `worker`, `dp_rank` | prompt tokens not yet prefilled |
//! | `worker_active_requests` | gauge | `worker`, `dp_rank` | requests in flight (the predicted count) |
//! | `worker_reported_requests` | gauge | `worker`, `dp_rank` | requests running plus waiting, as the worker last reported them |
//! | `worker_reported_kv_blocks` | gauge | `worker`, `dp_rank` | KV blocks in use, as the worker last reported them |
//! | `requests_reconciled_total` | counter | | other replicas' requests freed because their worker's report no longer counted them |
//! | `load_reports_total` | counter | `outcome` = applied, unregistered (a worker this router does not serve), invalid (undecodable or failing validation; dropped) | worker load reports received |
//! | `prediction_error_tokens` | histogram | `worker` | per request whose engine reported its cached prompt tokens: reported minus predicted (negative: the router over-predicted) |
//! | `cache_report_prompt_tokens_total` | counter | `worker` | prompt tokens of those requests |
//! | `cache_report_predicted_tokens_total` | counter | `worker` | tokens the router predicted cached for them |
//! | `cache_report_reported_tokens_total` | counter | `worker` | tokens the engines reported cached for them |
//! | `approx_capacity` | gauge | `worker`, `dp_rank`, `unit` = blocks, requests | an approximate-mode worker's learnt capacity that cuts its predictions, in the unit of the model in force (blocks of age for paged caches, requests of age for engines that keep a prompt a slot); no sample until its engine's reports have taught one |
//!
//! `worker_active_requests` against `worker_reported_requests` shows, per worker rank, how far
//! the router's prediction is from the engine's own queue (only for workers that report one;
//! the reported figure lags by the report interval, and counts requests other routers sent).
//!
//! The last three cache-report counters give, per worker, the predicted and the reported hit rate over the same
//! requests (`predicted / prompt` against `reported / prompt`): where the two part, the index does
//! not see the engine's cache as it is (wrong block size, salt, tokenizer, or lost events).
//!
//! When serving disaggregated, `/metrics` shows both phases' routers, each sample labelled
//! [`ROUTER_LABEL`] = [`ROUTER_PREFILL`] or [`ROUTER_DECODE`] (first label); otherwise no sample
//! has that label.

pub(crate) mod text;

use std::time::Duration;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use kvroute_protocols::{WorkerLoadReport, WorkerWithDpRank};
use kvroute_router_core::{Retention, Routed};
use kvroute_scheduler::WorkerLoad;
use std::sync::atomic::AtomicU64;

/// The prefix of every metric name.
pub const METRIC_PREFIX: &str = "kvroute_router";
/// The encoders `tokenizer_encoder` names (see [`crate::tokenizer::Tokenizer::encoder`]).
pub const TOKENIZER_ENCODERS: [&str; 3] = ["fastokens", "tokenizers", "builtin"];

/// The label telling, when serving disaggregated, which phase's router a sample is from.
pub const ROUTER_LABEL: &str = "router";

/// [`ROUTER_LABEL`]'s value on the prefill phase's router's samples.
pub const ROUTER_PREFILL: &str = "prefill";

/// [`ROUTER_LABEL`]'s value on the decode phase's router's samples.
pub const ROUTER_DECODE: &str = "decode";

type Labels = Vec<(&'static str, String)>;

fn outcome_labels(outcome: &str) -> Labels {
    vec![("outcome", outcome.to_owned())]
}

/// How a request ended, for `requests_finished_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The stream ended without an error.
    Ok,
    /// The worker or the transport failed it: a transport error (a lost worker, pinned or not,
    /// an engine that timed out or could not be reached) or an error finish reason, counted when
    /// the failure is seen, whatever drops the stream afterwards. A request migrated off a lost
    /// worker counts one `error` for that attempt and its continuation's own outcome.
    Error,
    /// The engine refused the request (an error item: a 4xx for a bad prompt, a 500): the
    /// request's fault or the engine's answer, not a routing or transport failure.
    Rejected,
    /// The caller dropped it before the end and before any failure: the client went away.
    Cancelled,
}

impl Outcome {
    const fn label(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Error => "error",
            Outcome::Rejected => "rejected",
            Outcome::Cancelled => "cancelled",
        }
    }
}

/// The router's metrics, registered in their own registry. Shared behind an `Arc`; every
/// method takes `&self`.
#[derive(Debug)]
pub struct RouterMetrics {
    registry: Registry,
    requests: Counter,
    queries: Counter,
    route_errors: Counter,
    finished: Family<Labels, Counter>,
    input_tokens: Counter,
    output_tokens: Counter,
    predicted_cached_tokens: Counter,
    predicted_hit_rate: Histogram,
    routed_off_cache: Counter,
    forgone_cached_tokens: Counter,
    ttft: Histogram,
    itl: Histogram,
    overhead: Family<Labels, Histogram, fn() -> Histogram>,
    worker_blocks: Family<Labels, Gauge<f64, AtomicU64>>,
    worker_prefill: Family<Labels, Gauge>,
    worker_requests: Family<Labels, Gauge>,
    worker_reported_requests: Family<Labels, Gauge>,
    worker_reported_blocks: Family<Labels, Gauge>,
    requests_reconciled: Counter,
    load_reports: Family<Labels, Counter>,
    prediction_error: Family<Labels, Histogram, fn() -> Histogram>,
    report_prompt: Family<Labels, Counter>,
    report_predicted: Family<Labels, Counter>,
    report_reported: Family<Labels, Counter>,
    worker_failures: Family<Labels, Counter>,
    worker_ejections: Family<Labels, Counter>,
    worker_ejected: Family<Labels, Gauge>,
    prediction_resets: Family<Labels, Counter>,
    approx_capacity: Family<Labels, Gauge<f64, AtomicU64>>,
    auth: Family<Labels, Counter>,
    prefill_placements: Family<Labels, Counter>,
    tokenizer_encoder: Family<Labels, Gauge>,
    /// Every worker ever ejected: those let back in read 0 on `worker_ejected`.
    ever_ejected: parking_lot::Mutex<std::collections::BTreeSet<kvroute_protocols::WorkerId>>,
}

impl Default for RouterMetrics {
    fn default() -> Self {
        Self::new()
    }
}

/// Signed token differences, symmetric around zero: 0, ±1, ±4, ... ±65,536.
fn prediction_error_histogram() -> Histogram {
    let positive = (0..9).map(|i| 4f64.powi(i));
    let mut bounds: Vec<f64> = positive.clone().rev().map(|b| -b).collect();
    bounds.push(0.0);
    bounds.extend(positive);
    Histogram::new(bounds)
}

fn overhead_histogram() -> Histogram {
    // 1 µs .. ~0.5 s.
    Histogram::new(exponential_buckets(1e-6, 2.0, 20))
}

impl RouterMetrics {
    /// Every metric, registered and at zero.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix(METRIC_PREFIX);
        let m = Self {
            requests: Counter::default(),
            queries: Counter::default(),
            route_errors: Counter::default(),
            finished: Family::default(),
            input_tokens: Counter::default(),
            output_tokens: Counter::default(),
            predicted_cached_tokens: Counter::default(),
            routed_off_cache: Counter::default(),
            forgone_cached_tokens: Counter::default(),
            // k / 10 rather than repeated additions of 0.1, so that bounds print as written
            // (`le="0.3"`, not `le="0.30000000000000004"`).
            predicted_hit_rate: Histogram::new((1..=10).map(|k| f64::from(k) / 10.0)),
            // 1 ms .. ~65 s.
            ttft: Histogram::new(exponential_buckets(1e-3, 2.0, 17)),
            // 100 µs .. ~6.5 s.
            itl: Histogram::new(exponential_buckets(1e-4, 2.0, 17)),
            overhead: Family::new_with_constructor(overhead_histogram),
            worker_blocks: Family::default(),
            worker_prefill: Family::default(),
            worker_requests: Family::default(),
            worker_reported_requests: Family::default(),
            worker_reported_blocks: Family::default(),
            requests_reconciled: Counter::default(),
            load_reports: Family::default(),
            prediction_error: Family::new_with_constructor(prediction_error_histogram),
            report_prompt: Family::default(),
            report_predicted: Family::default(),
            report_reported: Family::default(),
            worker_failures: Family::default(),
            worker_ejections: Family::default(),
            worker_ejected: Family::default(),
            prediction_resets: Family::default(),
            approx_capacity: Family::default(),
            auth: Family::default(),
            prefill_placements: Family::default(),
            tokenizer_encoder: Family::default(),
            ever_ejected: parking_lot::Mutex::default(),
            registry: Registry::default(),
        };
        m.register_all(&mut registry);
        Self { registry, ..m }
    }

    /// Registers every metric (clones sharing their values) in `registry`, by area, in the order
    /// `/metrics` lists them.
    fn register_all(&self, registry: &mut Registry) {
        self.register_health(registry);
        self.register_requests(registry);
        self.register_workers(registry);
        self.register_cache_reports(registry);
    }

    /// Passive health and client authentication.
    fn register_health(&self, registry: &mut Registry) {
        registry.register(
            "worker_failures",
            "Requests that failed on a worker at the transport, by reason",
            self.worker_failures.clone(),
        );
        registry.register(
            "worker_ejections",
            "Times passive health ejected a worker, by the failure that did it",
            self.worker_ejections.clone(),
        );
        registry.register(
            "prediction_resets",
            "Times an approximate-mode worker's predictions were dropped after its engine reported far fewer cached tokens",
            self.prediction_resets.clone(),
        );
        registry.register(
            "http_auth",
            "Requests judged by client authentication, by outcome (ok, missing, invalid)",
            self.auth.clone(),
        );
        registry.register(
            "worker_ejected",
            "1 while passive health routes around the worker",
            self.worker_ejected.clone(),
        );
    }

    /// Requests, tokens, predicted cache hits and routing time.
    fn register_requests(&self, registry: &mut Registry) {
        registry.register(
            "requests",
            "Requests routed to a worker",
            self.requests.clone(),
        );
        registry.register(
            "queries",
            "Query-only requests answered",
            self.queries.clone(),
        );
        registry.register(
            "route_errors",
            "Requests that could not be routed or sent",
            self.route_errors.clone(),
        );
        registry.register(
            "requests_finished",
            "Requests ended, by outcome",
            self.finished.clone(),
        );
        registry.register(
            "prefill_placements",
            "Conditional disaggregation's decisions: prefill on the decode worker (local) or a prefill worker (remote), by reason",
            self.prefill_placements.clone(),
        );
        registry.register(
            "input_tokens",
            "Prompt tokens of routed requests",
            self.input_tokens.clone(),
        );
        registry.register(
            "output_tokens",
            "Output tokens streamed back",
            self.output_tokens.clone(),
        );
        registry.register(
            "predicted_cached_tokens",
            "Prompt tokens the KV index predicted cached on the chosen worker",
            self.predicted_cached_tokens.clone(),
        );
        registry.register(
            "predicted_kv_hit_rate",
            "Per request, predicted cached tokens over prompt tokens",
            self.predicted_hit_rate.clone(),
        );
        registry.register(
            "routed_off_cache",
            "Requests sent to a worker holding fewer of their prompt's blocks than another eligible worker",
            self.routed_off_cache.clone(),
        );
        registry.register(
            "forgone_cached_tokens",
            "Prompt tokens cached on the best eligible worker but not on the chosen one",
            self.forgone_cached_tokens.clone(),
        );
        registry.register(
            "time_to_first_token_seconds",
            "Time from sending a request to its first token",
            self.ttft.clone(),
        );
        registry.register(
            "inter_token_latency_seconds",
            "Time between output tokens",
            self.itl.clone(),
        );
        registry.register(
            "routing_overhead_seconds",
            "Time spent routing, by phase",
            self.overhead.clone(),
        );
        registry.register(
            "tokenizer_encoder",
            "1 for the encoder that tokenizes a served model's prompts (fastokens, tokenizers, builtin), 0 for one it fell back from",
            self.tokenizer_encoder.clone(),
        );
    }

    /// Per-worker load, as tracked and as reported, and the load reports.
    fn register_workers(&self, registry: &mut Registry) {
        registry.register(
            "worker_active_blocks",
            "Active KV blocks per worker rank, as the cost model sees them",
            self.worker_blocks.clone(),
        );
        registry.register(
            "worker_prefill_tokens",
            "Prompt tokens not yet prefilled per worker rank",
            self.worker_prefill.clone(),
        );
        registry.register(
            "worker_active_requests",
            "Requests in flight per worker rank",
            self.worker_requests.clone(),
        );
        registry.register(
            "worker_reported_requests",
            "Requests running plus waiting per worker rank, as the worker last reported them",
            self.worker_reported_requests.clone(),
        );
        registry.register(
            "worker_reported_kv_blocks",
            "KV blocks in use per worker rank, as the worker last reported them",
            self.worker_reported_blocks.clone(),
        );
        registry.register(
            "requests_reconciled",
            "Other replicas' requests freed because their worker's report no longer counted them",
            self.requests_reconciled.clone(),
        );
        registry.register(
            "load_reports",
            "Worker load reports received, by outcome",
            self.load_reports.clone(),
        );
    }

    /// The engines' cached-token reports against the router's predictions.
    fn register_cache_reports(&self, registry: &mut Registry) {
        registry.register(
            "prediction_error_tokens",
            "Per request, cached prompt tokens the engine reported minus those the router predicted",
            self.prediction_error.clone(),
        );
        registry.register(
            "cache_report_prompt_tokens",
            "Prompt tokens of requests whose engine reported its cached tokens",
            self.report_prompt.clone(),
        );
        registry.register(
            "cache_report_predicted_tokens",
            "Cached tokens the router predicted for requests whose engine reported its own",
            self.report_predicted.clone(),
        );
        registry.register(
            "cache_report_reported_tokens",
            "Cached prompt tokens the engines reported",
            self.report_reported.clone(),
        );
        registry.register(
            "approx_capacity",
            "An approximate-mode worker's learnt capacity cutting its predictions, by unit (blocks or requests of age)",
            self.approx_capacity.clone(),
        );
    }

    /// A request was routed: its prompt, predicted cache hits, the hits its worker forgoes
    /// against the best cached eligible worker, and routing time.
    pub fn on_routed(&self, routed: &Routed, block_size: u32) {
        let isl_tokens = routed.isl_tokens;
        let predicted_cached_tokens = routed.predicted_cached_tokens(block_size);
        self.requests.inc();
        self.input_tokens.inc_by(isl_tokens);
        self.predicted_cached_tokens.inc_by(predicted_cached_tokens);
        if isl_tokens > 0 {
            self.predicted_hit_rate
                .observe(predicted_cached_tokens as f64 / isl_tokens as f64);
        }
        let forgone = routed.forgone_cached_tokens(block_size);
        if forgone > 0 {
            self.routed_off_cache.inc();
            self.forgone_cached_tokens.inc_by(forgone);
        }
        for (phase, d) in [
            ("hashing", routed.timings.hashing),
            ("find_matches", routed.timings.find_matches),
            ("scheduling", routed.timings.scheduling),
        ] {
            self.overhead
                .get_or_create(&vec![("phase", phase.to_owned())])
                .observe(d.as_secs_f64());
        }
    }

    /// A request's prompt was tokenized (with the chat template, for a chat request) in `d`.
    pub fn on_tokenized(&self, d: Duration) {
        self.overhead
            .get_or_create(&vec![("phase", "tokenizing".to_owned())])
            .observe(d.as_secs_f64());
    }

    /// The served model `model`'s prompts are encoded by `encoder` (one of
    /// [`TOKENIZER_ENCODERS`]): its `tokenizer_encoder` sample reads 1, and any other encoder's
    /// sample the model had reads 0.
    pub fn set_tokenizer_encoder(&self, model: &str, encoder: &str) {
        let labels = |e: &str| vec![("model", model.to_owned()), ("encoder", e.to_owned())];
        for other in TOKENIZER_ENCODERS.iter().filter(|e| **e != encoder) {
            if let Some(gauge) = self.tokenizer_encoder.get(&labels(other)) {
                gauge.set(0);
            }
        }
        self.tokenizer_encoder
            .get_or_create(&labels(encoder))
            .set(1);
    }

    /// A query-only request was answered.
    pub fn on_query(&self) {
        self.queries.inc();
    }

    /// Conditional disaggregation placed a request's prefill: `local` on its decode worker (for
    /// `reason`) or remotely.
    pub fn on_prefill_placement(&self, local: bool, reason: &str) {
        let site = if local { "local" } else { "remote" };
        self.prefill_placements
            .get_or_create(&vec![
                ("site", site.to_owned()),
                ("reason", reason.to_owned()),
            ])
            .inc();
    }

    /// A request could not be routed or sent.
    pub fn on_route_error(&self) {
        self.route_errors.inc();
    }

    /// The first token arrived `ttft` after sending.
    pub fn on_first_token(&self, ttft: Duration) {
        self.ttft.observe(ttft.as_secs_f64());
    }

    /// `tokens` more output tokens arrived, `since_last` after the previous ones.
    pub fn on_tokens(&self, tokens: u64, since_last: Option<Duration>) {
        self.output_tokens.inc_by(tokens);
        if let Some(d) = since_last
            && tokens > 0
        {
            let per_token = d.as_secs_f64() / tokens as f64;
            for _ in 0..tokens.min(64) {
                self.itl.observe(per_token);
            }
        }
    }

    /// `worker`'s engine reported `reported` of a request's `isl_tokens` prompt tokens cached,
    /// where the router predicted `predicted`.
    pub fn on_cache_report(
        &self,
        worker: WorkerWithDpRank,
        isl_tokens: u64,
        predicted: u64,
        reported: u64,
    ) {
        let labels = vec![("worker", worker.worker_id.to_string())];
        self.prediction_error
            .get_or_create(&labels)
            .observe(reported as f64 - predicted as f64);
        self.report_prompt.get_or_create(&labels).inc_by(isl_tokens);
        self.report_predicted
            .get_or_create(&labels)
            .inc_by(predicted);
        self.report_reported.get_or_create(&labels).inc_by(reported);
    }

    /// Replaces `approx_capacity` with these capacities in force (workers not listed, and a
    /// worker's other unit, have no sample).
    pub fn set_approx_capacities(
        &self,
        capacities: impl IntoIterator<Item = (WorkerWithDpRank, Retention)>,
    ) {
        self.approx_capacity.clear();
        for (w, retention) in capacities {
            let labels = vec![
                ("worker", w.worker_id.to_string()),
                ("dp_rank", w.dp_rank.to_string()),
                ("unit", retention.unit().to_owned()),
            ];
            self.approx_capacity
                .get_or_create(&labels)
                .set(retention.capacity());
        }
    }

    /// A request ended.
    pub fn on_finished(&self, outcome: Outcome) {
        self.finished
            .get_or_create(&outcome_labels(outcome.label()))
            .inc();
    }

    /// A request failed on `worker` at the transport for `reason` (see
    /// [`crate::health::HealthFailure::label`]).
    pub fn on_worker_failure(&self, worker: kvroute_protocols::WorkerId, reason: &str) {
        self.worker_failures
            .get_or_create(&vec![
                ("worker", worker.to_string()),
                ("reason", reason.to_owned()),
            ])
            .inc();
    }

    /// An approximate-mode worker's predictions were dropped (see `prediction_resets_total`).
    pub fn on_prediction_reset(&self, worker: kvroute_protocols::WorkerId) {
        self.prediction_resets
            .get_or_create(&vec![("worker", worker.to_string())])
            .inc();
    }

    /// Client authentication judged a request (`outcome` = ok, missing, invalid).
    pub fn on_auth(&self, outcome: &str) {
        self.auth.get_or_create(&outcome_labels(outcome)).inc();
    }

    /// Passive health ejected `worker` after a failure for `reason`.
    pub fn on_worker_ejected(&self, worker: kvroute_protocols::WorkerId, reason: &str) {
        self.worker_ejections
            .get_or_create(&vec![
                ("worker", worker.to_string()),
                ("reason", reason.to_owned()),
            ])
            .inc();
    }

    /// Sets `worker_ejected` for every worker passive health has ever ejected: 1 for those in
    /// `ejected`, 0 for the others that have a sample.
    pub fn set_ejected(&self, ejected: &[kvroute_protocols::WorkerId]) {
        let mut ever = self.ever_ejected.lock();
        ever.extend(ejected.iter().copied());
        for &worker in ever.iter() {
            self.worker_ejected
                .get_or_create(&vec![("worker", worker.to_string())])
                .set(i64::from(ejected.contains(&worker)));
        }
    }

    /// Replaces the per-worker gauges with these loads (workers not listed disappear).
    pub fn set_worker_loads(
        &self,
        loads: impl IntoIterator<Item = (WorkerWithDpRank, WorkerLoad)>,
    ) {
        self.worker_blocks.clear();
        self.worker_prefill.clear();
        self.worker_requests.clear();
        for (w, load) in loads {
            let labels = vec![
                ("worker", w.worker_id.to_string()),
                ("dp_rank", w.dp_rank.to_string()),
            ];
            self.worker_blocks
                .get_or_create(&labels)
                .set(load.decode_blocks);
            self.worker_prefill
                .get_or_create(&labels)
                .set(i64::try_from(load.prefill_tokens).unwrap_or(i64::MAX));
            self.worker_requests
                .get_or_create(&labels)
                .set(i64::try_from(load.active_requests).unwrap_or(i64::MAX));
        }
    }

    /// Replaces the reported-load gauges with these reports (workers not listed disappear; a
    /// figure a worker did not report has no sample).
    pub fn set_worker_reports<'a>(
        &self,
        reports: impl IntoIterator<Item = (WorkerWithDpRank, &'a WorkerLoadReport)>,
    ) {
        self.worker_reported_requests.clear();
        self.worker_reported_blocks.clear();
        for (w, report) in reports {
            let labels = vec![
                ("worker", w.worker_id.to_string()),
                ("dp_rank", w.dp_rank.to_string()),
            ];
            if let Some(requests) = report.requests() {
                self.worker_reported_requests
                    .get_or_create(&labels)
                    .set(i64::try_from(requests).unwrap_or(i64::MAX));
            }
            if let Some(blocks) = report.kv_used_blocks {
                self.worker_reported_blocks
                    .get_or_create(&labels)
                    .set(i64::try_from(blocks).unwrap_or(i64::MAX));
            }
        }
    }

    /// Brings `requests_reconciled_total` up to `total`, the scheduler's own monotonic count
    /// (a smaller `total` changes nothing: a counter never goes down).
    pub fn set_requests_reconciled(&self, total: u64) {
        let delta = total.saturating_sub(self.requests_reconciled.get());
        self.requests_reconciled.inc_by(delta);
    }

    /// Brings `load_reports_total{outcome="applied"|"unregistered"}` up to the core's own
    /// monotonic counts (smaller figures change nothing).
    pub fn set_load_reports(&self, applied: u64, unregistered: u64) {
        for (outcome, total) in [("applied", applied), ("unregistered", unregistered)] {
            let counter = self.load_reports.get_or_create(&outcome_labels(outcome));
            counter.inc_by(total.saturating_sub(counter.get()));
        }
    }

    /// A load report was dropped: undecodable, or failing validation.
    pub fn on_invalid_load_report(&self) {
        self.load_reports
            .get_or_create(&outcome_labels("invalid"))
            .inc();
    }

    /// The Prometheus text exposition of every metric (for a `/metrics` endpoint).
    pub fn encode_text(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }

    /// [`Self::encode_text`] with `router="<router>"` ([`ROUTER_LABEL`]) as the first label of
    /// every sample: the same families, help and values, told apart from another router's.
    pub fn encode_text_labelled(&self, router: &str) -> String {
        let mut registry = Registry::with_prefix_and_labels(
            METRIC_PREFIX,
            std::iter::once((ROUTER_LABEL.into(), router.to_owned().into())),
        );
        self.register_all(&mut registry);
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &registry);
        out
    }
}

#[cfg(test)]
mod tests;
