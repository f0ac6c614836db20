//! Robustness: arbitrary bodies and routing headers thrown at `/v1/chat/completions` and
//! `/v1/completions` of one in-process server never get a 5xx, a panic or leaked load. A 4xx
//! answer carries an OpenAI error JSON, a 2xx whole answer has `choices`, a streamed 2xx answer
//! ends with `[DONE]` and no error event.

use std::collections::BTreeMap;
use std::time::Duration;

use futures::StreamExt;
use kvroute_router::Policy;
use kvroute_router::http::HttpConfig;
use kvroute_router::tokenizer::MockTokenizer;
use parking_lot::Mutex;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use serde_json::{Map, Value, json};

use super::{Server, test_config};
use crate::support::{Behaviour, Fleet, eventually, idle};

const CHAT: &str = "/v1/chat/completions";
const COMPLETIONS: &str = "/v1/completions";

/// The longest prompt (and `max_tokens`) served, and the largest body.
const MAX_PROMPT_TOKENS: usize = 1000;
const MAX_BODY_BYTES: usize = 64 * 1024;

/// The most bytes read of one answer.
const MAX_ANSWER_BYTES: usize = 4 << 20;

/// One request: the endpoint, the raw body, the extra headers.
#[derive(Debug, Clone)]
struct Input {
    path: &'static str,
    body: Vec<u8>,
    headers: Vec<(&'static str, String)>,
}

fn path() -> impl Strategy<Value = &'static str> {
    prop_oneof![Just(CHAT), Just(COMPLETIONS)]
}

/// Short text: plain words, arbitrary printable unicode, or nothing.
fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => "[a-z]{1,8}( [a-z]{1,8}){0,4}",
        2 => "\\PC{0,24}",
        1 => Just(String::new()),
    ]
}

/// A very long string: beyond the prompt limit in words, or beyond the body limit in bytes.
fn long_text() -> impl Strategy<Value = String> {
    prop_oneof![
        (1..1500usize).prop_map(|n| "w ".repeat(n)),
        (MAX_BODY_BYTES - 100..MAX_BODY_BYTES + 4096).prop_map(|n| "x".repeat(n)),
    ]
}

/// An arbitrary JSON value (small).
fn any_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>()
            .prop_filter("JSON has no NaN or infinity", |f| f.is_finite())
            .prop_map(Value::from),
        text().prop_map(Value::String),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::vec(("[a-z_]{0,10}", inner), 0..4)
                .prop_map(|kv| Value::Object(kv.into_iter().collect::<Map<_, _>>())),
        ]
    })
}

/// A value of the wrong type or out of range for most fields.
fn weird() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(json!(null)),
        Just(json!(true)),
        Just(json!(0)),
        Just(json!(-1)),
        Just(json!(1.5)),
        Just(json!(-1e300)),
        Just(json!(1e300)),
        Just(json!(u64::MAX)),
        Just(json!(i64::MIN)),
        Just(json!(u32::MAX)),
        Just(json!("NaN")),
        Just(json!("Infinity")),
        Just(json!("-1")),
        Just(json!([])),
        Just(json!({})),
        Just(json!([[[1]]])),
        Just(json!({"a": {"b": {"c": []}}})),
        text().prop_map(Value::String),
        long_text().prop_map(Value::String),
        any_json(),
    ]
}

/// A worker id or dp rank as JSON: mostly plausible, sometimes not.
fn id_value() -> impl Strategy<Value = Value> {
    prop_oneof![
        3 => (0..5u64).prop_map(Value::from),
        1 => any::<u64>().prop_map(Value::from),
        1 => Just(json!(u32::MAX)),
        1 => weird(),
    ]
}

fn session_control() -> impl Strategy<Value = Value> {
    let action = prop_oneof![
        Just(json!("open")),
        Just(json!("close")),
        Just(json!("bind")),
        Just(Value::Null),
        text().prop_map(Value::String),
        weird(),
    ];
    let id = prop_oneof![
        3 => "[a-z0-9-]{1,12}".prop_map(Value::String),
        1 => Just(json!("")),
        1 => (250..300usize).prop_map(|n| Value::String("s".repeat(n))),
        1 => weird(),
    ];
    let timeout = prop_oneof![
        Just(None),
        Just(Some(json!(0))),
        (1..1000u64).prop_map(|t| Some(json!(t))),
        any::<u64>().prop_map(|t| Some(json!(t))),
        weird().prop_map(Some),
    ];
    (id, action, timeout).prop_map(|(id, action, timeout)| {
        let mut s = json!({"session_id": id, "action": action});
        if let Some(t) = timeout {
            s["timeout"] = t;
        }
        s
    })
}

/// One `nvext` field set to something plausible or not.
fn nvext_field() -> impl Strategy<Value = (String, Value)> {
    let known = |name: &'static str| name.to_owned();
    prop_oneof![
        id_value().prop_map(move |v| (known("backend_instance_id"), v)),
        id_value().prop_map(move |v| (known("decode_worker_id"), v)),
        id_value().prop_map(move |v| (known("prefill_worker_id"), v)),
        id_value().prop_map(move |v| (known("dp_rank"), v)),
        id_value().prop_map(move |v| (known("prefill_dp_rank"), v)),
        session_control().prop_map(move |v| (known("session_control"), v)),
        prop::collection::vec(
            prop_oneof![Just("query_instance_id:".to_owned()), text(), long_text()],
            0..3
        )
        .prop_map(move |a| (known("annotations"), json!(a))),
        prop::collection::vec(
            prop_oneof![
                Just("worker_id".to_owned()),
                Just("timing".to_owned()),
                text()
            ],
            0..3
        )
        .prop_map(move |a| (known("extra_fields"), json!(a))),
        prop::collection::vec(any::<u32>(), 0..40)
            .prop_map(move |t| (known("token_data"), json!(t))),
        (0..1200usize).prop_map(move |n| (known("token_data"), json!(vec![7u32; n]))),
        (
            prop::option::of(any::<i32>()),
            prop::option::of(any::<u32>()),
            prop::option::of(any::<bool>()),
            prop::option::of(-1e9..1e9f64),
        )
            .prop_map(move |(p, osl, spec, lat)| (
                known("agent_hints"),
                json!({"priority": p, "osl": osl, "speculative_prefill": spec,
                       "latency_sensitivity": lat})
            )),
        (0.0..1e13f64).prop_map(move |t| (known("request_timestamp_ms"), json!(t))),
        any_json().prop_map(move |v| (known("routing_constraints"), v)),
        any::<bool>().prop_map(move |b| (known("use_raw_prompt"), json!(b))),
        any::<bool>().prop_map(move |b| (known("greed_sampling"), json!(b))),
        ("[a-z_]{1,12}", any_json()),
        (
            prop_oneof![
                Just("backend_instance_id"),
                Just("dp_rank"),
                Just("session_control"),
                Just("annotations"),
                Just("token_data"),
                Just("agent_hints"),
                Just("extra_fields"),
            ],
            weird()
        )
            .prop_map(|(k, v)| (k.to_owned(), v)),
    ]
}

/// The top-level fields a mutation touches (both endpoints' and a few unknown ones).
const FIELDS: &[&str] = &[
    "model",
    "messages",
    "prompt",
    "stream",
    "stream_options",
    "max_tokens",
    "max_completion_tokens",
    "min_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "stop",
    "n",
    "ignore_eos",
    "include_stop_str_in_output",
    "cache_salt",
    "nvext",
    "logprobs",
    "top_logprobs",
    "tools",
    "tool_choice",
    "response_format",
    "echo",
    "best_of",
    "suffix",
    "logit_bias",
    "user",
    "totally_unknown",
];

/// One change to a valid request.
#[derive(Debug, Clone)]
enum Mutation {
    /// Sets a top-level field.
    Top(&'static str, Value),
    /// Sets a field of `nvext` (made an object first).
    NvExt(String, Value),
    /// Sets a field of the first message (chat) or replaces the prompt (completions).
    Message(&'static str, Value),
    /// Sets `messages` / `prompt` to an empty array.
    Empty,
    /// Wraps the conversation / prompt one level deeper.
    Nest,
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        3 => (prop::sample::select(FIELDS), weird()).prop_map(|(f, v)| Mutation::Top(f, v)),
        3 => nvext_field().prop_map(|(k, v)| Mutation::NvExt(k, v)),
        1 => (
            prop_oneof![Just("role"), Just("content"), Just("name"), Just("tool_calls")],
            prop_oneof![
                weird(),
                Just(json!([{"type": "text", "text": "hi"}, {"type": "image_url"}])),
                prop::collection::vec(text(), 0..3)
                    .prop_map(|t| json!(t.iter().map(|t| json!({"type": "text", "text": t}))
                        .collect::<Vec<_>>())),
                Just(json!("robot")),
            ]
        )
            .prop_map(|(k, v)| Mutation::Message(k, v)),
        1 => Just(Mutation::Empty),
        1 => Just(Mutation::Nest),
    ]
}

fn apply(body: &mut Value, chat: bool, m: Mutation) {
    let main = if chat { "messages" } else { "prompt" };
    match m {
        Mutation::Top(field, value) => body[field] = value,
        Mutation::NvExt(key, value) => {
            if !body["nvext"].is_object() {
                body["nvext"] = json!({});
            }
            body["nvext"][key] = value;
        }
        Mutation::Message(key, value) if chat => {
            if let Some(first) = body["messages"].get_mut(0).filter(|m| m.is_object()) {
                first[key] = value;
            }
        }
        Mutation::Message(_, value) => body["prompt"] = value,
        Mutation::Empty => body[main] = json!([]),
        Mutation::Nest => body[main] = json!([body[main].take()]),
    }
}

/// A valid request of `path`, then up to three mutations; routing headers, random or not.
fn mostly_valid() -> impl Strategy<Value = Input> {
    let base = (
        path(),
        text(),
        prop::option::of(1..5u32),
        any::<bool>(),
        any::<bool>(),
    );
    let headers = prop::collection::vec(
        (
            prop_oneof![
                Just("x-worker-instance-id"),
                Just("x-dp-rank"),
                Just("x-prefill-instance-id"),
                Just("x-prefill-dp-rank"),
            ],
            prop_oneof![
                3 => (0..5u64).prop_map(|n| n.to_string()),
                1 => any::<u64>().prop_map(|n| n.to_string()),
                1 => any::<i64>().prop_map(|n| n.to_string()),
                1 => Just(u32::MAX.to_string()),
                1 => Just(String::new()),
                1 => "[ -~]{0,16}",
            ],
        ),
        0..3,
    );
    (
        base,
        prop::collection::vec(mutation(), 0..4),
        headers,
        prop::option::of("[a-z]{1,6}"),
    )
        .prop_map(
            |((path, content, max_tokens, stream, usage), mutations, headers, extra)| {
                let chat = path == CHAT;
                let mut body = if chat {
                    json!({"model": "mock", "messages": [{"role": "user", "content": content}]})
                } else {
                    json!({"model": "mock", "prompt": content})
                };
                if let Some(n) = max_tokens {
                    body["max_tokens"] = json!(n);
                }
                body["stream"] = json!(stream);
                if stream && usage {
                    body["stream_options"] = json!({"include_usage": true});
                }
                if let Some(extra) = extra {
                    body[format!("unknown_{extra}")] = json!(extra);
                }
                for m in mutations {
                    apply(&mut body, chat, m);
                }
                Input {
                    path,
                    body: body.to_string().into_bytes(),
                    headers,
                }
            },
        )
}

fn input() -> impl Strategy<Value = Input> {
    prop_oneof![
        1 => (path(), prop::collection::vec(any::<u8>(), 0..256)).prop_map(|(path, body)| Input {
            path,
            body,
            headers: Vec::new(),
        }),
        1 => (path(), any_json()).prop_map(|(path, v)| Input {
            path,
            body: v.to_string().into_bytes(),
            headers: Vec::new(),
        }),
        4 => mostly_valid(),
    ]
}

/// The token ids that steer the fake engine (stall, fail, slow down): not the subject here.
fn magic_ids() -> [u32; 8] {
    Behaviour::STEERED.map(|b| MockTokenizer::word_id(b.magic_word()))
}

/// Whether `body` may carry a magic token: a word of any string, of the text parts of any array
/// concatenated (as chat content parts are), or any integer.
fn steers_engine(body: &[u8]) -> bool {
    let Ok(value) = serde_json::from_slice::<Value>(body) else {
        return false;
    };
    let magic = magic_ids();
    let words_hit = |s: &str| {
        s.split_whitespace()
            .any(|w| magic.contains(&MockTokenizer::word_id(w)))
    };
    fn walk(v: &Value, hit: &dyn Fn(&str) -> bool, magic: &[u32; 8]) -> bool {
        match v {
            Value::String(s) => hit(s),
            Value::Number(n) => n
                .as_u64()
                .is_some_and(|n| magic.iter().any(|&m| u64::from(m) == n)),
            Value::Array(a) => {
                let parts: String = a
                    .iter()
                    .filter_map(|p| p.get("text").and_then(Value::as_str))
                    .collect();
                hit(&parts) || a.iter().any(|x| walk(x, hit, magic))
            }
            Value::Object(o) => o.iter().any(|(k, x)| hit(k) || walk(x, hit, magic)),
            Value::Null | Value::Bool(_) => false,
        }
    }
    walk(&value, &words_hit, &magic)
}

fn fail(input: &Input, what: impl std::fmt::Display) -> TestCaseError {
    let body: String = String::from_utf8_lossy(&input.body)
        .chars()
        .take(300)
        .collect();
    TestCaseError::fail(format!(
        "{what}\n  POST {} headers {:?}\n  body {body}",
        input.path, input.headers
    ))
}

/// Sends `input` and checks the answer; returns its status.
async fn check(server: &Server, input: &Input) -> Result<u16, TestCaseError> {
    let mut req = server
        .client
        .post(format!("{}{}", server.base, input.path))
        .header("content-type", "application/json")
        .body(input.body.clone());
    for (k, v) in &input.headers {
        req = req.header(*k, v.as_str());
    }
    let answer = async {
        let resp = req
            .send()
            .await
            .map_err(|e| fail(input, format!("no answer (did the handler panic?): {e:?}")))?;
        let status = resp.status().as_u16();
        let content_type = resp
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned();
        let mut body = Vec::new();
        let mut chunks = resp.bytes_stream();
        while let Some(chunk) = chunks.next().await {
            let chunk = chunk.map_err(|e| fail(input, format!("{status}: body cut: {e:?}")))?;
            body.extend_from_slice(&chunk);
            if body.len() > MAX_ANSWER_BYTES {
                return Err(fail(input, format!("{status}: answer beyond 4 MiB")));
            }
        }
        Ok((status, content_type, body))
    };
    let (status, content_type, body) = tokio::time::timeout(Duration::from_secs(10), answer)
        .await
        .map_err(|_| fail(input, "no complete answer within 10 s"))??;
    let text = String::from_utf8_lossy(&body);
    let short: String = text.chars().take(300).collect();
    if status >= 500 {
        return Err(fail(
            input,
            format!("{status} for a client's request: {short}"),
        ));
    }
    if (400..500).contains(&status) {
        let json: Value = serde_json::from_slice(&body).map_err(|e| {
            fail(
                input,
                format!("{status} without a JSON body ({e}): {short}"),
            )
        })?;
        let error = &json["error"];
        let message = error["message"].as_str().unwrap_or_default();
        if message.is_empty() || !error["type"].is_string() {
            return Err(fail(
                input,
                format!("{status} without an OpenAI error: {short}"),
            ));
        }
        return Ok(status);
    }
    if status != 200 {
        return Err(fail(input, format!("unexpected {status}: {short}")));
    }
    if content_type.starts_with("text/event-stream") {
        let payloads: Vec<&str> = text
            .split("\n\n")
            .flat_map(|event| event.lines().filter_map(|l| l.strip_prefix("data:")))
            .map(str::trim_start)
            .collect();
        if payloads.last() != Some(&"[DONE]") {
            return Err(fail(
                input,
                format!("a stream not ended by [DONE]: {short}"),
            ));
        }
        for p in &payloads[..payloads.len() - 1] {
            let chunk: Value = serde_json::from_str(p)
                .map_err(|e| fail(input, format!("a chunk is not JSON ({e}): {p}")))?;
            if chunk.get("error").is_some() || !chunk["choices"].is_array() {
                return Err(fail(input, format!("a bad chunk: {p}")));
            }
        }
    } else {
        let json: Value = serde_json::from_slice(&body)
            .map_err(|e| fail(input, format!("a 200 that is not JSON ({e}): {short}")))?;
        if !json["choices"].is_array() {
            return Err(fail(input, format!("a 200 without choices: {short}")));
        }
    }
    Ok(status)
}

#[test]
fn arbitrary_bodies_and_routing_headers_never_get_a_5xx_a_panic_or_leaked_load() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (fleet, router, server) = runtime.block_on(async {
        let fleet = Fleet::start(3).await;
        let router = fleet.router(Policy::Kv).await;
        let config = HttpConfig {
            max_body_bytes: MAX_BODY_BYTES,
            max_prompt_tokens: MAX_PROMPT_TOKENS,
            ..test_config()
        };
        let server = Server::start(router.clone(), config).await;
        (fleet, router, server)
    });
    let mut runner = TestRunner::new(Config {
        cases: 300,
        failure_persistence: None,
        ..Config::default()
    });
    let statuses = Mutex::new(BTreeMap::<u16, usize>::new());
    let result = runner.run(&input(), |input| {
        // A magic word would make the fake engine stall or fail on purpose: not bad input.
        prop_assume!(!steers_engine(&input.body));
        let status = runtime.block_on(check(&server, &input))?;
        *statuses.lock().entry(status).or_default() += 1;
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    let statuses = statuses.into_inner();
    eprintln!("statuses: {statuses:?}");
    // Not vacuous: both served and refused requests were among the cases.
    assert!(statuses.get(&200).is_some_and(|&n| n >= 20), "{statuses:?}");
    assert!(statuses.get(&400).is_some_and(|&n| n >= 20), "{statuses:?}");
    runtime.block_on(async {
        let (status, body) = server.get("/live").await;
        assert_eq!(status, 200, "the server still answers: {body}");
        eventually("all load is freed", || idle(&router)).await;
    });
    drop(server);
    drop(fleet);
}
