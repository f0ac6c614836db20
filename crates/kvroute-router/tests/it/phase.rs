//! Disaggregated serving: the prefill router over the KV routers of both phases.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use futures::StreamExt;
use kvroute_prefill::{PrefillRouter, PrefillRouterConfig};
use kvroute_router::{KvPhaseRouter, Policy, role_filtered};
use kvroute_runtime::{Discovery, WorkerRole};

use crate::support::{Behaviour, Fleet, eventually, idle, request, run};

#[test]
fn prefill_then_decode_through_the_kv_routers_frees_both_phases() {
    run(async {
        let mut fleet = Fleet::start(0).await;
        fleet.add_role(1, None, WorkerRole::Prefill).await;
        fleet.add_role(2, None, WorkerRole::Decode).await;
        fleet.add_role(3, None, WorkerRole::Aggregated).await;
        let watch = fleet.discovery.watch();
        let prefill = fleet
            .router_on(
                role_filtered(watch.clone(), &[WorkerRole::Prefill]),
                Policy::Kv,
            )
            .await;
        let decode = fleet
            .router_on(
                role_filtered(watch.clone(), &[WorkerRole::Decode, WorkerRole::Aggregated]),
                Policy::Kv,
            )
            .await;
        assert_eq!(prefill.with_core(|c| c.workers().count()), 1);
        assert_eq!(decode.with_core(|c| c.workers().count()), 2);
        let phases = Arc::new(KvPhaseRouter::new(prefill.clone(), decode.clone()));
        let router = PrefillRouter::new(phases, watch, PrefillRouterConfig::default());
        assert!(router.is_active());
        let mut stream = router
            .generate("r-1", request((0..12).collect(), Behaviour::Complete))
            .await
            .unwrap();
        let mut tokens = 0;
        while let Some(item) = stream.next().await {
            assert!(!item.is_error(), "{item:?}");
            tokens += item.data.map_or(0, |d| d.token_ids.len());
        }
        assert_eq!(tokens, 5);
        assert_eq!(stream.prefill_worker().map(|w| w.worker_id), Some(1));
        let prefilled = fleet.worker(1).engine.requests.lock().clone();
        assert_eq!(prefilled.len(), 1);
        assert_eq!(prefilled[0].stop_conditions.max_tokens, Some(1));
        let decode_worker = stream.worker().worker_id;
        assert!(decode_worker == 2 || decode_worker == 3);
        let decoded = fleet.worker(decode_worker).engine.requests.lock().clone();
        assert!(decoded[0].prefill_result.is_some(), "{decoded:?}");
        assert_eq!(fleet.worker(1).engine.started.load(Ordering::SeqCst), 1);
        drop(stream);
        eventually("both phases are freed", || idle(&prefill) && idle(&decode)).await;
    });
}
