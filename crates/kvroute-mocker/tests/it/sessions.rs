//! Engine sessions keep their blocks cached through other traffic until they close or time out.

use std::time::Duration;

use kvroute_mocker::Engine;

use crate::support::{EventModel, request, run, small_config};

/// Sends one request and runs to idle; returns the prompt tokens it found cached.
fn serve(
    engine: &mut Engine,
    model: &mut EventModel,
    id: u64,
    tokens: Vec<u32>,
    session: Option<&str>,
) -> u32 {
    let now = engine.clock();
    engine
        .add_request(now, request(id, tokens, 2, session))
        .expect("accepted");
    let mut cached = 0;
    while engine.num_requests() > 0 {
        let t = engine.next_wakeup().expect("work pending");
        let out = engine.advance_to(t);
        out.events.iter().for_each(|e| model.apply(e));
        cached += out
            .finished
            .iter()
            .map(|f| f.cached_prompt_tokens)
            .sum::<u32>();
    }
    cached
}

fn churn(engine: &mut Engine, model: &mut EventModel, first_id: u64) {
    for k in 0..10u32 {
        let base = 10_000 + k * 100;
        serve(
            engine,
            model,
            first_id + u64::from(k),
            (base..base + 20).collect(),
            None,
        );
    }
}

#[test]
fn a_sessions_blocks_survive_other_traffic_until_close() {
    let mut engine = Engine::new(small_config(16, 4, 64), 0).expect("valid config");
    let mut model = EventModel::default();
    let turn: Vec<u32> = (0..16).collect();
    engine.open_session(Duration::ZERO, "chat", Some(Duration::from_secs(3600)));
    assert_eq!(
        serve(&mut engine, &mut model, 1, turn.clone(), Some("chat")),
        0
    );
    // Ten unrelated 20-token prompts cycle the 16-block cache several times over.
    churn(&mut engine, &mut model, 100);
    assert_eq!(
        serve(&mut engine, &mut model, 2, turn.clone(), Some("chat")),
        12,
        "the session's three prompt blocks are still cached (the fourth is recomputed)"
    );
    assert!(engine.close_session(engine.clock(), "chat"));
    churn(&mut engine, &mut model, 200);
    assert_eq!(
        serve(&mut engine, &mut model, 3, turn, None),
        0,
        "closed: evicted by traffic"
    );
    assert_eq!(engine.kv_usage().used, 0);
    assert_eq!(engine.cached_block_hashes(), model.cached());
}

#[test]
fn a_session_times_out_after_its_idle_timeout() {
    let mut engine = Engine::new(small_config(16, 4, 64), 0).expect("valid config");
    let mut model = EventModel::default();
    engine.open_session(Duration::ZERO, "chat", Some(Duration::from_secs(2)));
    serve(&mut engine, &mut model, 1, (0..16).collect(), Some("chat"));
    let held = engine.kv_usage().used;
    assert_eq!(held, 4, "the session holds its four cached blocks");
    let last_activity = engine.clock();
    run(
        &mut engine,
        Some(last_activity + Duration::from_millis(1999)),
        |_, _| {},
    );
    assert_eq!(engine.num_sessions(), 1);
    run(
        &mut engine,
        Some(last_activity + Duration::from_secs(2)),
        |_, _| {},
    );
    assert_eq!(engine.num_sessions(), 0);
    assert_eq!(engine.kv_usage().used, 0);
    let err = engine
        .add_request(engine.clock(), request(9, vec![1, 2, 3], 1, Some("chat")))
        .expect_err("the session is gone");
    assert!(err.to_string().contains("not open"), "{err}");
}
