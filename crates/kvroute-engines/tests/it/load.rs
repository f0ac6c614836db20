//! Reading an engine's own load from its `/metrics`, over HTTP: each engine's metrics text
//! (tests/fixtures/metrics), the request made (path, headers), and how failures are reported.

use std::num::NonZeroU32;
use std::time::Duration;

use axum::body::Bytes;
use kvroute_engines::{EngineKind, EngineLoad, HttpEngine, HttpEngineConfig, LoadError};

use crate::support::{After, MockEngine, Reply, refused_url};

const BLOCK_SIZE: NonZeroU32 = NonZeroU32::new(16).unwrap();

fn fixture(name: &str) -> String {
    let path = format!(
        "{}/tests/fixtures/metrics/{name}",
        env!("CARGO_MANIFEST_DIR")
    );
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// A `/metrics` answer: `status` with Prometheus's content type and `body`.
fn metrics(status: u16, body: impl Into<Bytes>) -> Reply {
    Reply::Stream {
        status,
        content_type: "text/plain; version=0.0.4; charset=utf-8".to_owned(),
        pieces: vec![body.into()],
        gap: std::time::Duration::ZERO,
        after: After::End,
    }
}

fn load(dp_rank: u32, running: u64, waiting: u64, kv: Option<u64>) -> EngineLoad {
    EngineLoad {
        dp_rank,
        requests_running: running,
        requests_waiting: waiting,
        kv_used_blocks: kv,
        kv_total_blocks: None,
    }
}

/// The same load with a capacity of `total` blocks.
fn of(load: EngineLoad, total: u64) -> EngineLoad {
    EngineLoad {
        kv_total_blocks: Some(total),
        ..load
    }
}

async fn read(kind: EngineKind, reply: Reply) -> (Result<Vec<EngineLoad>, LoadError>, String) {
    let mock = MockEngine::start(vec![reply]).await;
    let engine = HttpEngine::new(HttpEngineConfig::new(kind, &mock.base_url)).unwrap();
    (
        engine.load(BLOCK_SIZE).await,
        format!("{}/metrics", mock.base_url),
    )
}

#[tokio::test]
async fn each_engine_s_metrics_are_read_per_rank() {
    for (kind, file, expect) in [
        (
            EngineKind::Vllm,
            "vllm_single.txt",
            vec![of(load(0, 3, 3, Some(37)), 999)],
        ),
        (
            EngineKind::Vllm,
            "vllm_dp2.txt",
            vec![load(0, 4, 1, None), load(1, 2, 0, None)],
        ),
        (
            EngineKind::Sglang,
            "sglang_single.txt",
            vec![of(load(0, 5, 3, Some(94)), 6250)],
        ),
        (
            EngineKind::Sglang,
            "sglang_dp2_priority.txt",
            vec![
                of(load(0, 4, 2, Some(44)), 6250),
                of(load(1, 1, 6, Some(3)), 6250),
            ],
        ),
        (
            EngineKind::Llamacpp,
            "llamacpp_busy.txt",
            vec![load(0, 1, 2, None)],
        ),
    ] {
        let mut mock = MockEngine::start(vec![metrics(200, fixture(file))]).await;
        let engine = HttpEngine::new(HttpEngineConfig::new(kind, &mock.base_url)).unwrap();
        assert_eq!(engine.load(BLOCK_SIZE).await, Ok(expect), "{file}");
        let got = mock.request().await;
        assert_eq!(
            (got.method.as_str(), got.path.as_str()),
            ("GET", "/metrics")
        );
        assert_eq!(
            got.headers.get("accept").and_then(|v| v.to_str().ok()),
            Some("text/plain"),
            "the classic text format, not OpenMetrics"
        );
        assert!(got.headers.get("authorization").is_none());
    }
}

#[tokio::test]
async fn the_api_key_and_a_path_prefix_are_applied() {
    let mut mock = MockEngine::start(vec![metrics(200, fixture("vllm_single.txt"))]).await;
    let mut config = HttpEngineConfig::new(EngineKind::Vllm, format!("{}/engine-a", mock.base_url));
    config.api_key = Some("sk-test".to_owned());
    let engine = HttpEngine::new(config).unwrap();
    assert_eq!(
        engine.load(BLOCK_SIZE).await,
        Ok(vec![of(load(0, 3, 3, Some(37)), 999)])
    );
    let got = mock.request().await;
    assert_eq!(got.path, "/engine-a/metrics");
    assert_eq!(
        got.headers
            .get("authorization")
            .and_then(|v| v.to_str().ok()),
        Some("Bearer sk-test")
    );
}

#[tokio::test]
async fn a_load_becomes_the_report_a_worker_sends() {
    let (loads, _) = read(EngineKind::Vllm, metrics(200, fixture("vllm_dp2.txt"))).await;
    let reports: Vec<_> = loads.unwrap().iter().map(|l| l.report(42)).collect();
    for (report, rank) in reports.iter().zip([0, 1]) {
        assert_eq!(
            report.worker(),
            kvroute_protocols::WorkerWithDpRank::new(42, rank)
        );
        assert_eq!(report.validate(), Ok(()));
    }
    assert_eq!(reports[0].requests(), Some(5));
    assert_eq!(reports[1].requests(), Some(2));
}

#[tokio::test]
async fn metrics_not_served_are_an_http_error_with_a_hint() {
    // What a real llama.cpp server (xllamacpp 2026.10.11549) started without --metrics answers.
    let body = r#"{"error":{"code":501,"message":"This server does not support metrics endpoint. Start it with `--metrics`","type":"not_supported_error"}}"#;
    let body: serde_json::Value = serde_json::from_str(body).unwrap();
    let (got, url) = read(EngineKind::Llamacpp, Reply::json(501, &body)).await;
    let err = got.unwrap_err();
    assert_eq!(
        err,
        LoadError::Status {
            url,
            status: 501,
            message: "This server does not support metrics endpoint. Start it with `--metrics`"
                .to_owned(),
        }
    );
    assert!(
        err.to_string().contains("SGLang needs --enable-metrics"),
        "{err}"
    );
    let not_found = serde_json::json!({"detail": "Not Found"});
    let (got, _) = read(EngineKind::Sglang, Reply::json(404, &not_found)).await;
    assert!(
        matches!(&got, Err(LoadError::Status { status: 404, message, .. }) if message == "Not Found"),
        "{got:?}"
    );
}

#[tokio::test]
async fn a_missing_metric_is_named_with_the_url() {
    let text = fixture("vllm_single.txt")
        .lines()
        .filter(|l| !l.contains("vllm:num_requests_waiting{"))
        .collect::<Vec<_>>()
        .join("\n");
    let (got, url) = read(EngineKind::Vllm, metrics(200, text)).await;
    assert_eq!(
        got,
        Err(LoadError::MissingMetric {
            url,
            metric: "vllm:num_requests_waiting".to_owned(),
        })
    );
}

#[tokio::test]
async fn a_body_that_is_not_prometheus_text_is_malformed() {
    let (got, url) = read(
        EngineKind::Vllm,
        metrics(
            200,
            Bytes::from_static(b"vllm:num_requests_running 1\n\xff\xfe\n"),
        ),
    )
    .await;
    match got {
        Err(LoadError::Malformed { url: u, message }) => {
            assert_eq!(u, url);
            assert!(message.contains("not UTF-8"), "{message}");
        }
        other => panic!("expected Malformed, got {other:?}"),
    }
    let (got, _) = read(
        EngineKind::Sglang,
        metrics(200, "<html><body>proxy error</body></html>\n"),
    )
    .await;
    match got {
        Err(LoadError::Malformed { message, .. }) => {
            assert_eq!(
                message,
                "line 1: expected a metric name in `<html><body>proxy error</body></html>`"
            );
        }
        other => panic!("expected Malformed, got {other:?}"),
    }
}

#[tokio::test]
async fn an_unreachable_or_silent_engine_is_unreachable() {
    let url = refused_url().await;
    let engine = HttpEngine::new(HttpEngineConfig::new(EngineKind::Vllm, &url)).unwrap();
    match engine.load(BLOCK_SIZE).await {
        Err(LoadError::Unreachable { url: got, .. }) => assert_eq!(got, format!("{url}/metrics")),
        other => panic!("expected Unreachable, got {other:?}"),
    }
    let mock = MockEngine::start(vec![Reply::Stall]).await;
    let mut config = HttpEngineConfig::new(EngineKind::Sglang, &mock.base_url);
    config.health_timeout = Duration::from_millis(50);
    let engine = HttpEngine::new(config).unwrap();
    let got = engine.load(BLOCK_SIZE).await;
    assert!(matches!(got, Err(LoadError::Unreachable { .. })), "{got:?}");
}

#[tokio::test]
async fn trtllm_and_openai_are_unsupported_without_a_request() {
    for kind in [EngineKind::Trtllm, EngineKind::Openai] {
        let mut mock = MockEngine::start(vec![metrics(200, fixture("vllm_single.txt"))]).await;
        let engine = HttpEngine::new(HttpEngineConfig::new(kind, &mock.base_url)).unwrap();
        assert_eq!(
            engine.load(BLOCK_SIZE).await,
            Err(LoadError::Unsupported { kind })
        );
        // The first request the engine sees is the health check made after: load made none.
        let _ = engine.health().await;
        assert_ne!(mock.request().await.path, "/metrics", "{kind}");
    }
}
