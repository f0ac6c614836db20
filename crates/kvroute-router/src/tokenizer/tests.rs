use super::*;
use crate::tokenizer::fixtures::WORD_LEVEL;

fn check_mock_encode(text: &str, expect_len: usize) {
    let ids = MockTokenizer.encode(text).unwrap();
    assert_eq!(ids.len(), expect_len, "{text:?}");
    assert!(
        ids.iter()
            .all(|&id| (MOCK_FIRST_WORD_ID..MOCK_VOCAB_SIZE).contains(&id))
    );
}

#[test]
fn mock_tokenizer_is_one_id_per_word_and_deterministic() {
    check_mock_encode("", 0);
    check_mock_encode("hello", 1);
    check_mock_encode("  hello \n world\t again ", 3);
    let a = MockTokenizer.encode("the quick brown fox").unwrap();
    let b = MockTokenizer.encode("the quick brown dog").unwrap();
    assert_eq!(a[..3], b[..3], "shared words give shared leading ids");
    assert_ne!(a[3], b[3]);
    assert_eq!(a, MockTokenizer.encode("the  quick brown fox").unwrap());
}

#[test]
fn mock_decode_renders_words_and_skips_specials() {
    assert_eq!(MockTokenizer::render_id(0), "ba");
    assert_eq!(MockTokenizer::render_id(69), "zu");
    assert_eq!(MockTokenizer::render_id(70), "beba");
    assert_eq!(
        MockTokenizer.decode(&[MOCK_EOS_TOKEN_ID, 70, 71]).unwrap(),
        "beba bebe"
    );
}

#[test]
fn incremental_detokenizer_concatenates_to_the_full_decode() {
    let ids = MockTokenizer.encode("one two three four").unwrap();
    let mut detok = IncrementalDetokenizer::new();
    let mut text = String::new();
    for chunk in ids.chunks(1) {
        text.push_str(&detok.push(&MockTokenizer, chunk).unwrap());
    }
    assert_eq!(text, MockTokenizer.decode(&ids).unwrap());
    assert_eq!(text.split(' ').count(), 4);
}

#[test]
fn ids_the_engine_rendered_are_context_for_ids_decoded_after_them() {
    let ids = MockTokenizer.encode("one two three four").unwrap();
    let (rendered, rest) = ids.split_at(2);
    let continue_after = |detok: &mut IncrementalDetokenizer| -> String {
        rest.chunks(1)
            .map(|chunk| detok.push(&MockTokenizer, chunk).unwrap())
            .collect()
    };
    let whole = MockTokenizer.decode(&ids).unwrap();
    let before = MockTokenizer.decode(rendered).unwrap();
    // The engine rendered the first two itself; the rest comes as ids alone and continues the
    // text exactly, the space between the two included.
    let mut detok = IncrementalDetokenizer::new();
    detok.skip(rendered);
    let after = continue_after(&mut detok);
    assert_eq!(format!("{before}{after}"), whole);
    assert!(after.starts_with(' '), "{after:?}");
    // Without that context the continuation would lose the space.
    let alone = continue_after(&mut IncrementalDetokenizer::new());
    assert_eq!(alone, after.trim_start());
}

#[test]
fn mock_chat_template_tags_roles_and_opens_the_assistant_turn() {
    let messages = [
        TemplateMessage {
            role: "system".into(),
            content: "be brief".into(),
        },
        TemplateMessage {
            role: "user".into(),
            content: "hi".into(),
        },
    ];
    let t = ChatTemplate::mock();
    assert_eq!(
        t.render(&messages, true).unwrap(),
        "<|system|> be brief\n<|user|> hi\n<|assistant|>"
    );
    assert_eq!(
        t.render(&messages, false).unwrap(),
        "<|system|> be brief\n<|user|> hi\n"
    );
}

#[test]
fn hf_style_template_sees_bos_and_can_raise() {
    let source = "{{ bos_token }}{% for m in messages %}{% if m.role == 'tool' %}\
        {{ raise_exception('no tools') }}{% endif %}[{{ m.role }}]{{ m.content }}{% endfor %}";
    let t = ChatTemplate::new(source, "<s>", "</s>").unwrap();
    let user = TemplateMessage {
        role: "user".into(),
        content: "x".into(),
    };
    assert_eq!(
        t.render(std::slice::from_ref(&user), true).unwrap(),
        "<s>[user]x"
    );
    let tool = TemplateMessage {
        role: "tool".into(),
        content: "x".into(),
    };
    let err = t.render(&[tool], true).unwrap_err();
    assert!(err.to_string().contains("no tools"), "{err}");
    assert!(matches!(
        ChatTemplate::new("{% for %}", "", ""),
        Err(TokenizerError::Template(_))
    ));
}

#[test]
fn hf_tokenizer_loads_tokenizer_json_with_the_pure_rust_regex() {
    let t = HfTokenizer::from_bytes(WORD_LEVEL.as_bytes()).unwrap();
    assert_eq!(t.encode("hello world!").unwrap(), vec![1, 2, 3]);
    assert_eq!(t.encode("hello there").unwrap(), vec![1, 0]);
    assert_eq!(t.decode(&[1, 2]).unwrap(), "hello world");
    assert_eq!(t.token_to_id("world"), Some(2));
    assert!(matches!(
        HfTokenizer::from_bytes(b"{}"),
        Err(TokenizerError::Load { .. })
    ));
    assert!(matches!(
        HfTokenizer::from_file(Path::new("/nonexistent/tokenizer.json")),
        Err(TokenizerError::Load { .. })
    ));
}
