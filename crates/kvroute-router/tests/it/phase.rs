//! Disaggregated serving: the prefill router over the KV routers of both phases, and the
//! migration of disaggregated requests whose workers die.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use futures::StreamExt;
use kvroute_prefill::{DisaggMode, PrefillError, PrefillRouter, PrefillRouterConfig, Served};
use kvroute_protocols::{PreprocessedRequest, RequestPhase};
use kvroute_router::{
    KvPhaseRouter, KvPushRouter, KvResponse, MigratingDisaggStream, Migrator, Policy, role_filtered,
};
use kvroute_runtime::{Discovery, WorkerRole};

use crate::support::{Behaviour, Fleet, eventually, idle, output_token, request, run};

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
        // The prefill worker reported its 12 prompt tokens cached.
        let details = stream.prefill_tokens_details();
        assert_eq!(details.and_then(|d| d.cached_tokens), Some(12));
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

/// Prefill workers, decode workers, the KV router of each phase and the prefill router over
/// them.
struct Disagg {
    fleet: Fleet,
    prefill: KvPushRouter,
    decode: KvPushRouter,
    router: PrefillRouter<KvPhaseRouter>,
}

impl Disagg {
    async fn start(prefill_ids: &[u64], decode_ids: &[u64], mode: DisaggMode) -> Disagg {
        let mut fleet = Fleet::start(0).await;
        for &id in prefill_ids {
            fleet.add_role(id, None, WorkerRole::Prefill).await;
        }
        for &id in decode_ids {
            fleet.add_role(id, None, WorkerRole::Decode).await;
        }
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
        let phases = Arc::new(KvPhaseRouter::new(prefill.clone(), decode.clone()));
        let config = PrefillRouterConfig::default().with_mode(mode);
        let router = PrefillRouter::new(phases, watch, config);
        Disagg {
            fleet,
            prefill,
            decode,
            router,
        }
    }

    async fn generate(
        &self,
        max_migrations: u32,
        req: PreprocessedRequest,
    ) -> MigratingDisaggStream {
        Migrator::new(self.decode.clone(), max_migrations)
            .generate_disagg(&self.router, "r-1", req)
            .await
            .expect("served")
    }

    fn requests(&self, id: u64) -> Vec<PreprocessedRequest> {
        self.fleet.worker(id).engine.requests.lock().clone()
    }

    /// Waits until every per-worker load in both phases' routers reads zero.
    async fn drained(&self) {
        eventually("both phases are freed", || {
            idle(&self.prefill) && idle(&self.decode)
        })
        .await;
    }
}

/// A 16-token prompt whose engines stream `max_tokens` tokens slowly.
fn slow(max_tokens: u32) -> PreprocessedRequest {
    let mut req = request((0..16).collect(), Behaviour::Slow);
    req.stop_conditions.max_tokens = Some(max_tokens);
    req
}

/// Reads at least `n` tokens; returns them.
async fn take_tokens(stream: &mut MigratingDisaggStream, n: usize) -> Vec<u32> {
    let mut tokens = Vec::new();
    while tokens.len() < n {
        let item = stream.next().await.expect("stream ended early").unwrap();
        assert!(!item.is_error(), "{item:?}");
        tokens.extend(item.data.map(|d| d.token_ids).unwrap_or_default());
    }
    tokens
}

/// Reads the stream to its end: its tokens, and the error that ended it, if one did.
async fn drain(
    stream: &mut MigratingDisaggStream,
) -> (Vec<u32>, Option<kvroute_runtime::RequestError>) {
    let mut tokens = Vec::new();
    while let Some(item) = stream.next().await {
        match item {
            Ok(item) => {
                assert!(!item.is_error(), "{item:?}");
                tokens.extend(item.data.map(|d| d.token_ids).unwrap_or_default());
            }
            Err(e) => return (tokens, Some(e)),
        }
    }
    (tokens, None)
}

/// The cached tokens of the prefill details `stream` reports.
fn prefill_cached(stream: &MigratingDisaggStream) -> Option<u32> {
    stream
        .prefill_tokens_details()
        .and_then(|d| d.cached_tokens)
}

#[test]
fn killed_decode_worker_mid_stream_continues_with_a_fresh_prefill_on_another_decode_worker() {
    run(async {
        let mut d = Disagg::start(&[1], &[2, 3], DisaggMode::Enforced).await;
        let mut stream = d.generate(3, slow(10)).await;
        assert_eq!(stream.prefill_worker().map(|w| w.worker_id), Some(1));
        assert_eq!(prefill_cached(&stream), Some(16));
        let first = stream.worker().worker_id;
        let mut tokens = take_tokens(&mut stream, 3).await;
        d.fleet.worker_mut(first).kill();
        let (rest, error) = drain(&mut stream).await;
        assert!(error.is_none(), "the client sees no error: {error:?}");
        tokens.extend(rest);
        assert_eq!(stream.migrations(), 1);
        let second = stream.worker().worker_id;
        assert_ne!(second, first);
        assert_eq!(stream.prefill_worker().map(|w| w.worker_id), Some(1));
        assert!(matches!(stream.served(), Served::PrefillResult { .. }));

        // The continuation was prefilled again (prompt plus what was generated, one token) ...
        let prefills = d.requests(1);
        assert_eq!(prefills.len(), 2, "{prefills:?}");
        let generated = prefills[1].token_ids.len() - 16;
        assert!(generated >= 3, "{generated}");
        let expect: Vec<u32> = (0..16)
            .chain((0..generated as u32).map(output_token))
            .collect();
        assert_eq!(prefills[1].token_ids, expect);
        assert_eq!(prefills[1].stop_conditions.max_tokens, Some(1));
        // That prefill reported its longer prompt cached (16 + generated tokens); the first
        // prefill's details, over the client's prompt, are the request's.
        assert_eq!(prefill_cached(&stream), Some(16));
        let allowed = prefills[1]
            .routing
            .as_ref()
            .and_then(|r| r.allowed_worker_ids.clone())
            .expect("the continuation excludes the dead worker");
        assert!(!allowed.contains(&first), "{allowed:?}");
        // ... and decoded with the prefill's result and the rest of the budget.
        let continued = d.requests(second).pop().expect("the continuation");
        assert_eq!(continued.token_ids, expect);
        assert!(continued.prefill_result.is_some());
        assert_eq!(
            continued.stop_conditions.max_tokens,
            Some(10 - generated as u32)
        );
        // Every token the client saw came from exactly one worker, once: the first worker's
        // (all of them, since they are the continuation's prompt), then the second's.
        let client: Vec<u32> = (0..generated as u32)
            .chain(0..10 - generated as u32)
            .map(output_token)
            .collect();
        assert_eq!(tokens, client);
        drop(stream);
        d.drained().await;
    });
}

#[test]
fn a_decode_worker_pinned_by_the_request_is_not_left_when_it_dies() {
    run(async {
        let mut d = Disagg::start(&[1], &[2, 3], DisaggMode::Enforced).await;
        let mut req = slow(10);
        // What `x-worker-instance-id: 2` sets.
        let routing = req.routing_mut();
        routing.backend_instance_id = Some(2);
        routing.decode_worker_id = Some(2);
        let mut stream = d.generate(3, req).await;
        assert_eq!(stream.worker().worker_id, 2);
        take_tokens(&mut stream, 2).await;
        d.fleet.worker_mut(2).kill();
        let (_, error) = drain(&mut stream).await;
        let error = error.expect("the loss of the pinned worker reaches the client");
        assert!(error.is_worker_unavailable(), "{error}");
        assert_eq!(stream.migrations(), 0);
        assert_eq!(d.requests(1).len(), 1, "no second prefill");
        assert!(d.requests(3).is_empty(), "never moved to worker 3");
        drop(stream);
        d.drained().await;
    });
}

#[test]
fn once_the_migration_limit_is_spent_the_worker_loss_reaches_the_client() {
    run(async {
        let mut d = Disagg::start(&[1], &[2, 3], DisaggMode::Enforced).await;
        let mut stream = d.generate(1, slow(20)).await;
        let first = stream.worker().worker_id;
        take_tokens(&mut stream, 2).await;
        d.fleet.worker_mut(first).kill();
        take_tokens(&mut stream, 2).await;
        assert_eq!(stream.migrations(), 1);
        let second = stream.worker().worker_id;
        assert_ne!(second, first);
        d.fleet.worker_mut(second).kill();
        let (_, error) = drain(&mut stream).await;
        let error = error.expect("no migration left");
        assert!(error.is_worker_unavailable(), "{error}");
        assert_eq!(stream.migrations(), 1);
        assert_eq!(d.requests(1).len(), 2, "one fresh prefill per migration");
        drop(stream);
        d.drained().await;
    });
}

#[test]
fn engine_errors_of_disaggregated_requests_are_not_migrated() {
    run(async {
        let d = Disagg::start(&[1], &[2, 3], DisaggMode::Enforced).await;
        let mut stream = d
            .generate(3, request((0..8).collect(), Behaviour::Error))
            .await;
        let mut errors = 0;
        while let Some(item) = stream.next().await {
            errors += usize::from(item.expect("no transport error").is_error());
        }
        assert_eq!((errors, stream.migrations()), (1, 0));
        let decodes: usize = [2, 3]
            .iter()
            .map(|&id| d.fleet.worker(id).engine.started.load(Ordering::SeqCst))
            .sum();
        assert_eq!(decodes, 1);
        drop(stream);
        d.drained().await;
    });
}

#[test]
fn a_prefill_worker_lost_before_decode_is_replaced_when_disaggregation_is_enforced() {
    run(async {
        let d = Disagg::start(&[2], &[3], DisaggMode::Enforced).await;
        // Prefill worker 1 is registered but cannot be reached ...
        let _lease = d.fleet.register_unreachable(1, WorkerRole::Prefill).await;
        eventually("both prefill workers are known", || {
            d.prefill.with_core(|c| c.workers().count()) == 2
        })
        .await;
        // ... and the KV router prefers it: prefill worker 2 carries a stalled prefill.
        let mut stalled = request((100..116).collect(), Behaviour::Stall);
        stalled.routing_mut().prefill_worker_id = Some(2);
        let KvResponse::Stream(mut stalled) = d
            .prefill
            .generate_phase(stalled, RequestPhase::Prefill)
            .await
            .expect("worker 2 takes the stalled prefill")
        else {
            panic!("expected a stream");
        };
        stalled.next().await.expect("its token").unwrap();
        let req = request((0..16).collect(), Behaviour::Complete);
        let preferred = d.router.query(&req).await.expect("query").prefill;
        assert_eq!(preferred.map(|w| w.worker_id), Some(1));

        // Without migrations the loss is the client's, typed.
        let err = Migrator::new(d.decode.clone(), 0)
            .generate_disagg(&d.router, "r-0", req.clone())
            .await
            .expect_err("no migration allowed");
        assert_eq!(err.lost_worker(), Some((RequestPhase::Prefill, 1)));
        assert!(matches!(err, PrefillError::WorkerLost { .. }), "{err:?}");

        let mut stream = d.generate(3, req).await;
        assert_eq!(stream.prefill_worker().map(|w| w.worker_id), Some(2));
        assert_eq!(stream.migrations(), 1);
        let (tokens, error) = drain(&mut stream).await;
        assert!(error.is_none(), "{error:?}");
        assert_eq!(tokens.len(), 5);
        let prefilled = d.requests(2).pop().expect("the prefill moved to worker 2");
        assert_eq!(prefilled.token_ids, (0..16).collect::<Vec<u32>>());
        let allowed = prefilled.routing.and_then(|r| r.allowed_worker_ids);
        assert!(allowed.is_some_and(|a| !a.contains(&1)));
        drop(stream);
        drop(stalled);
        d.drained().await;
    });
}
