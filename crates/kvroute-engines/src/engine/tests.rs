//! Configuration checks and the URLs an engine derives from it.

use std::time::Duration;

use crate::config::{EngineConfigError, EngineKind, HttpEngineConfig};
use crate::engine::HttpEngine;

/// Builds an engine from `base_url` for `kind` and checks its generate URL, or the error.
fn check(kind: EngineKind, base_url: &str, expect: Result<&str, EngineConfigError>) {
    let got = HttpEngine::new(HttpEngineConfig::new(kind, base_url))
        .map(|engine| engine.generate_url().to_owned());
    assert_eq!(
        got.as_deref().map_err(Clone::clone),
        expect,
        "{kind} {base_url}"
    );
}

#[test]
fn generate_urls() {
    check(
        EngineKind::Vllm,
        "http://127.0.0.1:8000",
        Ok("http://127.0.0.1:8000/v1/completions"),
    );
    check(
        EngineKind::Trtllm,
        "http://127.0.0.1:8000/",
        Ok("http://127.0.0.1:8000/v1/completions"),
    );
    check(
        EngineKind::Openai,
        "http://gw/openai",
        Ok("http://gw/openai/v1/completions"),
    );
    check(
        EngineKind::Sglang,
        "http://localhost:30000",
        Ok("http://localhost:30000/generate"),
    );
    check(
        EngineKind::Llamacpp,
        " http://[::1]:8080/ ",
        Ok("http://[::1]:8080/completion"),
    );
}

#[test]
fn bad_base_urls_are_named() {
    let url = |s: &str| s.to_owned();
    check(
        EngineKind::Vllm,
        "127.0.0.1:8000",
        Err(EngineConfigError::InvalidBaseUrl {
            url: url("127.0.0.1:8000"),
            reason: url("relative URL without a base"),
        }),
    );
    check(
        EngineKind::Vllm,
        "localhost:8000",
        Err(EngineConfigError::InvalidBaseUrl {
            url: url("localhost:8000"),
            reason: url("no `http://` before the host"),
        }),
    );
    check(
        EngineKind::Vllm,
        "https://engine:8000",
        Err(EngineConfigError::UnsupportedScheme {
            url: url("https://engine:8000"),
            scheme: url("https"),
        }),
    );
    check(
        EngineKind::Vllm,
        "http://engine:8000/?x=1",
        Err(EngineConfigError::UnexpectedUrlPart {
            url: url("http://engine:8000/?x=1"),
            part: "a query",
        }),
    );
    check(
        EngineKind::Vllm,
        "http://u:p@engine:8000",
        Err(EngineConfigError::UnexpectedUrlPart {
            url: url("http://u:p@engine:8000"),
            part: "credentials",
        }),
    );
    check(
        EngineKind::Vllm,
        "not a url",
        Err(EngineConfigError::InvalidBaseUrl {
            url: url("not a url"),
            reason: url("relative URL without a base"),
        }),
    );
    let message = HttpEngine::new(HttpEngineConfig::new(EngineKind::Vllm, "nope"))
        .unwrap_err()
        .to_string();
    assert_eq!(
        message,
        "base_url `nope` is not a valid URL (relative URL without a base); expected e.g. \
         http://127.0.0.1:8000"
    );
}

#[test]
fn zero_timeouts_and_empty_names_are_refused() {
    let base = || HttpEngineConfig::new(EngineKind::Vllm, "http://127.0.0.1:8000");
    let err = |config: HttpEngineConfig| HttpEngine::new(config).unwrap_err();
    let mut c = base();
    c.connect_timeout = Duration::ZERO;
    assert_eq!(
        err(c),
        EngineConfigError::ZeroTimeout {
            field: "connect_timeout_ms"
        }
    );
    let mut c = base();
    c.idle_timeout = Some(Duration::ZERO);
    assert_eq!(
        err(c),
        EngineConfigError::ZeroTimeout {
            field: "idle_timeout_ms"
        }
    );
    let mut c = base();
    c.served_model_name = Some(String::new());
    assert_eq!(err(c), EngineConfigError::EmptyServedModelName);
    let mut c = base();
    c.api_key = Some("line\nbreak".to_owned());
    assert_eq!(err(c), EngineConfigError::InvalidApiKey);
}

#[test]
fn engine_kind_names() {
    for kind in EngineKind::ALL {
        assert_eq!(kind.to_string().parse::<EngineKind>(), Ok(kind));
        assert_eq!(serde_json::to_string(&kind).unwrap(), format!("\"{kind}\""));
    }
    assert_eq!(
        "tgi".parse::<EngineKind>().unwrap_err().to_string(),
        "unknown engine kind `tgi`, expected one of: vllm, sglang, trtllm, llamacpp, openai"
    );
    assert!("vLLM".parse::<EngineKind>().is_err(), "names are lowercase");
}

#[test]
fn config_file_shape() {
    let config: HttpEngineConfig = serde_json::from_str(
        r#"{"kind": "sglang", "base_url": "http://127.0.0.1:30000", "connect_timeout_ms": 250,
            "first_byte_timeout_ms": null, "idle_timeout_ms": 1000, "api_key": "k"}"#,
    )
    .unwrap();
    let mut expect = HttpEngineConfig::new(EngineKind::Sglang, "http://127.0.0.1:30000");
    expect.connect_timeout = Duration::from_millis(250);
    expect.first_byte_timeout = None;
    expect.idle_timeout = Some(Duration::from_secs(1));
    expect.api_key = Some("k".to_owned());
    assert_eq!(config, expect);
    let back: HttpEngineConfig =
        serde_json::from_str(&serde_json::to_string(&config).unwrap()).unwrap();
    assert_eq!(back, config);
    assert!(
        !format!("{config:?}").contains("\"k\""),
        "the key stays out of Debug"
    );
    let unknown = serde_json::from_str::<HttpEngineConfig>(
        r#"{"kind": "vllm", "base_url": "http://x", "timeout": 1}"#,
    );
    assert!(
        unknown
            .unwrap_err()
            .to_string()
            .contains("unknown field `timeout`")
    );
}
