//! The prefill router end to end over TCP: activation and deactivation with discovery, the
//! prefill-result and bootstrap paths, pins, fallback versus enforced disaggregation, and
//! backpressure.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use kvroute_prefill::{
    DisaggMode, DisaggStream, PrefillError, PrefillRouter, PrefillRouterConfig, RouteQuery, Served,
    TopologyAffinity, TopologyMode,
};
use kvroute_protocols::{PreprocessedRequest, RequestPhase, RoutingHints, WorkerWithDpRank};
use kvroute_runtime::{Discovery as _, WorkerRole};

use crate::support::{Behaviour, Fleet, PREFILL_DETAILS, PushPhases, bootstrap_meta, phase_name};

/// Every test's bound: a hung path fails instead of stalling the suite.
const BOUND: Duration = Duration::from_secs(20);

fn request(max_tokens: u32) -> PreprocessedRequest {
    let mut req = PreprocessedRequest::new("m", (0..40).collect());
    req.stop_conditions.max_tokens = Some(max_tokens);
    req
}

fn router(fleet: &Fleet, mode: DisaggMode) -> (PrefillRouter<PushPhases>, Arc<PushPhases>) {
    let phases = Arc::new(PushPhases::new(&fleet.discovery));
    let config = PrefillRouterConfig::default().with_mode(mode);
    let router = PrefillRouter::new(Arc::clone(&phases), fleet.discovery.watch(), config);
    (router, phases)
}

/// The generated token ids, asserting the stream ends without an error item.
async fn tokens(stream: DisaggStream) -> Vec<u32> {
    let items: Vec<_> = stream.collect().await;
    assert!(items.iter().all(|i| !i.is_error()), "{items:?}");
    items
        .into_iter()
        .filter_map(|i| i.data)
        .flat_map(|d| d.token_ids)
        .collect()
}

async fn bounded<F: Future>(f: F) -> F::Output {
    tokio::time::timeout(BOUND, f)
        .await
        .expect("test bounded in time")
}

#[tokio::test]
async fn activates_when_prefill_workers_appear_and_deactivates_when_they_leave() {
    bounded(async {
        let fleet = Fleet::new();
        let decode = fleet
            .spawn(20, WorkerRole::Decode, Behaviour::Decode, &[])
            .await;
        let (router, _) = router(&fleet, DisaggMode::Optional);
        assert!(!router.is_active());

        // Inactive: the decode worker serves the request whole.
        let stream = router.generate("r1", request(3)).await.expect("served");
        assert_eq!(stream.served(), &Served::Aggregated);
        assert_eq!(stream.prefill_tokens_details(), None, "no prefill worker");
        assert_eq!(tokens(stream).await, vec![100, 101, 102]);
        let seen = decode.seen();
        assert_eq!(seen[0].prefill_result, None);
        assert_eq!(
            seen[0].router_config_override, None,
            "aggregated keeps KV credit"
        );

        // A prefill worker registers: disaggregation activates.
        let mut prefill = fleet
            .spawn(10, WorkerRole::Prefill, Behaviour::Prefill, &[])
            .await;
        assert!(router.wait_active(true).await);
        assert!(router.is_active());
        let stream = router.generate("r2", request(3)).await.expect("served");
        assert_eq!(
            stream.served(),
            &Served::PrefillResult {
                prefill: WorkerWithDpRank::new(10, 0)
            }
        );
        assert_eq!(stream.worker().worker_id, 20);
        // The prefill worker's details are known once its result is: before decode streams.
        assert_eq!(stream.prefill_tokens_details(), Some(PREFILL_DETAILS));
        assert_eq!(tokens(stream).await, vec![100, 101, 102]);
        let to_prefill = prefill.seen();
        assert_eq!(to_prefill.len(), 1);
        assert_eq!(to_prefill[0].stop_conditions.max_tokens, Some(1));
        let to_decode = decode.seen().pop().expect("decode request");
        assert_eq!(to_decode.stop_conditions.max_tokens, Some(3));
        let result = to_decode.prefill_result.expect("prefill result carried");
        assert_eq!(
            result.disaggregated_params["worker_id"]["prefill_worker_id"],
            10
        );
        assert_eq!(result.disaggregated_params["prompt_tokens"], 40);
        assert_eq!(result.prompt_tokens_details, Some(PREFILL_DETAILS));
        let o = to_decode.router_config_override.expect("decode overrides");
        assert_eq!(
            (
                o.overlap_score_credit,
                o.assume_kv_reuse,
                o.track_prefill_tokens
            ),
            (Some(0.0), Some(false), Some(false))
        );

        // The only prefill worker leaves: back to aggregated serving.
        drop(prefill.lease.take());
        assert!(router.wait_active(false).await);
        let stream = router.generate("r3", request(2)).await.expect("served");
        assert_eq!(stream.served(), &Served::Aggregated);
        assert_eq!(tokens(stream).await, vec![100, 101]);
        assert_eq!(prefill.seen().len(), 1, "no prefill after deactivation");
    })
    .await;
}

#[tokio::test]
async fn enforced_disaggregation_fails_clearly_until_a_prefill_worker_exists() {
    bounded(async {
        let fleet = Fleet::new();
        let decode = fleet
            .spawn(20, WorkerRole::Decode, Behaviour::Decode, &[])
            .await;
        let (router, _) = router(&fleet, DisaggMode::Enforced);
        let err = router
            .generate("r1", request(2))
            .await
            .expect_err("enforced");
        assert_eq!(err, PrefillError::NotActivated);
        assert!(!err.is_retryable());
        assert!(err.to_string().contains("role prefill"), "{err}");
        assert!(decode.seen().is_empty(), "nothing reached a worker");

        let _prefill = fleet
            .spawn(10, WorkerRole::Prefill, Behaviour::Prefill, &[])
            .await;
        assert!(router.wait_active(true).await);
        let stream = router.generate("r2", request(2)).await.expect("served");
        assert!(matches!(stream.served(), Served::PrefillResult { .. }));
        assert_eq!(tokens(stream).await.len(), 2);
    })
    .await;
}

#[tokio::test]
async fn bootstrap_path_starts_decode_at_once_with_the_room() {
    bounded(async {
        let fleet = Fleet::new();
        let decode = fleet
            .spawn(20, WorkerRole::Decode, Behaviour::Decode, &[])
            .await;
        let prefill = fleet
            .spawn(
                10,
                WorkerRole::Prefill,
                Behaviour::Prefill,
                &bootstrap_meta("7001"),
            )
            .await;
        let (router, _) = router(&fleet, DisaggMode::Optional);
        for n in 0..3u32 {
            let mut stream = router
                .generate(&format!("r{n}"), request(4))
                .await
                .expect("served");
            let Served::Bootstrap { prefill: p, info } = stream.served().clone() else {
                panic!("expected the bootstrap path, got {:?}", stream.served());
            };
            assert_eq!(p, WorkerWithDpRank::new(10, 0));
            assert_eq!(
                (info.bootstrap_host.as_str(), info.bootstrap_port),
                ("127.0.0.1", 7001)
            );
            // Decode waits for the room the background prefill posts, so it only finishes if
            // both halves met; the stream ends after the background prefill, whose details
            // it then has.
            let mut generated = Vec::new();
            while let Some(item) = stream.next().await {
                assert!(!item.is_error(), "{item:?}");
                generated.extend(item.data.map(|d| d.token_ids).unwrap_or_default());
            }
            assert_eq!(generated, vec![100, 101, 102, 103]);
            assert_eq!(stream.prefill_tokens_details(), Some(PREFILL_DETAILS));
            let to_decode = decode.seen().pop().expect("decode request");
            assert_eq!(to_decode.bootstrap_info.as_ref(), Some(&info));
            assert_eq!(to_decode.prefill_result, None);
            let to_prefill = prefill.seen().pop().expect("prefill request");
            assert_eq!(to_prefill.bootstrap_info.as_ref(), Some(&info));
            assert_eq!(to_prefill.stop_conditions.max_tokens, Some(1));
            let routing = to_prefill.routing.expect("prefill pinned up front");
            assert_eq!(routing.prefill_worker_id, Some(10));
        }
        let rooms: std::collections::BTreeSet<u64> = decode
            .seen()
            .iter()
            .filter_map(|r| r.bootstrap_info.as_ref().map(|i| i.bootstrap_room))
            .collect();
        assert_eq!(rooms.len(), 3, "every request gets its own room");
    })
    .await;
}

#[tokio::test]
async fn explicit_prefill_and_decode_pins_are_honoured() {
    bounded(async {
        let fleet = Fleet::new();
        let d1 = fleet
            .spawn(21, WorkerRole::Decode, Behaviour::Decode, &[])
            .await;
        let d2 = fleet
            .spawn(22, WorkerRole::Decode, Behaviour::Decode, &[])
            .await;
        let p1 = fleet
            .spawn(11, WorkerRole::Prefill, Behaviour::Prefill, &[])
            .await;
        let p2 = fleet
            .spawn(12, WorkerRole::Prefill, Behaviour::Prefill, &[])
            .await;
        let (router, _) = router(&fleet, DisaggMode::Optional);
        for _ in 0..3 {
            let mut req = request(1);
            req.routing = Some(RoutingHints {
                prefill_worker_id: Some(12),
                decode_worker_id: Some(22),
                ..RoutingHints::default()
            });
            let stream = router.generate("pinned", req).await.expect("served");
            assert_eq!(stream.prefill_worker().map(|w| w.worker_id), Some(12));
            assert_eq!(stream.worker().worker_id, 22);
            tokens(stream).await;
        }
        assert_eq!((p1.seen().len(), p2.seen().len()), (0, 3));
        assert_eq!((d1.seen().len(), d2.seen().len()), (0, 3));

        // A prefill pin that names a decode worker is refused, not silently rerouted.
        let mut req = request(1);
        req.routing_mut().prefill_worker_id = Some(21);
        let err = router.generate("bad", req).await.expect_err("unknown pin");
        assert_eq!(err, PrefillError::UnknownPrefillWorker { worker_id: 21 });

        // A query reports the pinned pair without sending anything.
        let mut req = request(1);
        req.routing = Some(RoutingHints {
            prefill_worker_id: Some(11),
            decode_worker_id: Some(21),
            ..RoutingHints::default()
        });
        let answer = router.query(&req).await.expect("query");
        assert_eq!(
            answer,
            RouteQuery {
                prefill: Some(WorkerWithDpRank::new(11, 0)),
                decode: WorkerWithDpRank::new(21, 0),
            }
        );
        assert_eq!((p1.seen().len(), d1.seen().len()), (0, 0));
    })
    .await;
}

#[tokio::test]
async fn a_failed_prefill_falls_back_unless_disaggregation_is_enforced() {
    bounded(async {
        let fleet = Fleet::new();
        let decode = fleet
            .spawn(20, WorkerRole::Decode, Behaviour::Decode, &[])
            .await;
        let _prefill = fleet
            .spawn(10, WorkerRole::Prefill, Behaviour::FailingPrefill, &[])
            .await;

        let (optional, _) = router(&fleet, DisaggMode::Optional);
        let stream = optional.generate("r1", request(2)).await.expect("fallback");
        assert_eq!(stream.served(), &Served::Aggregated);
        assert_eq!(tokens(stream).await.len(), 2);
        let to_decode = decode.seen().pop().expect("decode request");
        assert_eq!(to_decode.prefill_result, None);
        assert_eq!(to_decode.stop_conditions.max_tokens, Some(2));

        let (enforced, _) = router(&fleet, DisaggMode::Enforced);
        let err = enforced
            .generate("r2", request(2))
            .await
            .expect_err("enforced");
        assert_eq!(
            err,
            PrefillError::PrefillFailed {
                worker_id: 10,
                message: "prefill engine out of memory".into()
            }
        );
        assert_eq!(
            decode.seen().len(),
            1,
            "no decode after an enforced failure"
        );
    })
    .await;
}

#[tokio::test]
async fn router_backpressure_is_a_retryable_resource_exhausted_error() {
    bounded(async {
        let fleet = Fleet::new();
        let decode = fleet
            .spawn(20, WorkerRole::Decode, Behaviour::Decode, &[])
            .await;
        let prefill = fleet
            .spawn(
                10,
                WorkerRole::Prefill,
                Behaviour::Prefill,
                &bootstrap_meta("7002"),
            )
            .await;
        let (router, phases) = router(&fleet, DisaggMode::Optional);
        for phase in [RequestPhase::Prefill, RequestPhase::Decode] {
            phases.saturated.lock().insert(phase_name(phase));
            let err = router
                .generate("r", request(2))
                .await
                .expect_err("saturated");
            assert!(err.is_retryable(), "{err}");
            assert!(
                matches!(&err, PrefillError::ResourceExhausted { phase: p, message }
                    if *p == phase && message.contains("queue is full")),
                "{err:?}"
            );
            phases.saturated.lock().clear();
        }
        // Saturation is never hidden by an aggregated fallback onto the decode fleet.
        assert!(decode.seen().is_empty());
        // The refused decode cancelled its background prefill: the prefill worker's in-flight
        // count (held by the prefill stream) drops back to zero.
        let mut waited = 0;
        while phases.prefill.in_flight(10) != 0 {
            assert!(waited < 500, "the background prefill was never released");
            waited += 1;
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        assert!(prefill.seen().len() <= 1);
        let stream = router.generate("after", request(1)).await.expect("served");
        assert_eq!(tokens(stream).await.len(), 1);
    })
    .await;
}

#[tokio::test]
async fn the_prefill_workers_topology_is_merged_into_the_decode_constraints() {
    bounded(async {
        let fleet = Fleet::new();
        let decode = fleet
            .spawn(20, WorkerRole::Decode, Behaviour::Decode, &[])
            .await;
        let _prefill = fleet
            .spawn(
                10,
                WorkerRole::Prefill,
                Behaviour::Prefill,
                &[("rack", "r7")],
            )
            .await;
        let phases = Arc::new(PushPhases::new(&fleet.discovery));
        let config = PrefillRouterConfig::default().with_topology(TopologyAffinity {
            keys: vec!["zone".into(), "rack".into()],
            mode: TopologyMode::Prefer { weight: 1.5 },
        });
        let router = PrefillRouter::new(phases, fleet.discovery.watch(), config);
        let mut req = request(1);
        req.routing_mut().routing_constraints = Some(kvroute_protocols::RoutingConstraints {
            required_taints: vec!["gpu=h100".into()],
            ..Default::default()
        });
        tokens(router.generate("r", req).await.expect("served")).await;
        let constraints = decode
            .seen()
            .pop()
            .and_then(|r| r.routing)
            .and_then(|r| r.routing_constraints)
            .expect("constraints");
        assert_eq!(constraints.required_taints, vec!["gpu=h100".to_owned()]);
        assert_eq!(constraints.preferred_taints.get("rack=r7"), Some(&1.5));
    })
    .await;
}

/// Waits (bounded by the test's bound) until `cond` holds.
async fn until(mut cond: impl FnMut() -> bool) {
    while !cond() {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test]
async fn a_prefill_worker_lost_mid_prefill_is_a_worker_loss_served_aggregated_unless_enforced() {
    bounded(async {
        let fleet = Fleet::new();
        let decode = fleet
            .spawn(20, WorkerRole::Decode, Behaviour::Decode, &[])
            .await;
        // The prefill answers its token and then holds the stream open until it dies.
        let mut prefill = fleet
            .spawn(10, WorkerRole::Prefill, Behaviour::Stall, &[])
            .await;

        let (enforced, _) = router(&fleet, DisaggMode::Enforced);
        let pending = tokio::spawn(async move { enforced.generate("r1", request(2)).await });
        until(|| prefill.seen().len() == 1).await;
        prefill.kill();
        let err = pending
            .await
            .expect("joined")
            .expect_err("the prefill worker is gone");
        assert!(
            matches!(
                &err,
                PrefillError::WorkerLost {
                    phase: RequestPhase::Prefill,
                    worker_id: 10,
                    ..
                }
            ),
            "{err:?}"
        );
        assert_eq!(err.lost_worker(), Some((RequestPhase::Prefill, 10)));
        assert!(!err.is_retryable());
        assert!(
            decode.seen().is_empty(),
            "no decode without the prefilled KV"
        );

        // Optional disaggregation falls back to aggregated serving, as for any failed prefill.
        let mut prefill = fleet
            .spawn(11, WorkerRole::Prefill, Behaviour::Stall, &[])
            .await;
        let (optional, _) = router(&fleet, DisaggMode::Optional);
        let pending = tokio::spawn(async move { optional.generate("r2", request(2)).await });
        until(|| prefill.seen().len() == 1).await;
        prefill.kill();
        let stream = pending.await.expect("joined").expect("fallback");
        assert_eq!(stream.served(), &Served::Aggregated);
        assert_eq!(tokens(stream).await.len(), 2);
        let to_decode = decode.seen().pop().expect("aggregated request");
        assert_eq!(to_decode.prefill_result, None);
    })
    .await;
}

#[tokio::test]
async fn a_lost_decode_worker_ends_the_stream_with_a_typed_worker_loss() {
    bounded(async {
        let fleet = Fleet::new();
        let _prefill = fleet
            .spawn(10, WorkerRole::Prefill, Behaviour::Prefill, &[])
            .await;
        let mut typed = fleet
            .spawn(20, WorkerRole::Decode, Behaviour::Stall, &[])
            .await;
        let mut in_band = fleet
            .spawn(21, WorkerRole::Decode, Behaviour::Stall, &[])
            .await;
        let (router, _) = router(&fleet, DisaggMode::Enforced);
        let pinned = |decode| {
            let mut req = request(4);
            req.routing_mut().decode_worker_id = Some(decode);
            req
        };
        let mut first = router.generate("r1", pinned(20)).await.expect("served");
        let mut second = router.generate("r2", pinned(21)).await.expect("served");

        let item = futures::future::poll_fn(|cx| first.poll_result(cx)).await;
        assert!(matches!(item, Some(Ok(ref i)) if !i.is_error()), "{item:?}");
        typed.kill();
        match futures::future::poll_fn(|cx| first.poll_result(cx)).await {
            Some(Err(e)) => assert!(e.is_worker_unavailable(), "{e}"),
            other => panic!("expected the worker loss, got {other:?}"),
        }

        // Read as a plain stream, the same loss is an error item.
        let item = second.next().await.expect("the first token");
        assert!(!item.is_error(), "{item:?}");
        in_band.kill();
        let item = second.next().await.expect("the loss");
        assert!(item.is_error(), "{item:?}");
        assert!(second.next().await.is_none());
    })
    .await;
}
