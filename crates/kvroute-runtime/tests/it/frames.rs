//! Hostile input: oversize, garbage and mistyped frames are refused without taking the server
//! down, and the caller is told why.

use futures::StreamExt;
use kvroute_runtime::{Client, ClientConfig, RequestError, WorkerServerConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::support::{Item, Job, bounded, collect, connect, start_worker, start_worker_with};

const HELLO: u8 = 0x01;
const HELLO_ACK: u8 = 0x81;
const GO_AWAY: u8 = 0x86;

fn raw_frame(kind: u8, stream: u64, body: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&((9 + body.len()) as u32).to_be_bytes());
    out.push(kind);
    out.extend_from_slice(&stream.to_le_bytes());
    out.extend_from_slice(body);
    out
}

fn hello(version: u16) -> Vec<u8> {
    let mut body = b"KVRT".to_vec();
    body.extend_from_slice(&version.to_le_bytes());
    body.extend_from_slice(&[0u8; 16]); // the client's nonce
    raw_frame(HELLO, 0, &body)
}

/// Reads one frame: (kind, body), or `None` at end of stream.
async fn read_frame(socket: &mut TcpStream) -> Option<(u8, Vec<u8>)> {
    let mut len = [0u8; 4];
    socket.read_exact(&mut len).await.ok()?;
    let mut frame = vec![0u8; u32::from_be_bytes(len) as usize];
    socket.read_exact(&mut frame).await.ok()?;
    Some((frame[0], frame[9..].to_vec()))
}

/// Reads until end of stream; returns the go-away message sent before closing, if any.
async fn go_away_then_close(socket: &mut TcpStream) -> String {
    let mut message = None;
    while let Some((kind, body)) = bounded("the server to close", read_frame(socket)).await {
        if kind == GO_AWAY {
            message = Some(String::from_utf8(body).unwrap());
        }
    }
    message.expect("a go-away frame before the close")
}

async fn still_serves(server: &kvroute_runtime::WorkerServer) {
    let client = connect(server).await;
    assert_eq!(
        collect(client.generate("after", &Job::new(3)).await.unwrap()).await,
        vec![0, 1, 2]
    );
}

#[tokio::test]
async fn an_oversize_length_prefix_is_refused_and_the_server_keeps_serving() {
    let (server, _engine) = start_worker(1).await;
    let mut socket = TcpStream::connect(server.local_addr()).await.unwrap();
    socket
        .write_all(&hello(kvroute_runtime::PROTOCOL_VERSION))
        .await
        .unwrap();
    let (kind, _) = read_frame(&mut socket).await.unwrap();
    assert_eq!(kind, HELLO_ACK);
    // Announce a 1 GiB frame; the server must refuse it before reading (or allocating) it.
    socket.write_all(&(1u32 << 30).to_be_bytes()).await.unwrap();
    let message = go_away_then_close(&mut socket).await;
    assert!(message.contains("maximum frame size"), "{message}");
    still_serves(&server).await;
}

#[tokio::test]
async fn garbage_instead_of_a_hello_is_refused_and_the_server_keeps_serving() {
    let (server, _engine) = start_worker(1).await;
    let mut socket = TcpStream::connect(server.local_addr()).await.unwrap();
    socket
        .write_all(&raw_frame(0x42, 9, b"GET / HTTP/1.1"))
        .await
        .unwrap();
    let message = go_away_then_close(&mut socket).await;
    assert!(message.contains("unknown frame kind 0x42"), "{message}");

    let mut socket = TcpStream::connect(server.local_addr()).await.unwrap();
    socket
        .write_all(&raw_frame(HELLO, 0, b"nonsense"))
        .await
        .unwrap();
    let message = go_away_then_close(&mut socket).await;
    assert!(message.contains("expected a kvroute hello"), "{message}");
    still_serves(&server).await;
}

#[tokio::test]
async fn a_version_mismatch_is_refused_with_both_versions_named() {
    let (server, _engine) = start_worker(1).await;
    let mut socket = TcpStream::connect(server.local_addr()).await.unwrap();
    socket.write_all(&hello(99)).await.unwrap();
    let message = go_away_then_close(&mut socket).await;
    assert!(message.contains("version 99"), "{message}");
    assert!(
        message.contains(&format!("speaks {}", kvroute_runtime::PROTOCOL_VERSION)),
        "{message}"
    );
}

#[tokio::test]
async fn an_unknown_frame_kind_after_the_handshake_closes_only_that_connection() {
    let (server, _engine) = start_worker(1).await;
    let bystander = connect(&server).await;
    let mut bystander_stream = bystander.generate("b", &Job::slow(3, 20)).await.unwrap();
    let mut socket = TcpStream::connect(server.local_addr()).await.unwrap();
    socket
        .write_all(&hello(kvroute_runtime::PROTOCOL_VERSION))
        .await
        .unwrap();
    read_frame(&mut socket).await.unwrap();
    socket
        .write_all(&raw_frame(0xee, 1, &[1, 2, 3]))
        .await
        .unwrap();
    let message = go_away_then_close(&mut socket).await;
    assert!(message.contains("unknown frame kind 0xee"), "{message}");
    let mut got = Vec::new();
    while let Some(item) = bounded("the bystander's stream", bystander_stream.next()).await {
        got.push(item.unwrap().data.unwrap());
    }
    assert_eq!(got, vec![0, 1, 2], "other connections are unaffected");
}

#[tokio::test]
async fn a_mistyped_request_fails_its_stream_but_not_the_connection() {
    let (server, _engine) = start_worker(1).await;
    let client: Client<(u8, String), Item> =
        Client::connect(&server.local_addr().to_string(), ClientConfig::default())
            .await
            .unwrap();
    for _ in 0..2 {
        let mut stream = client
            .generate("bad", &(1, "not a job".to_owned()))
            .await
            .unwrap();
        match bounded("the refusal", stream.next()).await {
            Some(Err(RequestError::BadRequest { .. })) => {}
            other => panic!("expected BadRequest, got {other:?}"),
        }
    }
    assert!(
        !client.is_closed(),
        "a malformed body is a stream error, not a connection error"
    );
}

#[tokio::test]
async fn an_oversize_request_is_refused_locally_with_the_limit_named() {
    let (server, _engine) = start_worker(1).await;
    let config = ClientConfig {
        max_frame_bytes: 1024,
        ..ClientConfig::default()
    };
    let client: Client<Job, Item> = Client::connect(&server.local_addr().to_string(), config)
        .await
        .unwrap();
    let mut job = Job::new(1);
    job.padding = vec![7; 4096];
    match client.generate("big", &job).await {
        Err(e @ RequestError::FrameTooLarge { max: 1024, .. }) => {
            assert!(
                e.to_string().contains("maximum frame size of 1024 bytes"),
                "{e}"
            );
        }
        other => panic!("expected FrameTooLarge, got {other:?}"),
    }
    assert_eq!(
        collect(client.generate("small", &Job::new(1)).await.unwrap()).await,
        vec![0]
    );
}

#[tokio::test]
async fn a_server_with_a_smaller_limit_refuses_the_frame_and_the_caller_learns_why() {
    let config = WorkerServerConfig {
        max_frame_bytes: 1024,
        ..WorkerServerConfig::new(1)
    };
    let (server, _engine) = start_worker_with(config).await;
    let client = connect(&server).await;
    let mut job = Job::new(1);
    job.padding = vec![7; 4096];
    let mut stream = client.generate("big", &job).await.unwrap();
    match bounded("the refusal", stream.next()).await {
        Some(Err(RequestError::WorkerUnavailable { reason, .. })) => {
            assert!(
                reason.contains("maximum frame size is 1024 bytes"),
                "{reason}"
            );
        }
        other => panic!("expected the connection to be refused, got {other:?}"),
    }
    still_serves(&server).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_garbage_never_takes_the_server_down() {
    use rand::{Rng, SeedableRng};
    let (server, engine) = start_worker(1).await;
    let bystander = connect(&server).await;
    let mut bystander_stream = bystander
        .generate("b", &Job::slow(u32::MAX, 1))
        .await
        .unwrap();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0x5eed);
    for case in 0..64 {
        let mut socket = TcpStream::connect(server.local_addr()).await.unwrap();
        let mut bytes = Vec::new();
        if case % 2 == 0 {
            bytes.extend(hello(kvroute_runtime::PROTOCOL_VERSION));
        }
        for _ in 0..rng.gen_range(1..8) {
            // Mostly well-framed junk (valid length, random kind and body), sometimes raw noise.
            let body: Vec<u8> = (0..rng.gen_range(0..300)).map(|_| rng.r#gen()).collect();
            if rng.gen_bool(0.7) {
                let kind =
                    [0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x81, rng.r#gen()][rng.gen_range(0..8)];
                bytes.extend(raw_frame(kind, rng.gen_range(0..4), &body));
            } else {
                bytes.extend(body);
            }
        }
        let _ = socket.write_all(&bytes).await;
        // Either side may close first; all that matters is that the server survives.
        drop(socket);
    }
    still_serves(&server).await;
    let item = bounded("the bystander's stream to go on", bystander_stream.next()).await;
    assert!(matches!(item, Some(Ok(_))), "{item:?}");
    drop(bystander_stream);
    crate::support::eventually("every garbage request to be cleaned up", || {
        engine.active.load(std::sync::atomic::Ordering::SeqCst) == 0
    })
    .await;
}
