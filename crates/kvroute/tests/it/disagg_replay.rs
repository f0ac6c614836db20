//! Disaggregated replay (`--prefill-workers`): prefill engines, KV transfer, decode engines.

use std::path::Path;

use serde_json::Value;

use crate::support::{kvroute, scratch, text, write_fixture};

/// A fixture replay with 2 prefill and 2 decode engines plus `extra`; returns the JSON.
fn disagg_json(trace: &Path, json: &Path, extra: &[&str]) -> Value {
    let mut args = vec![
        "replay",
        "--trace",
        trace.to_str().expect("utf-8 path"),
        "--json",
        json.to_str().expect("utf-8 path"),
        "--prefill-workers",
        "2",
        "--workers",
        "2",
        "--block-size",
        "16",
        "--trace-block-size",
        "64",
        "--cache-blocks",
        "400",
    ];
    args.extend_from_slice(extra);
    let output = kvroute(&args);
    let (stdout, stderr) = text(&output);
    // A replay whose router cores did not drain to zero load fails, so success also says
    // every request freed its load on both the prefill and the decode core.
    assert!(
        output.status.success(),
        "replay failed\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    let body = std::fs::read_to_string(json).expect("read the JSON report");
    serde_json::from_str(&body).expect("the JSON report parses")
}

#[test]
fn disaggregated_replay_reports_every_field_for_every_policy() {
    let dir = scratch("disagg_shape");
    let trace = write_fixture(&dir);
    let json = disagg_json(&trace, &dir.join("out.json"), &[]);
    assert_eq!(json["setup"]["prefill_workers"], 2);
    assert_eq!(json["setup"]["workers"], 2);
    let policies = json["policies"].as_array().expect("policies is an array");
    assert_eq!(policies.len(), 4, "{json:#}");
    for p in policies {
        assert_eq!(p["requests"], 100, "{p:#}");
        assert_eq!(p["completed"], 100, "{p:#}");
        assert_eq!(p["rejected"], 0, "{p:#}");
        for field in [
            "hit_rate",
            "oracle_hit_rate",
            "ttft_p50_ms",
            "ttft_p99_ms",
            "itl_p50_ms",
            "e2e_p99_ms",
            "output_tokens_per_s",
            "max_over_mean_load",
        ] {
            let v = p[field]
                .as_f64()
                .unwrap_or_else(|| panic!("{field} is a number in {p:#}"));
            assert!(v.is_finite() && v >= 0.0, "{field} = {v}");
        }
        assert!(p["ttft_p50_ms"].as_f64() > Some(0.0), "{p:#}");
        assert!(
            p["hit_rate"].as_f64() <= p["oracle_hit_rate"].as_f64(),
            "{p:#}"
        );
        // Load is shown for the 2 prefill and then the 2 decode workers.
        assert_eq!(
            p["mean_load_per_worker"].as_array().map(Vec::len),
            Some(4),
            "{p:#}"
        );
    }
    // Prefix reuse happens on the prefill engines, where kv routing sends shared prompts.
    let kv = policies
        .iter()
        .find(|p| p["policy"] == "kv")
        .expect("kv policy");
    assert!(kv["hit_rate"].as_f64() > Some(0.0), "{kv:#}");
}

#[test]
fn disaggregated_replay_is_deterministic() {
    let dir = scratch("disagg_determinism");
    let trace = write_fixture(&dir);
    let extra = ["--seed", "3", "--policy", "kv", "--policy", "random"];
    let a = disagg_json(&trace, &dir.join("a.json"), &extra);
    let b = disagg_json(&trace, &dir.join("b.json"), &extra);
    assert_eq!(a, b);
}

#[test]
fn conditional_and_never_replay_the_same_engines_and_thresholds_need_conditional() {
    let dir = scratch("disagg_conditional");
    let trace = write_fixture(&dir);
    let json = disagg_json(
        &trace,
        &dir.join("conditional.json"),
        &["--policy", "kv", "--disagg", "conditional"],
    );
    let p = &json["policies"][0];
    assert_eq!(
        (p["completed"].clone(), p["rejected"].clone()),
        (100.into(), 0.into()),
        "{p:#}"
    );
    assert_eq!(json["setup"]["prefill_workers"], 2);

    // never: the 2 + 2 engines all aggregated.
    let json = disagg_json(
        &trace,
        &dir.join("never.json"),
        &["--policy", "kv", "--disagg", "never"],
    );
    assert_eq!(json["setup"]["prefill_workers"], 0);
    assert_eq!(json["setup"]["workers"], 4);
    assert_eq!(json["policies"][0]["completed"], 100);

    let output = kvroute(&[
        "replay",
        "--trace",
        trace.to_str().expect("utf-8 path"),
        "--prefill-workers",
        "2",
        "--max-local-prefill-tokens",
        "5",
    ]);
    let (_, stderr) = text(&output);
    assert!(!output.status.success());
    assert!(
        stderr.contains("apply to --disagg conditional only, got --disagg enforced"),
        "{stderr}"
    );
}
