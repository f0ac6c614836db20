//! Worker loss: every stream on a dropped connection ends with the typed error.

use std::time::Duration;

use futures::StreamExt;
use kvroute_runtime::{Client, ClientConfig, RequestError};

use crate::support::{Job, TestClient, bounded, connect, first_error, start_worker};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_dying_mid_stream_ends_every_stream_with_worker_unavailable() {
    let (server, engine) = start_worker(7).await;
    let client = connect(&server).await;
    let mut streams = Vec::new();
    for i in 0..20 {
        let mut stream = client
            .generate(&format!("r{i}"), &Job::slow(u32::MAX, 2))
            .await
            .unwrap();
        bounded("first item", stream.next()).await.unwrap().unwrap();
        streams.push(stream);
    }
    // Aborting the server task drops its listener, connections and engine streams: a crash as
    // the caller sees it.
    server.abort();
    crate::support::eventually("the engine to see every request killed", || {
        engine.killed() == 20
    })
    .await;
    for stream in streams {
        let last = bounded(
            "the stream to end after the worker died",
            first_error(stream),
        )
        .await;
        match last {
            Some(e @ RequestError::WorkerUnavailable { .. }) => assert!(e.is_worker_unavailable()),
            other => panic!("expected WorkerUnavailable, got {other:?}"),
        }
    }
    assert!(client.is_closed());
    match client.generate("late", &Job::new(1)).await {
        Err(RequestError::WorkerUnavailable { .. }) => {}
        other => panic!("a closed client must refuse new requests, got {other:?}"),
    }
}

#[tokio::test]
async fn an_engine_gone_mid_stream_is_a_worker_loss_the_caller_may_migrate() {
    let (server, _engine) = start_worker(7).await;
    let client = connect(&server).await;
    let job = Job {
        unavailable_after: Some(3),
        ..Job::new(10)
    };
    let mut stream = client.generate("r", &job).await.unwrap();
    let mut items = 0;
    let error = loop {
        match bounded("the next item", stream.next()).await {
            Some(Ok(_)) => items += 1,
            Some(Err(e)) => break e,
            None => panic!("the stream ended normally; expected the engine's failure"),
        }
    };
    assert_eq!(items, 3, "the items before the failure arrive");
    match &error {
        RequestError::WorkerUnavailable { addr, reason } => {
            assert_eq!(addr, &server.local_addr().to_string());
            assert!(reason.contains("engine connection refused"), "{reason}");
        }
        other => panic!("expected WorkerUnavailable, got {other:?}"),
    }
    assert!(error.is_worker_unavailable());
    // The connection itself is fine: the next request on it is served.
    assert!(!client.is_closed());
    let ok: Vec<_> = client
        .generate("r2", &Job::new(2))
        .await
        .unwrap()
        .collect()
        .await;
    assert_eq!(ok.len(), 2);
}

#[tokio::test]
async fn an_engine_unavailable_at_start_is_a_worker_loss_and_an_engine_refusal_is_not() {
    let (server, _engine) = start_worker(7).await;
    let client = connect(&server).await;
    let job = Job {
        unavailable_after: Some(0),
        ..Job::new(10)
    };
    let error = bounded(
        "the failure",
        first_error(client.generate("a", &job).await.unwrap()),
    )
    .await;
    assert!(
        matches!(error, Some(RequestError::WorkerUnavailable { .. })),
        "{error:?}"
    );
    let job = Job {
        reject: Some("prompt too long".to_owned()),
        ..Job::new(10)
    };
    let error = bounded(
        "the refusal",
        first_error(client.generate("b", &job).await.unwrap()),
    )
    .await;
    match error {
        Some(e @ RequestError::Engine { .. }) => assert!(!e.is_worker_unavailable()),
        other => panic!("expected an engine error, got {other:?}"),
    }
}

#[tokio::test]
async fn connecting_to_a_closed_port_is_worker_unavailable() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    drop(listener);
    match TestClient::connect(&addr, ClientConfig::default()).await {
        Err(e @ RequestError::WorkerUnavailable { .. }) => assert!(e.is_worker_unavailable()),
        other => panic!("expected WorkerUnavailable, got {other:?}"),
    }
}

#[tokio::test]
async fn a_peer_that_never_answers_the_handshake_trips_the_connect_timeout() {
    // The kernel completes the TCP handshake from the backlog; nobody ever answers the hello.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let config = ClientConfig {
        connect_timeout: Duration::from_millis(100),
        ..ClientConfig::default()
    };
    match bounded(
        "the connect timeout",
        Client::<Job, crate::support::Item>::connect(&addr, config),
    )
    .await
    {
        Err(e @ RequestError::ConnectTimeout { .. }) => assert!(e.is_worker_unavailable()),
        other => panic!("expected ConnectTimeout, got {other:?}"),
    }
    drop(listener);
}

#[tokio::test]
async fn a_worker_that_goes_silent_is_declared_dead_by_the_keepalive() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    // A "worker" that completes the handshake, then never sends another byte (a host that
    // vanished without closing its sockets looks the same).
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let silent = tokio::spawn(async move {
        let (mut socket, _) = listener.accept().await.unwrap();
        let mut hello = [0u8; 4 + 9 + 6 + 16];
        socket.read_exact(&mut hello).await.unwrap();
        let mut ack = Vec::new();
        ack.extend_from_slice(&(9u32 + 18 + 16 + 1).to_be_bytes());
        ack.push(0x81);
        ack.extend_from_slice(&0u64.to_le_bytes());
        ack.extend_from_slice(&kvroute_runtime::PROTOCOL_VERSION.to_le_bytes());
        ack.extend_from_slice(&9u64.to_le_bytes());
        ack.extend_from_slice(&(1u64 << 20).to_le_bytes());
        ack.extend_from_slice(&[0u8; 16]); // the worker's nonce
        ack.push(0); // no fleet secret: no proof
        socket.write_all(&ack).await.unwrap();
        let mut sink = vec![0u8; 1024];
        while socket.read(&mut sink).await.is_ok_and(|n| n > 0) {}
    });
    let config = ClientConfig {
        keepalive_interval: Some(Duration::from_millis(30)),
        first_response_timeout: None,
        ..ClientConfig::default()
    };
    let client: TestClient = Client::connect(&addr, config).await.unwrap();
    assert_eq!(client.worker_id(), 9);
    let stream = client.generate("r", &Job::new(1)).await.unwrap();
    match bounded("the keepalive to fire", first_error(stream)).await {
        Some(RequestError::WorkerUnavailable { reason, .. }) => {
            assert!(reason.contains("keepalive"), "{reason}")
        }
        other => panic!("expected WorkerUnavailable, got {other:?}"),
    }
    silent.abort();
}

#[tokio::test]
async fn an_idle_connection_to_a_live_worker_stays_open() {
    let (server, _engine) = start_worker(1).await;
    // Ten intervals of quiet: several pings answered. The interval leaves 150 ms (three
    // intervals) for a pong, so a loaded machine (a build beside the tests) cannot fake a death;
    // at 10 ms it once did.
    let config = ClientConfig {
        keepalive_interval: Some(Duration::from_millis(50)),
        ..ClientConfig::default()
    };
    let client: TestClient = Client::connect(&server.local_addr().to_string(), config)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!client.is_closed(), "pongs keep a quiet connection alive");
    assert_eq!(
        crate::support::collect(client.generate("r", &Job::new(2)).await.unwrap()).await,
        vec![0, 1]
    );
}
