//! Cancellation reaches the worker and frees the engine's slot.

use std::sync::atomic::Ordering;
use std::time::Duration;

use futures::StreamExt;
use kvroute_runtime::{ClientConfig, RequestError};

use crate::support::{Job, STOPPED, TestClient, bounded, connect, eventually, start_worker};

#[tokio::test]
async fn dropping_a_stream_kills_it_on_the_worker() {
    let (server, engine) = start_worker(1).await;
    let client = connect(&server).await;
    let mut stream = client.generate("r", &Job::slow(u32::MAX, 1)).await.unwrap();
    let first = bounded("first item", stream.next()).await.unwrap().unwrap();
    assert_eq!(first.data, Some(0));
    assert_eq!(engine.active.load(Ordering::SeqCst), 1);
    drop(stream);
    eventually("the worker to free the slot", || {
        engine.active.load(Ordering::SeqCst) == 0
    })
    .await;
    assert_eq!(client.open_streams(), 0);
}

#[tokio::test]
async fn kill_ends_the_stream_and_frees_the_slot() {
    let (server, engine) = start_worker(1).await;
    let client = connect(&server).await;
    let mut streams = Vec::new();
    for i in 0..50 {
        streams.push(
            client
                .generate(&format!("r{i}"), &Job::slow(u32::MAX, 2))
                .await
                .unwrap(),
        );
    }
    for stream in &mut streams {
        bounded("first item", stream.next()).await.unwrap().unwrap();
    }
    assert_eq!(engine.active.load(Ordering::SeqCst), 50);
    for stream in &mut streams {
        stream.kill();
        assert!(
            stream.next().await.is_none(),
            "a killed stream ends at once"
        );
    }
    eventually("the worker to free all 50 slots", || {
        engine.active.load(Ordering::SeqCst) == 0
    })
    .await;
}

#[tokio::test]
async fn stop_lets_the_engine_finish_gracefully() {
    let (server, engine) = start_worker(1).await;
    let client = connect(&server).await;
    let mut stream = client.generate("r", &Job::slow(u32::MAX, 5)).await.unwrap();
    bounded("first item", stream.next()).await.unwrap().unwrap();
    stream.stop();
    assert_eq!(engine.killed(), 0);
    let rest: Vec<u32> = bounded(
        "the stream to end",
        stream.map(|i| i.unwrap().data.unwrap()).collect::<Vec<_>>(),
    )
    .await;
    assert_eq!(
        rest.last(),
        Some(&STOPPED),
        "the engine's final item arrives before the end"
    );
    eventually("the slot to free", || {
        engine.active.load(Ordering::SeqCst) == 0
    })
    .await;
}

#[tokio::test]
async fn a_silent_engine_trips_the_first_response_timeout() {
    let (server, engine) = start_worker(1).await;
    let config = ClientConfig {
        first_response_timeout: Some(Duration::from_millis(50)),
        ..ClientConfig::default()
    };
    let client: TestClient =
        kvroute_runtime::Client::connect(&server.local_addr().to_string(), config)
            .await
            .unwrap();
    let mut stream = client.generate("r", &Job::slow(3, 60_000)).await.unwrap();
    match bounded("the timeout", stream.next()).await {
        Some(Err(RequestError::FirstResponseTimeout { after })) => {
            assert_eq!(after, Duration::from_millis(50))
        }
        other => panic!("expected a first-response timeout, got {other:?}"),
    }
    assert!(stream.next().await.is_none());
    eventually("the timed-out request to be killed on the worker", || {
        engine.active.load(Ordering::SeqCst) == 0
    })
    .await;
}
