//! SGLang's bootstrap disaggregation end to end: `kvroute serve` with a static fleet of a
//! simulated SGLang prefill engine and decode engine (two `kvroute engine-sim --dialect sglang`
//! processes, `--disaggregation-mode prefill|decode`). The router gives both the same
//! `bootstrap_host`, `bootstrap_port` and a fresh `bootstrap_room` and sends them together; the
//! decode engine fetches the room from the prefill engine and streams.

use serde_json::json;

use crate::disagg_support::{assert_no_load, chat_body, serve_disaggregated, stream_cut_mid_way};
use crate::e2e::{Fleet, Sse};
use crate::engine_sim::EngineSim;
use crate::support::scratch;

/// `kvroute serve --disagg enforced` over `prefill` (worker 1, its HTTP port its bootstrap
/// port) and `decode` (worker 2).
async fn fleet_of(prefill: &EngineSim, decode: &EngineSim, test: &str) -> Fleet {
    let dir = scratch(&format!("sglang-disagg-{test}"));
    let prefill_url = prefill.field(0, "url");
    let port = prefill_url.rsplit(':').next().expect("a port");
    let text = format!(
        "[[workers]]\nid = 1\nrole = \"prefill\"\nengine = \"sglang\"\nengine_url = \"{prefill_url}\"\n\
         bootstrap_port = {port}\nkv_block_size = 16\n\n\
         [[workers]]\nid = 2\nrole = \"decode\"\nengine = \"sglang\"\nengine_url = \"{}\"\n\
         kv_block_size = 16\n",
        decode.field(0, "url")
    );
    serve_disaggregated(&dir, &text).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_prefill_and_decode_engines_meet_in_a_bootstrap_room() {
    let sglang = ["--dialect", "sglang", "--disaggregation-mode"];
    let prefill = EngineSim::start_with("sglang-p", 1, &[&sglang[..], &["prefill"]].concat());
    let decode = EngineSim::start_with("sglang-d", 1, &[&sglang[..], &["decode"]].concat());
    let fleet = fleet_of(&prefill, &decode, "pair").await;

    let (status, answer) = fleet.chat(&chat_body("a", 4, false), None).await;
    assert_eq!(status, 200, "{answer}");
    let workers = &answer["nvext"]["worker_id"];
    assert_eq!(workers["prefill_worker_id"], json!(1), "{answer}");
    assert_eq!(workers["decode_worker_id"], json!(2), "{answer}");
    assert_eq!(answer["usage"]["completion_tokens"], json!(4), "{answer}");
    // The decode engine fetched the room: the prefilled full blocks count as its cached tokens.
    let prompt = answer["usage"]["prompt_tokens"]
        .as_u64()
        .expect("prompt tokens");
    let cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64();
    assert_eq!(cached, Some(prompt / 16 * 16), "{answer}");

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
    assert_no_load(&fleet).await;
}

/// The engine at `sim`'s running and queued requests, from its `/metrics`.
async fn engine_requests(fleet: &Fleet, sim: &EngineSim) -> f64 {
    let metrics = fleet.get(&format!("{}/metrics", sim.field(0, "url"))).await;
    metrics
        .lines()
        .filter(|l| {
            l.starts_with("sglang:num_running_reqs{") || l.starts_with("sglang:num_queue_reqs{")
        })
        .filter_map(|l| l.rsplit_once(' ')?.1.trim().parse::<f64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_engine_killed_mid_stream_fails_the_pair_and_leaves_no_load() {
    let sglang = ["--dialect", "sglang", "--disaggregation-mode"];
    let prefill = EngineSim::start_with("sglang-kd-p", 1, &[&sglang[..], &["prefill"]].concat());
    let decode_args = [&sglang[..], &["decode", "--speedup", "1"]].concat();
    let mut decode = EngineSim::start_with("sglang-kd-d", 1, &decode_args);
    let fleet = fleet_of(&prefill, &decode, "kill-decode").await;
    stream_cut_mid_way(&fleet, "c", || decode.kill()).await;
    assert_no_load(&fleet).await;
    // No orphaned prefill half keeps running on the prefill engine.
    assert_eq!(engine_requests(&fleet, &prefill).await, 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_prefill_engine_fails_the_pair_and_leaves_no_decode_half() {
    let sglang = ["--dialect", "sglang", "--disaggregation-mode"];
    let mut prefill =
        EngineSim::start_with("sglang-kp-p", 1, &[&sglang[..], &["prefill"]].concat());
    let decode = EngineSim::start_with("sglang-kp-d", 1, &[&sglang[..], &["decode"]].concat());
    let fleet = fleet_of(&prefill, &decode, "kill-prefill").await;
    let (status, answer) = fleet.chat(&chat_body("d", 4, false), None).await;
    assert_eq!(status, 200, "{answer}");
    prefill.kill();
    let (status, answer) = fleet.chat(&chat_body("e", 4, false), None).await;
    assert!((400..600).contains(&status), "{status} {answer}");
    assert_no_load(&fleet).await;
    assert_eq!(
        engine_requests(&fleet, &decode).await,
        0.0,
        "no decode half left waiting"
    );
}
