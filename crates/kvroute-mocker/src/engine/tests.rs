use super::*;
use crate::config::{Admission, PolynomialTiming, RooflineTiming, TimingConfig};
use crate::timing::SeqWork;
use kvroute_protocols::kv_events::{KvCacheEvent, KvCacheEventData};

fn config(num_blocks: u32, max_batched: u32) -> MockerConfig {
    MockerConfig {
        block_size: 4,
        num_blocks,
        max_num_batched_tokens: max_batched,
        ..MockerConfig::default()
    }
}

fn request(id: RequestId, tokens: std::ops::Range<u32>, out: u32) -> Request {
    Request {
        id,
        tokens: tokens.collect(),
        max_output_tokens: out,
        session: None,
    }
}

/// Runs the engine until idle and returns everything it produced.
fn drain(engine: &mut Engine) -> StepOutput {
    let mut out = StepOutput::default();
    while let Some(t) = engine.next_wakeup() {
        engine.advance_into(t, &mut out);
    }
    out
}

fn stored_blocks(events: &[KvCacheEvent]) -> Vec<usize> {
    events
        .iter()
        .filter_map(|e| match &e.data {
            KvCacheEventData::Stored(s) => Some(s.blocks.len()),
            _ => None,
        })
        .collect()
}

#[test]
fn one_request_prefills_then_decodes_and_caches_output_blocks() {
    let mut engine = Engine::new(config(64, 64), 0).expect("valid config");
    engine
        .add_request(Duration::ZERO, request(1, 0..10, 7))
        .expect("accepted");
    let out = drain(&mut engine);
    // Prefill caches blocks 0 and 1; decoding appends 6 tokens (the 7th is never computed), so
    // the sequence reaches 16 computed tokens and blocks 2 and 3 are cached one at a time.
    assert_eq!(stored_blocks(&out.events), vec![2, 1, 1]);
    assert_eq!(out.tokens.len(), 7);
    assert_eq!(
        out.tokens.iter().map(|t| t.index).collect::<Vec<_>>(),
        (0..7).collect::<Vec<_>>()
    );
    assert_eq!(out.finished.len(), 1);
    assert_eq!(out.finished[0].reason, FinishReason::Length);
    assert_eq!(out.finished[0].output_tokens, 7);
    let ids: Vec<u64> = out.events.iter().map(|e| e.event_id).collect();
    assert_eq!(ids, vec![0, 1, 2]);
    assert_eq!(engine.kv_usage().used, 0);
    assert_eq!(engine.kv_usage().cached, 4);
    assert_eq!(engine.stats().steps, 7);
}

#[test]
fn tokens_are_emitted_at_the_modelled_step_ends() {
    let cfg = config(64, 64);
    let timing = TimingModel::for_engine(&cfg);
    let mut engine = Engine::new(cfg, 0).expect("valid config");
    let start = Duration::from_secs(5);
    engine
        .add_request(start, request(1, 0..10, 2))
        .expect("accepted");
    assert_eq!(engine.next_wakeup(), Some(start));
    let out = drain(&mut engine);
    let mut prefill = StepShape::default();
    prefill.add_prefill(0, 10);
    let mut decode = StepShape::default();
    decode.add_decode(11);
    let first = start + timing.step_duration(&prefill);
    let second = first + timing.step_duration(&decode);
    let times: Vec<Duration> = out.tokens.iter().map(|t| t.at).collect();
    assert_eq!(times, vec![first, second]);
    assert_eq!(engine.next_wakeup(), None);
}

#[test]
fn a_repeated_prompt_hits_the_prefix_cache_but_recomputes_its_last_token() {
    let mut engine = Engine::new(config(64, 64), 0).expect("valid config");
    engine
        .add_request(Duration::ZERO, request(1, 0..10, 1))
        .expect("accepted");
    drain(&mut engine);
    let t = engine.clock();
    engine
        .add_request(t, request(2, 0..10, 1))
        .expect("accepted");
    engine
        .add_request(t, request(3, 0..8, 1))
        .expect("accepted");
    let out = drain(&mut engine);
    let cached: Vec<(RequestId, u32)> = out
        .finished
        .iter()
        .map(|f| (f.request_id, f.cached_prompt_tokens))
        .collect();
    // Request 3's prompt is exactly two blocks; one must be recomputed to produce logits.
    assert_eq!(cached, vec![(2, 8), (3, 4)]);
    assert!(
        stored_blocks(&out.events).is_empty(),
        "nothing new to cache"
    );
}

#[test]
fn chunked_prefill_splits_a_long_prompt_over_steps() {
    let mut engine = Engine::new(config(64, 4), 0).expect("valid config");
    engine
        .add_request(Duration::ZERO, request(1, 0..10, 1))
        .expect("accepted");
    let out = drain(&mut engine);
    // 4 + 4 + 2 prompt tokens, the last chunk producing the only token.
    assert_eq!(engine.stats().steps, 3);
    assert_eq!(stored_blocks(&out.events), vec![1, 1]);
}

#[test]
fn same_seed_and_prompt_give_the_same_tokens() {
    let run = |seed: u64, id: RequestId| {
        let cfg = MockerConfig {
            seed,
            ..config(64, 64)
        };
        let mut engine = Engine::new(cfg, 0).expect("valid config");
        engine
            .add_request(Duration::ZERO, request(id, 0..9, 5))
            .expect("accepted");
        drain(&mut engine)
            .tokens
            .iter()
            .map(|t| t.token)
            .collect::<Vec<_>>()
    };
    assert_eq!(run(1, 1), run(1, 2));
    assert_ne!(run(1, 1), run(2, 1));
}

#[test]
fn bad_requests_are_refused_with_the_reason() {
    let mut engine = Engine::new(config(4, 64), 0).expect("valid config");
    let now = Duration::ZERO;
    let check = |engine: &mut Engine, req: Request, expect: Result<(), RequestError>| {
        assert_eq!(engine.add_request(now, req), expect);
    };
    check(
        &mut engine,
        request(1, 0..0, 1),
        Err(RequestError::EmptyPrompt(1)),
    );
    check(
        &mut engine,
        request(1, 0..4, 0),
        Err(RequestError::NoOutput(1)),
    );
    check(
        &mut engine,
        request(1, 0..16, 1),
        Err(RequestError::TooLong {
            id: 1,
            needed: 5,
            capacity: 4,
        }),
    );
    check(&mut engine, request(1, 0..4, 1), Ok(()));
    check(
        &mut engine,
        request(1, 0..4, 1),
        Err(RequestError::DuplicateId(1)),
    );
    let mut with_session = request(2, 0..4, 1);
    with_session.session = Some("s".into());
    check(
        &mut engine,
        with_session,
        Err(RequestError::UnknownSession {
            id: 2,
            session: "s".into(),
        }),
    );
}

#[test]
fn cancel_frees_blocks_and_reports_the_request() {
    let mut engine = Engine::new(config(64, 64), 0).expect("valid config");
    engine
        .add_request(Duration::ZERO, request(1, 0..10, 100))
        .expect("accepted");
    let t = engine.next_wakeup().expect("work to do");
    let mut out = engine.advance_to(t);
    assert_eq!(engine.kv_usage().used, 3);
    assert!(engine.cancel(t, 1, &mut out));
    assert!(!engine.cancel(t, 1, &mut out));
    assert_eq!(engine.kv_usage().used, 0);
    assert_eq!(
        out.finished.last().map(|f| f.reason),
        Some(FinishReason::Cancelled)
    );
    // The step in flight still ends, but produces nothing for the cancelled request.
    let rest = drain(&mut engine);
    assert!(rest.tokens.is_empty());
    assert_eq!(engine.next_wakeup(), None);
}

#[test]
fn session_expiry_is_a_wakeup_and_releases_blocks() {
    let mut engine = Engine::new(config(64, 64), 0).expect("valid config");
    engine.open_session(Duration::ZERO, "s", Some(Duration::from_secs(10)));
    let mut req = request(1, 0..10, 1);
    req.session = Some("s".into());
    engine.add_request(Duration::ZERO, req).expect("accepted");
    drain_until_idle_requests(&mut engine);
    assert_eq!(
        engine.kv_usage().used,
        2,
        "the session holds the two cached prompt blocks"
    );
    let finished_at = engine.clock();
    assert_eq!(
        engine.next_wakeup(),
        Some(finished_at + Duration::from_secs(10))
    );
    drain(&mut engine);
    assert_eq!(engine.num_sessions(), 0);
    assert_eq!(engine.kv_usage().used, 0);
    assert_eq!(
        engine.kv_usage().cached,
        2,
        "expiry frees blocks but keeps them cached"
    );
}

fn drain_until_idle_requests(engine: &mut Engine) {
    while engine.num_requests() > 0 {
        let t = engine.next_wakeup().expect("requests pending");
        engine.advance_to(t);
    }
}

#[test]
fn config_json_overrides_only_what_it_states() {
    let cfg = MockerConfig::from_json_str(r#"{"num_blocks": 10, "timing": {"overhead_ms": 2.5}}"#)
        .expect("valid config");
    assert_eq!(cfg.num_blocks, 10);
    assert_eq!(cfg.block_size, 16);
    let TimingConfig::Roofline(roofline) = &cfg.timing else {
        panic!(
            "an untagged timing table is the roofline, got {:?}",
            cfg.timing
        );
    };
    assert_eq!(roofline.overhead_ms, 2.5);
    assert_eq!(
        roofline.weights_read_ms,
        RooflineTiming::default().weights_read_ms
    );

    let check = |text: &str, expect: &str| {
        let err = MockerConfig::from_json_str(text).expect_err("invalid config");
        assert!(
            err.to_string().contains(expect),
            "{err} should mention {expect}"
        );
    };
    check(
        r#"{"block_size": 0}"#,
        "block_size must be at least 1, got 0",
    );
    check(
        r#"{"speedup": -1.0}"#,
        "speedup must be a finite number > 0",
    );
    check(r#"{"timing": {"overhead_ms": -1.0}}"#, "timing.overhead_ms");
    check(r#"{"blocks": 3}"#, "unknown field `blocks`");

    let toml = MockerConfig::from_toml_str("speedup = 4.0\n[timing]\nper_sequence_ms = 0.0\n")
        .expect("valid TOML config");
    let TimingConfig::Roofline(roofline) = &toml.timing else {
        panic!("expected the roofline, got {:?}", toml.timing);
    };
    assert_eq!((toml.speedup, roofline.per_sequence_ms), (4.0, 0.0));
    let err = MockerConfig::from_toml_str("num_blocks = 0").expect_err("out of range");
    assert!(
        err.to_string().contains("num_blocks must be at least 1"),
        "{err}"
    );
}

#[test]
fn speedup_divides_step_time() {
    let timing = TimingConfig::default();
    let mut shape = StepShape::default();
    shape.add_prefill(0, 8192);
    let normal = TimingModel::new(timing.clone(), 1.0, 1 << 20).step_duration(&shape);
    let fast = TimingModel::new(timing, 10.0, 1 << 20).step_duration(&shape);
    assert_eq!(normal.as_micros() / 10, fast.as_micros());
    // The documented default: ~282 ms for 8192 fresh tokens.
    assert_eq!(normal.as_millis(), 282);
}

/// The reference's fits, written out with its literal coefficients (`polynomial_prefill_time`
/// and `polynomial_decode_time`, aisimulate-core 0.13.0 `src/engine/common/perf_model.rs`).
fn reference_prefill_ms(tokens: f64) -> f64 {
    4.209989e-07 * tokens * tokens + 1.518344e-02 * tokens + 1.650142e+01
}

fn reference_decode_ms(used: f64) -> f64 {
    (-25.74 * used * used + 54.01 * used + 5.74).max(1.0)
}

fn work(prompt_len: u64, len: u64, computed: u64, new_tokens: u64, generated: u64) -> SeqWork {
    SeqWork {
        prompt_len,
        len,
        computed,
        new_tokens,
        generated,
    }
}

#[test]
fn polynomial_timing_reproduces_the_reference_step_costs() {
    const CAPACITY: u64 = 1 << 20;
    let model = TimingModel::new(
        TimingConfig::Polynomial(PolynomialTiming::default()),
        1.0,
        CAPACITY,
    );
    let check = |batch: &[SeqWork], expect_ms: f64| {
        let mut shape = StepShape::default();
        for &w in batch {
            shape.add(w);
        }
        let got = model.step_ms(&shape);
        assert!(
            (got - expect_ms).abs() < 1e-9,
            "{batch:?}: {got} ms, expected {expect_ms} ms"
        );
    };
    // A fresh 8192-token prompt: one prefill pass; its first token needs no decode pass.
    check(
        &[work(8192, 8192, 0, 8192, 0)],
        reference_prefill_ms(8192.0),
    );
    // A chunk after cached tokens costs only its new tokens.
    check(
        &[work(3000, 3000, 2048, 952, 0)],
        reference_prefill_ms(952.0),
    );
    // Two chunks of 5 and 8 new tokens: the reference's integer means give 2 * (13/2 - 0) = 12.
    check(
        &[work(5, 5, 0, 5, 0), work(8, 8, 0, 8, 0)],
        reference_prefill_ms(12.0),
    );
    // Decoding only: the utilisation is the decoding contexts over the capacity, capped at 1.
    check(
        &[work(100, CAPACITY / 2, CAPACITY / 2 - 1, 1, 7)],
        reference_decode_ms(0.5),
    );
    check(
        &[
            work(100, CAPACITY, CAPACITY - 1, 1, 7),
            work(100, 4096, 4095, 1, 7),
        ],
        reference_decode_ms(1.0),
    );
    // A mixed step is the prefill pass plus the decode pass.
    check(
        &[
            work(1512, 1512, 512, 1000, 0),
            work(200, CAPACITY / 4, CAPACITY / 4 - 1, 1, 3),
        ],
        reference_prefill_ms(1000.0) + reference_decode_ms(0.25),
    );
    // A preempted sequence recomputing prompt and output: its prompt part is prefill, and
    // finishing the recompute samples a token as a decoding sequence does.
    check(
        &[work(100, 110, 0, 110, 10)],
        reference_prefill_ms(100.0) + reference_decode_ms(110.0 / CAPACITY as f64),
    );
    // A middle chunk of a long prompt: prefill only.
    check(
        &[work(20_000, 20_000, 8192, 8192, 0)],
        reference_prefill_ms(8192.0),
    );
    // An empty step costs nothing (the engine never runs one).
    check(&[], 0.0);
}

#[test]
fn reference_engine_emits_tokens_at_the_reference_step_ends() {
    let cfg = MockerConfig::reference();
    let capacity = f64::from(cfg.num_blocks) * f64::from(cfg.block_size);
    let mut engine = Engine::new(cfg, 0).expect("valid config");
    let start = Duration::from_secs(3);
    engine
        .add_request(start, request(1, 0..100, 3))
        .expect("accepted");
    let out = drain(&mut engine);
    let ms = |v: f64| Duration::from_nanos((v * 1e6).round() as u64);
    let first = start + ms(reference_prefill_ms(100.0));
    let second = first + ms(reference_decode_ms(101.0 / capacity));
    let third = second + ms(reference_decode_ms(102.0 / capacity));
    let times: Vec<Duration> = out.tokens.iter().map(|t| t.at).collect();
    assert_eq!(times, vec![first, second, third]);
}

#[test]
fn whole_prompt_admission_waits_for_room_for_the_whole_prompt() {
    // 10 blocks of 4 tokens, 8 tokens a step. Request 1 (16 prompt tokens) holds 5 blocks once
    // it decodes; request 2's 24-token prompt needs 6 blocks in all but 2 for its first chunk.
    let first_step_after_arrival = |admission: Admission| {
        let cfg = MockerConfig {
            admission,
            ..config(10, 8)
        };
        let mut engine = Engine::new(cfg, 0).expect("valid config");
        engine
            .add_request(Duration::ZERO, request(1, 0..16, 20))
            .expect("accepted");
        let mut out = StepOutput::default();
        while out.tokens.len() < 2 {
            let t = engine.next_wakeup().expect("request 1 runs");
            engine.advance_into(t, &mut out);
        }
        engine
            .add_request(engine.clock(), request(2, 100..124, 1))
            .expect("accepted");
        // The step already running ends; the next one is planned with request 2 waiting.
        let t = engine.next_wakeup().expect("request 1 runs");
        engine.advance_to(t);
        let waiting = engine.num_waiting();
        drain_until_idle_requests(&mut engine);
        assert_eq!(
            engine.kv_usage().used,
            0,
            "{admission:?}: every block freed"
        );
        waiting
    };
    assert_eq!(first_step_after_arrival(Admission::FirstChunk), 0);
    assert_eq!(first_step_after_arrival(Admission::WholePrompt), 1);
}

#[test]
fn timing_config_names_its_model() {
    let cfg =
        MockerConfig::from_json_str(r#"{"timing": {"model": "polynomial", "decode_c0": 6.0}}"#)
            .expect("valid config");
    assert_eq!(
        cfg.timing,
        TimingConfig::Polynomial(PolynomialTiming {
            decode_c0: 6.0,
            ..PolynomialTiming::default()
        })
    );
    let roofline =
        MockerConfig::from_toml_str("[timing]\nmodel = \"roofline\"\noverhead_ms = 2.0\n")
            .expect("valid TOML config");
    assert_eq!(
        roofline.timing,
        TimingConfig::Roofline(RooflineTiming {
            overhead_ms: 2.0,
            ..RooflineTiming::default()
        })
    );
    // The reference preset survives both file formats.
    let reference = MockerConfig::reference();
    let json = serde_json::to_string(&reference).expect("serializable");
    assert_eq!(
        MockerConfig::from_json_str(&json).expect("round trip"),
        reference
    );
    let toml_text = toml::to_string(&reference).expect("serializable");
    assert_eq!(
        MockerConfig::from_toml_str(&toml_text).expect("round trip"),
        reference
    );

    let check = |text: &str, expect: &str| {
        let err = MockerConfig::from_json_str(text).expect_err("invalid config");
        assert!(
            err.to_string().contains(expect),
            "{err} should mention {expect}"
        );
    };
    check(
        r#"{"timing": {"model": "gpu"}}"#,
        r#"timing.model must be "roofline" or "polynomial", got "gpu""#,
    );
    check(
        r#"{"timing": {"model": "polynomial", "overhead_ms": 1.0}}"#,
        "unknown field `overhead_ms`",
    );
    check(
        r#"{"timing": {"model": "polynomial", "decode_floor_ms": -1.0}}"#,
        "timing.decode_floor_ms must be a finite number >= 0",
    );
    check(r#"{"admission": "eager"}"#, "unknown variant `eager`");
}
