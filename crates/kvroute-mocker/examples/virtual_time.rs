//! Drives the simulated engine in virtual time: a request is prefilled and decoded step by step,
//! the engine publishes the KV events a real engine would, and a second request with the same
//! prompt prefix finds it in the prefix cache and reaches its first token sooner.
//!
//! Run with `cargo run -p kvroute-mocker --example virtual_time`.

use std::time::Duration;

use kvroute_mocker::{Engine, Finished, MockerConfig, Request, StepOutput};
use kvroute_protocols::kv_events::KvCacheEventData;

fn main() {
    // The default config models an 8B model on one H100, 16-token blocks.
    let mut engine = Engine::new(MockerConfig::default(), 0).expect("valid config");
    let prompt: Vec<u32> = (0..1000).collect();

    let start = Duration::ZERO;
    engine
        .add_request(start, request(1, prompt.clone()))
        .expect("accepted");
    let (first, out) = run_until_idle(&mut engine);
    let stored_blocks: usize = out
        .events
        .iter()
        .map(|e| match &e.data {
            KvCacheEventData::Stored(s) => s.blocks.len(),
            _ => 0,
        })
        .sum();
    println!(
        "request 1: first token after {:?}, finished at {:?}, {} cached prompt tokens, {} KV events storing {} blocks",
        first,
        out.finished[0].at,
        out.finished[0].cached_prompt_tokens,
        out.events.len(),
        stored_blocks
    );
    assert_eq!(out.finished[0].cached_prompt_tokens, 0);
    assert_eq!(out.finished[0].output_tokens, 8);
    // 1000 prompt tokens and 7 decoded ones (the last token's KV is never computed) fill 62 full
    // blocks; a partial block is never published.
    assert_eq!(stored_blocks, 62);

    // Same 1000-token prefix plus a new question: only the uncached tail is prefilled.
    let t = engine.clock();
    let follow_up: Vec<u32> = prompt.iter().copied().chain(5000..5100).collect();
    engine
        .add_request(t, request(2, follow_up))
        .expect("accepted");
    let (second, out) = run_until_idle(&mut engine);
    let Finished {
        cached_prompt_tokens,
        ..
    } = out.finished[0];
    println!(
        "request 2: first token after {:?}, {cached_prompt_tokens} of 1100 prompt tokens cached",
        second - t
    );
    assert_eq!(cached_prompt_tokens, 62 * 16);
    assert!(
        second - t < first,
        "a cache hit makes the first token faster"
    );
}

fn request(id: u64, tokens: Vec<u32>) -> Request {
    Request {
        id,
        tokens,
        max_output_tokens: 8,
        session: None,
    }
}

/// Advances the engine from wakeup to wakeup until it has nothing left to do; returns when the
/// first token came out and everything the engine produced.
fn run_until_idle(engine: &mut Engine) -> (Duration, StepOutput) {
    let mut all = StepOutput::default();
    while let Some(wakeup) = engine.next_wakeup() {
        engine.advance_into(wakeup, &mut all);
    }
    let first = all.tokens.first().expect("tokens were generated").at;
    (first, all)
}
