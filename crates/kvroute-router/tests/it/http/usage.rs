//! `usage.prompt_tokens_details.cached_tokens`: the frontend keeps its own token counts and adds
//! the cached prompt tokens the engines report, whole or streamed, through a migration and
//! disaggregated (where the prefill worker's count is the request's).

use std::sync::Arc;
use std::sync::atomic::Ordering;

use futures::StreamExt;

use kvroute_prefill::PrefillRouterConfig;
use kvroute_protocols::{
    Annotated, BOOTSTRAP_HOST_KEY, BOOTSTRAP_PORT_KEY, CompletionUsage, LLMEngineOutput,
    PreprocessedRequest, PromptTokensDetails,
};
use kvroute_router::http::{AppState, Disagg};
use kvroute_router::{KvPhaseRouter, KvPushRouter, ModelRegistry, Policy, role_filtered};
use kvroute_runtime::{
    Discovery, Engine, EngineError, InstanceInfo, Lease, LlmResponse, RequestContext,
    ResponseStream, WorkerRole, WorkerServer, WorkerServerConfig,
};
use serde_json::{Value, json};

use super::{Server, Sse, chat, test_config};
use crate::support::{BLOCK, Fleet, eventually, idle, output_token, run};

/// The prompt tokens the mock template makes of `chat(...)` with a two-word user message.
const PROMPT_TOKENS: usize = 9;

/// The `prompt_tokens` every [`UsageEngine`] claims, so that a test can tell it apart from the
/// router's own count.
const ENGINE_PROMPT_TOKENS: u32 = 999;

/// A worker that streams `max_tokens` (default 5) tokens and reports usage like vLLM: on the
/// last item, with `prompt_tokens_details.cached_tokens` when it has a count.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct UsageEngine {
    /// Cached tokens reported on the first token's item (most engines report none there).
    pub(super) first: Option<u32>,
    /// Cached tokens reported on the last item (its usage has no details when `None`).
    pub(super) last: Option<u32>,
    /// Stream the first token, then nothing until the worker dies.
    pub(super) stall: bool,
    /// A prefill worker: its first item carries `disaggregated_params`.
    pub(super) prefill: bool,
}

fn usage_item(details: Option<PromptTokensDetails>, completion_tokens: u32) -> CompletionUsage {
    CompletionUsage {
        prompt_tokens: ENGINE_PROMPT_TOKENS,
        completion_tokens,
        total_tokens: ENGINE_PROMPT_TOKENS + completion_tokens,
        prompt_tokens_details: details,
    }
}

fn cached(tokens: Option<u32>) -> Option<PromptTokensDetails> {
    tokens.map(|t| PromptTokensDetails {
        audio_tokens: None,
        cached_tokens: Some(t),
    })
}

impl Engine for UsageEngine {
    type Request = PreprocessedRequest;
    type Response = LlmResponse;

    fn generate(
        &self,
        request: PreprocessedRequest,
        _context: RequestContext,
    ) -> Result<ResponseStream<LlmResponse>, EngineError> {
        let n = request.stop_conditions.max_tokens.unwrap_or(5);
        let mut items: Vec<LlmResponse> = (0..n)
            .map(|i| {
                let first = i == 0;
                Annotated::from_data(LLMEngineOutput {
                    token_ids: vec![output_token(i)],
                    disaggregated_params: (first && self.prefill).then(|| json!({"kv": "here"})),
                    completion_usage: self
                        .first
                        .filter(|_| first)
                        .map(|c| usage_item(cached(Some(c)), 1)),
                    ..LLMEngineOutput::default()
                })
            })
            .collect();
        if self.stall {
            items.truncate(1);
            return Ok(Box::pin(
                futures::stream::iter(items).chain(futures::stream::pending()),
            ));
        }
        items.push(Annotated::from_data(LLMEngineOutput {
            completion_usage: Some(usage_item(cached(self.last), n)),
            ..LLMEngineOutput::length()
        }));
        Ok(Box::pin(futures::stream::iter(items)))
    }
}

/// A running [`UsageEngine`] worker; dropping it kills it.
pub(super) struct UsageWorker {
    server: WorkerServer,
    _lease: Lease,
}

pub(super) async fn start_worker(
    fleet: &Fleet,
    id: u64,
    role: WorkerRole,
    engine: UsageEngine,
) -> UsageWorker {
    start_worker_with(fleet, id, role, engine, &[]).await
}

/// [`start_worker`] with discovery `metadata`.
async fn start_worker_with(
    fleet: &Fleet,
    id: u64,
    role: WorkerRole,
    engine: UsageEngine,
    metadata: &[(&str, &str)],
) -> UsageWorker {
    let server = WorkerServer::bind("127.0.0.1:0", Arc::new(engine), WorkerServerConfig::new(id))
        .await
        .unwrap();
    let mut info = InstanceInfo::new(id, server.local_addr().to_string(), BLOCK).with_role(role);
    info.metadata = metadata
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    let lease = fleet.discovery.register(info).await.unwrap();
    UsageWorker {
        server,
        _lease: lease,
    }
}

/// The `usage` the frontend should write: its own counts and, when given, the cached tokens.
fn expected_usage(completion_tokens: usize, cached_tokens: Option<usize>) -> Value {
    let mut usage = json!({
        "prompt_tokens": PROMPT_TOKENS,
        "completion_tokens": completion_tokens,
        "total_tokens": PROMPT_TOKENS + completion_tokens,
    });
    if let Some(c) = cached_tokens {
        usage["prompt_tokens_details"] = json!({"cached_tokens": c});
    }
    usage
}

/// The `usage` of a whole chat completion of 4 tokens.
async fn whole_usage(server: &Server) -> Value {
    let mut body = chat("hello there");
    body["max_tokens"] = json!(4);
    let (status, resp) = server.json("/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{resp}");
    resp["usage"].clone()
}

/// The chunks of a streamed chat completion of `max_tokens` tokens that asks for usage.
async fn streamed(server: &Server, max_tokens: u32) -> Vec<Value> {
    let mut body = chat("stream please");
    body["max_tokens"] = json!(max_tokens);
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let resp = server
        .post("/v1/chat/completions", &body)
        .send()
        .await
        .unwrap();
    chunks(Sse::new(resp).rest().await)
}

fn chunks(payloads: Vec<String>) -> Vec<Value> {
    assert_eq!(payloads.last().map(String::as_str), Some("[DONE]"));
    payloads[..payloads.len() - 1]
        .iter()
        .map(|p| serde_json::from_str(p).unwrap())
        .collect()
}

/// The `usage` of the usage chunk, checking it is the last chunk and the only one with usage.
fn streamed_usage(chunks: &[Value]) -> Value {
    let with_usage: Vec<&Value> = chunks.iter().filter(|c| c.get("usage").is_some()).collect();
    assert_eq!(with_usage.len(), 1, "{chunks:?}");
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"], json!([]), "{last}");
    last["usage"].clone()
}

#[test]
fn cached_tokens_a_worker_reports_reach_the_usage_whole_and_streamed() {
    run(async {
        let fleet = Fleet::start(0).await;
        let engine = UsageEngine {
            last: Some(4),
            ..UsageEngine::default()
        };
        let _worker = start_worker(&fleet, 1, WorkerRole::Aggregated, engine).await;
        let router = fleet.router(Policy::Kv).await;
        let server = Server::start(router.clone(), test_config()).await;
        // prompt_tokens stays the router's own count, not the engine's 999.
        assert_eq!(whole_usage(&server).await, expected_usage(4, Some(4)));
        let chunks = streamed(&server, 5).await;
        assert_eq!(streamed_usage(&chunks), expected_usage(5, Some(4)));
        eventually("all load is freed", || idle(&router)).await;
    });
}

#[test]
fn no_reported_cached_tokens_means_no_prompt_tokens_details() {
    run(async {
        // One worker reports usage without details, the other (the shared fake) no usage at all.
        let mut fleet = Fleet::start(0).await;
        let _worker = start_worker(&fleet, 1, WorkerRole::Aggregated, UsageEngine::default()).await;
        fleet.add(2, None).await;
        let router = fleet.router(Policy::RoundRobin).await;
        eventually("both workers are known", || {
            router.with_core(|c| c.workers().count()) == 2
        })
        .await;
        let server = Server::start(router.clone(), test_config()).await;
        // Round robin takes turns: each worker serves one whole and one streamed response.
        for _ in 0..2 {
            assert_eq!(whole_usage(&server).await, expected_usage(4, None));
        }
        for _ in 0..2 {
            let chunks = streamed(&server, 5).await;
            assert_eq!(streamed_usage(&chunks), expected_usage(5, None));
        }
        assert_eq!(fleet.worker(2).engine.started.load(Ordering::SeqCst), 2);
        eventually("all load is freed", || idle(&router)).await;
    });
}

#[test]
fn cached_tokens_are_capped_at_the_prompt_length() {
    run(async {
        let fleet = Fleet::start(0).await;
        let engine = UsageEngine {
            last: Some(1000),
            ..UsageEngine::default()
        };
        let _worker = start_worker(&fleet, 1, WorkerRole::Aggregated, engine).await;
        let router = fleet.router(Policy::Kv).await;
        let server = Server::start(router.clone(), test_config()).await;
        assert_eq!(
            whole_usage(&server).await,
            expected_usage(4, Some(PROMPT_TOKENS))
        );
        eventually("all load is freed", || idle(&router)).await;
    });
}

#[test]
fn across_a_migration_the_first_workers_cached_tokens_are_reported() {
    run(async {
        let fleet = Fleet::start(0).await;
        // Worker 1 reports 4 cached tokens with its first token, then dies; worker 2 finishes
        // the continuation (prompt + 1 generated token) and reports its own count over it.
        let first = UsageEngine {
            first: Some(4),
            stall: true,
            ..UsageEngine::default()
        };
        let worker = start_worker(&fleet, 1, WorkerRole::Aggregated, first).await;
        let router = fleet.router(Policy::Kv).await;
        let server = Server::start(router.clone(), test_config()).await;
        let mut body = chat("stream please");
        body["max_tokens"] = json!(6);
        body["stream"] = json!(true);
        body["stream_options"] = json!({"include_usage": true});
        let resp = server
            .post("/v1/chat/completions", &body)
            .send()
            .await
            .unwrap();
        let mut sse = Sse::new(resp);
        let mut payloads = Vec::new();
        // The opening chunk (the role), then the first token's.
        for _ in 0..2 {
            payloads.push(sse.next().await.unwrap());
        }
        let second = UsageEngine {
            last: Some(8),
            ..UsageEngine::default()
        };
        let _second = start_worker(&fleet, 2, WorkerRole::Aggregated, second).await;
        eventually("worker 2 is known", || {
            router.with_core(|c| c.workers().count()) == 2
        })
        .await;
        worker.server.abort();
        drop(worker);
        payloads.extend(sse.rest().await);
        let chunks = chunks(payloads);
        assert!(
            chunks.iter().all(|c| c.get("error").is_none()),
            "{chunks:?}"
        );
        assert_eq!(streamed_usage(&chunks), expected_usage(6, Some(4)));
        eventually("all load is freed", || idle(&router)).await;
    });
}

/// A disaggregated frontend over prefill worker 1 and decode worker 2 (registered with
/// `prefill_meta` and no metadata); returns the server, both phases' routers and the workers.
pub(super) async fn disagg_server(
    fleet: &Fleet,
    prefill_engine: UsageEngine,
    prefill_meta: &[(&str, &str)],
    decode_engine: UsageEngine,
) -> (Server, KvPushRouter, KvPushRouter, [UsageWorker; 2]) {
    let prefill_worker =
        start_worker_with(fleet, 1, WorkerRole::Prefill, prefill_engine, prefill_meta).await;
    let decode_worker = start_worker(fleet, 2, WorkerRole::Decode, decode_engine).await;
    let watch = fleet.discovery.watch();
    let prefill = fleet
        .router_on(
            role_filtered(watch.clone(), &[WorkerRole::Prefill]),
            Policy::Kv,
        )
        .await;
    let decode = fleet
        .router_on(
            role_filtered(watch.clone(), &[WorkerRole::Decode]),
            Policy::Kv,
        )
        .await;
    let disagg = Disagg::new(
        KvPhaseRouter::new(prefill.clone(), decode.clone()),
        watch,
        PrefillRouterConfig::default(),
    );
    assert!(disagg.router().is_active());
    let state = AppState::new(decode.clone(), ModelRegistry::mock("mock"), test_config())
        .with_disagg(disagg);
    let server = Server::serve(state).await;
    (server, prefill, decode, [prefill_worker, decode_worker])
}

#[test]
fn disaggregated_usage_reports_the_prefill_workers_cached_tokens_over_the_decode_workers() {
    run(async {
        // The prompt's cache hit happens on the prefill worker (8 tokens); the decode worker
        // reports a count of its own (2), which is not the request's.
        let prefill_engine = UsageEngine {
            last: Some(8),
            prefill: true,
            ..UsageEngine::default()
        };
        let decode_engine = UsageEngine {
            last: Some(2),
            ..UsageEngine::default()
        };
        // The prefill-result path, then the bootstrap path (the prefill runs in the background
        // and its details arrive on their own).
        let bootstrap = [
            (BOOTSTRAP_HOST_KEY, "127.0.0.1"),
            (BOOTSTRAP_PORT_KEY, "7100"),
        ];
        for meta in [&[][..], &bootstrap[..]] {
            let fleet = Fleet::start(0).await;
            let (server, prefill, decode, _workers) =
                disagg_server(&fleet, prefill_engine, meta, decode_engine).await;
            let mut body = chat("hello there");
            body["max_tokens"] = json!(4);
            body["nvext"] = json!({"extra_fields": ["worker_id"]});
            let (status, resp) = server.json("/v1/chat/completions", &body).await;
            assert_eq!(status, 200, "{resp}");
            assert_eq!(resp["nvext"]["worker_id"]["prefill_worker_id"], 1, "{resp}");
            assert_eq!(resp["nvext"]["worker_id"]["decode_worker_id"], 2, "{resp}");
            assert_eq!(resp["usage"], expected_usage(4, Some(8)), "{meta:?}");
            let chunks = streamed(&server, 5).await;
            assert_eq!(
                streamed_usage(&chunks),
                expected_usage(5, Some(8)),
                "{meta:?}"
            );
            eventually("both phases are freed", || idle(&prefill) && idle(&decode)).await;
        }
    });
}

#[test]
fn disaggregated_usage_falls_back_to_the_decode_workers_count_without_a_prefill_count() {
    run(async {
        let fleet = Fleet::start(0).await;
        let prefill_engine = UsageEngine {
            prefill: true,
            ..UsageEngine::default()
        };
        // A decode worker that echoes the prefill's details (like Dynamo's) would report none
        // here; this one reports a count of its own, which is then the only count there is.
        let decode_engine = UsageEngine {
            last: Some(2),
            ..UsageEngine::default()
        };
        let (server, prefill, decode, _workers) =
            disagg_server(&fleet, prefill_engine, &[], decode_engine).await;
        let mut body = chat("hello there");
        body["max_tokens"] = json!(4);
        let (status, resp) = server.json("/v1/chat/completions", &body).await;
        assert_eq!(status, 200, "{resp}");
        assert_eq!(resp["usage"], expected_usage(4, Some(2)));
        eventually("both phases are freed", || idle(&prefill) && idle(&decode)).await;
    });
}
