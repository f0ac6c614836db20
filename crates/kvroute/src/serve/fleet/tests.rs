use super::*;

fn workers(toml_text: &str) -> Vec<FleetWorker> {
    toml::from_str::<FleetFile>(toml_text).unwrap().workers
}

/// The error `check` gives the one worker of `toml_text`, or "ok: process|engine".
fn checked(toml_text: &str) -> String {
    let worker = workers(toml_text).pop().unwrap();
    match check(worker) {
        Ok(Entry::Process(info)) => format!("ok: process at {}", info.address),
        Ok(Entry::Engine(info, spec, load_interval)) => format!(
            "ok: engine {} at {} events={:?} block={} load every {load_interval:?}",
            spec.engine, spec.engine_url, spec.kv_events, info.kv_block_size
        ),
        Err(e) => e.to_string(),
    }
}

#[test]
fn an_entry_is_a_worker_process_or_an_engine_this_process_fronts() {
    let cases = [
        (
            "[[workers]]\nid = 1\naddress = \"10.0.0.1:7100\"\nkv_block_size = 16\n",
            "ok: process at 10.0.0.1:7100",
        ),
        (
            "[[workers]]\nid = 2\nengine = \"vllm\"\nengine_url = \"http://127.0.0.1:8000\"\nkv_events = \"tcp://127.0.0.1:5557\"\nkv_block_size = 16\n",
            "ok: engine vllm at http://127.0.0.1:8000 events=Some(\"tcp://127.0.0.1:5557\") block=16 load every 1s",
        ),
        (
            "[[workers]]\nid = 8\nengine = \"vllm\"\nengine_url = \"http://h:2\"\nload_report_interval_ms = 250\nkv_block_size = 16\n",
            "ok: engine vllm at http://h:2 events=None block=16 load every 250ms",
        ),
        (
            "[[workers]]\nid = 9\nengine = \"vllm\"\nengine_url = \"http://h:2\"\nload_report_interval_ms = 10\nkv_block_size = 16\n",
            "workers[id=9]: load_report_interval_ms must be at least 50 (milliseconds; the default is 1000), got 10",
        ),
        (
            "[[workers]]\nid = 10\naddress = \"h:1\"\nload_report_interval_ms = 250\nkv_block_size = 16\n",
            "workers[id=10]: `address` names a worker process",
        ),
        (
            "[[workers]]\nid = 3\nengine = \"llamacpp\"\nkv_block_size = 16\n",
            "workers[id=3]: `engine` needs `engine_url`",
        ),
        (
            "[[workers]]\nid = 4\nkv_block_size = 16\n",
            "workers[id=4]: expected `address` (a worker process) or `engine` and `engine_url`",
        ),
        (
            "[[workers]]\nid = 5\naddress = \"h:1\"\nengine = \"sglang\"\nengine_url = \"http://h:2\"\nkv_block_size = 16\n",
            "workers[id=5]: `address` names a worker process",
        ),
        (
            "[[workers]]\nid = 6\naddress = \"h:1\"\nkv_events = \"tcp://h:3\"\nkv_block_size = 16\n",
            "workers[id=6]: `address` names a worker process",
        ),
        (
            "[[workers]]\nid = 7\nrole = \"prefill\"\nengine = \"llamacpp\"\nengine_url = \"http://h:2\"\nkv_block_size = 16\n",
            "workers[id=7]: engine llamacpp cannot take role prefill: kvroute speaks the \
             disaggregation exchange of vllm, sglang, trtllm only",
        ),
    ];
    for (text, expected) in cases {
        let got = checked(text);
        assert!(
            got.starts_with(expected),
            "{text}\ngot:      {got}\nexpected: {expected}..."
        );
    }
}

#[test]
fn an_unknown_engine_or_key_is_refused_by_name() {
    let err = toml::from_str::<FleetFile>(
        "[[workers]]\nid = 1\nengine = \"tgi\"\nengine_url = \"http://h:1\"\nkv_block_size = 16\n",
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("tgi"), "{err}");
    let err = toml::from_str::<FleetFile>(
        "[[workers]]\nid = 1\naddress = \"h:1\"\nkv_block_size = 16\nengin = \"vllm\"\n",
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("engin"), "{err}");
}

#[test]
fn fleet_files_read_as_toml_or_json() {
    let dir = std::env::temp_dir().join(format!("kvroute-fleet-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let toml_path = dir.join("fleet.toml");
    std::fs::write(
        &toml_path,
        "[[workers]]\nid = 1\nengine = \"sglang\"\nengine_url = \"http://h:30000\"\nkv_block_size = 16\n",
    )
    .unwrap();
    let json_path = dir.join("fleet.json");
    std::fs::write(
        &json_path,
        r#"{"workers": [{"id": 1, "engine": "sglang", "engine_url": "http://h:30000", "kv_block_size": 16}]}"#,
    )
    .unwrap();
    assert_eq!(
        read_file(&toml_path).unwrap(),
        read_file(&json_path).unwrap()
    );
    let missing = read_file(&dir.join("absent.toml")).unwrap_err();
    assert!(
        format!("{missing:#}").contains("absent.toml"),
        "{missing:#}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_example_fleet_file_is_valid() {
    let text = include_str!("../../../../../docs/examples/fleet.toml");
    let workers = toml::from_str::<FleetFile>(text).unwrap().workers;
    let kinds: Vec<String> = workers
        .into_iter()
        .map(|w| match check(w).unwrap() {
            Entry::Process(_) => "process".to_owned(),
            Entry::Engine(_, spec, _) => spec.engine.to_string(),
        })
        .collect();
    assert_eq!(kinds, ["vllm", "llamacpp", "process"]);
}

/// What `check_against_router` says of `toml_text` for a router with block size 16 serving
/// `models`: "ok" or its error.
fn against_router(toml_text: &str, models: &[kvroute_router::ModelConfig]) -> String {
    match check_against_router(&workers(toml_text), 16, models) {
        Ok(()) => "ok".to_owned(),
        Err(e) => e.to_string(),
    }
}

fn real_model() -> kvroute_router::ModelConfig {
    kvroute_router::ModelConfig {
        tokenizer: Some("tokenizer.json".into()),
        ..kvroute_router::ModelConfig::mock("tiny")
    }
}

#[test]
fn an_entry_with_another_block_size_is_refused_at_start_not_served_without() {
    let got = against_router(
        "[[workers]]\nid = 1\naddress = \"h:1\"\nkv_block_size = 32\n",
        &[real_model()],
    );
    assert!(
        got.starts_with(
            "workers[id=1]: kv_block_size = 32 differs from the router's block size 16"
        ),
        "{got}"
    );
    assert_eq!(
        against_router(
            "[[workers]]\nid = 1\naddress = \"h:1\"\nkv_block_size = 16\n",
            &[real_model()]
        ),
        "ok"
    );
}

#[test]
fn real_engines_behind_the_mock_tokenizer_are_refused_with_what_to_pass() {
    let engine = "[[workers]]\nid = 2\nengine = \"llamacpp\"\nengine_url = \"http://h:2\"\nkv_block_size = 16\n";
    let got = against_router(engine, &[kvroute_router::ModelConfig::mock("mock")]);
    assert!(got.contains("llamacpp (id 2)"), "{got}");
    assert!(got.contains("`mock`"), "{got}");
    assert!(got.contains("--model NAME,tokenizer="), "{got}");
    assert_eq!(against_router(engine, &[real_model()]), "ok");
    // Mock workers need no tokenizer.
    assert_eq!(
        against_router(
            "[[workers]]\nid = 1\naddress = \"h:1\"\nkv_block_size = 16\n",
            &[kvroute_router::ModelConfig::mock("mock")]
        ),
        "ok"
    );
}
