//! What fronting real engines needs from the frontend: a LoRA adapter named in `model` and
//! vLLM's `cache_salt` change the prompt's block identity (the engine never shares blocks across
//! them, so neither may the router's prediction), and reach the engine; the cached tokens an
//! engine reports are compared with the router's prediction, per worker, on `/metrics`.

use kvroute_router::http::AppState;
use kvroute_router::{Model, ModelRegistry, Policy};
use serde_json::{Value, json};

use super::{Server, test_config};
use crate::support::{BLOCK, Fleet, eventually, idle, run};

/// Four full blocks of prompt.
fn prompt() -> Vec<u32> {
    (0..4 * BLOCK).map(|t| 1000 + t).collect()
}

fn completion(model: &str) -> Value {
    json!({
        "model": model,
        "prompt": prompt(),
        "max_tokens": 2,
        "nvext": {"extra_fields": ["worker_id", "timing"]},
    })
}

/// The predicted hit rate and the worker of one completion.
async fn send(server: &Server, body: &Value) -> (f64, u64) {
    let (status, resp) = server.json("/v1/completions", body).await;
    assert_eq!(status, 200, "{resp}");
    let nvext = &resp["nvext"];
    (
        nvext["timing"]["kv_hit_rate"].as_f64().unwrap(),
        nvext["worker_id"]["decode_worker_id"].as_u64().unwrap(),
    )
}

#[test]
fn a_lora_adapter_or_a_cache_salt_is_a_cache_of_its_own_and_reaches_the_engine() {
    run(async {
        let fleet = Fleet::start(2).await;
        let router = fleet.router(Policy::Kv).await;
        let mut models = ModelRegistry::mock("mock");
        models.insert(Model::mock("mock").adapter("sql-lora"));
        let server = Server::serve(AppState::new(router.clone(), models, test_config())).await;

        let (first, worker) = send(&server, &completion("mock")).await;
        assert_eq!(first, 0.0, "nothing is cached yet");
        let engine = fleet.worker(worker).engine.clone();
        eventually("the engine's stored event to be indexed", || {
            router.with_core(|core| core.stats().events_applied) > 0
        })
        .await;
        let (again, same) = send(&server, &completion("mock")).await;
        assert_eq!(same, worker, "the cached prefix pulls the request back");
        assert!(again > 0.9, "predicted hit rate {again}");

        // The same tokens under a cache salt: a different cache, predicted cold.
        let mut salted = completion("mock");
        salted["cache_salt"] = json!("tenant-a");
        let (salted_hit, salted_worker) = send(&server, &salted).await;
        assert_eq!(
            salted_hit, 0.0,
            "a salted prompt never hits unsalted blocks"
        );
        let received = fleet.worker(salted_worker).engine.requests.lock().clone();
        let last = received.last().unwrap();
        assert_eq!(
            last.cache_salt(),
            Some("tenant-a"),
            "the engine gets the salt"
        );

        // The same tokens through a LoRA adapter: its own cache, and the engine is asked for it.
        let (lora_hit, lora_worker) = send(&server, &completion("sql-lora")).await;
        assert_eq!(lora_hit, 0.0, "an adapter's blocks are its own");
        let received = fleet.worker(lora_worker).engine.requests.lock().clone();
        let last = received.last().unwrap();
        assert_eq!(last.model, "sql-lora");
        assert_eq!(
            last.routing.as_ref().and_then(|r| r.lora_name.as_deref()),
            Some("sql-lora")
        );
        assert!(engine.requests.lock().len() >= 2);
        eventually("all load is freed", || idle(&router)).await;
    });
}

#[test]
fn an_unknown_adapter_is_an_unknown_model() {
    run(async {
        let fleet = Fleet::start(1).await;
        let router = fleet.router(Policy::Kv).await;
        let server = Server::start(router.clone(), test_config()).await;
        let (status, resp) = server
            .json("/v1/completions", &completion("sql-lora"))
            .await;
        assert_eq!(status, 404, "{resp}");
    });
}
