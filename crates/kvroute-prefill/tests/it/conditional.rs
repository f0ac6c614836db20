//! Conditional disaggregation: the phase router's placement decides, per request, whether the
//! request is served aggregated on a decode worker or prefilled remotely.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use kvroute_prefill::{DisaggMode, PrefillError, PrefillRouter, PrefillRouterConfig, Served};
use kvroute_protocols::{PreprocessedRequest, RequestPhase, RoutingHints, WorkerWithDpRank};
use kvroute_runtime::{Discovery as _, WorkerRole};

use crate::support::{Behaviour, Fleet, PushPhases, phase_name};

const BOUND: Duration = Duration::from_secs(20);

fn request(prompt: u32) -> PreprocessedRequest {
    let mut req = PreprocessedRequest::new("m", (0..prompt).collect());
    req.stop_conditions.max_tokens = Some(2);
    req
}

fn router(fleet: &Fleet) -> (PrefillRouter<PushPhases>, Arc<PushPhases>) {
    let phases = Arc::new(PushPhases::new(&fleet.discovery));
    let config = PrefillRouterConfig::default().with_mode(DisaggMode::Conditional);
    let router = PrefillRouter::new(Arc::clone(&phases), fleet.discovery.watch(), config);
    (router, phases)
}

async fn drain(stream: kvroute_prefill::DisaggStream) -> usize {
    let items: Vec<_> = stream.collect().await;
    assert!(items.iter().all(|i| !i.is_error()), "{items:?}");
    items
        .iter()
        .filter_map(|i| i.data.as_ref())
        .map(|d| d.token_ids.len())
        .sum()
}

#[tokio::test]
async fn each_request_is_prefilled_where_the_phase_router_places_it() {
    tokio::time::timeout(BOUND, async {
        let fleet = Fleet::new();
        let decode = fleet
            .spawn(20, WorkerRole::Decode, Behaviour::Decode, &[])
            .await;
        let (router, phases) = router(&fleet);

        // No prefill worker: served aggregated, as optional disaggregation does.
        let stream = router.generate("r0", request(40)).await.expect("served");
        assert_eq!(stream.served(), &Served::Aggregated);
        assert_eq!(drain(stream).await, 2);

        let prefill = fleet
            .spawn(10, WorkerRole::Prefill, Behaviour::Prefill, &[])
            .await;
        assert!(router.wait_active(true).await);
        *phases.local_up_to.lock() = 16;

        // Placed locally: the decode worker serves it whole, no prefill worker sees it.
        let stream = router.generate("short", request(8)).await.expect("served");
        assert_eq!(stream.served(), &Served::Aggregated);
        assert_eq!(stream.worker().worker_id, 20);
        assert_eq!(drain(stream).await, 2);
        assert!(prefill.seen().is_empty());
        let local = decode.seen().pop().expect("decode request");
        assert_eq!(local.prefill_result, None);
        assert_eq!(
            local.router_config_override, None,
            "aggregated keeps KV credit"
        );
        let query = router.query(&request(8)).await.expect("query");
        assert_eq!(query.prefill, None);

        // Placed remotely: prefill first, its result carried to decode.
        let stream = router.generate("long", request(40)).await.expect("served");
        assert_eq!(
            stream.served(),
            &Served::PrefillResult {
                prefill: WorkerWithDpRank::new(10, 0)
            }
        );
        assert_eq!(drain(stream).await, 2);
        assert_eq!(prefill.seen().len(), 1);
        assert!(
            decode
                .seen()
                .pop()
                .expect("decode")
                .prefill_result
                .is_some()
        );
        let query = router.query(&request(40)).await.expect("query");
        assert_eq!(query.prefill, Some(WorkerWithDpRank::new(10, 0)));

        // A prefill pin is obeyed whatever the placement would say.
        let mut pinned = request(8);
        pinned.routing = Some(RoutingHints {
            prefill_worker_id: Some(10),
            ..RoutingHints::default()
        });
        let stream = router.generate("pinned", pinned).await.expect("served");
        assert!(matches!(stream.served(), Served::PrefillResult { .. }));
        assert_eq!(drain(stream).await, 2);
        assert_eq!(prefill.seen().len(), 2);

        // Backpressure while placing is the client's to retry, never a silent remote prefill.
        phases
            .saturated
            .lock()
            .insert(phase_name(RequestPhase::Aggregated));
        let err = router
            .generate("busy", request(8))
            .await
            .expect_err("saturated");
        assert!(err.is_retryable(), "{err}");
        assert!(
            matches!(err, PrefillError::ResourceExhausted { .. }),
            "{err:?}"
        );
        assert_eq!(prefill.seen().len(), 2);
    })
    .await
    .expect("test bounded in time");
}
