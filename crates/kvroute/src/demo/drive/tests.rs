use std::time::{Duration, Instant};

use super::*;

fn empty() -> TurnResult {
    TurnResult {
        conversation: 0,
        turn: 0,
        error: None,
        ttft: None,
        latency: Duration::ZERO,
        worker: None,
        predicted_hit_rate: None,
        chunks: 0,
    }
}

/// Feeds `chunks` to one turn; returns its result, reply, and the first error.
fn check(chunks: &[&str]) -> (TurnResult, String, Option<String>) {
    let (mut result, mut reply) = (empty(), String::new());
    let sent = Instant::now();
    for chunk in chunks {
        if let Err(e) = on_chunk(chunk, sent, &mut result, &mut reply) {
            return (result, reply, Some(e));
        }
    }
    (result, reply, None)
}

#[test]
fn the_opening_chunk_is_not_a_first_token() {
    let (r, reply, err) = check(&[
        r#"{"choices":[{"delta":{"role":"assistant","content":""}}],"nvext":{"worker_id":{"decode_worker_id":3}}}"#,
    ]);
    assert_eq!((r.ttft, r.chunks, r.worker, err), (None, 0, Some(3), None));
    assert_eq!(reply, "");
}

#[test]
fn text_chunks_build_the_reply_and_the_last_carries_timing() {
    let (r, reply, err) = check(&[
        r#"{"choices":[{"delta":{"content":"ba"}}]}"#,
        r#"{"choices":[{"delta":{"content":" de"}}]}"#,
        r#"{"choices":[{"delta":{},"finish_reason":"length"}],"nvext":{"worker_id":{"decode_worker_id":2},"timing":{"kv_hit_rate":0.75}}}"#,
    ]);
    assert_eq!(err, None);
    assert!(r.ttft.is_some());
    assert_eq!(
        (r.chunks, r.worker, r.predicted_hit_rate),
        (2, Some(2), Some(0.75))
    );
    assert_eq!(reply, "ba de");
}

#[test]
fn an_error_chunk_or_bad_json_fails_the_turn() {
    let (_, _, err) = check(&[r#"{"error":{"message":"engine exploded"}}"#]);
    assert!(err.is_some_and(|e| e.contains("engine exploded")));
    let (_, _, err) = check(&["not json"]);
    assert!(err.is_some_and(|e| e.contains("not JSON")));
}
