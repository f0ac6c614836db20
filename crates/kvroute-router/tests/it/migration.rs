//! Migration without HTTP: a worker killed mid-stream, the request finishing elsewhere; a
//! worker that cannot be reached replaced before the request streams.

use std::sync::atomic::Ordering;

use futures::StreamExt;
use kvroute_protocols::PreprocessedRequest;
use kvroute_router::{
    KvPushRouter, KvResponse, KvRoutedStream, KvRouterError, MigratingResponse, MigratingStream,
    Migrator, Policy,
};
use kvroute_runtime::{Lease, RouteError, WorkerRole};

use crate::support::{Behaviour, Fleet, eventually, idle, output_token, request, run};

fn slow(max_tokens: u32) -> PreprocessedRequest {
    let mut req = request((0..16).collect(), Behaviour::Slow);
    req.stop_conditions.max_tokens = Some(max_tokens);
    req
}

async fn start(migrator: &Migrator, req: PreprocessedRequest) -> MigratingStream {
    match migrator.generate(req).await.unwrap() {
        MigratingResponse::Stream(s) => *s,
        MigratingResponse::Query(_) => panic!("expected a stream"),
    }
}

/// Reads `n` token items; returns their tokens.
async fn take_tokens(stream: &mut MigratingStream, n: usize) -> Vec<u32> {
    let mut tokens = Vec::new();
    while tokens.len() < n {
        let item = stream.next().await.expect("stream ended early").unwrap();
        tokens.extend(item.data.map(|d| d.token_ids).unwrap_or_default());
    }
    tokens
}

#[test]
fn killed_worker_mid_stream_continues_on_another_with_the_generated_tokens() {
    run(async {
        let mut fleet = Fleet::start(3).await;
        let router = fleet.router(Policy::Kv).await;
        let migrator = Migrator::new(router.clone(), 3);
        let mut stream = start(&migrator, slow(10)).await;
        let first_worker = stream.worker().worker_id;
        let mut tokens = take_tokens(&mut stream, 3).await;
        fleet.worker_mut(first_worker).kill();
        let mut finish = None;
        while let Some(item) = stream.next().await {
            let data = item.expect("the client sees no error").data.unwrap();
            tokens.extend(&data.token_ids);
            finish = data.finish_reason.or(finish);
        }
        assert_eq!(tokens.len(), 10, "{tokens:?}");
        assert!(finish.is_some());
        assert_eq!(stream.migrations(), 1);
        let second = stream.worker().worker_id;
        assert_ne!(second, first_worker);
        // The continuation carried the prompt plus what was generated, and the rest of the budget.
        let continued = fleet
            .worker(second)
            .engine
            .requests
            .lock()
            .last()
            .cloned()
            .unwrap();
        let generated = &tokens[..continued.token_ids.len() - 16];
        assert!(generated.len() >= 3, "{generated:?}");
        let expect: Vec<u32> = (0..16)
            .chain((0..generated.len() as u32).map(output_token))
            .collect();
        assert_eq!(continued.token_ids, expect);
        assert_eq!(
            continued.stop_conditions.max_tokens,
            Some(10 - generated.len() as u32)
        );
        drop(stream);
        eventually("all load is freed", || idle(&router)).await;
    });
}

#[test]
fn without_migrations_left_the_worker_loss_reaches_the_caller() {
    run(async {
        let mut fleet = Fleet::start(2).await;
        let router = fleet.router(Policy::Kv).await;
        let migrator = Migrator::new(router.clone(), 0);
        let mut stream = start(&migrator, slow(10)).await;
        take_tokens(&mut stream, 2).await;
        fleet.worker_mut(stream.worker().worker_id).kill();
        let mut error = None;
        while let Some(item) = stream.next().await {
            if let Err(e) = item {
                error = Some(e);
            }
        }
        let error = error.expect("the worker loss surfaces");
        assert!(error.is_worker_unavailable(), "{error}");
        assert_eq!(stream.migrations(), 0);
        drop(stream);
        eventually("all load is freed", || idle(&router)).await;
    });
}

#[test]
fn engine_errors_are_not_migrated() {
    run(async {
        let fleet = Fleet::start(2).await;
        let router = fleet.router(Policy::Kv).await;
        let migrator = Migrator::new(router.clone(), 3);
        let mut stream = start(&migrator, request((0..8).collect(), Behaviour::Error)).await;
        let mut errors = 0;
        while let Some(item) = stream.next().await {
            errors += usize::from(item.unwrap().is_error());
        }
        assert_eq!((errors, stream.migrations()), (1, 0));
        let started: usize = fleet
            .workers
            .iter()
            .map(|w| w.engine.started.load(std::sync::atomic::Ordering::SeqCst))
            .sum();
        assert_eq!(started, 1);
        drop(stream);
        assert!(idle(&router));
    });
}

/// Worker 2 (a fake engine) and worker 1, registered but unreachable, which the KV router
/// prefers: worker 2 carries a stalled request, whose decode load makes it the costlier choice.
/// Returns the router, the stalled stream (dropping it frees worker 2) and worker 1's lease.
async fn unreachable_worker_preferred(fleet: &mut Fleet) -> (KvPushRouter, KvRoutedStream, Lease) {
    fleet.add(2, None).await;
    let lease = fleet.register_unreachable(1, WorkerRole::Aggregated).await;
    let router = fleet.router(Policy::Kv).await;
    eventually("both workers are known", || {
        router.with_core(|c| c.workers().count()) == 2
    })
    .await;
    let mut stalled = request((100..108).collect(), Behaviour::Stall);
    stalled.routing_mut().backend_instance_id = Some(2);
    let KvResponse::Stream(mut stalled) = router.generate(stalled).await.unwrap() else {
        panic!("expected a stream");
    };
    stalled
        .next()
        .await
        .expect("the stalled request's token")
        .unwrap();
    (router, stalled, lease)
}

/// How many requests worker 2 has received.
fn started_on_worker_2(fleet: &Fleet) -> usize {
    fleet.worker(2).engine.started.load(Ordering::SeqCst)
}

#[test]
fn an_unreachable_worker_chosen_first_is_replaced_before_the_request_streams() {
    run(async {
        let mut fleet = Fleet::start(0).await;
        let (router, stalled, _lease) = unreachable_worker_preferred(&mut fleet).await;

        // Without migrations the loss is the caller's, typed, and names the lost worker.
        let err = Migrator::new(router.clone(), 0)
            .generate(slow(4))
            .await
            .expect_err("no migration allowed");
        let KvRouterError::Send { worker, source } = &err else {
            panic!("expected a send failure, got {err:?}");
        };
        assert_eq!(worker.worker_id, 1, "{err}");
        assert!(
            matches!(source, RouteError::Request { source, .. } if source.is_worker_unavailable()),
            "{err}"
        );
        assert_eq!(started_on_worker_2(&fleet), 1, "only the stalled request");

        let mut stream = start(&Migrator::new(router.clone(), 3), slow(4)).await;
        assert_eq!(stream.worker().worker_id, 2);
        assert_eq!(stream.migrations(), 1);
        assert_eq!(stream.first_decision().worker.worker_id, 2);
        let mut tokens = Vec::new();
        while let Some(item) = stream.next().await {
            let item = item.expect("the client sees no error");
            assert!(!item.is_error(), "{item:?}");
            tokens.extend(item.data.map(|d| d.token_ids).unwrap_or_default());
        }
        assert_eq!(tokens, (0..4).map(output_token).collect::<Vec<_>>());
        // Worker 2 got the request whole (nothing was generated before), kept off worker 1.
        let sent = fleet
            .worker(2)
            .engine
            .requests
            .lock()
            .last()
            .cloned()
            .unwrap();
        assert_eq!(sent.token_ids, (0..16).collect::<Vec<u32>>());
        assert_eq!(sent.stop_conditions.max_tokens, Some(4));
        let allowed = sent.routing.and_then(|r| r.allowed_worker_ids);
        assert_eq!(allowed, Some(vec![2]));
        drop(stream);
        drop(stalled);
        eventually("all load is freed", || idle(&router)).await;
    });
}

#[test]
fn a_request_pinned_to_an_unreachable_worker_fails_typed_without_a_retry() {
    run(async {
        let mut fleet = Fleet::start(0).await;
        let (router, stalled, _lease) = unreachable_worker_preferred(&mut fleet).await;
        let mut req = slow(4);
        req.routing_mut().backend_instance_id = Some(1);
        let err = Migrator::new(router.clone(), 3)
            .generate(req)
            .await
            .expect_err("the pin is honoured");
        let KvRouterError::Send { worker, source } = &err else {
            panic!("expected a send failure, got {err:?}");
        };
        assert_eq!(worker.worker_id, 1, "{err}");
        assert!(
            matches!(source, RouteError::Request { source, .. } if source.is_worker_unavailable()),
            "{err}"
        );
        assert_eq!(started_on_worker_2(&fleet), 1, "never retried on worker 2");
        // The worker failed it, the client did not go away: an error, not a cancellation.
        let metrics = router.metrics_text();
        assert!(
            metrics.contains("kvroute_router_requests_finished_total{outcome=\"error\"} 1"),
            "{metrics}"
        );
        assert!(!metrics.contains("outcome=\"cancelled\"} 1"), "{metrics}");
        drop(stalled);
        eventually("all load is freed", || idle(&router)).await;
    });
}
