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

fn spec(engine: EngineKind, role: kvroute_runtime::WorkerRole) -> super::EngineSpec {
    super::EngineSpec {
        engine,
        engine_url: "http://10.0.0.7:30000".to_owned(),
        kv_events: None,
        kv_events_replay: None,
        served_model_name: None,
        first_byte_timeout: None,
        idle_timeout: None,
        api_key: None,
        role,
        bootstrap_port: None,
    }
}

#[test]
fn a_bootstrapping_prefill_engine_advertises_its_url_host_and_bootstrap_port() {
    use kvroute_runtime::WorkerRole;

    use super::{DEFAULT_BOOTSTRAP_PORT, bootstrap_endpoint, check_role};
    let prefill = spec(EngineKind::Sglang, WorkerRole::Prefill);
    assert_eq!(
        bootstrap_endpoint(&prefill).unwrap(),
        Some(("10.0.0.7".to_owned(), DEFAULT_BOOTSTRAP_PORT))
    );
    let given = super::EngineSpec {
        bootstrap_port: Some(9100),
        ..prefill.clone()
    };
    assert_eq!(
        bootstrap_endpoint(&given).unwrap(),
        Some(("10.0.0.7".to_owned(), 9100))
    );
    // Decode engines and vLLM prefill engines meet no one at a bootstrap server.
    assert_eq!(
        bootstrap_endpoint(&spec(EngineKind::Sglang, WorkerRole::Decode)).unwrap(),
        None
    );
    assert_eq!(
        bootstrap_endpoint(&spec(EngineKind::Vllm, WorkerRole::Prefill)).unwrap(),
        None
    );
    let stray = super::EngineSpec {
        bootstrap_port: Some(9100),
        ..spec(EngineKind::Vllm, WorkerRole::Prefill)
    };
    let err = bootstrap_endpoint(&stray).unwrap_err().to_string();
    assert!(err.contains("sglang with role prefill"), "{err}");

    assert!(check_role(EngineKind::Trtllm, WorkerRole::Decode).is_ok());
    let err = check_role(EngineKind::Openai, WorkerRole::Decode)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("engine openai cannot take role decode"),
        "{err}"
    );
}
