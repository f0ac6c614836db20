//! Slow and large clients: the header and body read timeouts, the body size limit checked
//! against `Content-Length` before reading, and the body memory budget. Raw TCP clients write
//! partial requests; the server's reaction is awaited with a bound, never timed.

use std::time::Duration;

use kvroute_router::http::{AppState, HttpConfig, serve};
use kvroute_router::{ModelRegistry, Policy};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::oneshot;

use super::{Server, test_config};
use crate::support::{Fleet, eventually, run};

/// The longest the tests wait for the server to react (far beyond the configured timeouts).
const BOUND: Duration = Duration::from_secs(20);

/// A chat request for a model that is not served: answered 404 without any worker.
const UNKNOWN_MODEL: &str = r#"{"model":"nope","messages":[{"role":"user","content":"hi"}]}"#;

fn addr(server: &Server) -> String {
    server.base.trim_start_matches("http://").to_owned()
}

/// The head of a `POST /v1/chat/completions` with `extra` header lines.
fn head(extra: &str) -> String {
    format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n{extra}\r\n"
    )
}

/// Connects to `addr` and writes `bytes`.
async fn send(addr: &str, bytes: &[u8]) -> TcpStream {
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    tcp.write_all(bytes).await.unwrap();
    tcp
}

/// Everything the server sends until it closes the connection (a reset counts as closed).
/// Panics when the connection stays open beyond [`BOUND`].
async fn read_until_closed(tcp: &mut TcpStream) -> Vec<u8> {
    let mut out = Vec::new();
    let read = async {
        let mut buf = [0u8; 4096];
        loop {
            match tcp.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => out.extend_from_slice(&buf[..n]),
            }
        }
    };
    tokio::time::timeout(BOUND, read)
        .await
        .expect("the server kept the connection open");
    out
}

/// Reads one response with a `content-length` body: its status and JSON body.
async fn read_response(tcp: &mut TcpStream) -> (u16, Value) {
    let mut got = Vec::new();
    let read = async {
        let mut buf = [0u8; 4096];
        loop {
            if let Some(parsed) = parse_response(&got) {
                return parsed;
            }
            let n = tcp.read(&mut buf).await.unwrap();
            assert!(n > 0, "closed before a whole response: {got:?}");
            got.extend_from_slice(&buf[..n]);
        }
    };
    tokio::time::timeout(BOUND, read)
        .await
        .expect("no response from the server")
}

/// The status and JSON body of `bytes` once they hold a whole response.
fn parse_response(bytes: &[u8]) -> Option<(u16, Value)> {
    let text = std::str::from_utf8(bytes).ok()?;
    let (head, body) = text.split_once("\r\n\r\n")?;
    let status = head.split(' ').nth(1)?.parse().unwrap();
    let length: usize = head
        .lines()
        .find_map(|l| {
            let (name, value) = l.split_once(':')?;
            name.eq_ignore_ascii_case("content-length")
                .then(|| value.trim().parse().unwrap())
        })
        .expect("a content-length");
    (body.len() >= length).then(|| (status, serde_json::from_str(&body[..length]).unwrap()))
}

fn config() -> HttpConfig {
    HttpConfig {
        header_timeout: Duration::from_millis(200),
        body_timeout: Duration::from_millis(200),
        ..test_config()
    }
}

#[test]
fn slow_headers_get_the_connection_closed_after_header_timeout() {
    run(async {
        let fleet = Fleet::start(1).await;
        let server = Server::start(fleet.router(Policy::Kv).await, config()).await;
        let mut clients = Vec::new();
        for _ in 0..8 {
            // Part of the head, never finished.
            clients.push(
                send(
                    &addr(&server),
                    b"POST /v1/chat/completions HTTP/1.1\r\nhost: te",
                )
                .await,
            );
        }
        for tcp in &mut clients {
            let sent = read_until_closed(tcp).await;
            assert!(
                sent.is_empty() || sent.starts_with(b"HTTP/1.1 408"),
                "{}",
                String::from_utf8_lossy(&sent)
            );
        }
        // The server still serves.
        let mut tcp = send(
            &addr(&server),
            format!(
                "{}{UNKNOWN_MODEL}",
                head(&format!("content-length: {}\r\n", UNKNOWN_MODEL.len()))
            )
            .as_bytes(),
        )
        .await;
        assert_eq!(read_response(&mut tcp).await.0, 404);
    });
}

#[test]
fn slow_body_gets_408_openai_error_and_the_connection_closed_after_body_timeout() {
    run(async {
        let fleet = Fleet::start(1).await;
        let server = Server::start(fleet.router(Policy::Kv).await, config()).await;
        // 10 of 75 body bytes, the rest never sent.
        let request = format!("{}{}", head("content-length: 75\r\n"), &UNKNOWN_MODEL[..10]);
        let mut tcp = send(&addr(&server), request.as_bytes()).await;
        let sent = read_until_closed(&mut tcp).await;
        let (status, body) = parse_response(&sent).expect("a whole response before the close");
        assert_eq!(status, 408, "{body}");
        assert_eq!(body["error"]["code"], "request_timeout", "{body}");
        assert_eq!(body["error"]["type"], "invalid_request_error", "{body}");
        assert!(
            body["error"]["message"]
                .as_str()
                .unwrap()
                .contains("body_timeout"),
            "{body}"
        );
        eventually("the body's reservation is released", || {
            server.state.body_bytes_reserved() == 0
        })
        .await;
    });
}

#[test]
fn content_length_beyond_max_body_bytes_gets_413_without_reading_the_body() {
    run(async {
        let fleet = Fleet::start(1).await;
        let server = Server::start(fleet.router(Policy::Kv).await, config()).await;
        // 1 GiB announced, nothing of it sent: the answer comes from the headers alone.
        let mut tcp = send(
            &addr(&server),
            head("content-length: 1073741824\r\n").as_bytes(),
        )
        .await;
        let (status, body) = read_response(&mut tcp).await;
        assert_eq!(status, 413, "{body}");
        assert_eq!(body["error"]["code"], "request_too_large", "{body}");
        let message = body["error"]["message"].as_str().unwrap();
        assert!(message.contains("max_body_bytes"), "{body}");
        assert!(message.contains("1073741824"), "{body}");
        read_until_closed(&mut tcp).await;
        assert_eq!(server.state.body_bytes_reserved(), 0);
    });
}

#[test]
fn chunked_body_beyond_max_body_bytes_gets_413() {
    run(async {
        let fleet = Fleet::start(1).await;
        let config = HttpConfig {
            max_body_bytes: 1024,
            body_timeout: Duration::from_secs(10),
            ..config()
        };
        let server = Server::start(fleet.router(Policy::Kv).await, config).await;
        let chunk = "x".repeat(600);
        let request = format!(
            "{}258\r\n{chunk}\r\n258\r\n{chunk}\r\n0\r\n\r\n",
            head("transfer-encoding: chunked\r\n")
        );
        let mut tcp = send(&addr(&server), request.as_bytes()).await;
        let (status, body) = read_response(&mut tcp).await;
        assert_eq!(status, 413, "{body}");
        assert!(
            body["error"]["message"]
                .as_str()
                .unwrap()
                .contains("max_body_bytes"),
            "{body}"
        );
        eventually("the body's reservation is released", || {
            server.state.body_bytes_reserved() == 0
        })
        .await;
    });
}

#[test]
fn a_refused_body_the_client_sends_anyway_is_drained_and_the_connection_serves_the_next_request() {
    run(async {
        let fleet = Fleet::start(1).await;
        let config = HttpConfig {
            max_body_bytes: 1024,
            body_timeout: Duration::from_secs(10),
            ..config()
        };
        let server = Server::start(fleet.router(Policy::Kv).await, config).await;
        let next = format!(
            "{}{UNKNOWN_MODEL}",
            head(&format!("content-length: {}\r\n", UNKNOWN_MODEL.len()))
        );
        // Three times the limit, announced and sent whole, as HTTP clients do: the 413 must
        // reach the client (not a reset) and the connection must stay in step.
        let body = "x".repeat(3000);
        let oversized = format!("{}{body}", head("content-length: 3000\r\n"));
        let mut tcp = send(&addr(&server), oversized.as_bytes()).await;
        let (status, answer) = read_response(&mut tcp).await;
        assert_eq!(status, 413, "{answer}");
        tcp.write_all(next.as_bytes()).await.unwrap();
        let (status, answer) = read_response(&mut tcp).await;
        assert_eq!(status, 404, "the next request on the connection: {answer}");
        // The same without a Content-Length: the limit is passed while reading.
        let chunk = "x".repeat(600);
        let chunked = format!(
            "{}258\r\n{chunk}\r\n258\r\n{chunk}\r\n0\r\n\r\n",
            head("transfer-encoding: chunked\r\n")
        );
        tcp.write_all(chunked.as_bytes()).await.unwrap();
        let (status, answer) = read_response(&mut tcp).await;
        assert_eq!(status, 413, "{answer}");
        tcp.write_all(next.as_bytes()).await.unwrap();
        let (status, answer) = read_response(&mut tcp).await;
        assert_eq!(status, 404, "the next request on the connection: {answer}");
        assert_eq!(server.state.body_bytes_reserved(), 0);
    });
}

#[test]
fn body_reads_beyond_max_body_memory_bytes_wait_for_the_budget() {
    run(async {
        let fleet = Fleet::start(1).await;
        let len = UNKNOWN_MODEL.len();
        let config = HttpConfig {
            max_body_bytes: len,
            // Room for one body, not two.
            max_body_memory_bytes: len + len / 2,
            body_timeout: Duration::from_secs(10),
            ..config()
        };
        let server = Server::start(fleet.router(Policy::Kv).await, config).await;
        let state = server.state.clone();
        let content_length = format!("content-length: {len}\r\n");
        // A sends 10 bytes of its body and holds its reservation.
        let mut a = send(
            &addr(&server),
            format!("{}{}", head(&content_length), &UNKNOWN_MODEL[..10]).as_bytes(),
        )
        .await;
        eventually("A reserved its body", || state.body_bytes_reserved() == len).await;
        // B sends all of its body but must wait for A's reservation.
        let mut b = send(
            &addr(&server),
            format!("{}{UNKNOWN_MODEL}", head(&content_length)).as_bytes(),
        )
        .await;
        eventually("B waits for the budget", || state.body_reads_waiting() == 1).await;
        // The waiting read may hold what was left of the budget, never more.
        assert!(state.body_bytes_reserved() <= len + len / 2);
        assert_eq!(state.body_reads_waiting(), 1);
        // A finishes: both are answered, one body read at a time.
        a.write_all(&UNKNOWN_MODEL.as_bytes()[10..]).await.unwrap();
        assert_eq!(read_response(&mut a).await.0, 404);
        assert_eq!(read_response(&mut b).await.0, 404);
        eventually("the budget is free", || {
            state.body_bytes_reserved() == 0 && state.body_reads_waiting() == 0
        })
        .await;
    });
}

#[test]
fn shutdown_lets_a_request_in_flight_finish_then_serve_returns() {
    run(async {
        let fleet = Fleet::start(1).await;
        let state = AppState::new(
            fleet.router(Policy::Kv).await,
            ModelRegistry::mock("mock"),
            HttpConfig {
                body_timeout: Duration::from_secs(10),
                ..config()
            },
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let (stop, stopped) = oneshot::channel::<()>();
        let server = tokio::spawn(serve(listener, state.clone(), async move {
            let _ = stopped.await;
        }));
        let len = UNKNOWN_MODEL.len();
        let mut tcp = send(
            &addr,
            format!(
                "{}{}",
                head(&format!("content-length: {len}\r\n")),
                &UNKNOWN_MODEL[..10]
            )
            .as_bytes(),
        )
        .await;
        eventually("the request is reading its body", || {
            state.body_bytes_reserved() == len
        })
        .await;
        stop.send(()).unwrap();
        // The listener closes: new connections are refused.
        for _ in 0..500 {
            if TcpStream::connect(&addr).await.is_err() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(TcpStream::connect(&addr).await.is_err());
        assert!(!server.is_finished());
        tcp.write_all(&UNKNOWN_MODEL.as_bytes()[10..])
            .await
            .unwrap();
        assert_eq!(read_response(&mut tcp).await.0, 404);
        read_until_closed(&mut tcp).await;
        tokio::time::timeout(BOUND, server)
            .await
            .expect("serve returns once its connections end")
            .unwrap()
            .unwrap();
    });
}
