//! One simulated engine's `/metrics`, under vLLM 0.33's Prometheus names and labels
//! (`engine="0"`, `model_name`), so that kvroute-engines' vLLM load reader and any vLLM-aware
//! router read it as a vLLM server's.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};

use kvroute_protocols::WorkerLoadReport;

/// Counters kept as requests finish (vLLM counts prefix-cache queries and hits in tokens).
#[derive(Debug, Default)]
pub(super) struct Counters {
    pub(super) prefix_queries: AtomicU64,
    pub(super) prefix_hits: AtomicU64,
    pub(super) prompt_tokens: AtomicU64,
    pub(super) generation_tokens: AtomicU64,
    pub(super) requests_finished: AtomicU64,
}

impl Counters {
    /// Counts one finished request.
    pub(super) fn finished(&self, prompt: u32, cached: u32, generated: u32) {
        self.prefix_queries
            .fetch_add(u64::from(prompt), Ordering::Relaxed);
        self.prefix_hits
            .fetch_add(u64::from(cached), Ordering::Relaxed);
        self.prompt_tokens
            .fetch_add(u64::from(prompt), Ordering::Relaxed);
        self.generation_tokens
            .fetch_add(u64::from(generated), Ordering::Relaxed);
        self.requests_finished.fetch_add(1, Ordering::Relaxed);
    }
}

/// What the page states about the engine's cache.
pub(super) struct CacheShape {
    pub(super) block_size: u32,
    pub(super) num_blocks: u32,
}

/// The Prometheus text. vLLM's `num_gpu_blocks` counts its null block, and its usage is
/// `used / (num_gpu_blocks - 1)`, so the page states `num_blocks + 1`.
pub(super) fn render(
    model: &str,
    load: &WorkerLoadReport,
    counters: &Counters,
    cache: &CacheShape,
) -> String {
    let labels = format!("engine=\"0\",model_name=\"{}\"", model.replace('"', "\\\""));
    let mut out = String::new();
    let mut metric = |name: &str, kind: &str, help: &str, value: f64| {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} {kind}");
        let _ = writeln!(out, "{name}{{{labels}}} {value:?}");
    };
    let used = load.kv_used_blocks.unwrap_or(0) as f64;
    let c = |a: &AtomicU64| a.load(Ordering::Relaxed) as f64;
    metric(
        "vllm:num_requests_running",
        "gauge",
        "Number of requests in model execution batches.",
        load.requests_running.unwrap_or(0) as f64,
    );
    metric(
        "vllm:num_requests_waiting",
        "gauge",
        "Number of requests waiting to be processed.",
        load.requests_waiting.unwrap_or(0) as f64,
    );
    metric(
        "vllm:kv_cache_usage_perc",
        "gauge",
        "KV-cache usage. 1 means 100 percent usage.",
        used / f64::from(cache.num_blocks.max(1)),
    );
    metric(
        "vllm:prefix_cache_queries_total",
        "counter",
        "Prefix cache queries, in terms of number of queried tokens.",
        c(&counters.prefix_queries),
    );
    metric(
        "vllm:prefix_cache_hits_total",
        "counter",
        "Prefix cache hits, in terms of number of cached tokens.",
        c(&counters.prefix_hits),
    );
    metric(
        "vllm:prompt_tokens_total",
        "counter",
        "Number of prefill tokens processed.",
        c(&counters.prompt_tokens),
    );
    metric(
        "vllm:generation_tokens_total",
        "counter",
        "Number of generation tokens processed.",
        c(&counters.generation_tokens),
    );
    metric(
        "vllm:request_success_total",
        "counter",
        "Count of successfully processed requests.",
        c(&counters.requests_finished),
    );
    let _ = writeln!(
        out,
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n\
         # TYPE vllm:cache_config_info gauge\n\
         vllm:cache_config_info{{block_size=\"{}\",cache_dtype=\"auto\",\
         enable_prefix_caching=\"True\",engine=\"0\",num_gpu_blocks=\"{}\",\
         prefix_caching_hash_algo=\"sha256\"}} 1.0",
        cache.block_size,
        u64::from(cache.num_blocks) + 1,
    );
    out
}
