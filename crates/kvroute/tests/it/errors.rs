//! Bad input fails with a message that says what was wrong, where, and what was expected.

use crate::support::{kvroute, scratch, text, write_fixture};

/// Runs `kvroute replay` with `args`, expects failure, and returns stderr.
fn fails(args: &[&str]) -> String {
    let mut all = vec!["replay"];
    all.extend_from_slice(args);
    let output = kvroute(&all);
    let (stdout, stderr) = text(&output);
    assert!(
        !output.status.success(),
        "expected failure\nstdout:\n{stdout}"
    );
    assert!(stdout.is_empty(), "nothing on stdout on failure: {stdout}");
    stderr
}

#[test]
fn missing_trace_names_the_file() {
    let dir = scratch("missing");
    let path = dir.join("no-such-trace.jsonl");
    let stderr = fails(&["--trace", path.to_str().expect("utf-8 path")]);
    assert!(stderr.contains("cannot read trace"), "{stderr}");
    assert!(stderr.contains("no-such-trace.jsonl"), "{stderr}");
}

#[test]
fn malformed_line_names_the_file_and_line() {
    let dir = scratch("malformed");
    let path = dir.join("bad.jsonl");
    let good = r#"{"timestamp": 0, "input_length": 100, "output_length": 5, "hash_ids": [1]}"#;
    let bad = r#"{"timestamp": 1, "input_length": "many", "output_length": 5, "hash_ids": [2]}"#;
    std::fs::write(&path, format!("{good}\n{good}\n{bad}\n")).expect("write the trace");
    let stderr = fails(&["--trace", path.to_str().expect("utf-8 path")]);
    assert!(stderr.contains("bad.jsonl"), "{stderr}");
    assert!(stderr.contains("line 3"), "{stderr}");
    assert!(stderr.contains("input_length"), "{stderr}");
}

#[test]
fn empty_trace_is_refused() {
    let dir = scratch("empty");
    let path = dir.join("empty.jsonl");
    std::fs::write(&path, "\n").expect("write the trace");
    let stderr = fails(&["--trace", path.to_str().expect("utf-8 path")]);
    assert!(stderr.contains("no requests"), "{stderr}");
}

#[test]
fn unknown_policy_lists_the_known_ones() {
    let dir = scratch("unknown_policy");
    let trace = write_fixture(&dir);
    let stderr = fails(&[
        "--trace",
        trace.to_str().expect("utf-8 path"),
        "--policy",
        "fastest",
    ]);
    assert!(
        stderr.contains("unknown routing policy \"fastest\""),
        "{stderr}"
    );
    assert!(
        stderr.contains("round-robin, random, kv, kv-affinity"),
        "{stderr}"
    );
}

#[test]
fn zero_prefill_workers_is_refused() {
    let dir = scratch("prefill");
    let trace = write_fixture(&dir);
    let stderr = fails(&[
        "--trace",
        trace.to_str().expect("utf-8 path"),
        "--prefill-workers",
        "0",
    ]);
    assert!(
        stderr.contains("--prefill-workers must be at least 1, got 0"),
        "{stderr}"
    );
}

#[test]
fn trace_block_size_must_be_a_multiple_of_block_size() {
    let dir = scratch("block_sizes");
    let trace = write_fixture(&dir);
    let stderr = fails(&[
        "--trace",
        trace.to_str().expect("utf-8 path"),
        "--block-size",
        "48",
    ]);
    assert!(
        stderr.contains(
            "--trace-block-size must be a positive multiple of --block-size (48), got 512"
        ),
        "{stderr}"
    );
}

#[test]
fn json_path_must_not_be_the_html_report() {
    let dir = scratch("json_html");
    let trace = write_fixture(&dir);
    let out = dir.join("report.html");
    let stderr = fails(&[
        "--trace",
        trace.to_str().expect("utf-8 path"),
        "--json",
        out.to_str().expect("utf-8 path"),
    ]);
    assert!(stderr.contains("must not end in .html"), "{stderr}");
    assert!(!out.exists(), "nothing was written");
}

#[test]
fn workloads_are_named_and_exactly_one_source_is_taken() {
    let stderr = fails(&["--workload", "chat"]);
    assert!(stderr.contains("chat"), "{stderr}");
    for known in ["agentic", "agentic-tools", "multi-turn", "rag", "bursty"] {
        assert!(stderr.contains(known), "{stderr}");
    }
    let dir = scratch("both_sources");
    let trace = write_fixture(&dir);
    let stderr = fails(&[
        "--trace",
        trace.to_str().expect("utf-8 path"),
        "--workload",
        "rag",
    ]);
    assert!(stderr.contains("cannot be used with"), "{stderr}");
    let stderr = fails(&[]);
    assert!(
        stderr.contains("required") && stderr.contains("--trace"),
        "{stderr}"
    );
    let stderr = fails(&["--trace", "x.jsonl", "--write-trace", "y.jsonl"]);
    assert!(stderr.contains("--workload"), "{stderr}");
    let stderr = fails(&["--workload", "rag", "--workload-scale", "0"]);
    assert!(stderr.contains("--workload-scale must be"), "{stderr}");
}
