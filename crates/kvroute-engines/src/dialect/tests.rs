//! Request mapping and chunk reading of each dialect, without HTTP. The exchanges the engines
//! really send are in `tests/fixtures/`; these cases pin the field-by-field rules.

use kvroute_protocols::{
    CompletionUsage, FinishReason, OutputOptions, PreprocessedRequest, PromptTokensDetails,
    RoutingHints, SamplingOptions, StopConditions,
};
use kvroute_runtime::{EngineError, WorkerRole};
use serde_json::{Value, json};

use super::{Parsed, Step, Target, check_supported, for_kind, write_token_ids};
use crate::config::EngineKind;
use crate::error::Failure;
use crate::sse::SseEvent;

/// A request that sets every option the dialects map.
fn full_request() -> PreprocessedRequest {
    let mut r = PreprocessedRequest::new("llama", vec![1, 2, 3]);
    r.stop_conditions = StopConditions {
        max_tokens: Some(8),
        stop: Some(vec!["\n\n".to_owned()]),
        stop_token_ids: Some(vec![7]),
        stop_token_ids_hidden: Some(vec![2, 7]),
        min_tokens: Some(2),
        ignore_eos: Some(false),
        max_thinking_tokens: None,
    };
    r.sampling_options = SamplingOptions {
        n: Some(1),
        temperature: Some(0.5),
        top_p: Some(0.9),
        top_k: Some(40),
        min_p: Some(0.05),
        seed: Some(42),
        frequency_penalty: Some(0.25),
        presence_penalty: Some(0.5),
        repetition_penalty: Some(1.25),
        include_stop_str_in_output: Some(true),
        ..SamplingOptions::default()
    };
    r.output_options = OutputOptions {
        logprobs: Some(2),
        skip_special_tokens: Some(false),
        ..OutputOptions::default()
    };
    r.eos_token_ids = vec![2];
    r.extra_args = Some(json!({"cache_salt": "s3cret"}));
    r.routing = Some(RoutingHints {
        dp_rank: Some(1),
        ..RoutingHints::default()
    });
    r
}

/// Checks the JSON body (and extra headers) `kind` sends for `request`.
fn check_body(
    kind: EngineKind,
    request: &PreprocessedRequest,
    model: &str,
    expect: Value,
    headers: &[(&str, &str)],
) {
    let target = Target {
        model,
        max_tokens: request.stop_conditions.max_tokens,
        role: WorkerRole::Aggregated,
    };
    let built = for_kind(kind).build(request, &target).expect("builds");
    let body: Value = serde_json::from_slice(&built.body).expect("json body");
    assert_eq!(body, expect, "{kind} body");
    let got: Vec<(&str, &str)> = built
        .headers
        .iter()
        .map(|(k, v)| (*k, v.as_str()))
        .collect();
    assert_eq!(got, headers, "{kind} headers");
}

#[test]
fn vllm_body_maps_every_option() {
    check_body(
        EngineKind::Vllm,
        &full_request(),
        "llama",
        json!({
            "model": "llama", "prompt": [1, 2, 3], "max_tokens": 8,
            "stream": true, "stream_options": {"include_usage": true},
            "temperature": 0.5, "top_p": 0.9, "top_k": 40,
            "min_p": 0.05, "seed": 42, "frequency_penalty": 0.25,
            "presence_penalty": 0.5, "repetition_penalty": 1.25, "stop": ["\n\n"],
            "stop_token_ids": [7, 2], "min_tokens": 2, "ignore_eos": false,
            "include_stop_str_in_output": true, "skip_special_tokens": false, "logprobs": 2,
            "return_token_ids": true, "cache_salt": "s3cret"
        }),
        &[("x-data-parallel-rank", "1")],
    );
}

#[test]
fn trtllm_body_asks_for_ids_and_sends_no_vllm_fields() {
    check_body(
        EngineKind::Trtllm,
        &full_request(),
        "llama",
        json!({
            "model": "llama", "prompt": [1, 2, 3], "max_tokens": 8,
            "stream": true, "stream_options": {"include_usage": true},
            "temperature": 0.5, "top_p": 0.9, "top_k": 40,
            "min_p": 0.05, "seed": 42, "frequency_penalty": 0.25,
            "presence_penalty": 0.5, "repetition_penalty": 1.25, "stop": ["\n\n"],
            "stop_token_ids": [7, 2], "min_tokens": 2, "ignore_eos": false,
            "include_stop_str_in_output": true, "skip_special_tokens": false, "logprobs": 2,
            "detokenize": false
        }),
        &[],
    );
}

#[test]
fn openai_body_has_standard_fields_only() {
    check_body(
        EngineKind::Openai,
        &full_request(),
        "llama",
        json!({
            "model": "llama", "prompt": [1, 2, 3], "max_tokens": 8,
            "stream": true, "stream_options": {"include_usage": true},
            "temperature": 0.5, "top_p": 0.9, "seed": 42,
            "frequency_penalty": 0.25, "presence_penalty": 0.5, "stop": ["\n\n"],
            "logprobs": 2
        }),
        &[],
    );
}

#[test]
fn sglang_body_uses_the_contract_names() {
    check_body(
        EngineKind::Sglang,
        &full_request(),
        "llama",
        json!({
            "input_ids": [1, 2, 3],
            "sampling_params": {
                "max_new_tokens": 8, "min_new_tokens": 2, "stop": ["\n\n"],
                "stop_token_ids": [7, 2], "ignore_eos": false, "no_stop_trim": true,
                "temperature": 0.5, "top_p": 0.9, "top_k": 40,
                "min_p": 0.05, "frequency_penalty": 0.25,
                "presence_penalty": 0.5, "repetition_penalty": 1.25, "sampling_seed": 42,
                "skip_special_tokens": false
            },
            "stream": true, "return_logprob": true, "top_logprobs_num": 2,
            "routed_dp_rank": 1, "cache_salt": "s3cret"
        }),
        &[],
    );
}

#[test]
fn llamacpp_body_uses_the_native_names() {
    check_body(
        EngineKind::Llamacpp,
        &full_request(),
        "llama",
        json!({
            "model": "llama", "prompt": [1, 2, 3], "n_predict": 8, "stream": true,
            "return_tokens": true, "cache_prompt": true, "temperature": 0.5,
            "top_p": 0.9, "top_k": 40, "min_p": 0.05,
            "seed": 42, "stop": ["\n\n"], "ignore_eos": false, "repeat_penalty": 1.25,
            "presence_penalty": 0.5, "frequency_penalty": 0.25, "n_probs": 2
        }),
        &[],
    );
}

#[test]
fn minimal_requests_send_only_what_is_required() {
    let r = PreprocessedRequest::new("", vec![5]);
    let completions = |extra: Value| {
        let mut v =
            json!({"prompt": [5], "stream": true, "stream_options": {"include_usage": true}});
        v.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        v
    };
    check_body(
        EngineKind::Vllm,
        &r,
        "",
        completions(json!({"return_token_ids": true})),
        &[],
    );
    // trtllm-serve requires `model`.
    check_body(
        EngineKind::Trtllm,
        &r,
        "",
        completions(json!({"model": "", "detokenize": false})),
        &[],
    );
    check_body(EngineKind::Openai, &r, "", completions(json!({})), &[]);
    check_body(
        EngineKind::Sglang,
        &r,
        "",
        json!({"input_ids": [5], "sampling_params": {}, "stream": true}),
        &[],
    );
    check_body(
        EngineKind::Llamacpp,
        &r,
        "",
        json!({"prompt": [5], "stream": true, "return_tokens": true, "cache_prompt": true}),
        &[],
    );
}

#[test]
fn ignore_eos_leaves_hidden_stop_ids_out() {
    let mut r = PreprocessedRequest::new("m", vec![5]);
    r.stop_conditions.stop_token_ids_hidden = Some(vec![2]);
    r.stop_conditions.ignore_eos = Some(true);
    let target = Target {
        model: "m",
        max_tokens: None,
        role: WorkerRole::Aggregated,
    };
    let body: Value =
        serde_json::from_slice(&for_kind(EngineKind::Vllm).build(&r, &target).unwrap().body)
            .unwrap();
    assert_eq!(body.get("stop_token_ids"), None);
    assert_eq!(body["ignore_eos"], json!(true));
}

#[test]
fn cache_salt_goes_to_vllm_and_sglang_only_and_only_as_a_string() {
    let mut r = PreprocessedRequest::new("m", vec![5]);
    r.extra_args = Some(json!({"cache_salt": 7}));
    let target = Target {
        model: "m",
        max_tokens: None,
        role: WorkerRole::Aggregated,
    };
    let vllm = |r: &PreprocessedRequest| -> Value {
        serde_json::from_slice(&for_kind(EngineKind::Vllm).build(r, &target).unwrap().body).unwrap()
    };
    assert_eq!(vllm(&r).get("cache_salt"), None, "a number is no salt");
    r.extra_args = Some(json!({"cache_salt": "x"}));
    assert_eq!(vllm(&r)["cache_salt"], json!("x"));
    let sglang: Value = serde_json::from_slice(
        &for_kind(EngineKind::Sglang)
            .build(&r, &target)
            .unwrap()
            .body,
    )
    .unwrap();
    assert_eq!(
        sglang["cache_salt"],
        json!("x"),
        "SGLang salts its cache too"
    );
    for kind in [EngineKind::Trtllm, EngineKind::Openai, EngineKind::Llamacpp] {
        let body = String::from_utf8(for_kind(kind).build(&r, &target).unwrap().body).unwrap();
        assert!(!body.contains("cache_salt"), "{kind}: {body}");
    }
}

#[test]
fn several_sequences_or_beam_search_are_refused() {
    let refused = |f: fn(&mut SamplingOptions)| {
        let mut r = PreprocessedRequest::new("m", vec![5]);
        f(&mut r.sampling_options);
        match check_supported(&r) {
            Err(EngineError::Rejected { message }) => message,
            other => panic!("expected a rejection, got {other:?}"),
        }
    };
    assert!(refused(|s| s.n = Some(2)).contains("n = 2"));
    assert!(refused(|s| s.best_of = Some(3)).contains("best_of = 3"));
    assert!(refused(|s| s.use_beam_search = Some(true)).contains("beam"));
    let mut ok = PreprocessedRequest::new("m", vec![5]);
    ok.sampling_options.n = Some(1);
    assert_eq!(check_supported(&ok), Ok(()));
}

/// Runs `chunks` (SSE data payloads, or `error:` payloads prefixed with `ERROR `) through
/// `kind`'s parser for `request` and checks what each means.
fn check_parse(
    kind: EngineKind,
    request: &PreprocessedRequest,
    chunks: &[&str],
    expect: &[Parsed],
) {
    let mut parser = for_kind(kind).parser(request);
    let got: Vec<Parsed> = chunks
        .iter()
        .map(|c| match c.strip_prefix("ERROR ") {
            Some(e) => parser.parse(SseEvent::Error(e.to_owned())),
            None => parser.parse(SseEvent::Data((*c).to_owned())),
        })
        .collect();
    assert_eq!(got, expect, "{kind}");
}

fn ids(ids: &[u32]) -> Parsed {
    Parsed::Step(Step {
        token_ids: ids.to_vec(),
        ..Step::default()
    })
}

fn finish(ids: &[u32], finish: FinishReason, usage: Option<CompletionUsage>) -> Parsed {
    Parsed::Step(Step {
        token_ids: ids.to_vec(),
        finish: Some(finish),
        usage,
        ..Step::default()
    })
}

/// A last step: the stream ends with it.
fn last(ids: &[u32], finish: FinishReason, usage: Option<CompletionUsage>) -> Parsed {
    match self::finish(ids, finish, usage) {
        Parsed::Step(step) => Parsed::Last(step),
        other => other,
    }
}

fn usage(prompt: u32, completion: u32, cached: Option<u32>) -> CompletionUsage {
    CompletionUsage {
        prompt_tokens: prompt,
        completion_tokens: completion,
        total_tokens: prompt + completion,
        prompt_tokens_details: cached.map(|c| PromptTokensDetails {
            audio_tokens: None,
            cached_tokens: Some(c),
        }),
    }
}

fn eos_request() -> PreprocessedRequest {
    let mut r = PreprocessedRequest::new("m", vec![1, 2, 3]);
    r.eos_token_ids = vec![2];
    r
}

#[test]
fn completions_finish_reasons() {
    let r = eos_request();
    let chunk = |reason: &str, stop_reason: Value| {
        json!({"choices": [{"index": 0, "text": "", "token_ids": [], "finish_reason": reason,
            "stop_reason": stop_reason}]})
        .to_string()
    };
    let cases = [
        (chunk("stop", Value::Null), FinishReason::Eos),
        (chunk("stop", json!(2)), FinishReason::Eos),
        (chunk("stop", json!(9)), FinishReason::Stop),
        (chunk("stop", json!("\n")), FinishReason::Stop),
        (chunk("length", Value::Null), FinishReason::Length),
        (chunk("abort", Value::Null), FinishReason::Cancelled),
        (chunk("repetition", Value::Null), FinishReason::Stop),
    ];
    for (chunk, reason) in cases {
        check_parse(
            EngineKind::Vllm,
            &r,
            &[&chunk],
            &[finish(&[], reason, None)],
        );
    }
    // A plain OpenAI server has no `stop_reason`: `stop` cannot tell an end token apart.
    check_parse(
        EngineKind::Openai,
        &r,
        &[&chunk("stop", Value::Null)],
        &[Parsed::Step(Step {
            finish: Some(FinishReason::Stop),
            ..Step::default()
        })],
    );
}

#[test]
fn completions_chunks() {
    let r = eos_request();
    check_parse(
        EngineKind::Vllm,
        &r,
        &[
            r#"{"choices":[{"index":0,"text":" Hi","token_ids":[11],"prompt_token_ids":[1,2,3],"finish_reason":null,"stop_reason":null}]}"#,
            // A token that ends inside a character: vLLM holds its text back.
            r#"{"choices":[{"index":0,"text":"","token_ids":[240],"finish_reason":null}]}"#,
            r#"{"choices":[{"index":0,"text":"","token_ids":[],"finish_reason":null}]}"#,
            r#"{"choices":[],"usage":{"prompt_tokens":3,"total_tokens":4,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":2}}}"#,
            "[DONE]",
        ],
        &[
            // vLLM's own text goes along with the ids (the router relays it).
            Parsed::Step(Step {
                token_ids: vec![11],
                text: Some(" Hi".to_owned()),
                ..Step::default()
            }),
            Parsed::Step(Step {
                token_ids: vec![240],
                text: Some(String::new()),
                ..Step::default()
            }),
            Parsed::Nothing,
            Parsed::Step(Step {
                usage: Some(usage(3, 1, Some(2))),
                ..Step::default()
            }),
            Parsed::Done,
        ],
    );
    // TensorRT-LLM with `detokenize: false` streams empty text beside the ids: ids only.
    check_parse(
        EngineKind::Trtllm,
        &r,
        &[r#"{"choices":[{"index":0,"text":"","token_ids":[11],"finish_reason":null}]}"#],
        &[ids(&[11])],
    );
    // Text only, with log probabilities.
    check_parse(
        EngineKind::Openai,
        &r,
        &[
            r#"{"choices":[{"index":0,"text":" Hi","logprobs":{"token_logprobs":[-0.5,null]},"finish_reason":null}]}"#,
        ],
        &[Parsed::Step(Step {
            text: Some(" Hi".to_owned()),
            log_probs: Some(vec![-0.5, -9999.0]),
            ..Step::default()
        })],
    );
}

#[test]
fn the_echoed_prompt_ids_are_cut_out_before_parsing_and_nothing_else_is() {
    use super::completions::skip_prompt_token_ids;
    let cut = |s: &str| {
        let mut s = s.to_owned();
        skip_prompt_token_ids(&mut s);
        s
    };
    // vLLM's own spacing and a pretty-printed one: the array becomes `null`, all else stays.
    assert_eq!(
        cut(r#"{"choices":[{"text":"a","prompt_token_ids":[1,22,333],"token_ids":[4]}]}"#),
        r#"{"choices":[{"text":"a","prompt_token_ids":null,"token_ids":[4]}]}"#
    );
    assert_eq!(
        cut("{\"prompt_token_ids\" :\n [ 1,\n\t2 ], \"x\": [5]}"),
        "{\"prompt_token_ids\" :\n null, \"x\": [5]}"
    );
    assert_eq!(
        cut(r#"{"prompt_token_ids":[]}"#),
        r#"{"prompt_token_ids":null}"#
    );
    // Anything but an array of plain numbers is left for the parser to judge.
    for untouched in [
        r#"{"prompt_token_ids":null,"token_ids":[4]}"#,
        r#"{"prompt_token_ids":[1,"2"],"token_ids":[4]}"#,
        r#"{"prompt_token_ids":[1,[2]],"token_ids":[4]}"#,
        r#"{"prompt_token_ids":[-1,2.5]}"#,
        r#"{"prompt_token_ids":[1,2"#,
        r#"{"prompt_token_ids""#,
        r#"{"text":"prompt_token_ids: [1]","token_ids":[4]}"#,
        r#"{"text":"\"prompt_token_ids\":[1]"}"#,
    ] {
        assert_eq!(cut(untouched), untouched);
    }
    // A long echo parses to exactly what the chunk without it does.
    let r = eos_request();
    let echo: Vec<String> = (0..20_000)
        .map(|i| (i * 7919 % 128_000).to_string())
        .collect();
    let with_echo = format!(
        r#"{{"choices":[{{"index":0,"text":" Hi","prompt_token_ids":[{}],"token_ids":[11],"finish_reason":null}}]}}"#,
        echo.join(",")
    );
    let plain = r#"{"choices":[{"index":0,"text":" Hi","token_ids":[11],"finish_reason":null}]}"#;
    let expect = for_kind(EngineKind::Vllm)
        .parser(&r)
        .parse(SseEvent::Data(plain.to_owned()));
    assert!(matches!(expect, Parsed::Step(ref s) if s.token_ids == [11]));
    let mut parser = for_kind(EngineKind::Vllm).parser(&r);
    assert_eq!(parser.parse(SseEvent::Data(with_echo)), expect);
    // A chunk that is not JSON is refused whether or not it holds the key.
    assert!(matches!(
        parser.parse(SseEvent::Data(
            r#"{"prompt_token_ids":[1,2],"choices":"#.to_owned()
        )),
        Parsed::Failed(Failure::Malformed(_))
    ));
}

#[test]
fn completions_errors_are_sorted_by_code() {
    let r = eos_request();
    check_parse(
        EngineKind::Vllm,
        &r,
        &[
            r#"{"error":{"message":"Internal server error","type":"InternalServerError","param":null,"code":500}}"#,
            r#"{"error":{"message":"KV load failed","type":"ServiceUnavailableError","code":503}}"#,
            r#"{"choices":[{"index":1,"text":"x"}]}"#,
            r#"{"id":"x"}"#,
            "not json",
        ],
        &[
            Parsed::Failed(Failure::Refused(
                "vllm engine error 500: Internal server error".to_owned(),
            )),
            Parsed::Failed(Failure::Unavailable(
                "vllm engine reported error 503 mid-stream: KV load failed".to_owned(),
            )),
            Parsed::Failed(Failure::Malformed(
                "malformed vllm stream chunk: a choice with index 1 or several choices; \
                 expected one choice, index 0 (n = 1)"
                    .to_owned(),
            )),
            Parsed::Failed(Failure::Malformed(
                "malformed vllm stream chunk: a chunk with neither `choices`, `usage` nor `error`"
                    .to_owned(),
            )),
            Parsed::Failed(Failure::Malformed(
                "malformed vllm stream chunk: expected ident at line 1 column 2; expected a \
                 completions chunk, got not json"
                    .to_owned(),
            )),
        ],
    );
}

#[test]
fn sglang_reads_cumulative_and_incremental_output() {
    let r = eos_request();
    let chunk = |ids: &[u32], total: u32, finish: Value| {
        json!({"text": "", "output_ids": ids, "meta_info": {"id": "x", "prompt_tokens": 3,
            "completion_tokens": total, "cached_tokens": 1, "finish_reason": finish}})
        .to_string()
    };
    let stop_eos = json!({"type": "stop", "matched": 2});
    // The default: every chunk repeats the whole output.
    let cumulative = [
        chunk(&[10], 1, Value::Null),
        chunk(&[10, 11, 12], 3, Value::Null),
        chunk(&[10, 11, 12, 2], 4, stop_eos.clone()),
    ];
    // `--incremental-streaming-output`: only the new ids.
    let incremental = [
        chunk(&[10], 1, Value::Null),
        chunk(&[11, 12], 3, Value::Null),
        chunk(&[2], 4, stop_eos),
    ];
    let expect = [
        ids(&[10]),
        ids(&[11, 12]),
        finish(&[2], FinishReason::Eos, Some(usage(3, 4, Some(1)))),
    ];
    for chunks in [cumulative, incremental] {
        let chunks: Vec<&str> = chunks.iter().map(String::as_str).collect();
        check_parse(EngineKind::Sglang, &r, &chunks, &expect);
    }
}

#[test]
fn sglang_without_running_total_tells_modes_by_prefix() {
    let r = eos_request();
    check_parse(
        EngineKind::Sglang,
        &r,
        &[
            r#"{"output_ids":[10,11]}"#,
            r#"{"output_ids":[10,11,12]}"#,
            r#"{"output_ids":[13]}"#,
        ],
        &[ids(&[10, 11]), ids(&[12]), ids(&[13])],
    );
}

#[test]
fn sglang_finish_reasons() {
    let r = eos_request();
    let chunk = |finish: Value| {
        json!({"output_ids": [], "meta_info": {"prompt_tokens": 3, "completion_tokens": 0,
            "cached_tokens": 0, "finish_reason": finish}})
        .to_string()
    };
    let done = |reason| finish(&[], reason, Some(usage(3, 0, Some(0))));
    let cases = [
        (
            json!({"type": "length", "length": 8}),
            done(FinishReason::Length),
        ),
        (
            json!({"type": "stop", "matched": 9}),
            done(FinishReason::Stop),
        ),
        (
            json!({"type": "stop", "matched": "\n"}),
            done(FinishReason::Stop),
        ),
        (
            json!({"type": "abort", "message": "Aborted"}),
            done(FinishReason::Cancelled),
        ),
        (
            json!({"type": "abort", "message": "too long", "status_code": 400}),
            Parsed::Failed(Failure::Refused(
                "sglang engine aborted the request with status 400: too long".to_owned(),
            )),
        ),
        (
            json!({"type": "abort", "message": "overloaded", "status_code": 503}),
            Parsed::Failed(Failure::Unavailable(
                "sglang engine aborted the request with status 503: overloaded".to_owned(),
            )),
        ),
    ];
    for (reason, expect) in cases {
        check_parse(EngineKind::Sglang, &r, &[&chunk(reason)], &[expect]);
    }
}

#[test]
fn sglang_logprobs_follow_the_new_ids() {
    let r = eos_request();
    let chunk = |ids: &[u32], lps: Value| {
        json!({"output_ids": ids, "meta_info": {"completion_tokens": ids.len(),
            "output_token_logprobs": lps}})
        .to_string()
    };
    check_parse(
        EngineKind::Sglang,
        &r,
        &[
            &chunk(&[10], json!([[-0.5, 10, null]])),
            &chunk(&[10, 11], json!([[-0.5, 10, null], [-1.5, 11, null]])),
        ],
        &[
            Parsed::Step(Step {
                token_ids: vec![10],
                log_probs: Some(vec![-0.5]),
                ..Step::default()
            }),
            Parsed::Step(Step {
                token_ids: vec![11],
                log_probs: Some(vec![-1.5]),
                ..Step::default()
            }),
        ],
    );
}

#[test]
fn llamacpp_chunks() {
    let r = eos_request();
    let final_chunk = r#"{"index":0,"content":"","tokens":[],"stop":true,"stop_type":"limit","tokens_predicted":2,"tokens_evaluated":3,"truncated":false,"timings":{"cache_n":2,"prompt_n":1}}"#;
    check_parse(
        EngineKind::Llamacpp,
        &r,
        &[
            r#"{"index":0,"content":" Hi","tokens":[10],"stop":false}"#,
            r#"{"index":0,"content":"!","tokens":[11],"stop":false}"#,
            final_chunk,
        ],
        &[
            ids(&[10]),
            ids(&[11]),
            last(&[], FinishReason::Length, Some(usage(3, 2, Some(2)))),
        ],
    );
    // Older servers repeat the whole output in the last chunk.
    let old_last = r#"{"content":" Hi!","tokens":[10,11],"stop":true,"stop_type":"eos","tokens_predicted":2,"tokens_evaluated":3}"#;
    check_parse(
        EngineKind::Llamacpp,
        &r,
        &[
            r#"{"content":" Hi","tokens":[10],"stop":false}"#,
            r#"{"content":"!","tokens":[11],"stop":false}"#,
            old_last,
        ],
        &[
            ids(&[10]),
            ids(&[11]),
            last(&[], FinishReason::Eos, Some(usage(3, 2, None))),
        ],
    );
}

#[test]
fn llamacpp_stops_on_stop_token_ids_itself() {
    let mut r = eos_request();
    r.stop_conditions.stop_token_ids = Some(vec![13]);
    check_parse(
        EngineKind::Llamacpp,
        &r,
        &[
            r#"{"content":"a","tokens":[10],"stop":false}"#,
            r#"{"content":"b","tokens":[11,13,14],"stop":false}"#,
        ],
        &[
            ids(&[10]),
            last(&[11], FinishReason::Stop, Some(usage(3, 2, None))),
        ],
    );
}

#[test]
fn llamacpp_errors() {
    let r = eos_request();
    check_parse(
        EngineKind::Llamacpp,
        &r,
        &[
            r#"ERROR {"code":500,"message":"slot failed","type":"server_error"}"#,
            r#"{"error":{"code":503,"message":"Loading model","type":"unavailable_error"}}"#,
        ],
        &[
            Parsed::Failed(Failure::Refused(
                "llamacpp engine error 500: slot failed".to_owned(),
            )),
            Parsed::Failed(Failure::Unavailable(
                "llamacpp engine reported error 503 mid-stream: Loading model".to_owned(),
            )),
        ],
    );
}

/// The prompt's ids are written by hand (`write_token_ids`); they must read back as the same
/// numbers serde writes, at every digit count, and appended after what the buffer held.
#[test]
fn token_ids_are_written_as_serde_writes_them() {
    let mut edges = vec![
        0u32,
        1,
        9,
        10,
        11,
        99,
        100,
        101,
        999,
        1_000,
        65_535,
        151_643,
        u32::MAX,
    ];
    edges.extend((0..10).map(|d| 10u32.pow(d)));
    edges.extend((1..10).map(|d| 10u32.pow(d) - 1));
    // Numbers of every length, scattered.
    edges.extend((0..2_000u32).map(|i| i.wrapping_mul(2_654_435_761) >> (i % 32)));
    for ids in [&edges[..], &edges[..1], &[][..], &[7][..], &[0, 0][..]] {
        let mut out = b"[".to_vec();
        write_token_ids(&mut out, ids);
        out.push(b']');
        assert_eq!(
            String::from_utf8(out).unwrap(),
            serde_json::to_string(ids).unwrap(),
            "ids {ids:?}"
        );
    }
    let mut out = b"{\"prompt\":[".to_vec();
    write_token_ids(&mut out, &[12, 3]);
    assert_eq!(out, b"{\"prompt\":[12,3");
}
