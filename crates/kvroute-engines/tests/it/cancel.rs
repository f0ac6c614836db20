//! Cancellation as the engine sees it: stopping a request or dropping its stream drops the HTTP
//! connection (vLLM, SGLang and llama.cpp abort a request whose client went away), and a
//! stopped stream ends with a `cancelled` output.

use kvroute_engines::EngineKind;
use kvroute_protocols::{FinishReason, PreprocessedRequest};

use crate::support::{After, MockEngine, Reply, engine, next, start};

fn request() -> PreprocessedRequest {
    PreprocessedRequest::new("m", vec![1, 2, 3])
}

/// One token, then an engine that keeps generating slowly (the body hangs open).
fn one_token_then_busy(kind: EngineKind) -> Reply {
    let event = match kind {
        EngineKind::Sglang => {
            r#"data: {"output_ids":[10],"meta_info":{"completion_tokens":1,"finish_reason":null}}"#
        }
        EngineKind::Llamacpp => r#"data: {"content":"a","tokens":[10],"stop":false}"#,
        _ => r#"data: {"choices":[{"index":0,"text":"a","token_ids":[10],"finish_reason":null}]}"#,
    };
    Reply::sse(&[event.to_owned()], After::Hang)
}

#[tokio::test]
async fn stopping_drops_the_connection_and_ends_cancelled() {
    for kind in [
        EngineKind::Vllm,
        EngineKind::Sglang,
        EngineKind::Llamacpp,
        EngineKind::Trtllm,
    ] {
        let mut mock = MockEngine::start(vec![one_token_then_busy(kind)]).await;
        let engine = engine(kind, &mock);
        let (mut stream, context) = start(&engine, request());
        let first = next(&mut stream).await.expect("a token");
        assert_eq!(first.data.expect("data").token_ids, vec![10], "{kind}");
        assert!(!mock.was_abandoned(), "{kind}: still streaming");
        context.stop_generating();
        let last = next(&mut stream).await.expect("the cancelled output");
        assert_eq!(
            last.data.expect("data").finish_reason,
            Some(FinishReason::Cancelled),
            "{kind}"
        );
        mock.abandoned().await;
        assert!(next(&mut stream).await.is_none(), "{kind}: the stream ends");
        assert_eq!(context.failure(), None, "{kind}: a stop is no failure");
    }
}

#[tokio::test]
async fn dropping_the_stream_drops_the_connection() {
    let mut mock = MockEngine::start(vec![one_token_then_busy(EngineKind::Sglang)]).await;
    let engine = engine(EngineKind::Sglang, &mock);
    let (mut stream, _context) = start(&engine, request());
    assert!(next(&mut stream).await.is_some());
    assert!(!mock.was_abandoned());
    drop(stream);
    mock.abandoned().await;
}

#[tokio::test]
async fn stopping_before_the_answer_drops_the_pending_request() {
    let mut mock = MockEngine::start(vec![Reply::Stall]).await;
    let engine = engine(EngineKind::Vllm, &mock);
    let (mut stream, context) = start(&engine, request());
    // Poll once so the request is sent; the engine never answers.
    let waiting = tokio::spawn(async move {
        let item = next(&mut stream).await;
        (item, next(&mut stream).await)
    });
    mock.request().await;
    context.stop_generating();
    let (item, end) = waiting.await.unwrap();
    assert_eq!(
        item.and_then(|i| i.data).and_then(|d| d.finish_reason),
        Some(FinishReason::Cancelled)
    );
    assert!(end.is_none());
    mock.abandoned().await;
}

#[tokio::test]
async fn a_request_stopped_before_it_starts_sends_nothing() {
    let mut mock = MockEngine::start(vec![Reply::Stall]).await;
    let engine = engine(EngineKind::Vllm, &mock);
    let (mut stream, context) = start(&engine, request());
    context.stop_generating();
    let item = next(&mut stream).await.expect("the cancelled output");
    assert_eq!(
        item.data.unwrap().finish_reason,
        Some(FinishReason::Cancelled)
    );
    assert!(next(&mut stream).await.is_none());
    // The next request reaches the mock first, so none was sent before it.
    let (mut second, _ctx) = start(&engine, request());
    let pending = tokio::spawn(async move { next(&mut second).await });
    let got = mock.request().await;
    assert_eq!(got.body["prompt"], serde_json::json!([1, 2, 3]));
    pending.abort();
}

#[tokio::test]
async fn a_client_side_stop_token_drops_the_llamacpp_connection() {
    let mut mock = MockEngine::start(vec![Reply::sse(
        &[
            r#"data: {"content":"a","tokens":[10],"stop":false}"#.to_owned(),
            r#"data: {"content":".","tokens":[13],"stop":false}"#.to_owned(),
        ],
        After::Hang,
    )])
    .await;
    let engine = engine(EngineKind::Llamacpp, &mock);
    let mut r = request();
    r.stop_conditions.stop_token_ids = Some(vec![13]);
    let (mut stream, context) = start(&engine, r);
    assert_eq!(
        next(&mut stream).await.unwrap().data.unwrap().token_ids,
        vec![10]
    );
    let last = next(&mut stream).await.unwrap().data.unwrap();
    assert_eq!(last.finish_reason, Some(FinishReason::Stop));
    assert!(last.token_ids.is_empty());
    // The connection is dropped while the stream is still held: llama.cpp frees the slot.
    mock.abandoned().await;
    assert!(next(&mut stream).await.is_none());
    assert_eq!(context.failure(), None);
}
