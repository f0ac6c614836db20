//! Migration without HTTP: a worker killed mid-stream, the request finishing elsewhere.

use futures::StreamExt;
use kvroute_protocols::PreprocessedRequest;
use kvroute_router::{MigratingResponse, MigratingStream, Migrator, Policy};

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
