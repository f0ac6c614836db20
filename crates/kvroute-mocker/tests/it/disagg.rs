//! The prefill and decode roles: a prefill worker answers one token with `disaggregated_params`
//! and fills its bootstrap room over TCP; a decode worker fetches the KV instead of computing the
//! prompt, and its KV events still describe exactly what it holds.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use kvroute_mocker::disagg::{BootstrapServer, DecodeConfig, Role};
use kvroute_mocker::live::LiveMocker;
use kvroute_mocker::{Engine, MockerConfig};
use kvroute_protocols::{
    Annotated, BootstrapInfo, FinishReason, LLMEngineOutput, PrefillResult, PreprocessedRequest,
};
use kvroute_runtime::{KvEventPublisher, LlmClient, WorkerServer, WorkerServerConfig};

use crate::support::{EventModel, request, run, small_config};

const BOUND: Duration = Duration::from_secs(20);

fn config() -> MockerConfig {
    MockerConfig {
        // Fast steps: the roles are under test, not the timing model.
        speedup: 100.0,
        ..small_config(256, 16, 512)
    }
}

fn prompt() -> Vec<u32> {
    (0..42).collect()
}

fn llm(max_tokens: u32) -> PreprocessedRequest {
    let mut req = PreprocessedRequest::new("mock", prompt());
    req.stop_conditions.max_tokens = Some(max_tokens);
    req
}

struct Served {
    client: LlmClient,
    publisher: KvEventPublisher,
    _server: WorkerServer,
    _mocker: Arc<LiveMocker>,
}

async fn serve(id: u64, role: Role) -> Served {
    let publisher = KvEventPublisher::new(id, 4096);
    let mocker = Arc::new(
        LiveMocker::spawn_with_role(config(), 0, publisher.clone(), role).expect("valid config"),
    );
    let server = WorkerServer::bind(
        "127.0.0.1:0",
        Arc::clone(&mocker),
        WorkerServerConfig::new(id),
    )
    .await
    .expect("bind loopback");
    let client = LlmClient::connect(&server.local_addr().to_string(), Default::default())
        .await
        .expect("connect");
    Served {
        client,
        publisher,
        _server: server,
        _mocker: mocker,
    }
}

async fn collect(
    client: &LlmClient,
    id: &str,
    req: &PreprocessedRequest,
) -> Vec<Annotated<LLMEngineOutput>> {
    client
        .generate(id, req)
        .await
        .expect("started")
        .map(|i| i.expect("item"))
        .collect()
        .await
}

/// The cached blocks a worker's published events describe, checked for consistency.
fn published_blocks(publisher: &KvEventPublisher) -> Vec<u64> {
    let mut model = EventModel::default();
    for e in publisher.range(0, u64::MAX - 1).unwrap_or_default() {
        model.apply(&e.event);
    }
    model.cached()
}

fn block_hashes(params: &serde_json::Value) -> Vec<u64> {
    params["block_hashes"]
        .as_array()
        .expect("block_hashes")
        .iter()
        .map(|h| h.as_u64().expect("u64"))
        .collect()
}

#[tokio::test]
async fn a_prefill_worker_answers_one_token_with_its_blocks() {
    tokio::time::timeout(BOUND, async {
        let prefill = serve(
            5,
            Role::Prefill {
                worker_id: 5,
                rooms: None,
            },
        )
        .await;
        let items = collect(&prefill.client, "p", &llm(50)).await;
        let data: Vec<_> = items.into_iter().map(|i| i.data.expect("data")).collect();
        assert_eq!(data.len(), 2, "one token, then the finish");
        let params = data[0]
            .disaggregated_params
            .clone()
            .expect("params on the token");
        assert_eq!(params["worker_id"]["prefill_worker_id"], 5);
        assert_eq!(data[1].finish_reason, Some(FinishReason::Length));
        assert_eq!(
            data[1].completion_usage.map(|u| u.completion_tokens),
            Some(1)
        );
        // The params name the prompt's full blocks, which the worker's events show it holds.
        let named = block_hashes(&params);
        assert_eq!(named.len(), 42 / 4);
        let held = published_blocks(&prefill.publisher);
        assert!(
            named.iter().all(|h| held.contains(h)),
            "{named:?} vs {held:?}"
        );
    })
    .await
    .expect("bounded");
}

#[tokio::test]
async fn bootstrap_decode_pulls_the_room_and_stores_the_transferred_blocks() {
    tokio::time::timeout(BOUND, async {
        let bootstrap = BootstrapServer::bind("127.0.0.1:0").await.expect("bind");
        let role = Role::Prefill {
            worker_id: 5,
            rooms: Some(bootstrap.rooms()),
        };
        let prefill = serve(5, role).await;
        let decode = serve(6, Role::Decode(DecodeConfig::default())).await;
        let info = BootstrapInfo {
            bootstrap_host: bootstrap.local_addr().ip().to_string(),
            bootstrap_port: bootstrap.local_addr().port(),
            bootstrap_room: 77,
        };
        let mut decode_req = llm(6);
        decode_req.bootstrap_info = Some(info.clone());
        let mut prefill_req = llm(1);
        prefill_req.bootstrap_info = Some(info);
        // Decode starts first and waits in the room; prefill fills it.
        let decode_stream = decode
            .client
            .generate("d", &decode_req)
            .await
            .expect("started");
        let prefill_items = collect(&prefill.client, "p", &prefill_req).await;
        let params = prefill_items[0]
            .data
            .as_ref()
            .and_then(|d| d.disaggregated_params.clone())
            .expect("params");
        let items: Vec<_> = decode_stream.map(|i| i.expect("item")).collect().await;
        assert!(items.iter().all(|i| !i.is_error()), "{items:?}");
        let last = items
            .last()
            .and_then(|i| i.data.clone())
            .expect("final item");
        assert_eq!(last.finish_reason, Some(FinishReason::Length));
        let usage = last.completion_usage.expect("usage");
        assert_eq!((usage.prompt_tokens, usage.completion_tokens), (42, 6));
        // The decode worker now holds the transferred prompt blocks, and says so in its events.
        let held = published_blocks(&decode.publisher);
        assert!(block_hashes(&params).iter().all(|h| held.contains(h)));
    })
    .await
    .expect("bounded");
}

#[tokio::test]
async fn a_cancelled_bootstrap_prefill_fails_the_decode_clearly() {
    tokio::time::timeout(BOUND, async {
        let bootstrap = BootstrapServer::bind("127.0.0.1:0").await.expect("bind");
        let rooms = bootstrap.rooms();
        let decode = serve(6, Role::Decode(DecodeConfig::default())).await;
        let mut decode_req = llm(3);
        decode_req.bootstrap_info = Some(BootstrapInfo {
            bootstrap_host: "127.0.0.1".into(),
            bootstrap_port: bootstrap.local_addr().port(),
            bootstrap_room: 9,
        });
        let stream = decode
            .client
            .generate("d", &decode_req)
            .await
            .expect("started");
        rooms.post(9, Err("the prefill was cancelled".into()));
        let items: Vec<_> = stream.map(|i| i.expect("item")).collect().await;
        let error = items
            .iter()
            .find_map(|i| i.error_message())
            .expect("error item");
        assert!(
            error.contains("prefill failed: the prefill was cancelled"),
            "{error}"
        );
        assert!(
            published_blocks(&decode.publisher).is_empty(),
            "nothing was stored"
        );
    })
    .await
    .expect("bounded");
}

#[tokio::test]
async fn prefill_result_decode_checks_the_params_and_serves_the_request() {
    tokio::time::timeout(BOUND, async {
        let prefill = serve(
            5,
            Role::Prefill {
                worker_id: 5,
                rooms: None,
            },
        )
        .await;
        let decode = serve(6, Role::Decode(DecodeConfig::default())).await;
        let first = collect(&prefill.client, "p", &llm(1)).await;
        let params = first[0]
            .data
            .as_ref()
            .and_then(|d| d.disaggregated_params.clone());
        let mut req = llm(4);
        req.prefill_result = Some(PrefillResult {
            disaggregated_params: params.clone().expect("params"),
            prompt_tokens_details: None,
        });
        let items = collect(&decode.client, "d", &req).await;
        let tokens: usize = items
            .iter()
            .filter_map(|i| i.data.as_ref())
            .map(|d| d.token_ids.len())
            .sum();
        assert_eq!(tokens, 4);

        // Params of another prompt are refused rather than served with the wrong KV.
        let mut wrong = llm(4);
        wrong.token_ids.reverse();
        wrong.prefill_result = req.prefill_result.clone();
        // The engine's refusal reaches the caller as the stream's error.
        let mut stream = decode.client.generate("w", &wrong).await.expect("sent");
        let err = stream
            .next()
            .await
            .expect("an answer")
            .expect_err("refused");
        assert!(err.to_string().contains("not this prompt's"), "{err}");
    })
    .await
    .expect("bounded");
}

#[test]
fn a_prefilled_request_skips_the_prompt_compute_and_stores_its_blocks() {
    let config = MockerConfig::default();
    let tokens: Vec<u32> = (0..4000).collect();
    let first_token_at = |prefilled: bool| {
        let mut engine = Engine::new(config.clone(), 0).expect("valid");
        let req = request(0, tokens.clone(), 2, None);
        if prefilled {
            engine
                .add_prefilled_request(Duration::ZERO, req)
                .expect("accepted");
        } else {
            engine.add_request(Duration::ZERO, req).expect("accepted");
        }
        let (mut first, mut model) = (None, EventModel::default());
        run(&mut engine, None, |_, out| {
            first = first.or(out.tokens.first().map(|t| t.at));
            out.events.iter().for_each(|e| model.apply(e));
        });
        let stats = engine.stats();
        (
            first.expect("a token"),
            model.cached().len(),
            stats.cached_prompt_tokens,
        )
    };
    let (local_at, local_blocks, _) = first_token_at(false);
    let (remote_at, remote_blocks, cached) = first_token_at(true);
    // 4000 tokens take one chunked prefill of several steps; transferred KV needs one short step.
    assert!(remote_at * 5 < local_at, "{remote_at:?} vs {local_at:?}");
    assert_eq!(remote_blocks, local_blocks, "the same blocks end up cached");
    assert_eq!(cached, 0, "transferred tokens are not local cache hits");
}
