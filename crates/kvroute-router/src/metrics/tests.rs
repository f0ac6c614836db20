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
