use std::time::Duration;

use super::*;

fn turn(conversation: usize, turn: usize, worker: Option<u64>) -> TurnResult {
    TurnResult {
        conversation,
        turn,
        error: None,
        ttft: None,
        latency: Duration::ZERO,
        worker,
        predicted_hit_rate: None,
        chunks: 0,
    }
}

#[test]
fn percentiles_use_the_nearest_rank() {
    let check = |values: &[f64], q: f64, expect: f64| {
        let mut v = values.to_vec();
        assert_eq!(percentile(&mut v, q), expect, "{values:?} q={q}");
    };
    check(&[], 0.5, 0.0);
    check(&[3.0], 0.99, 3.0);
    check(&[4.0, 1.0, 3.0, 2.0], 0.5, 2.0);
    check(&[4.0, 1.0, 3.0, 2.0], 0.99, 4.0);
    check(&(1..=100).map(f64::from).collect::<Vec<_>>(), 0.99, 99.0);
}

#[test]
fn same_worker_share_counts_consecutive_turns_of_one_conversation() {
    let results = [
        turn(0, 0, Some(1)),
        turn(0, 1, Some(1)), // same
        turn(0, 2, Some(2)), // moved
        turn(1, 0, Some(2)), // a new conversation: not compared with the one before
        turn(1, 1, None),    // unknown: skipped
        turn(1, 2, Some(2)), // previous unknown: skipped
    ];
    assert_eq!(same_worker_share(&results), 0.5);
    assert_eq!(same_worker_share(&[]), 0.0);
}

#[test]
fn the_table_puts_policies_side_by_side() {
    let report = |policy: &str, hit: f64| RunReport {
        policy: policy.to_owned(),
        requests: 4,
        ok: 4,
        failed: 0,
        errors: Vec::new(),
        prompt_tokens: 100,
        cached_tokens: 50,
        hit_rate: hit,
        predicted_hit_rate: hit,
        ttft_p50_ms: 1.25,
        ttft_p99_ms: 2.5,
        latency_p50_ms: 3.0,
        requests_per_s: 10.0,
        tokens_per_s: 100.0,
        wall_s: 0.4,
        same_worker_share: 1.0,
        per_worker_requests: vec![2, 2],
    };
    let table = table(&[report("round-robin", 0.25), report("kv", 0.875)]);
    let cells = |label: &str| -> Vec<String> {
        let line = table.lines().find(|l| l.starts_with(label)).unwrap();
        line[label.len()..]
            .split_whitespace()
            .map(str::to_owned)
            .collect()
    };
    assert_eq!(cells(""), ["round-robin", "kv"], "{table}");
    assert_eq!(
        cells("KV hit rate (engines)"),
        ["25.0%", "87.5%"],
        "{table}"
    );
    assert_eq!(cells("TTFT p50"), ["1.2", "ms", "1.2", "ms"], "{table}");
    assert_eq!(
        cells("requests per worker"),
        ["2", "2", "2", "2"],
        "{table}"
    );
    // Columns are right-aligned: every line is as wide as the header.
    let width = table.lines().next().unwrap().len();
    assert!(table.lines().all(|l| l.len() == width), "{table}");
}
