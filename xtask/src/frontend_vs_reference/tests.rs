use std::time::Duration;

use serde_json::json;

use super::load::{Figures, Pacing, Sample, Scenario, SseScan, Tally, Workload, percentile};
use super::*;

fn args(list: &[&str]) -> Result<Args> {
    let owned: Vec<String> = list.iter().map(|s| (*s).to_owned()).collect();
    Args::parse(&owned)
}

#[test]
fn arguments_default_to_two_rounds_at_300_per_second_and_ranges_are_checked() {
    assert_eq!(
        args(&[]).expect("valid"),
        Args {
            rounds: 2,
            warm_up: 2.0,
            measure: 5.0,
            rate: 300.0,
        }
    );
    assert_eq!(
        args(&[
            "--rounds",
            "3",
            "--warm-up",
            "0",
            "--measure",
            "1.5",
            "--rate",
            "50"
        ])
        .expect("valid"),
        Args {
            rounds: 3,
            warm_up: 0.0,
            measure: 1.5,
            rate: 50.0,
        }
    );
    for (list, expect) in [
        (&["--rounds", "0"][..], "--rounds must be 1 to 10, got 0"),
        (
            &["--measure", "0.1"][..],
            "--measure must be 0.5 to 600 seconds",
        ),
        (
            &["--warm-up", "61"][..],
            "--warm-up must be 0 to 60 seconds, got 61",
        ),
        (&["--rate", "0"][..], "--rate must be 1 to 20000"),
        (&["--bogus"][..], "--bogus"),
    ] {
        let err = args(list).expect_err("invalid arguments").to_string();
        assert!(err.contains(expect), "{err:?} should mention {expect:?}");
    }
}

#[test]
fn a_round_runs_closed_loops_at_1_and_32_streamed_and_not_then_the_open_loop() {
    let labels: Vec<String> = args(&["--rate", "250"])
        .expect("valid")
        .scenarios()
        .iter()
        .map(Scenario::label)
        .collect();
    assert_eq!(
        labels,
        [
            "closed, 1 client, non-streamed",
            "closed, 1 client, streamed",
            "closed, 32 clients, non-streamed",
            "closed, 32 clients, streamed",
            "open, 250 req/s, streamed",
        ]
    );
}

#[test]
fn percentiles_are_nearest_rank() {
    let hundred: Vec<f64> = (1..=100).map(f64::from).collect();
    let check = |values: &[f64], p: f64, expect: Option<f64>| {
        assert_eq!(percentile(values, p), expect, "p{p} of {values:?}");
    };
    check(&hundred, 50.0, Some(50.0));
    check(&hundred, 99.0, Some(99.0));
    check(&hundred, 100.0, Some(100.0));
    check(&[1.0, 2.0, 3.0, 4.0], 50.0, Some(2.0));
    check(&[1.0, 2.0, 3.0, 4.0], 99.0, Some(4.0));
    check(&[7.0], 1.0, Some(7.0));
    check(&[], 50.0, None);
}

#[test]
fn a_tally_counts_successes_per_second_and_keeps_the_first_error() {
    let ms = Duration::from_millis;
    let mut tally = Tally::default();
    for i in 1..=10 {
        tally.record(Ok(Sample {
            ttft: Some(ms(i)),
            e2e: ms(10 * i),
            prompt_tokens: None,
        }));
    }
    tally.record(Err(anyhow::anyhow!("HTTP 503: busy")));
    tally.record(Err(anyhow::anyhow!("HTTP 500: later")));
    let f = tally.figures(2.0);
    assert_eq!((f.ok, f.errors), (10, 2));
    assert_eq!(f.first_error.as_deref(), Some("HTTP 503: busy"));
    assert_eq!(f.req_per_s, 5.0);
    assert_eq!((f.ttft_p50_ms, f.ttft_p99_ms), (Some(5.0), Some(10.0)));
    assert_eq!((f.e2e_p50_ms, f.e2e_p99_ms), (Some(50.0), Some(100.0)));
    assert_eq!(f.mean_prompt_tokens, None);

    let mut whole = Tally::default();
    for tokens in [540, 542] {
        whole.record(Ok(Sample {
            ttft: None,
            e2e: ms(3),
            prompt_tokens: Some(tokens),
        }));
    }
    let f = whole.figures(1.0);
    assert_eq!((f.ttft_p50_ms, f.mean_prompt_tokens), (None, Some(541.0)));
    assert_eq!(Tally::default().figures(1.0).req_per_s, 0.0);
}

#[test]
fn requests_share_their_familys_system_prompt_and_nothing_else() {
    let workload = Workload::new("tiny");
    let system = |n: u64| workload.body(n, false)["messages"][0]["content"].clone();
    let user = |n: u64| workload.body(n, false)["messages"][1]["content"].clone();
    assert_eq!(system(3), system(3 + load::FAMILIES));
    assert_eq!(system(3), system(3 + 5 * load::FAMILIES));
    let families: std::collections::HashSet<String> =
        (0..load::FAMILIES).map(|n| system(n).to_string()).collect();
    assert_eq!(
        families.len(),
        load::FAMILIES as usize,
        "every family differs"
    );
    let questions: std::collections::HashSet<String> =
        (0..1000).map(|n| user(n).to_string()).collect();
    assert_eq!(questions.len(), 1000, "every request asks its own question");
    // The same request is the same body every time (the prompts are generated, not random).
    assert_eq!(
        Workload::new("tiny").body(42, true),
        workload.body(42, true)
    );

    let words = |v: serde_json::Value| v.as_str().expect("text").split_whitespace().count();
    // "You are assistant F of a family of 8." is 9 words before the system prompt's own.
    assert_eq!(words(system(0)), 9 + load::SYSTEM_WORDS);
    assert_eq!(words(user(0)), 2 + load::USER_WORDS);

    let body = workload.body(7, true);
    assert_eq!(body["model"], "tiny");
    assert_eq!(body["max_tokens"], load::OUTPUT_TOKENS);
    assert_eq!(body["stream"], true);
    assert_eq!(body["ignore_eos"], true);
    assert_eq!(workload.body(7, false)["stream"], false);
}

#[test]
fn generated_words_are_deterministic_per_seed() {
    assert_eq!(load::words(1, 50), load::words(1, 50));
    assert_ne!(load::words(1, 50), load::words(2, 50));
    assert_eq!(load::words(9, 0), "");
    assert_eq!(load::words(9, 30).split(' ').count(), 30);
    assert!(load::words(9, 30).starts_with(&load::words(9, 3)));
}

#[test]
fn the_stream_scan_sees_the_first_choice_and_done_across_chunk_boundaries() {
    let role = r#"data: {"choices":[{"index":0,"delta":{"role":"assistant"}}]}"#;
    let mut scan = SseScan::default();
    scan.feed(b": keep-alive\n\n").expect("a comment");
    assert!(!scan.first_choice);
    let (head, rest) = role.split_at(20);
    scan.feed(head.as_bytes()).expect("half an event");
    assert!(!scan.first_choice, "half an event is not an event");
    scan.feed(format!("{rest}\n\n").as_bytes())
        .expect("the rest");
    assert!(scan.first_choice && !scan.done);
    scan.feed(b"data: {\"choices\":[],\"usage\":{}}\n\ndata: [DO")
        .expect("usage");
    assert!(!scan.done);
    scan.feed(b"NE]\n\n").expect("done");
    assert!(scan.done);

    let mut usage_only = SseScan::default();
    usage_only
        .feed(b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":1}}\n")
        .expect("usage");
    assert!(
        !usage_only.first_choice,
        "an empty choices list carries no token"
    );

    let err = SseScan::default()
        .feed(b"data: {\"error\":{\"message\":\"worker lost\"}}\n")
        .expect_err("an error event");
    assert!(err.to_string().contains("worker lost"), "{err}");
    let err = SseScan::default()
        .feed(b"data: not json\n")
        .expect_err("not JSON");
    assert!(err.to_string().contains("not JSON"), "{err}");
}

#[test]
fn an_answer_must_finish_with_every_token() {
    let answer = |finish: serde_json::Value, tokens: u64| json!({"choices": [{"finish_reason": finish}], "usage": {"completion_tokens": tokens}});
    load::check_answer(&answer(json!("length"), 16)).expect("complete");
    let err = load::check_answer(&answer(json!("length"), 15)).expect_err("short");
    assert!(
        err.to_string()
            .contains("completion_tokens = 16, got Some(15)"),
        "{err}"
    );
    let err = load::check_answer(&answer(json!(null), 16)).expect_err("unfinished");
    assert!(err.to_string().contains("finish_reason"), "{err}");
}

#[test]
fn readiness_is_read_from_each_systems_own_listing() {
    let health = json!({"status": "healthy", "instances": [
        {"endpoint": "generate", "instance_id": 1},
        {"endpoint": "generate", "instance_id": 2},
        {"endpoint": "worker_kv_query_source_a", "instance_id": 1},
    ]});
    assert_eq!(generate_instances(&health), 2);
    assert_eq!(generate_instances(&json!({"status": "starting"})), 0);
    let models = json!({"object": "list", "data": [{"id": "tiny"}]});
    assert!(lists_model(&models, "tiny"));
    assert!(!lists_model(&models, "other"));
    assert!(!lists_model(&json!({}), "tiny"));
    let metrics = "# TYPE kvroute_router_worker_active_requests gauge\n\
        kvroute_router_worker_active_requests{worker=\"1\",dp_rank=\"0\"} 0\n\
        kvroute_router_worker_active_requests{worker=\"2\",dp_rank=\"0\"} 3\n\
        kvroute_router_requests_total 5\n";
    assert_eq!(listed_workers(metrics), 2);
    let line = "kvroute serve: http=127.0.0.1:4100 registry=127.0.0.1:4101";
    assert_eq!(field(line, "http").as_deref(), Some("127.0.0.1:4100"));
    assert_eq!(field(line, "registry").as_deref(), Some("127.0.0.1:4101"));
    assert_eq!(field(line, "metrics"), None);
}

#[test]
fn a_log_tail_keeps_the_last_lines() {
    assert_eq!(crate::procs::tail_of("a\nb\nc\nd\n", 2), "c\nd");
    assert_eq!(crate::procs::tail_of("a\nb", 5), "a\nb");
    assert_eq!(crate::procs::tail_of("", 5), "(empty)");
}

fn figures(req_per_s: f64, ttft: Option<(f64, f64)>, e2e: (f64, f64), errors: usize) -> Figures {
    Figures {
        ok: 100,
        errors,
        first_error: None,
        req_per_s,
        ttft_p50_ms: ttft.map(|t| t.0),
        ttft_p99_ms: ttft.map(|t| t.1),
        e2e_p50_ms: Some(e2e.0),
        e2e_p99_ms: Some(e2e.1),
        mean_prompt_tokens: None,
    }
}

#[test]
fn the_table_shows_ranges_over_rounds_and_kvroutes_advantage() {
    let rows = [
        Row {
            scenario: Scenario {
                pacing: Pacing::Closed { clients: 32 },
                stream: false,
            },
            reference: vec![
                figures(700.0, None, (40.0, 80.0), 0),
                figures(740.0, None, (44.0, 70.0), 0),
            ],
            kvroute: vec![
                figures(1_800.0, None, (16.0, 30.0), 0),
                figures(2_000.0, None, (15.0, 36.0), 0),
            ],
        },
        Row {
            scenario: Scenario {
                pacing: Pacing::Open { rate: 300.0 },
                stream: true,
            },
            reference: vec![figures(300.0, Some((6.0, 48.0)), (7.5, 120.0), 2)],
            kvroute: vec![figures(300.0, Some((1.2, 1.9)), (2.5, 3.0), 0)],
        },
    ];
    let expect = "\
| scenario                         | figure        | reference |     kvroute | kvroute advantage |
| -------------------------------- | ------------- | --------: | ----------: | ----------------: |
| closed, 32 clients, non-streamed | req/s         |   700-740 | 1,800-2,000 |             2.64x |
|                                  | E2E p50 (ms)  | 40.0-44.0 |   15.0-16.0 |             2.71x |
|                                  | E2E p99 (ms)  | 70.0-80.0 |   30.0-36.0 |             2.27x |
| open, 300 req/s, streamed        | req/s         |       300 |         300 |             1.00x |
|                                  | TTFT p50 (ms) |      6.00 |        1.20 |             5.00x |
|                                  | TTFT p99 (ms) |      48.0 |        1.90 |            25.26x |
|                                  | E2E p50 (ms)  |      7.50 |        2.50 |             3.00x |
|                                  | E2E p99 (ms)  |       120 |        3.00 |            40.00x |
|                                  | errors        |         2 |           0 |                   |
";
    assert_eq!(table(&rows), expect);
}

#[test]
fn a_figure_missing_on_one_side_has_no_advantage() {
    let row = Row {
        scenario: Scenario {
            pacing: Pacing::Closed { clients: 1 },
            stream: true,
        },
        reference: vec![figures(250.0, None, (4.0, 9.0), 0)],
        kvroute: vec![figures(800.0, Some((1.0, 2.0)), (1.2, 2.4), 0)],
    };
    let out = table(&[row]);
    let ttft = out
        .lines()
        .find(|l| l.contains("TTFT p50"))
        .expect("a TTFT line");
    let cells: Vec<&str> = ttft.split('|').map(str::trim).collect();
    // ["", "", "TTFT p50 (ms)", reference, kvroute, advantage, ""]
    assert_eq!(cells[2..6], ["TTFT p50 (ms)", "-", "1.00", "-"], "{ttft}");
}

#[test]
fn figures_are_formatted_for_reading() {
    assert_eq!(thousands(1_234_567.4), "1,234,567");
    assert_eq!(thousands(999.5), "1,000");
    assert_eq!(format_ms(1.234), "1.23");
    assert_eq!(format_ms(38.04), "38.0");
    assert_eq!(format_ms(2_048.2), "2,048");
    assert_eq!(range(&[3.0, 1.0, 2.0], thousands), "1-3");
    assert_eq!(range(&[1.001, 1.004], format_ms), "1.00");
    assert_eq!(range(&[], thousands), "-");
}
