//! The real-time adapter: tokens stream at the modelled times (tokio's paused clock, to its
//! millisecond resolution), KV events
//! reach the publisher with consecutive ids, cancellation frees the request, and the adapter
//! serves requests as a kvroute-runtime worker over TCP.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use kvroute_mocker::disagg::{DecodeConfig, Role, prefill_params};
use kvroute_mocker::live::LiveMocker;
use kvroute_mocker::{Engine, MockerConfig};
use kvroute_protocols::{
    FinishReason, PrefillResult, PreprocessedRequest, PromptTokensDetails, RoutingHints,
    SessionAction, SessionControl,
};
use kvroute_runtime::{
    Engine as _, KvEventPublisher, LlmClient, RequestContext, WorkerServer, WorkerServerConfig,
};
use tokio::time::Instant;

use crate::support::{request, run};

fn prompt() -> Vec<u32> {
    (0..40).collect()
}

fn llm_request(max_tokens: u32) -> PreprocessedRequest {
    let mut req = PreprocessedRequest::new("mock", prompt());
    req.stop_conditions.max_tokens = Some(max_tokens);
    req
}

#[tokio::test(start_paused = true)]
async fn tokens_arrive_at_the_modelled_times_and_events_are_published() {
    let config = MockerConfig::default();
    // The same request run offline in virtual time is the expectation.
    let mut offline = Engine::new(config.clone(), 0).expect("valid config");
    offline
        .add_request(Duration::ZERO, request(0, prompt(), 5, None))
        .expect("accepted");
    let (mut expect_tokens, mut expect_events) = (Vec::new(), Vec::new());
    run(&mut offline, None, |_, out| {
        expect_tokens.extend(out.tokens.iter().map(|t| (t.token, t.at)));
        expect_events.extend(out.events.iter().cloned());
    });

    let publisher = KvEventPublisher::new(7, 1024);
    let start = Instant::now();
    let mocker = LiveMocker::spawn(config, 0, publisher.clone()).expect("valid config");
    let mut stream = mocker
        .generate(llm_request(5), RequestContext::new("r1"))
        .expect("accepted");
    let mut got = Vec::new();
    let mut last = None;
    while let Some(item) = stream.next().await {
        let data = item.data.expect("data item");
        if let Some(reason) = data.finish_reason {
            last = Some((
                reason,
                data.completion_usage.expect("usage on the last item"),
            ));
        } else {
            got.push((data.token_ids[0], start.elapsed()));
        }
    }
    // Tokio's timer has millisecond resolution: each token arrives at its modelled time rounded
    // up to the millisecond, and the rounding does not accumulate (steps chain in virtual time).
    assert_eq!(got.len(), expect_tokens.len());
    for ((token, arrived), (expect, at)) in got.iter().zip(&expect_tokens) {
        assert_eq!(token, expect);
        assert!(
            *arrived >= *at && *arrived < *at + Duration::from_millis(1),
            "{arrived:?} vs {at:?}"
        );
    }
    let (reason, usage) = last.expect("a final item");
    assert_eq!(reason, FinishReason::Length);
    assert_eq!((usage.prompt_tokens, usage.completion_tokens), (40, 5));

    let published = publisher.range(0, u64::MAX - 1).expect("held");
    let ids: Vec<u64> = published.iter().map(|e| e.event.event_id).collect();
    assert_eq!(ids, (0..expect_events.len() as u64).collect::<Vec<_>>());
    assert!(published.iter().map(|e| &e.event).eq(expect_events.iter()));
    assert_eq!(
        mocker.kv_dump().len(),
        2,
        "two full 16-token prompt blocks are cached"
    );
}

#[tokio::test(start_paused = true)]
async fn a_stop_ends_the_stream_with_a_cancelled_item() {
    let mocker =
        LiveMocker::spawn(MockerConfig::default(), 0, KvEventPublisher::new(1, 16)).expect("valid");
    let context = RequestContext::new("r1");
    let mut stream = mocker
        .generate(llm_request(10_000), context.clone())
        .expect("accepted");
    let mut tokens = 0;
    while let Some(item) = stream.next().await {
        let data = item.data.expect("data item");
        if data.finish_reason.is_some() {
            assert_eq!(data.finish_reason, Some(FinishReason::Cancelled));
            break;
        }
        tokens += 1;
        if tokens == 3 {
            context.stop_generating();
        }
    }
    assert!(
        (3..10).contains(&tokens),
        "stopped soon after the stop, got {tokens} tokens"
    );
    assert!(
        stream.next().await.is_none(),
        "the stream ends after the cancelled item"
    );
}

#[tokio::test(start_paused = true)]
async fn an_open_session_keeps_its_prefix_for_the_next_turn() {
    let config = MockerConfig {
        num_blocks: 8,
        block_size: 16,
        ..MockerConfig::default()
    };
    let mocker = LiveMocker::spawn(config, 0, KvEventPublisher::new(1, 64)).expect("valid");
    let turn = |id: &str, tokens: Vec<u32>, action: Option<SessionAction>| {
        let mut req = PreprocessedRequest::new("mock", tokens);
        req.stop_conditions.max_tokens = Some(1);
        let mut control = SessionControl::new("chat");
        control.action = action;
        req.routing = Some(RoutingHints {
            session_control: Some(control),
            ..RoutingHints::default()
        });
        mocker
            .generate(req, RequestContext::new(id))
            .expect("accepted")
    };
    let cached = |mut stream: kvroute_runtime::ResponseStream<_>| async move {
        let mut cached = None;
        while let Some(item) = stream.next().await {
            let item: kvroute_protocols::Annotated<kvroute_protocols::LLMEngineOutput> = item;
            if let Some(usage) = item.data.and_then(|d| d.completion_usage) {
                cached = usage.prompt_tokens_details.and_then(|d| d.cached_tokens);
            }
        }
        cached
    };
    assert_eq!(
        cached(turn("t1", (0..64).collect(), Some(SessionAction::Open))).await,
        Some(0)
    );
    // Other traffic cycles the 8-block cache; the session's 4 blocks are not evictable.
    for k in 0..4u32 {
        let mut req =
            PreprocessedRequest::new("mock", (1000 * (k + 1)..1000 * (k + 1) + 64).collect());
        req.stop_conditions.max_tokens = Some(1);
        let stream = mocker
            .generate(req, RequestContext::new(format!("o{k}")))
            .expect("fits");
        cached(stream).await;
    }
    assert_eq!(
        cached(turn("t2", (0..64).collect(), Some(SessionAction::Close))).await,
        Some(48)
    );
}

/// The cached tokens the last item of `stream` reports.
async fn reported_cached_tokens(
    mut stream: kvroute_runtime::ResponseStream<
        kvroute_protocols::Annotated<kvroute_protocols::LLMEngineOutput>,
    >,
) -> Option<u32> {
    let mut cached = None;
    while let Some(item) = stream.next().await {
        assert!(!item.is_error(), "{item:?}");
        if let Some(usage) = item.data.and_then(|d| d.completion_usage) {
            cached = usage.prompt_tokens_details.and_then(|d| d.cached_tokens);
        }
    }
    cached
}

#[tokio::test(start_paused = true)]
async fn a_decode_worker_reports_the_cached_tokens_of_the_prefill_result() {
    let config = MockerConfig::default();
    let block_size = config.block_size;
    let role = Role::Decode(DecodeConfig::default());
    let mocker = LiveMocker::spawn_with_role(config, 0, KvEventPublisher::new(6, 1024), role)
        .expect("valid");
    let decode = |id: &str, details: Option<PromptTokensDetails>| {
        let mut req = llm_request(2);
        req.prefill_result = Some(PrefillResult {
            disaggregated_params: prefill_params(5, 0, &prompt(), block_size),
            prompt_tokens_details: details,
        });
        mocker
            .generate(req, RequestContext::new(id))
            .expect("accepted")
    };
    // Without details from the prefill the decode worker reports its own cache: empty at first,
    // then holding the 2 full blocks of the prompt whose KV it received.
    assert_eq!(reported_cached_tokens(decode("d1", None)).await, Some(0));
    assert_eq!(reported_cached_tokens(decode("d2", None)).await, Some(32));
    // With them it reports the prefill worker's count, where the prompt's cache hits happened.
    let prefill = PromptTokensDetails {
        audio_tokens: None,
        cached_tokens: Some(17),
    };
    assert_eq!(
        reported_cached_tokens(decode("d3", Some(prefill))).await,
        Some(17)
    );
}

#[tokio::test]
async fn the_adapter_serves_as_a_worker_over_tcp() {
    let config = MockerConfig {
        speedup: 1000.0,
        ..MockerConfig::default()
    };
    let publisher = KvEventPublisher::new(3, 1024);
    let mocker = Arc::new(LiveMocker::spawn(config, 0, publisher.clone()).expect("valid config"));
    let server_config = WorkerServerConfig::new(3).with_kv_events(publisher.clone());
    let server = WorkerServer::bind("127.0.0.1:0", mocker, server_config)
        .await
        .expect("bind");
    let client = LlmClient::connect(&server.local_addr().to_string(), Default::default())
        .await
        .expect("connect");
    let mut stream = client
        .generate("r1", &llm_request(8))
        .await
        .expect("generate");
    let mut tokens = 0;
    let mut finish = None;
    while let Some(item) = stream.next().await {
        let data = item.expect("item").data.expect("data");
        tokens += data.token_ids.len();
        finish = finish.or(data.finish_reason);
    }
    assert_eq!((tokens, finish), (8, Some(FinishReason::Length)));
    assert!(
        publisher.last_event_id().is_some(),
        "the prompt's blocks were published"
    );
}

#[tokio::test(start_paused = true)]
async fn the_load_report_counts_the_batch_the_queue_and_the_blocks_in_use() {
    let config = MockerConfig {
        max_num_seqs: 1,
        ..MockerConfig::default()
    };
    let mocker = LiveMocker::spawn(config, 2, KvEventPublisher::new(7, 1024)).expect("valid");
    let idle = mocker.load_report();
    assert_eq!((idle.worker_id, idle.dp_rank), (7, 2));
    assert_eq!(idle.requests(), Some(0));
    assert_eq!(idle.kv_used_blocks, Some(0));
    let mut streams: Vec<_> = (0..3)
        .map(|i| {
            mocker
                .generate(llm_request(4), RequestContext::new(format!("r{i}")))
                .expect("accepted")
        })
        .collect();
    // One sequence at a time: the first runs, the other two wait.
    let first = streams[0].next().await.expect("a token");
    assert!(first.data.is_some());
    let busy = mocker.load_report();
    assert_eq!(
        (busy.requests_running, busy.requests_waiting),
        (Some(1), Some(2))
    );
    // The running request's 40-token prompt plus its first token hold three 16-token blocks.
    assert_eq!(busy.kv_used_blocks, Some(3));
    assert!(busy.validate().is_ok());
    for stream in &mut streams {
        while stream.next().await.is_some() {}
    }
    let drained = mocker.load_report();
    assert_eq!(
        (drained.requests(), drained.kv_used_blocks),
        (Some(0), Some(0))
    );
}
