//! Client authentication: with API keys configured, `/v1/*` answers only requests that carry one
//! as `Authorization: Bearer KEY` (401 `invalid_api_key` otherwise, before any routing), streamed
//! or not; `/health` and `/metrics` stay open; a reload swaps the keys; no key reaches a response
//! or `/metrics`.

use kvroute_router::http::{ApiKeys, AppState};
use kvroute_router::{ModelRegistry, Policy};
use serde_json::{Value, json};

use super::{Server, Sse, test_config};
use crate::support::{Fleet, eventually, idle, run};

const KEY: &str = "sk-kvroute-test-0123456789";
const OTHER: &str = "sk-rotated-9876543210";

fn body(stream: bool) -> Value {
    json!({"model": "mock", "prompt": "hello there friend", "max_tokens": 3, "stream": stream})
}

#[test]
fn only_clients_with_a_configured_key_are_served_and_health_and_metrics_stay_open() {
    run(async {
        let fleet = Fleet::start(2).await;
        let router = fleet.router(Policy::Kv).await;
        let dir = std::env::temp_dir().join(format!("kvroute-auth-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("keys");
        std::fs::write(&file, format!("# clients\n{KEY}\n")).unwrap();
        let keys = ApiKeys::load(&file).unwrap();
        let state = AppState::new(router.clone(), ModelRegistry::mock("mock"), test_config())
            .with_api_keys(keys.clone());
        let server = Server::serve(state).await;

        // No key, a wrong key, another scheme: 401 in OpenAI's shape, nothing routed.
        for auth in [
            None,
            Some(format!("Bearer {OTHER}")),
            Some(format!("Basic {KEY}")),
        ] {
            let mut req = server.post("/v1/completions", &body(false));
            if let Some(auth) = &auth {
                req = req.header("authorization", auth);
            }
            let resp = req.send().await.unwrap();
            assert_eq!(resp.status(), 401, "{auth:?}");
            let text = resp.text().await.unwrap();
            let err: Value = serde_json::from_str(&text).unwrap();
            assert_eq!(err["error"]["code"], "invalid_api_key", "{text}");
            assert_eq!(err["error"]["type"], "invalid_request_error", "{text}");
            assert!(!text.contains(KEY) && !text.contains(OTHER), "{text}");
        }
        let resp = server
            .client
            .get(format!("{}/v1/models", server.base))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 401);

        // The right key: served, whole and streamed (any case of `Bearer`).
        let resp = server
            .post("/v1/completions", &body(false))
            .header("authorization", format!("Bearer {KEY}"))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        let resp = server
            .post("/v1/completions", &body(true))
            .header("authorization", format!("bearer {KEY}"))
            .send()
            .await
            .unwrap();
        let chunks = Sse::new(resp).rest().await;
        assert_eq!(chunks.last().map(String::as_str), Some("[DONE]"));
        let resp = server
            .client
            .get(format!("{}/v1/models", server.base))
            .header("authorization", format!("Bearer {KEY}"))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);

        // Probes and scrapers carry no key.
        assert_eq!(server.get("/health").await.0, 200);
        let (status, metrics) = server.get("/metrics").await;
        assert_eq!(status, 200);
        for (outcome, n) in [("ok", 3), ("missing", 3), ("invalid", 1)] {
            let sample = format!("kvroute_router_http_auth_total{{outcome=\"{outcome}\"}} {n}");
            assert!(metrics.contains(&sample), "{sample} in {metrics}");
        }
        assert!(!metrics.contains(KEY) && !metrics.contains(OTHER));
        // Only the authenticated requests were routed.
        assert!(
            metrics.contains("kvroute_router_requests_total 2"),
            "{metrics}"
        );

        // Rotation: the file changes, a reload applies it to every clone.
        std::fs::write(&file, format!("{OTHER}\n")).unwrap();
        assert_eq!(keys.reload().unwrap(), 1);
        let (old, new) = (
            server
                .post("/v1/completions", &body(false))
                .header("authorization", format!("Bearer {KEY}"))
                .send()
                .await
                .unwrap(),
            server
                .post("/v1/completions", &body(false))
                .header("authorization", format!("Bearer {OTHER}"))
                .send()
                .await
                .unwrap(),
        );
        assert_eq!((old.status().as_u16(), new.status().as_u16()), (401, 200));
        eventually("all load is freed", || idle(&router)).await;
        let _ = std::fs::remove_dir_all(&dir);
    });
}
