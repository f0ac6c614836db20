//! Conditional disaggregation through `kvroute serve`: a prompt whose uncached part is short is
//! prefilled on its decode worker (served aggregated), a long one on the prefill worker, and the
//! router counts both decisions.

use serde_json::json;

use crate::e2e::{Fleet, chat_body, conversation};

/// The value of `prefill_placements_total` with `site` and `reason` (0 when absent).
fn placements(metrics: &str, site: &str, reason: &str) -> f64 {
    metrics
        .lines()
        .filter(|l| l.starts_with("kvroute_router_prefill_placements_total{"))
        .filter(|l| {
            l.contains(&format!("site=\"{site}\"")) && l.contains(&format!("reason=\"{reason}\""))
        })
        .find_map(|l| l.rsplit_once(' ')?.1.trim().parse().ok())
        .unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conditional_disaggregation_prefills_a_short_prompt_where_it_decodes() {
    let flags = [
        "--disagg",
        "conditional",
        "--max-local-prefill-tokens",
        "40",
    ];
    let fleet = Fleet::start_roles("conditional", &flags, "50", &["prefill", "decode"]).await;
    let nvext = json!({"extra_fields": ["worker_id"]});

    let short = chat_body(
        vec![json!({"role": "user", "content": "hello there"})],
        4,
        nvext.clone(),
    );
    let (status, reply) = fleet.chat(&short, None).await;
    assert_eq!(status, 200, "{reply}");
    let workers = &reply["nvext"]["worker_id"];
    assert_eq!(workers["decode_worker_id"], 2, "{reply}");
    // Served aggregated: prefilled where it decodes (the reference names that worker twice).
    assert_eq!(workers["prefill_worker_id"], 2, "{reply}");

    // The shared system prompt alone is well over 40 tokens, none of them cached yet.
    let long = chat_body(conversation(0, 1), 4, nvext);
    let (status, reply) = fleet.chat(&long, None).await;
    assert_eq!(status, 200, "{reply}");
    assert_eq!(
        reply["nvext"]["worker_id"]["prefill_worker_id"], 1,
        "{reply}"
    );
    assert_eq!(
        reply["nvext"]["worker_id"]["decode_worker_id"], 2,
        "{reply}"
    );

    let metrics = fleet.router_metrics().await;
    assert_eq!(
        placements(&metrics, "local", "short_uncached"),
        1.0,
        "{metrics}"
    );
    assert_eq!(placements(&metrics, "remote", "remote"), 1.0, "{metrics}");
    fleet.assert_idle(&[1, 2]).await;
}
