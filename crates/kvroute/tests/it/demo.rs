//! `kvroute demo` with a tiny workload: both policies serve every request over the real HTTP
//! path, the summary compares them, and routing on the KV cache finds more of it than
//! round-robin does.

use crate::support::{kvroute, scratch, text};

#[test]
fn demo_serves_every_request_and_kv_routing_beats_round_robin_on_hit_rate() {
    let dir = scratch("demo");
    let json = dir.join("demo.json");
    let output = kvroute(&[
        "demo",
        "--workers",
        "3",
        "--conversations",
        "12",
        "--turns",
        "3",
        "--speedup",
        "4",
        "--seed",
        "5",
        "--policy",
        "kv",
        "--json",
        json.to_str().expect("utf-8 path"),
    ]);
    let (stdout, stderr) = text(&output);
    assert!(
        output.status.success(),
        "demo failed\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    for row in [
        "requests ok / failed",
        "KV hit rate (engines)",
        "TTFT p50",
        "TTFT p99",
        "throughput",
    ] {
        assert!(stdout.contains(row), "no {row:?} row in:\n{stdout}");
    }
    let header = stdout.lines().find(|l| l.contains("round-robin"));
    assert!(
        header.is_some_and(|h| h.trim_end().ends_with("kv")),
        "the table's columns are round-robin then kv:\n{stdout}"
    );

    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).expect("read the JSON"))
            .expect("the JSON parses");
    assert_eq!(doc["setup"]["requests"], 36, "{doc:#}");
    let runs = doc["runs"].as_array().expect("runs");
    let policies: Vec<&str> = runs.iter().map(|r| r["policy"].as_str().unwrap()).collect();
    assert_eq!(policies, ["round-robin", "kv"]);
    for run in runs {
        assert_eq!(run["requests"], 36, "{run:#}");
        assert_eq!(run["ok"], 36, "{run:#}");
        assert_eq!(run["failed"], 0, "{run:#}");
        // Every request reached a worker, and the workers finished every prompt.
        let per_worker: u64 = run["per_worker_requests"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| n.as_u64().unwrap())
            .sum();
        assert_eq!(per_worker, 36, "{run:#}");
        assert!(run["prompt_tokens"].as_u64().unwrap() > 0, "{run:#}");
        assert!(run["ttft_p50_ms"].as_f64().unwrap() > 0.0, "{run:#}");
    }
    let hit = |i: usize| runs[i]["hit_rate"].as_f64().unwrap();
    assert!(
        hit(1) > hit(0),
        "kv hit rate {} should beat round-robin's {}",
        hit(1),
        hit(0)
    );
    let same = |i: usize| runs[i]["same_worker_share"].as_f64().unwrap();
    assert!(
        same(1) > same(0),
        "kv keeps more conversations on their worker: {} vs {}",
        same(1),
        same(0)
    );
}

#[test]
fn demo_refuses_bad_arguments_with_what_it_expected() {
    let check = |args: &[&str], expect: &str| {
        let output = kvroute(args);
        let (_, stderr) = text(&output);
        assert!(!output.status.success(), "{args:?} succeeded");
        assert!(stderr.contains(expect), "{args:?}: {stderr}");
    };
    check(
        &["demo", "--conversations", "0"],
        "--conversations must be at least 1, got 0",
    );
    check(
        &["demo", "--speedup", "0"],
        "--speedup must be a finite number > 0, got 0",
    );
    check(
        &["demo", "--policy", "round-robin"],
        "round-robin is not a KV-aware policy",
    );
}
