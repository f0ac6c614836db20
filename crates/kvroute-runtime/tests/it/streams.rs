//! Many concurrent streams over one connection, and unary calls beside them.

use futures::StreamExt;
use futures::future::join_all;
use kvroute_protocols::{SessionAction, SessionControl};
use kvroute_runtime::RequestError;

use crate::support::{Job, bounded, collect, connect, start_worker};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thousands_of_concurrent_streams_share_one_connection() {
    let (server, engine) = start_worker(1).await;
    let client = connect(&server).await;
    let streams = 4000u32;
    let results = bounded(
        "4000 streams completing",
        join_all((0..streams).map(|i| {
            let client = client.clone();
            async move {
                let stream = client
                    .generate(&format!("req-{i}"), &Job::new(i % 7 + 1))
                    .await
                    .expect("send");
                (i, collect(stream).await)
            }
        })),
    )
    .await;
    for (i, items) in results {
        assert_eq!(
            items,
            (0..i % 7 + 1).collect::<Vec<_>>(),
            "stream {i} got the wrong items"
        );
    }
    assert_eq!(
        engine.started.load(std::sync::atomic::Ordering::SeqCst),
        streams as usize
    );
    assert_eq!(
        client.open_streams(),
        0,
        "every finished stream releases its slot"
    );
    crate::support::eventually("the engine's slots to free", || {
        engine.active.load(std::sync::atomic::Ordering::SeqCst) == 0
    })
    .await;
}

#[tokio::test]
async fn the_engine_sees_the_request_id() {
    let (server, _engine) = start_worker(1).await;
    let client = connect(&server).await;
    assert_eq!(
        client.worker_id(),
        1,
        "the handshake announces the worker id"
    );
    let items: Vec<_> = client
        .generate("abc-123", &Job::new(2))
        .await
        .unwrap()
        .collect()
        .await;
    let ids: Vec<_> = items.into_iter().map(|i| i.unwrap().id).collect();
    assert_eq!(
        ids,
        vec![Some("abc-123".to_owned()), Some("abc-123".to_owned())]
    );
}

#[tokio::test]
async fn an_engine_rejection_fails_only_that_stream() {
    let (server, _engine) = start_worker(1).await;
    let client = connect(&server).await;
    let mut job = Job::new(1);
    job.reject = Some("over capacity".to_owned());
    let mut stream = client.generate("r", &job).await.unwrap();
    match stream.next().await {
        Some(Err(RequestError::Engine { message })) => {
            assert!(message.contains("over capacity"), "{message}")
        }
        other => panic!("expected an engine error, got {other:?}"),
    }
    assert!(stream.next().await.is_none(), "an error is the last item");
    assert_eq!(
        collect(client.generate("ok", &Job::new(2)).await.unwrap()).await,
        vec![0, 1]
    );
}

#[tokio::test]
async fn session_control_reaches_the_engine() {
    let (server, engine) = start_worker(1).await;
    let client = connect(&server).await;
    let open = SessionControl::new("s1").with_action(SessionAction::Open);
    client.session_control(&open).await.expect("open");
    assert!(engine.sessions.lock().contains("s1"));
    let close = SessionControl::new("s1").with_action(SessionAction::Close);
    client.session_control(&close).await.expect("close");
    assert!(engine.sessions.lock().is_empty());
    match client.session_control(&close).await {
        Err(RequestError::Engine { message }) => {
            assert!(message.contains("no session s1"), "{message}")
        }
        other => panic!("closing twice must fail in the engine, got {other:?}"),
    }
    match client.session_control(&SessionControl::new("s2")).await {
        Err(RequestError::Unsupported { .. }) => {}
        other => panic!("expected unsupported, got {other:?}"),
    }
}

#[tokio::test]
async fn a_connection_over_its_stream_limit_is_refused_the_extra_stream() {
    let config = kvroute_runtime::WorkerServerConfig {
        max_streams_per_connection: 2,
        ..kvroute_runtime::WorkerServerConfig::new(1)
    };
    let (server, _engine) = crate::support::start_worker_with(config).await;
    let client = connect(&server).await;
    let mut held = Vec::new();
    for i in 0..2 {
        let mut stream = client
            .generate(&format!("r{i}"), &Job::slow(u32::MAX, 5))
            .await
            .unwrap();
        bounded("first item", stream.next()).await.unwrap().unwrap();
        held.push(stream);
    }
    let mut third = client.generate("r2", &Job::new(1)).await.unwrap();
    match bounded("the refusal", third.next()).await {
        Some(Err(RequestError::TooManyStreams { message })) => {
            assert!(message.contains("2 streams"), "{message}")
        }
        other => panic!("expected TooManyStreams, got {other:?}"),
    }
    held.pop();
    // The killed stream's slot frees once the worker processes the kill.
    let items = bounded("a stream after a slot freed", async {
        loop {
            match client
                .generate("r3", &Job::new(1))
                .await
                .unwrap()
                .next()
                .await
            {
                Some(Err(RequestError::TooManyStreams { .. })) => tokio::task::yield_now().await,
                other => return other,
            }
        }
    })
    .await;
    assert_eq!(items.unwrap().unwrap().data, Some(0));
}
