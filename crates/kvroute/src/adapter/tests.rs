use std::time::{Duration, Instant};

use kvroute_engines::{EngineKind, HttpEngine, HttpEngineConfig};

use super::wait_healthy;

/// A loopback URL where nothing listens.
fn refused_url() -> String {
    let addr = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .unwrap();
    format!("http://{addr}")
}

#[tokio::test]
async fn the_engine_wait_lasts_as_long_as_asked_not_a_backoff_step_less() {
    let url = refused_url();
    let engine = HttpEngine::new(HttpEngineConfig::new(EngineKind::Llamacpp, &url)).unwrap();
    let wait = Duration::from_millis(900);
    let start = Instant::now();
    let error = wait_healthy(&engine, &url, wait).await.unwrap_err();
    let waited = start.elapsed();
    // The backoff (100, 200, 400 ms...) used to give up once the next step would cross the
    // deadline: after 700 ms here.
    assert!(waited >= wait, "gave up after {waited:?} of {wait:?}");
    assert!(
        format!("{error:#}").contains("did not become healthy within 900ms"),
        "{error:#}"
    );
}
