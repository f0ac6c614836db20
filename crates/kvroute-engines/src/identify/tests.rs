use serde_json::json;

use super::*;

fn answers(props: Option<Value>, model_info: Option<Value>, models: Option<Value>) -> Answers {
    Answers {
        props,
        model_info,
        models,
    }
}

fn llamacpp() -> Answers {
    answers(
        Some(json!({"default_generation_settings": {"n_ctx": 512}, "total_slots": 1})),
        None,
        Some(json!({"data": [{"id": "tiny", "owned_by": "llamacpp"}]})),
    )
}

fn sglang() -> Answers {
    answers(
        None,
        Some(json!({"model_path": "/models/qwen", "is_generation": true})),
        Some(json!({"data": [{"id": "qwen", "owned_by": "sglang", "max_model_len": 32768}]})),
    )
}

fn vllm() -> Answers {
    answers(
        None,
        None,
        Some(json!({"data": [{"id": "m", "owned_by": "vllm", "max_model_len": 4096}]})),
    )
}

/// What `check` says: "ok found=... ctx=..." or the error.
fn checked(expected: EngineKind, a: &Answers) -> String {
    match check("http://e", expected, a) {
        Ok(id) => format!("ok found={:?} ctx={:?}", id.found, id.context_length),
        Err(e) => e.to_string(),
    }
}

#[test]
fn each_engine_is_recognised_and_its_context_length_learned() {
    assert_eq!(
        checked(EngineKind::Llamacpp, &llamacpp()),
        "ok found=Some(Llamacpp) ctx=Some(512)"
    );
    assert_eq!(
        checked(EngineKind::Sglang, &sglang()),
        "ok found=Some(Sglang) ctx=Some(32768)"
    );
    assert_eq!(
        checked(EngineKind::Vllm, &vllm()),
        "ok found=Some(Vllm) ctx=Some(4096)"
    );
    // Any OpenAI server is an OpenAI server.
    assert_eq!(
        checked(EngineKind::Openai, &llamacpp()),
        "ok found=Some(Llamacpp) ctx=Some(512)"
    );
}

#[test]
fn a_worker_pointed_at_another_kind_of_engine_is_refused_naming_what_was_found() {
    let got = checked(EngineKind::Sglang, &llamacpp());
    assert!(
        got.contains("configured as sglang but answers like llamacpp"),
        "{got}"
    );
    assert!(got.contains("--engine llamacpp"), "{got}");
    let got = checked(EngineKind::Llamacpp, &vllm());
    assert!(got.contains("answers like vllm"), "{got}");
    let got = checked(EngineKind::Trtllm, &sglang());
    assert!(got.contains("answers like sglang"), "{got}");
}

#[test]
fn an_engine_that_does_not_answer_its_own_probe_is_refused() {
    let silent = answers(None, None, None);
    let got = checked(EngineKind::Llamacpp, &silent);
    assert!(got.contains("GET /props did not answer"), "{got}");
    let got = checked(EngineKind::Sglang, &silent);
    assert!(got.contains("GET /get_model_info did not answer"), "{got}");
    // vLLM, TensorRT-LLM and OpenAI servers have no probe of their own to fail.
    assert_eq!(checked(EngineKind::Vllm, &silent), "ok found=None ctx=None");
    assert_eq!(
        checked(EngineKind::Trtllm, &silent),
        "ok found=None ctx=None"
    );
}
