//! One simulated engine's `/metrics`, under vLLM 0.33's Prometheus names and labels
//! (`engine="0"`, `model_name`), so that kvroute-engines' vLLM load reader and any vLLM-aware
//! router read it as a vLLM server's.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use kvroute_protocols::WorkerLoadReport;

/// Counters kept as requests finish (vLLM counts prefix-cache queries and hits in tokens).
#[derive(Debug, Default)]
pub(super) struct Counters {
    pub(super) prefix_queries: AtomicU64,
    pub(super) prefix_hits: AtomicU64,
    pub(super) prompt_tokens: AtomicU64,
    pub(super) generation_tokens: AtomicU64,
    pub(super) requests_finished: AtomicU64,
    /// Times to first token, counted per bucket of [`TTFT_BUCKETS`] (the first bound at or
    /// above each time; the last slot past the last bound), not cumulated.
    ttft_buckets: [AtomicU64; TTFT_BUCKETS.len() + 1],
    ttft_nanos: AtomicU64,
    ttft_count: AtomicU64,
}

/// The upper bounds, in seconds, of vLLM's `vllm:time_to_first_token_seconds` buckets.
const TTFT_BUCKETS: [f64; 22] = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];

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

    /// Counts one request's time from its arrival at the engine to its first output token (in
    /// the engine's own real time, sped up as it runs): what vLLM's TTFT histogram counts, and
    /// what tells a router's lag from the engine's.
    pub(super) fn first_token(&self, ttft: Duration) {
        let seconds = ttft.as_secs_f64();
        let bucket = TTFT_BUCKETS
            .iter()
            .position(|&bound| seconds <= bound)
            .unwrap_or(TTFT_BUCKETS.len());
        self.ttft_buckets[bucket].fetch_add(1, Ordering::Relaxed);
        let nanos = u64::try_from(ttft.as_nanos()).unwrap_or(u64::MAX);
        self.ttft_nanos.fetch_add(nanos, Ordering::Relaxed);
        self.ttft_count.fetch_add(1, Ordering::Relaxed);
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
    let name = "vllm:time_to_first_token_seconds";
    let _ = writeln!(
        out,
        "# HELP {name} Histogram of time to first token in seconds."
    );
    let _ = writeln!(out, "# TYPE {name} histogram");
    let mut below = 0;
    for (bound, n) in TTFT_BUCKETS.iter().zip(&counters.ttft_buckets) {
        below += n.load(Ordering::Relaxed);
        let _ = writeln!(
            out,
            "{name}_bucket{{{labels},le=\"{bound:?}\"}} {below:?}.0"
        );
    }
    let count = counters.ttft_count.load(Ordering::Relaxed);
    let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {count:?}.0");
    let sum = counters.ttft_nanos.load(Ordering::Relaxed) as f64 / 1e9;
    let _ = writeln!(out, "{name}_sum{{{labels}}} {sum:?}");
    let _ = writeln!(out, "{name}_count{{{labels}}} {count:?}.0");
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

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(text: &str, series: &str) -> f64 {
        text.lines()
            .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {series} in\n{text}"))
    }

    #[test]
    fn time_to_first_token_is_vllms_cumulative_histogram() {
        let counters = Counters::default();
        counters.first_token(Duration::from_millis(3));
        counters.first_token(Duration::from_millis(50));
        counters.first_token(Duration::from_secs(3000));
        let cache = CacheShape {
            block_size: 16,
            num_blocks: 100,
        };
        let text = render("m", &WorkerLoadReport::default(), &counters, &cache);
        let series = |le: &str| {
            format!(
                "vllm:time_to_first_token_seconds_bucket{{engine=\"0\",model_name=\"m\",le=\"{le}\"}}"
            )
        };
        assert_eq!(sample(&text, &series("0.001")), 0.0);
        assert_eq!(sample(&text, &series("0.005")), 1.0);
        assert_eq!(sample(&text, &series("0.04")), 1.0);
        assert_eq!(sample(&text, &series("0.06")), 2.0);
        assert_eq!(sample(&text, &series("2560.0")), 2.0);
        assert_eq!(sample(&text, &series("+Inf")), 3.0);
        let labels = "{engine=\"0\",model_name=\"m\"}";
        assert_eq!(
            sample(
                &text,
                &format!("vllm:time_to_first_token_seconds_count{labels}")
            ),
            3.0
        );
        let sum = sample(
            &text,
            &format!("vllm:time_to_first_token_seconds_sum{labels}"),
        );
        assert!((sum - 3000.053).abs() < 1e-6, "{sum}");
        assert!(text.contains("# TYPE vllm:time_to_first_token_seconds histogram"));
    }
}
