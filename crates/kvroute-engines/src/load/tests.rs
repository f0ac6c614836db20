use super::*;

const URL: &str = "http://engine/metrics";

fn bs(n: u32) -> NonZeroU32 {
    NonZeroU32::new(n).expect("nonzero")
}

/// Reads `text` as a `kind` engine's metrics with blocks of `block_size`, and renders each rank
/// as `rank R: running N, waiting M, kv B of T` (`kv -` for `None`, no `of T` without a
/// total), one a line, or the error.
fn check(kind: EngineKind, block_size: u32, text: &str, expect: &str) {
    let got = match read(kind, text, bs(block_size), URL) {
        Ok(loads) => loads
            .iter()
            .map(|l| {
                let mut kv = l.kv_used_blocks.map_or("-".to_owned(), |b| b.to_string());
                if let Some(total) = l.kv_total_blocks {
                    kv = format!("{kv} of {total}");
                }
                format!(
                    "rank {}: running {}, waiting {}, kv {kv}",
                    l.dp_rank, l.requests_running, l.requests_waiting
                )
            })
            .collect::<Vec<_>>()
            .join("\n"),
        Err(e) => format!("error: {e}"),
    };
    assert_eq!(got, expect, "text:\n{text}");
}

const VLLM_SINGLE: &str = include_str!("../../tests/fixtures/metrics/vllm_single.txt");
const VLLM_DP2: &str = include_str!("../../tests/fixtures/metrics/vllm_dp2.txt");
const SGLANG_SINGLE: &str = include_str!("../../tests/fixtures/metrics/sglang_single.txt");
const SGLANG_DP2: &str = include_str!("../../tests/fixtures/metrics/sglang_dp2_priority.txt");
const LLAMACPP_BUSY: &str = include_str!("../../tests/fixtures/metrics/llamacpp_busy.txt");

#[test]
fn vllm_one_engine_states_its_blocks_in_use() {
    // 3 running, 2 waiting for capacity + 1 deferred, 37 of 999 usable blocks of 16 tokens.
    check(
        EngineKind::Vllm,
        16,
        VLLM_SINGLE,
        "rank 0: running 3, waiting 3, kv 37 of 999",
    );
    // 37 blocks of 16 = 592 tokens = 18.5 blocks of 32, 74 of 8.
    check(
        EngineKind::Vllm,
        32,
        VLLM_SINGLE,
        "rank 0: running 3, waiting 3, kv 19 of 499",
    );
    check(
        EngineKind::Vllm,
        8,
        VLLM_SINGLE,
        "rank 0: running 3, waiting 3, kv 74 of 1998",
    );
}

#[test]
fn vllm_data_parallel_ranks_are_split_by_engine_label() {
    // The server's num_gpu_blocks is the sum over both engines: KV use per engine is unknown.
    check(
        EngineKind::Vllm,
        16,
        VLLM_DP2,
        "rank 0: running 4, waiting 1, kv -\nrank 1: running 2, waiting 0, kv -",
    );
}

#[test]
fn older_vllm_names_its_usage_gpu_cache_usage_perc() {
    let text = VLLM_SINGLE.replace("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc");
    check(
        EngineKind::Vllm,
        16,
        &text,
        "rank 0: running 3, waiting 3, kv 37 of 999",
    );
}

#[test]
fn vllm_kv_is_unknown_without_its_total_or_with_an_odd_usage() {
    let without_info: String = VLLM_SINGLE
        .lines()
        .filter(|l| !l.starts_with("vllm:cache_config_info"))
        .map(|l| format!("{l}\n"))
        .collect();
    check(
        EngineKind::Vllm,
        16,
        &without_info,
        "rank 0: running 3, waiting 3, kv -",
    );
    let not_profiled = VLLM_SINGLE.replace("num_gpu_blocks=\"1000\"", "num_gpu_blocks=\"None\"");
    check(
        EngineKind::Vllm,
        16,
        &not_profiled,
        "rank 0: running 3, waiting 3, kv -",
    );
    let usage = "vllm:num_requests_running 1\nvllm:num_requests_waiting 0\n\
                 vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"101\"} 1\n";
    check(
        EngineKind::Vllm,
        16,
        &format!("{usage}vllm:kv_cache_usage_perc 0.5\n"),
        "rank 0: running 1, waiting 0, kv 50 of 100",
    );
    check(
        EngineKind::Vllm,
        16,
        &format!("{usage}vllm:kv_cache_usage_perc NaN\n"),
        "rank 0: running 1, waiting 0, kv - of 100",
    );
    check(
        EngineKind::Vllm,
        16,
        &format!("{usage}vllm:kv_cache_usage_perc 1.5\n"),
        "rank 0: running 1, waiting 0, kv - of 100",
    );
    check(
        EngineKind::Vllm,
        16,
        usage,
        "rank 0: running 1, waiting 0, kv - of 100",
    );
}

#[test]
fn vllm_missing_or_partial_request_gauges_are_named() {
    let text = "vllm:num_requests_waiting{engine=\"0\"} 1\n";
    check(
        EngineKind::Vllm,
        16,
        text,
        "error: engine metrics at http://engine/metrics have no `vllm:num_requests_running` \
         (is the engine the kind the config names?)",
    );
    let text = "vllm:num_requests_running{engine=\"0\"} 1\n\
                vllm:num_requests_running{engine=\"1\"} 1\n\
                vllm:num_requests_waiting{engine=\"0\"} 1\n";
    check(
        EngineKind::Vllm,
        16,
        text,
        "error: engine metrics at http://engine/metrics have no \
         `vllm:num_requests_waiting{engine=\"1\"}` (is the engine the kind the config names?)",
    );
    // The metrics of another engine than the config names.
    check(
        EngineKind::Sglang,
        16,
        VLLM_SINGLE,
        "error: engine metrics at http://engine/metrics have no `sglang:num_running_reqs` \
         (is the engine the kind the config names?)",
    );
}

#[test]
fn request_counts_must_be_whole_numbers() {
    for value in ["NaN", "-1", "2.5", "+Inf", "1e300"] {
        check(
            EngineKind::Llamacpp,
            16,
            &format!("llamacpp:requests_processing {value}\nllamacpp:requests_deferred 0\n"),
            &format!(
                "error: engine metrics at http://engine/metrics give \
                 `llamacpp:requests_processing` = {}; expected a whole number >= 0",
                value
                    .parse::<f64>()
                    .map_or(value.to_owned(), |v| v.to_string())
            ),
        );
    }
    check(
        EngineKind::Llamacpp,
        16,
        "llamacpp:requests_processing 3.0\nllamacpp:requests_deferred -0\n",
        "rank 0: running 3, waiting 0, kv -",
    );
}

#[test]
fn a_rank_label_that_is_not_a_number_is_malformed() {
    check(
        EngineKind::Vllm,
        16,
        "vllm:num_requests_running{engine=\"zero\"} 1\n",
        "error: engine metrics at http://engine/metrics are not Prometheus text: \
         `vllm:num_requests_running{engine=\"zero\"}` has engine=\"zero\"; expected a \
         data-parallel rank (a whole number)",
    );
}

#[test]
fn sglang_states_used_tokens() {
    // 5 running, 3 queued, 1500 token slots in use = 93.75 blocks of 16, of 100,000 in all.
    check(
        EngineKind::Sglang,
        16,
        SGLANG_SINGLE,
        "rank 0: running 5, waiting 3, kv 94 of 6250",
    );
    check(
        EngineKind::Sglang,
        1,
        SGLANG_SINGLE,
        "rank 0: running 5, waiting 3, kv 1500 of 100000",
    );
}

#[test]
fn sglang_reads_totals_per_dp_rank_not_per_priority() {
    check(
        EngineKind::Sglang,
        16,
        SGLANG_DP2,
        "rank 0: running 4, waiting 2, kv 44 of 6250\nrank 1: running 1, waiting 6, kv 3 of 6250",
    );
}

#[test]
fn sglang_before_kv_used_tokens_states_num_used_tokens() {
    let text: String = SGLANG_SINGLE
        .lines()
        .filter(|l| !l.starts_with("sglang:kv_used_tokens"))
        .map(|l| format!("{l}\n"))
        .collect();
    // num_used_tokens is 1700 in the fixture.
    check(
        EngineKind::Sglang,
        1,
        &text,
        "rank 0: running 5, waiting 3, kv 1700 of 100000",
    );
}

#[test]
fn sglang_counts_the_grammar_queue_as_waiting_and_reads_one_copy_per_rank() {
    // --enable-metrics-for-all-schedulers: every TP rank of dp rank 0 reports the same figures.
    let text = "sglang:num_running_reqs{dp_rank=\"0\",pp_rank=\"0\",tp_rank=\"1\"} 9\n\
                sglang:num_running_reqs{dp_rank=\"0\",pp_rank=\"0\",tp_rank=\"0\"} 2\n\
                sglang:num_queue_reqs{dp_rank=\"0\",pp_rank=\"0\",tp_rank=\"1\"} 9\n\
                sglang:num_queue_reqs{dp_rank=\"0\",pp_rank=\"0\",tp_rank=\"0\"} 1\n\
                sglang:num_grammar_queue_reqs{dp_rank=\"0\",pp_rank=\"0\",tp_rank=\"0\"} 4\n";
    check(
        EngineKind::Sglang,
        16,
        text,
        "rank 0: running 2, waiting 5, kv -",
    );
}

#[test]
fn sglang_counts_the_disaggregation_queues_a_request_waits_in() {
    // A decode worker (SGLang 0.5.23, `--disaggregation-mode decode`): its requests waiting for
    // KV memory and for their KV to arrive wait as surely as those in the waiting queue; the
    // host-receive queue is a part of the transfer queue, so it is not added again.
    let decode = "sglang:num_running_reqs{dp_rank=\"1\"} 6\n\
                  sglang:num_queue_reqs{dp_rank=\"1\"} 1\n\
                  sglang:num_decode_prealloc_queue_reqs{dp_rank=\"1\"} 2\n\
                  sglang:num_decode_transfer_queue_reqs{dp_rank=\"1\"} 3\n\
                  sglang:num_decode_host_receive_queue_reqs{dp_rank=\"1\"} 3\n";
    check(
        EngineKind::Sglang,
        16,
        decode,
        "rank 1: running 6, waiting 6, kv -",
    );
    // A prefill worker: requests waiting for the decode side's handshake are waiting; those in
    // flight have finished their prefill and only send their KV.
    let prefill = "sglang:num_running_reqs 2\n\
                   sglang:num_queue_reqs 4\n\
                   sglang:num_prefill_bootstrap_queue_reqs 5\n\
                   sglang:num_prefill_inflight_queue_reqs 7\n";
    check(
        EngineKind::Sglang,
        16,
        prefill,
        "rank 0: running 2, waiting 9, kv -",
    );
}

#[test]
fn llamacpp_busy_server() {
    // Recorded from a real llama.cpp server with one slot and three requests.
    check(
        EngineKind::Llamacpp,
        16,
        LLAMACPP_BUSY,
        "rank 0: running 1, waiting 2, kv -",
    );
}

#[test]
fn trtllm_and_openai_are_unsupported() {
    for kind in [EngineKind::Trtllm, EngineKind::Openai] {
        check(
            kind,
            16,
            LLAMACPP_BUSY,
            &format!(
                "error: reading the load of a {kind} engine is not supported: it publishes no \
                 request gauges"
            ),
        );
    }
}

#[test]
fn blocks_in_use_is_exact_for_every_count_vllm_can_state() {
    // vLLM computes 1.0 - free / (num_gpu_blocks - 1) in f64; the count comes back exactly.
    for num_gpu_blocks in [2_u64, 3, 1000, 65_537, 1_048_577] {
        let usable = num_gpu_blocks - 1;
        let step = (usable / 97).max(1);
        for used in (0..=usable).step_by(usize::try_from(step).unwrap()) {
            #[allow(clippy::cast_precision_loss)]
            let usage = 1.0 - ((usable - used) as f64 / usable as f64);
            assert_eq!(
                blocks_in_use(usage, num_gpu_blocks),
                Some(used),
                "{used}/{usable}"
            );
        }
    }
    assert_eq!(blocks_in_use(0.5, 1), None);
    assert_eq!(blocks_in_use(0.5, 0), None);
}

#[test]
fn a_load_becomes_a_valid_report() {
    let load = EngineLoad {
        dp_rank: 1,
        requests_running: 2,
        requests_waiting: 3,
        kv_used_blocks: Some(4),
        kv_total_blocks: Some(10),
    };
    let report = load.report(7);
    assert_eq!(
        report,
        WorkerLoadReport::new(7)
            .with_dp_rank(1)
            .with_requests(2, 3)
            .with_kv_used_blocks(4)
            .with_kv_total_blocks(10)
    );
    assert_eq!(report.validate(), Ok(()));
    let report = EngineLoad {
        kv_used_blocks: None,
        kv_total_blocks: None,
        ..load
    }
    .report(7);
    assert_eq!(
        (report.kv_used_blocks, report.kv_total_blocks),
        (None, None)
    );
    assert_eq!(report.validate(), Ok(()));
}
