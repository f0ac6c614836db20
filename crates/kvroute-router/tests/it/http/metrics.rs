//! `/metrics`: one router's text when serving aggregated; both phases' routers, each sample
//! labelled `router="prefill"` or `router="decode"`, when serving disaggregated; valid
//! OpenMetrics either way.

use std::collections::HashSet;
use std::time::Duration;

use kvroute_prefill::PrefillRouterConfig;
use kvroute_protocols::{WorkerLoadReport, WorkerWithDpRank};
use kvroute_router::http::{AppState, Disagg};
use kvroute_router::{KvPhaseRouter, KvPushRouter, ModelRegistry, Policy, role_filtered};
use kvroute_runtime::{Discovery, WorkerRole};
use kvroute_scheduler::{RequestId, RequestLoad};
use serde_json::json;

use super::usage::{UsageEngine, disagg_server};
use super::{Server, chat, test_config};
use crate::support::{Fleet, eventually, idle, run};

/// The family a sample named `sample` belongs to, among the `declared` ones.
fn family_of<'a>(sample: &str, declared: &HashSet<&'a str>) -> Option<&'a str> {
    ["", "_total", "_bucket", "_sum", "_count", "_created"]
        .iter()
        .find_map(|suffix| {
            let base = sample.strip_suffix(suffix)?;
            declared.get(base).copied()
        })
}

/// Checks what a Prometheus scraper needs of an OpenMetrics text: each family's `# HELP` and
/// `# TYPE` once, every sample right in its own family's block (so each family is one
/// contiguous block), no series twice, and one `# EOF`, last. Panics naming the offending line.
fn assert_openmetrics(text: &str) {
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.last(), Some(&"# EOF"), "no final # EOF:\n{text}");
    assert_eq!(
        lines.iter().filter(|l| **l == "# EOF").count(),
        1,
        "# EOF more than once:\n{text}"
    );
    let declared: HashSet<&str> = lines
        .iter()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .map(|rest| rest.split(' ').next().unwrap())
        .collect();
    let mut seen_help = HashSet::new();
    let mut seen_type = HashSet::new();
    let mut series = HashSet::new();
    let mut current = None;
    for line in &lines[..lines.len() - 1] {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let name = rest.split(' ').next().unwrap();
            assert!(seen_help.insert(name), "second # HELP of {name}:\n{text}");
            current = Some(name);
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let name = rest.split(' ').next().unwrap();
            assert!(seen_type.insert(name), "second # TYPE of {name}:\n{text}");
            assert_eq!(current, Some(name), "# TYPE {name} not after its # HELP");
        } else {
            assert!(!line.starts_with('#'), "unexpected comment {line:?}");
            let key = line.rsplit_once(' ').expect("a sample has a value").0;
            let name = key.split('{').next().unwrap();
            let family = family_of(name, &declared)
                .unwrap_or_else(|| panic!("sample {line:?} of no declared family:\n{text}"));
            assert_eq!(
                current,
                Some(family),
                "sample {line:?} outside its family's block:\n{text}"
            );
            assert!(series.insert(key), "series {key} twice:\n{text}");
        }
    }
    assert_eq!(
        seen_help, seen_type,
        "families without both # HELP and # TYPE"
    );
}

#[test]
fn the_checker_rejects_split_families_and_a_missing_eof() {
    let ok = "# HELP a A.\n# TYPE a counter\na_total 1\n# HELP b B.\n# TYPE b gauge\nb 2\n# EOF\n";
    assert_openmetrics(ok);
    for bad in [
        // `a`'s samples in two blocks.
        "# HELP a A.\n# TYPE a counter\na_total 1\n# HELP b B.\n# TYPE b gauge\nb 2\na_total{x=\"1\"} 1\n# EOF\n",
        // `a` declared twice.
        "# HELP a A.\n# TYPE a counter\na_total 1\n# HELP a A.\n# TYPE a counter\n# EOF\n",
        // The same series twice.
        "# HELP a A.\n# TYPE a counter\na_total 1\na_total 2\n# EOF\n",
        // No `# EOF`.
        "# HELP a A.\n# TYPE a counter\na_total 1\n",
    ] {
        assert!(
            std::panic::catch_unwind(|| assert_openmetrics(bad)).is_err(),
            "accepted:\n{bad}"
        );
    }
}

/// Serves one request through `server` and checks that `/metrics` is then exactly
/// `router`'s own text, without a `router` label.
async fn assert_aggregated_metrics(server: &Server, router: &KvPushRouter) {
    let (status, _) = server.json("/v1/chat/completions", &chat("count me")).await;
    assert_eq!(status, 200);
    // Settled: nothing changes the metrics between the scrape and the direct encoding.
    eventually("the request has ended", || {
        idle(router)
            && router
                .metrics_text()
                .contains("kvroute_router_requests_finished_total{outcome=\"ok\"} 1\n")
    })
    .await;
    let (status, metrics) = server.get("/metrics").await;
    assert_eq!(status, 200);
    assert_eq!(metrics, router.metrics_text());
    assert!(!metrics.contains("router=\""), "{metrics}");
    assert!(
        metrics.contains("kvroute_router_requests_total 1\n"),
        "{metrics}"
    );
    assert_openmetrics(&metrics);
}

#[test]
fn aggregated_metrics_are_the_routers_own_text_without_a_router_label() {
    run(async {
        let fleet = Fleet::start(2).await;
        let router = fleet.router(Policy::Kv).await;
        let server = Server::start(router.clone(), test_config()).await;
        assert_aggregated_metrics(&server, &router).await;
    });
}

#[test]
fn metrics_stay_aggregated_while_optional_disaggregation_has_no_prefill_worker() {
    run(async {
        // `kvroute serve`'s default: disaggregation configured, two aggregated workers only.
        let fleet = Fleet::start(2).await;
        let watch = fleet.discovery.watch();
        let on = |roles: &'static [WorkerRole]| {
            fleet.router_on(role_filtered(watch.clone(), roles), Policy::Kv)
        };
        let prefill = on(&[WorkerRole::Prefill]).await;
        let decode = on(&[WorkerRole::Decode, WorkerRole::Aggregated]).await;
        let disagg = Disagg::new(
            KvPhaseRouter::new(prefill, decode.clone()),
            watch.clone(),
            PrefillRouterConfig::default(),
        );
        assert!(!disagg.router().is_active());
        let state = AppState::new(decode.clone(), ModelRegistry::mock("mock"), test_config())
            .with_disagg(disagg);
        let server = Server::serve(state).await;
        assert_aggregated_metrics(&server, &decode).await;
    });
}

#[test]
fn disaggregated_metrics_show_both_routers_series_labelled_by_router() {
    run(async {
        let fleet = Fleet::start(0).await;
        let prefill_engine = UsageEngine {
            prefill: true,
            ..UsageEngine::default()
        };
        let (server, prefill, decode, _workers) =
            disagg_server(&fleet, prefill_engine, &[], UsageEngine::default()).await;
        let mut body = chat("hello there");
        body["max_tokens"] = json!(4);
        let (status, resp) = server.json("/v1/chat/completions", &body).await;
        assert_eq!(status, 200, "{resp}");
        eventually("both phases are freed", || idle(&prefill) && idle(&decode)).await;
        let (status, metrics) = server.get("/metrics").await;
        assert_eq!(status, 200);
        assert_openmetrics(&metrics);
        for router in ["prefill", "decode"] {
            // Router-wide series: the request counter, the routing overhead per phase, the
            // predicted KV hit rate.
            for sample in [
                format!("kvroute_router_requests_total{{router=\"{router}\"}} 1\n"),
                format!(
                    "kvroute_router_routing_overhead_seconds_count{{router=\"{router}\",phase=\"hashing\"}} 1\n"
                ),
                format!(
                    "kvroute_router_routing_overhead_seconds_count{{router=\"{router}\",phase=\"scheduling\"}} 1\n"
                ),
                format!("kvroute_router_predicted_kv_hit_rate_count{{router=\"{router}\"}} 1\n"),
            ] {
                assert!(metrics.contains(&sample), "no {sample:?} in\n{metrics}");
            }
        }
        // Per-worker series: each phase's router lists its own worker.
        for sample in [
            "kvroute_router_worker_active_requests{router=\"prefill\",worker=\"1\",dp_rank=\"0\"} 0\n",
            "kvroute_router_worker_active_requests{router=\"decode\",worker=\"2\",dp_rank=\"0\"} 0\n",
        ] {
            assert!(metrics.contains(sample), "no {sample:?} in\n{metrics}");
        }
        // Every sample says which router it is from.
        for line in metrics.lines().filter(|l| !l.starts_with('#')) {
            assert!(
                line.contains("{router=\"prefill\"") || line.contains("{router=\"decode\""),
                "{line:?} has no router label"
            );
        }
    });
}

#[test]
fn the_engines_cached_tokens_are_compared_with_the_prediction_per_worker() {
    run(async {
        let fleet = Fleet::start(0).await;
        // The engine says 4 of the prompt's 9 tokens were cached. The router has seen no KV
        // event: it predicts none for the first request, nor for the second, sent once the first
        // was served (a prompt counts as cached in flight only until its first token; after
        // that the worker's events alone say what it holds).
        let engine = UsageEngine {
            last: Some(4),
            ..UsageEngine::default()
        };
        let _worker = super::usage::start_worker(&fleet, 7, WorkerRole::Aggregated, engine).await;
        let router = fleet.router(Policy::Kv).await;
        eventually("the worker to join", || {
            router.with_core(|c| c.workers().count()) == 1
        })
        .await;
        let server = Server::start(router.clone(), test_config()).await;
        for _ in 0..2 {
            let (status, resp) = server.json("/v1/chat/completions", &chat("hi there")).await;
            assert_eq!(status, 200, "{resp}");
        }
        let (_, text) = server.get("/metrics").await;
        assert_openmetrics(&text);
        for expected in [
            "kvroute_router_prediction_error_tokens_count{worker=\"7\"} 2\n",
            // Reported minus predicted: +4, twice.
            "kvroute_router_prediction_error_tokens_sum{worker=\"7\"} 8.0\n",
            "kvroute_router_prediction_error_tokens_bucket{le=\"-4.0\",worker=\"7\"} 0\n",
            "kvroute_router_prediction_error_tokens_bucket{le=\"1.0\",worker=\"7\"} 0\n",
            "kvroute_router_prediction_error_tokens_bucket{le=\"4.0\",worker=\"7\"} 2\n",
            "kvroute_router_cache_report_prompt_tokens_total{worker=\"7\"} 18\n",
            "kvroute_router_cache_report_predicted_tokens_total{worker=\"7\"} 0\n",
            "kvroute_router_cache_report_reported_tokens_total{worker=\"7\"} 8\n",
        ] {
            assert!(text.contains(expected), "missing {expected:?} in\n{text}");
        }
        eventually("all load is freed", || idle(&router)).await;
    });
}

#[test]
fn reported_load_shows_beside_the_predicted_and_reconciled_requests_are_counted() {
    run(async {
        let fleet = Fleet::start(1).await;
        let router = fleet.router(Policy::Kv).await;
        eventually("the worker to join", || {
            router.with_core(|c| c.workers().count()) == 1
        })
        .await;
        let worker = WorkerWithDpRank::from_worker_id(1);
        let freed = router.with_core(|core| {
            // Two requests of another replica that died; the worker reports one request.
            let load = RequestLoad {
                worker,
                prefill_tokens: 8,
                block_hashes: vec![1, 2],
                expected_output_tokens: None,
            };
            for id in [1 << 40, (1 << 40) + 1] {
                core.add_remote_request(RequestId(id), &load, Duration::ZERO)
                    .unwrap();
            }
            let report = WorkerLoadReport::new(1)
                .with_requests(1, 0)
                .with_kv_used_blocks(12);
            core.on_load_report(&report, Duration::from_secs(60))
                .unwrap()
        });
        assert_eq!(freed, vec![RequestId(1 << 40)]);
        let text = router.metrics_text();
        assert_openmetrics(&text);
        for expected in [
            "kvroute_router_worker_active_requests{worker=\"1\",dp_rank=\"0\"} 1\n",
            "kvroute_router_worker_reported_requests{worker=\"1\",dp_rank=\"0\"} 1\n",
            "kvroute_router_worker_reported_kv_blocks{worker=\"1\",dp_rank=\"0\"} 12\n",
            "kvroute_router_requests_reconciled_total 1\n",
        ] {
            assert!(text.contains(expected), "missing {expected:?} in\n{text}");
        }
        // Reading the metrics again does not count the reconciled request twice.
        assert!(
            router
                .metrics_text()
                .contains("kvroute_router_requests_reconciled_total 1\n")
        );
        router.with_core(|core| core.on_finished(RequestId((1 << 40) + 1)));
        assert!(idle(&router));
    });
}

#[test]
fn bucket_bounds_print_as_written() {
    let text = kvroute_router::RouterMetrics::new().encode_text();
    assert!(
        text.contains("kvroute_router_predicted_kv_hit_rate_bucket{le=\"0.3\"} 0"),
        "{text}"
    );
    for bound in text.split("le=\"").skip(1) {
        let bound = bound.split('"').next().unwrap();
        assert!(
            bound == "+Inf" || bound.len() <= 12,
            "bucket bound {bound:?} is not printed as written"
        );
    }
}

#[test]
fn the_learnt_capacity_shows_in_the_unit_of_the_model_in_force() {
    use kvroute_protocols::WorkerWithDpRank;
    use kvroute_router_core::Retention;
    let metrics = kvroute_router::RouterMetrics::new();
    assert!(!metrics.encode_text().contains("approx_capacity{"));
    let (a, b) = (WorkerWithDpRank::new(3, 0), WorkerWithDpRank::new(4, 1));
    metrics.set_approx_capacities([(a, Retention::Blocks(40.5)), (b, Retention::Requests(2.0))]);
    let text = metrics.encode_text();
    assert_openmetrics(&text);
    for expected in [
        "kvroute_router_approx_capacity{worker=\"3\",dp_rank=\"0\",unit=\"blocks\"} 40.5\n",
        "kvroute_router_approx_capacity{worker=\"4\",dp_rank=\"1\",unit=\"requests\"} 2.0\n",
    ] {
        assert!(text.contains(expected), "missing {expected:?} in\n{text}");
    }
    // Worker 3 turned out to keep a prompt a slot, and worker 4 left: one sample remains.
    metrics.set_approx_capacities([(a, Retention::Requests(1.0))]);
    let text = metrics.encode_text();
    assert!(
        text.contains(
            "kvroute_router_approx_capacity{worker=\"3\",dp_rank=\"0\",unit=\"requests\"} 1.0\n"
        ),
        "{text}"
    );
    assert_eq!(
        text.matches("kvroute_router_approx_capacity{").count(),
        1,
        "{text}"
    );
}
