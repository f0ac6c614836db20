//! Disaggregated serving with vLLM's KV connector handshake, end to end: `kvroute serve` with a
//! static fleet whose prefill and decode entries are simulated vLLM engines (`kvroute
//! engine-sim`, which plays both sides of the handshake). The prefill engine is asked for one
//! whole token with `kv_transfer_params.do_remote_decode`, its answer's parameters go verbatim to
//! the decode engine, which refuses parameters naming blocks nobody holds.

use serde_json::json;

use crate::disagg_support::{assert_no_load, chat_body, serve_disaggregated, stream_cut_mid_way};
use crate::e2e::{Fleet, Sse};
use crate::engine_sim::{EngineSim, MODEL, vllm_sample};
use crate::support::scratch;

/// `kvroute serve --disagg enforced` over engine 0 of `sim` as prefill worker 1 and engine 1 as
/// decode worker 2.
async fn disagg_fleet(sim: &EngineSim, test: &str) -> Fleet {
    fleet_of(sim.field(0, "url"), sim.field(1, "url"), test).await
}

/// `kvroute serve --disagg enforced` over the engine at `prefill` as prefill worker 1 and the one
/// at `decode` as decode worker 2.
async fn fleet_of(prefill: &str, decode: &str, test: &str) -> Fleet {
    let dir = scratch(&format!("vllm-disagg-{test}"));
    let entry = |id: u64, role: &str, url: &str| {
        format!(
            "[[workers]]\nid = {id}\nrole = \"{role}\"\nengine = \"vllm\"\nengine_url = \"{url}\"\n\
             served_model_name = \"{MODEL}\"\nkv_block_size = 16\n\n"
        )
    };
    serve_disaggregated(
        &dir,
        &(entry(1, "prefill", prefill) + &entry(2, "decode", decode)),
    )
    .await
}

async fn engine_metrics(fleet: &Fleet, sim: &EngineSim, engine: usize) -> String {
    fleet
        .get(&format!("{}/metrics", sim.field(engine, "url")))
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_prefill_and_decode_engines_hand_the_kv_over_through_kvroute() {
    let sim = EngineSim::start_with("vllm-disagg", 2, &[]);
    let fleet = disagg_fleet(&sim, "handoff").await;

    let (status, answer) = fleet.chat(&chat_body("a", 4, false), None).await;
    assert_eq!(status, 200, "{answer}");
    let workers = &answer["nvext"]["worker_id"];
    assert_eq!(workers["prefill_worker_id"], json!(1), "{answer}");
    assert_eq!(workers["decode_worker_id"], json!(2), "{answer}");
    assert_eq!(answer["usage"]["completion_tokens"], json!(4), "{answer}");
    // The decode engine received the prefill's parameters: it took the prompt's full blocks as
    // transferred (counted as its cache hits) and computed nothing it was handed.
    let prompt = answer["usage"]["prompt_tokens"]
        .as_u64()
        .expect("prompt tokens");
    let transferred = prompt / 16 * 16;
    assert!(transferred >= 64, "a prompt of several blocks: {prompt}");
    let decode = engine_metrics(&fleet, &sim, 1).await;
    assert_eq!(
        vllm_sample(&decode, "vllm:prefix_cache_hits_total"),
        transferred as f64
    );
    assert_eq!(vllm_sample(&decode, "vllm:generation_tokens_total"), 4.0);
    let prefill = engine_metrics(&fleet, &sim, 0).await;
    assert_eq!(vllm_sample(&prefill, "vllm:generation_tokens_total"), 1.0);
    assert_eq!(
        vllm_sample(&prefill, "vllm:prompt_tokens_total"),
        prompt as f64
    );

    // Streamed: the decode engine's stream reaches the client.
    let response = fleet
        .http
        .post(format!("{}/v1/chat/completions", fleet.base))
        .json(&chat_body("b", 3, true))
        .send()
        .await
        .expect("POST");
    assert_eq!(response.status(), 200);
    let mut sse = Sse::new(response);
    let mut events = Vec::new();
    while let Some(data) = sse.next().await {
        events.push(data);
    }
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{events:?}"
    );
    assert!(
        events.iter().all(|e| !e.contains("\"error\"")),
        "{events:?}"
    );
    assert!(events.len() >= 3, "content chunks and the end: {events:?}");
    fleet.assert_idle(&[1, 2]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_engine_refuses_expired_blocks_and_the_client_is_told() {
    // The prefill engine frees its blocks at once: the decode engine finds nothing to pull.
    let sim = EngineSim::start_with("vllm-disagg-expired", 2, &["--kv-transfer-ttl", "0s"]);
    let fleet = disagg_fleet(&sim, "expired").await;
    let (status, answer) = fleet.chat(&chat_body("c", 4, false), None).await;
    assert!((400..600).contains(&status), "{status} {answer}");
    let message = answer.to_string();
    assert!(message.contains("expired"), "{message}");
    fleet.assert_idle(&[1, 2]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_engine_killed_mid_stream_fails_the_request_and_frees_every_load() {
    // Prefill and decode engines in two processes: the decode engine pulls the blocks over HTTP.
    let prefill = EngineSim::start_with("vllm-disagg-kill-decode-p", 1, &[]);
    let mut decode = EngineSim::start_with("vllm-disagg-kill-decode-d", 1, &["--speedup", "1"]);
    let fleet = fleet_of(
        prefill.field(0, "url"),
        decode.field(0, "url"),
        "kill-decode",
    )
    .await;
    stream_cut_mid_way(&fleet, "d", || decode.kill()).await;
    assert_no_load(&fleet).await;
    let metrics = fleet
        .get(&format!("{}/metrics", prefill.field(0, "url")))
        .await;
    assert_eq!(vllm_sample(&metrics, "vllm:num_requests_running"), 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_prefill_engine_fails_the_next_request_cleanly() {
    let mut prefill = EngineSim::start_with("vllm-disagg-kill-prefill-p", 1, &[]);
    let decode = EngineSim::start_with("vllm-disagg-kill-prefill-d", 1, &[]);
    let fleet = fleet_of(
        prefill.field(0, "url"),
        decode.field(0, "url"),
        "kill-prefill",
    )
    .await;
    let (status, answer) = fleet.chat(&chat_body("e", 4, false), None).await;
    assert_eq!(status, 200, "across processes: {answer}");
    prefill.kill();
    let (status, answer) = fleet.chat(&chat_body("f", 4, false), None).await;
    assert!((400..600).contains(&status), "{status} {answer}");
    assert_no_load(&fleet).await;
    let metrics = fleet
        .get(&format!("{}/metrics", decode.field(0, "url")))
        .await;
    assert_eq!(vllm_sample(&metrics, "vllm:num_requests_running"), 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engines_killed_mid_stream_fail_the_request_cleanly_and_free_every_load() {
    let mut sim = EngineSim::start_with("vllm-disagg-kill", 2, &["--speedup", "1"]);
    let fleet = disagg_fleet(&sim, "kill").await;
    stream_cut_mid_way(&fleet, "d", || sim.kill()).await;
    assert_no_load(&fleet).await;
}

/// The stock `openai` client against the disaggregated fleet (`KVROUTE_PYTHON` with
/// tests/python/requirements.txt; the test fails, naming the set-up, without it).
const OPENAI_SCRIPT: &str = r#"
import sys, openai
client = openai.OpenAI(base_url=sys.argv[1] + "/v1", api_key="unused", timeout=30)
nvext = {"nvext": {"extra_fields": ["worker_id"]}}
prompt = " ".join(f"c{i}" for i in range(70))
whole = client.completions.create(model="mock", prompt=prompt, max_tokens=3, extra_body=nvext)
workers = whole.model_extra["nvext"]["worker_id"]
assert (workers["prefill_worker_id"], workers["decode_worker_id"]) == (1, 2), workers
assert whole.usage.completion_tokens == 3, whole.usage
stream = client.chat.completions.create(
    model="mock", messages=[{"role": "user", "content": prompt}], max_tokens=3, stream=True,
    extra_body=nvext)
# engine-sim's tokens are random ids (often outside the test's tiny vocabulary): the
# stream is checked by its chunks and its finish, not its text.
finishes = [c.choices[0].finish_reason for c in stream if c.choices]
assert len(finishes) >= 2 and finishes[-1] == "length", finishes
print("ok")
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stock_openai_client_is_served_disaggregated() {
    let python = std::env::var("KVROUTE_PYTHON").unwrap_or_else(|_| {
        panic!(
            "KVROUTE_PYTHON is not set: set it to a python with tests/python/requirements.txt \
             installed (cargo xtask ci makes ~/.cache/kvroute/venv)"
        )
    });
    let sim = EngineSim::start_with("vllm-disagg-openai", 2, &[]);
    let fleet = disagg_fleet(&sim, "openai").await;
    let base = fleet.base.clone();
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(python)
            .args(["-c", OPENAI_SCRIPT, &base])
            .output()
            .expect("run KVROUTE_PYTHON")
    })
    .await
    .expect("join");
    assert!(
        out.status.success() && String::from_utf8_lossy(&out.stdout).trim() == "ok",
        "openai client failed:\nstdout: {}\nstderr: {}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    fleet.assert_idle(&[1, 2]).await;
}
