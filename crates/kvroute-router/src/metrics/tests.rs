use super::*;

fn sample(text: &str, model: &str, encoder: &str) -> Option<String> {
    let prefix =
        format!("kvroute_router_tokenizer_encoder{{model=\"{model}\",encoder=\"{encoder}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix).map(str::to_owned))
}

#[test]
fn the_tokenizer_encoder_reads_one_for_the_encoder_in_use_and_zero_for_one_left() {
    let m = RouterMetrics::new();
    m.set_tokenizer_encoder("llama", "fastokens");
    m.set_tokenizer_encoder("mock", "builtin");
    let text = m.encode_text();
    assert_eq!(sample(&text, "llama", "fastokens").as_deref(), Some("1"));
    assert_eq!(
        sample(&text, "llama", "tokenizers"),
        None,
        "no sample for an encoder never used"
    );
    assert_eq!(sample(&text, "mock", "builtin").as_deref(), Some("1"));
    // fastokens was turned off: the model falls back to the tokenizers crate.
    m.set_tokenizer_encoder("llama", "tokenizers");
    let text = m.encode_text();
    assert_eq!(sample(&text, "llama", "fastokens").as_deref(), Some("0"));
    assert_eq!(sample(&text, "llama", "tokenizers").as_deref(), Some("1"));
    assert_eq!(sample(&text, "mock", "builtin").as_deref(), Some("1"));
}

fn counter(text: &str, name: &str) -> Option<u64> {
    let prefix = format!("kvroute_router_{name} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix).map(|v| v.parse().unwrap()))
}

#[test]
fn a_request_routed_away_from_its_cached_prefix_counts_what_it_forgoes() {
    use kvroute_router_core::{KvMode, KvRouterCore, Policy, RouteRequest, RouterConfig};
    use kvroute_scheduler::{RequestId, WorkerSpec};
    use rand::SeedableRng;

    const BS: u32 = 4;
    let mut core = KvRouterCore::new(RouterConfig::new(BS).with_policy(Policy::Kv)).unwrap();
    for id in [1, 2] {
        core.add_worker(&WorkerSpec::new(id), KvMode::Events)
            .unwrap();
    }
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    let m = RouterMetrics::new();
    let first: Vec<u32> = (0..64).collect();
    let routed = core
        .route(
            &RouteRequest::new(RequestId(1), &first),
            Duration::ZERO,
            &mut rng,
        )
        .unwrap();
    m.on_routed(&routed, BS);
    let text = m.encode_text();
    assert_eq!(counter(&text, "routed_off_cache_total"), Some(0));
    assert_eq!(counter(&text, "forgone_cached_tokens_total"), Some(0));
    // Half of this prompt is in flight on the busy first worker: the reference's weights send
    // it to the idle one, forgoing those 32 tokens.
    let second: Vec<u32> = (0..32).chain(1000..1032).collect();
    let routed = core
        .route(
            &RouteRequest::new(RequestId(2), &second),
            Duration::ZERO,
            &mut rng,
        )
        .unwrap();
    m.on_routed(&routed, BS);
    let text = m.encode_text();
    assert_eq!(counter(&text, "requests_total"), Some(2));
    assert_eq!(counter(&text, "routed_off_cache_total"), Some(1));
    assert_eq!(counter(&text, "forgone_cached_tokens_total"), Some(32));
}
