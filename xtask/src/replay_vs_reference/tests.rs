use super::*;

fn args(list: &[&str]) -> Result<Args> {
    let owned: Vec<String> = list.iter().map(|s| (*s).to_owned()).collect();
    Args::parse(&owned)
}

#[test]
fn arguments_default_to_the_reference_setup_and_ranges_are_checked() {
    assert_eq!(
        args(&["--trace", "t.jsonl"]).expect("valid"),
        Args {
            trace: "t.jsonl".into(),
            trace_block_size: 512,
            workers: 8,
            reference_runs: 3,
        }
    );
    assert_eq!(
        args(&[
            "--trace",
            "t.jsonl",
            "--trace-block-size",
            "64",
            "--workers",
            "32",
            "--reference-runs",
            "1"
        ])
        .expect("valid"),
        Args {
            trace: "t.jsonl".into(),
            trace_block_size: 64,
            workers: 32,
            reference_runs: 1,
        }
    );
    let check = |list: &[&str], expect: &str| {
        let err = args(list).expect_err("invalid arguments").to_string();
        assert!(err.contains(expect), "{err:?} should mention {expect:?}");
    };
    check(&[], "--trace <FILE>");
    check(
        &["--trace", "t", "--trace-block-size", "100"],
        "--trace-block-size must be a positive multiple of the engines' 64-token blocks, got 100",
    );
    check(
        &["--trace", "t", "--trace-block-size", "0"],
        "positive multiple",
    );
    check(
        &["--trace", "t", "--workers", "0"],
        "--workers must be at least 1, got 0",
    );
    check(
        &["--trace", "t", "--reference-runs", "0"],
        "--reference-runs must be 1 to 20, got 0",
    );
    check(
        &["--trace", "t", "--workers", "many"],
        "invalid value 'many'",
    );
}

#[test]
fn a_trace_line_the_reference_would_refuse_is_named() {
    let good = r#"{"timestamp": 0, "input_length": 1024, "output_length": 3, "hash_ids": [1, 2]}"#;
    let short = r#"{"timestamp": 5, "input_length": 1100, "output_length": 3, "hash_ids": [1, 2]}"#;
    check_trace_text(&format!("{good}\n\n{good}\n"), 512).expect("every line is covered");
    let check = |text: &str, block: u32, expect: &str| {
        let err = check_trace_text(text, block)
            .expect_err("a bad trace")
            .to_string();
        assert!(err.contains(expect), "{err:?} should mention {expect:?}");
    };
    check(
        &format!("{good}\n{short}\n"),
        512,
        "line 2: 2 hash ids x 512 tokens cover 1024 tokens, fewer than its input_length 1100",
    );
    // The same trace read at a smaller block size covers less.
    check(
        good,
        256,
        "line 1: 2 hash ids x 256 tokens cover 512 tokens",
    );
    check("not json\n", 512, "line 1: not a JSON object");
    check(
        r#"{"input_length": 10}"#,
        512,
        "line 1: expected a hash_ids array",
    );
    check("\n\n", 512, "the trace has no requests");
}

#[test]
fn both_replays_reports_are_read() {
    let reference = parse_reference_summary(
        r#"{"num_requests": 10, "completed_requests": 10, "prefix_cache_reused_ratio": 0.0817,
            "median_ttft_ms": 184.13, "p99_ttft_ms": 2048.46, "p99_e2e_latency_ms": 10888.57}"#,
    )
    .expect("a summary");
    assert_eq!(
        reference,
        Figures {
            hit_rate: 0.0817,
            ttft_p50_ms: 184.13,
            ttft_p99_ms: 2048.46,
            e2e_p99_ms: 10888.57,
        }
    );
    let err = parse_reference_summary(r#"{"num_requests": 10}"#).expect_err("incomplete");
    assert!(err.to_string().contains("completed_requests"), "{err:#}");

    let (oracle, rows) = parse_kvroute_json(
        r#"{"oracle": {"token_hit_rate": 0.3736},
            "policies": [{"policy": "kv", "requests": 10, "completed": 10, "hit_rate": 0.1968,
                          "ttft_p50_ms": 169.2, "ttft_p99_ms": 1689.6, "e2e_p99_ms": 9097.4}]}"#,
    )
    .expect("a report");
    assert_eq!(oracle, 0.3736);
    assert_eq!(
        rows,
        vec![Row {
            system: "kvroute",
            policy: "kv".to_owned(),
            runs: vec![Figures {
                hit_rate: 0.1968,
                ttft_p50_ms: 169.2,
                ttft_p99_ms: 1689.6,
                e2e_p99_ms: 9097.4,
            }],
        }]
    );
    let err = parse_kvroute_json(r#"{"oracle": {}, "policies": []}"#).expect_err("no oracle");
    assert!(err.to_string().contains("token_hit_rate"), "{err:#}");
}

#[test]
fn table_shows_ranges_over_runs_and_the_best_run() {
    let figures = |hit_rate, ttft_p50_ms, ttft_p99_ms, e2e_p99_ms| Figures {
        hit_rate,
        ttft_p50_ms,
        ttft_p99_ms,
        e2e_p99_ms,
    };
    let rows = [
        Row {
            system: "reference",
            policy: "kv_router".to_owned(),
            runs: vec![
                figures(0.1980, 169.16, 1717.4, 8839.5),
                figures(0.2009, 169.16, 1687.9, 8887.2),
            ],
        },
        Row {
            system: "kvroute",
            policy: "kv".to_owned(),
            runs: vec![figures(0.1968, 169.2, 1689.6, 9097.4)],
        },
    ];
    let expect = "\
| system    | policy               | runs |     hit rate | hit/oracle | TTFT p50 |       TTFT p99 |     E2E p99 |
| --------- | -------------------- | ---: | -----------: | ---------: | -------: | -------------: | ----------: |
| reference | kv_router            |    2 | 19.80-20.09% | 53.0-53.8% |   169 ms | 1,688-1,717 ms | 8.84-8.89 s |
| reference | kv_router (best run) |    1 |       20.09% |      53.8% |   169 ms |       1,688 ms |      8.89 s |
| kvroute   | kv                   |    1 |       19.68% |      52.7% |   169 ms |       1,690 ms |      9.10 s |
";
    assert_eq!(table(&rows, 0.3736), expect);
}

#[test]
fn figures_are_formatted_for_reading() {
    let check = |ms: f64, expect: &str| assert_eq!(thousands(ms), expect, "{ms}");
    check(0.0, "0");
    check(999.4, "999");
    check(999.6, "1,000");
    check(2048.46, "2,048");
    check(1_234_567.0, "1,234,567");
    assert_eq!(range(&[], thousands, " ms"), "-");
    assert_eq!(range(&[169.16, 169.2], thousands, " ms"), "169 ms");
    assert_eq!(range(&[1717.4, 1687.9], thousands, " ms"), "1,688-1,717 ms");
}
