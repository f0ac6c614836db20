//! Unit tests of the pure parts: request derivation, override and constraint merging, result
//! collection, and reading prefill workers from discovery.

use std::collections::BTreeMap;

use kvroute_protocols::{
    Annotated, BootstrapInfo, CompletionUsage, FinishReason, LLMEngineOutput, PreprocessedRequest,
    PromptTokensDetails, RouterConfigOverride, RoutingConstraints, RoutingHints, WorkerWithDpRank,
};
use kvroute_runtime::{InstanceInfo, WorkerRole};
use serde_json::json;

use crate::config::{TopologyAffinity, TopologyMode};
use crate::error::PrefillError;
use crate::fleet::{BootstrapEndpoint, PrefillFleet, bootstrap_endpoint};
use crate::request::{
    Handoff, PrefillCollector, decode_override, decode_request, merge_constraints, prefill_request,
};

fn base() -> PreprocessedRequest {
    let mut req = PreprocessedRequest::new("m", vec![1, 2, 3]);
    req.stop_conditions.max_tokens = Some(50);
    req.stop_conditions.min_tokens = Some(10);
    req
}

#[test]
fn prefill_request_asks_for_one_token_and_pins_the_target() {
    let mut req = base();
    req.routing = Some(RoutingHints {
        backend_instance_id: Some(9),
        decode_worker_id: Some(9),
        ..RoutingHints::default()
    });
    let info = BootstrapInfo {
        bootstrap_host: "h".into(),
        bootstrap_port: 1,
        bootstrap_room: 7,
    };
    let p = prefill_request(&req, Some(WorkerWithDpRank::new(3, 1)), Some(info.clone()));
    assert_eq!(p.stop_conditions.max_tokens, Some(1));
    assert_eq!(p.stop_conditions.min_tokens, None);
    let routing = p.routing.expect("routing");
    assert_eq!(routing.prefill_worker_id, Some(3));
    assert_eq!(routing.prefill_dp_rank, Some(1));
    assert_eq!(
        routing.backend_instance_id, None,
        "the backend pin names decode"
    );
    assert_eq!(routing.decode_worker_id, Some(9));
    assert_eq!(p.bootstrap_info, Some(info));
    // The client's request is untouched.
    assert_eq!(req.stop_conditions.max_tokens, Some(50));

    let unpinned = prefill_request(&base(), None, None);
    assert_eq!(unpinned.routing, None);
    assert_eq!(unpinned.bootstrap_info, None);
}

#[test]
fn decode_override_disables_overlap_reuse_and_prefill_tracking_keeping_the_rest() {
    fn check(existing: Option<RouterConfigOverride>, expect: RouterConfigOverride) {
        assert_eq!(decode_override(existing), expect);
    }
    let forced = RouterConfigOverride {
        overlap_score_credit: Some(0.0),
        assume_kv_reuse: Some(false),
        track_prefill_tokens: Some(false),
        ..RouterConfigOverride::default()
    };
    check(None, forced);
    check(
        Some(RouterConfigOverride {
            overlap_score_credit: Some(2.0),
            router_temperature: Some(0.5),
            prefill_load_scale: Some(3.0),
            assume_kv_reuse: Some(true),
            track_prefill_tokens: Some(true),
        }),
        RouterConfigOverride {
            router_temperature: Some(0.5),
            prefill_load_scale: Some(3.0),
            ..forced
        },
    );
}

#[test]
fn constraints_merge_by_mode() {
    fn check(
        existing: Option<RoutingConstraints>,
        mode: TopologyMode,
        expect_required: &[&str],
        expect_preferred: &[(&str, f32)],
    ) {
        let taints = vec!["rack=a".to_owned(), "zone=z".to_owned()];
        let merged = merge_constraints(existing, &taints, mode);
        let required: Vec<&str> = merged.required_taints.iter().map(String::as_str).collect();
        assert_eq!(required, expect_required);
        let preferred: Vec<(&str, f32)> = merged
            .preferred_taints
            .iter()
            .map(|(k, v)| (k.as_str(), *v))
            .collect();
        assert_eq!(preferred, expect_preferred);
    }
    let existing = RoutingConstraints {
        required_taints: vec!["gpu=h100".into(), "rack=a".into()],
        preferred_taints: BTreeMap::from([("rack=a".to_owned(), 5.0), ("x".to_owned(), 1.0)]),
    };
    check(None, TopologyMode::Require, &["rack=a", "zone=z"], &[]);
    check(
        Some(existing.clone()),
        TopologyMode::Require,
        &["gpu=h100", "rack=a", "zone=z"],
        &[("rack=a", 5.0), ("x", 1.0)],
    );
    check(
        Some(existing),
        TopologyMode::Prefer { weight: 2.0 },
        &["gpu=h100", "rack=a"],
        &[("rack=a", 5.0), ("x", 1.0), ("zone=z", 2.0)],
    );
}

#[test]
fn decode_request_carries_the_handoff_and_keeps_the_clients_budget() {
    let result = kvroute_protocols::PrefillResult {
        disaggregated_params: json!({"blocks": 2}),
        prompt_tokens_details: None,
    };
    let d = decode_request(base(), Some(Handoff::Result(result.clone())), None);
    assert_eq!(d.prefill_result, Some(result));
    assert_eq!(d.bootstrap_info, None);
    assert_eq!(d.stop_conditions.max_tokens, Some(50));
    assert_eq!(d.router_config_override, Some(decode_override(None)));
    assert_eq!(d.routing, None, "no topology, no constraints");

    let info = BootstrapInfo::default();
    let taints = vec!["rack=a".to_owned()];
    let d = decode_request(
        base(),
        Some(Handoff::Bootstrap(info.clone())),
        Some((&taints, TopologyMode::Require)),
    );
    assert_eq!(d.bootstrap_info, Some(info));
    let constraints = d
        .routing
        .and_then(|r| r.routing_constraints)
        .expect("merged");
    assert_eq!(constraints.required_taints, vec!["rack=a".to_owned()]);
}

fn data(
    params: Option<serde_json::Value>,
    finish: Option<FinishReason>,
) -> Annotated<LLMEngineOutput> {
    Annotated::from_data(LLMEngineOutput {
        token_ids: vec![5],
        disaggregated_params: params,
        finish_reason: finish,
        ..LLMEngineOutput::default()
    })
}

#[test]
fn collector_decides_on_the_first_real_item() {
    fn check(
        items: Vec<Annotated<LLMEngineOutput>>,
        expect: Result<serde_json::Value, PrefillError>,
    ) {
        let mut c = PrefillCollector::new(4);
        for item in items {
            c.push(item);
        }
        assert_eq!(c.finish().map(|r| r.disaggregated_params), expect);
    }
    let params = json!({"block_hashes": [1, 2]});
    let failed = |m: &str| PrefillError::PrefillFailed {
        worker_id: 4,
        message: m.to_owned(),
    };
    check(
        vec![
            Annotated::from_annotation("worker", vec!["4".into()]),
            data(Some(params.clone()), None),
            Annotated::from_error("late"),
        ],
        Ok(params.clone()),
    );
    check(vec![Annotated::from_error("boom")], Err(failed("boom")));
    check(
        vec![data(None, Some(FinishReason::Error("oom".into())))],
        Err(failed("oom")),
    );
    check(
        vec![data(None, Some(FinishReason::Length))],
        Err(PrefillError::NoDisaggregatedParams { worker_id: 4 }),
    );
    check(
        vec![],
        Err(failed("the response stream ended without any output")),
    );
}

#[test]
fn collector_takes_prompt_details_from_the_usage_item() {
    let mut c = PrefillCollector::new(1);
    c.push(data(Some(json!(1)), None));
    let mut last = LLMEngineOutput::length();
    last.completion_usage = Some(CompletionUsage {
        prompt_tokens: 3,
        completion_tokens: 1,
        total_tokens: 4,
        prompt_tokens_details: Some(PromptTokensDetails {
            audio_tokens: None,
            cached_tokens: Some(2),
        }),
    });
    c.push(Annotated::from_data(last));
    let result = c.finish().expect("prefilled");
    assert_eq!(
        result.prompt_tokens_details.and_then(|d| d.cached_tokens),
        Some(2)
    );
}

#[test]
fn bootstrap_endpoints_are_validated() {
    fn check(host: Option<&str>, port: Option<&str>, expect: Option<(&str, u16)>) {
        let mut meta = BTreeMap::new();
        if let Some(h) = host {
            meta.insert(
                kvroute_protocols::BOOTSTRAP_HOST_KEY.to_owned(),
                h.to_owned(),
            );
        }
        if let Some(p) = port {
            meta.insert(
                kvroute_protocols::BOOTSTRAP_PORT_KEY.to_owned(),
                p.to_owned(),
            );
        }
        let expect = expect.map(|(h, p)| BootstrapEndpoint {
            host: h.to_owned(),
            port: p,
        });
        assert_eq!(bootstrap_endpoint(&meta), expect, "{host:?} {port:?}");
    }
    check(Some("10.0.0.1"), Some("8998"), Some(("10.0.0.1", 8998)));
    check(Some("h"), Some(" 1 "), Some(("h", 1)));
    check(Some("h"), Some("0"), None);
    check(Some("h"), Some("65536"), None);
    check(Some("h"), Some("x"), None);
    check(Some(""), Some("1"), None);
    check(None, Some("1"), None);
    check(Some("h"), None, None);
}

#[test]
fn fleet_keeps_prefill_workers_only_and_derives_topology() {
    let mut prefill = InstanceInfo::new(2, "a:1", 16).with_role(WorkerRole::Prefill);
    prefill.metadata.insert("rack".into(), "r1".into());
    prefill
        .metadata
        .insert(kvroute_protocols::BOOTSTRAP_HOST_KEY.into(), "a".into());
    prefill
        .metadata
        .insert(kvroute_protocols::BOOTSTRAP_PORT_KEY.into(), "9".into());
    let plain = InstanceInfo::new(3, "b:1", 16).with_role(WorkerRole::Prefill);
    let decode = InstanceInfo::new(4, "c:1", 16).with_role(WorkerRole::Decode);
    let aggregated = InstanceInfo::new(5, "d:1", 16);
    let set: BTreeMap<_, _> = [prefill, plain, decode, aggregated]
        .into_iter()
        .map(|i| (i.id, i))
        .collect();
    let fleet = PrefillFleet::from_instances(&set);
    let ids: Vec<u64> = fleet.workers().map(|w| w.id).collect();
    assert_eq!(ids, vec![2, 3]);
    assert!(fleet.any_bootstrap());
    assert!(fleet.get(3).is_some_and(|w| w.bootstrap.is_none()));
    let affinity = TopologyAffinity {
        keys: vec!["zone".into(), "rack".into()],
        mode: TopologyMode::Require,
    };
    assert_eq!(
        fleet.get(2).map(|w| w.topology_taints(&affinity)),
        Some(vec!["rack=r1".to_owned()])
    );
    assert!(PrefillFleet::from_instances(&BTreeMap::new()).is_empty());
}

#[test]
fn only_backpressure_is_retryable() {
    use kvroute_protocols::RequestPhase;

    use crate::phase::PhaseRouteError;
    let exhausted = PrefillError::from_route(
        RequestPhase::Decode,
        PhaseRouteError::ResourceExhausted {
            phase: RequestPhase::Decode,
            message: "queue full".into(),
        },
    );
    assert!(exhausted.is_retryable());
    assert!(!exhausted.allows_fallback());
    let unknown = PrefillError::from_route(
        RequestPhase::Prefill,
        PhaseRouteError::UnknownWorker {
            phase: RequestPhase::Prefill,
            worker_id: 1,
        },
    );
    assert!(!unknown.is_retryable());
    assert!(!unknown.allows_fallback());
    assert!(!PrefillError::NotActivated.is_retryable());
    assert!(PrefillError::NoDisaggregatedParams { worker_id: 1 }.allows_fallback());
}

#[test]
fn a_lost_worker_is_named_and_only_worker_losses_are() {
    use kvroute_protocols::RequestPhase;

    use crate::phase::PhaseRouteError;
    fn check(error: PrefillError, expect: Option<(RequestPhase, u64)>) {
        assert_eq!(error.lost_worker(), expect, "{error}");
    }
    let lost = PrefillError::from_route(
        RequestPhase::Decode,
        PhaseRouteError::WorkerLost {
            phase: RequestPhase::Decode,
            worker_id: 7,
            message: "connection refused".into(),
        },
    );
    assert_eq!(
        lost.to_string(),
        "decode worker 7 was lost: connection refused"
    );
    assert!(!lost.is_retryable());
    check(lost, Some((RequestPhase::Decode, 7)));
    check(
        PrefillError::from_route(
            RequestPhase::Prefill,
            PhaseRouteError::Failed {
                phase: RequestPhase::Prefill,
                worker_id: Some(3),
                message: "the engine failed the request".into(),
            },
        ),
        None,
    );
    check(
        PrefillError::PrefillFailed {
            worker_id: 3,
            message: "out of memory".into(),
        },
        None,
    );
}
