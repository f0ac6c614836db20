use std::time::Duration;

use serde_json::json;

use super::fleet::{self, Engine};
use super::llamacpp::{self, CacheRam, Sizing};
use super::load::{self, Sample, Shape, SseScan};
use super::routers::{self, Config};
use super::*;

fn args(list: &[&str]) -> Result<Args> {
    let owned: Vec<String> = list.iter().map(|s| (*s).to_owned()).collect();
    Args::parse(&owned)
}

#[test]
fn defaults_cover_both_fleet_sizes_every_workload_and_every_router() {
    let a = args(&[]).expect("valid");
    assert_eq!(a.engines, vec![8, 32]);
    assert_eq!(a.workloads.len(), 5);
    assert_eq!(a.routers, Config::ALL.to_vec());
    assert_eq!(a.rounds, 2);
    assert_eq!(a.scale("agentic"), 1.0);
    assert_eq!(a.scale("rag"), 0.15);
    let b = args(&["--workload-scale", "0.5"]).expect("valid");
    assert_eq!(b.scale("agentic"), 0.5);
}

#[test]
fn quick_is_one_small_cell_with_every_router_once() {
    let a = args(&["--quick"]).expect("valid");
    assert_eq!(a.engines, vec![4]);
    assert_eq!(a.workloads, vec!["multi-turn".to_owned()]);
    assert_eq!(a.rounds, 1);
    assert_eq!(a.routers, Config::ALL.to_vec());
    assert!(a.duration <= 3.0);
}

#[test]
fn a_pinned_router_starts_under_taskset_on_its_core() {
    assert!(!args(&[]).expect("valid").pin);
    assert!(args(&["--pin"]).expect("valid").pin);
    let mut bin = routers::Binaries {
        kvroute: PathBuf::from("/bin/kvroute"),
        baseline: None,
        smg: PathBuf::from("/venv/bin/smg"),
        vllm_router: PathBuf::new(),
        tokenizer: PathBuf::new(),
        chat_template: None,
        dialect: "vllm",
        router_core: Some("3".to_owned()),
    };
    let pinned = bin.router_command(&bin.smg);
    assert_eq!(pinned.get_program(), "taskset");
    let pinned_args: Vec<_> = pinned.get_args().collect();
    assert_eq!(pinned_args, ["-c", "3", "/venv/bin/smg"]);
    bin.router_core = None;
    let free = bin.router_command(&bin.kvroute);
    assert_eq!(free.get_program(), "/bin/kvroute");
    assert_eq!(free.get_args().count(), 0);
}

#[test]
fn bad_arguments_name_the_flag_and_the_range() {
    let e = args(&["--engines", "0"]).unwrap_err().to_string();
    assert!(e.contains("--engines must list 1 to 64"), "{e}");
    let e = args(&["--workloads", "chat"]).unwrap_err().to_string();
    assert!(e.contains("unknown workload `chat`"), "{e}");
    let e = args(&["--speedup", "0"]).unwrap_err().to_string();
    assert!(e.contains("--speedup must be 1 to 1000, got 0"), "{e}");
    let e = args(&["--routers", "kvroute,smg-cache-aware"]).expect("valid");
    assert_eq!(e.routers, vec![Config::Kvroute, Config::SmgCacheAware]);
}

#[test]
fn a_baseline_binary_adds_the_twin_of_each_kvroute_configuration() {
    let e = args(&["--routers", "kvroute-base"])
        .unwrap_err()
        .to_string();
    assert!(e.contains("give --baseline PATH"), "{e}");
    let e = args(&["--baseline", "/no/such/kvroute"])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("--baseline /no/such/kvroute is not a file"),
        "{e}"
    );
    let file = std::env::current_exe().expect("the test binary");
    let file = file.to_str().expect("a UTF-8 path");
    let a = args(&[
        "--routers",
        "kvroute-approx,smg-cache-aware",
        "--baseline",
        file,
    ])
    .unwrap();
    assert_eq!(
        a.routers,
        vec![
            Config::KvrouteApprox,
            Config::SmgCacheAware,
            Config::KvrouteApproxBase
        ]
    );
    assert!(Config::KvrouteBase.uses_events() && Config::KvrouteBase.is_kvroute());
    assert!(!Config::KvrouteApproxBase.uses_events() && Config::KvrouteApproxBase.is_baseline());
    // Against llama.cpp only the approximate twin, and the events one is refused as its model is.
    let a = args(&["--engine", "llamacpp", "--baseline", file]).unwrap();
    assert!(a.routers.contains(&Config::KvrouteApproxBase));
    assert!(!a.routers.iter().any(|c| c.uses_events()));
}

fn shape(duration: f64) -> Shape {
    Shape {
        token_scale: 1.0 / 64.0,
        speedup: 10.0,
        max_duration: Duration::from_secs_f64(duration),
        vocabulary: 100,
    }
}

#[test]
fn prompts_share_exactly_the_words_of_their_shared_blocks() {
    // 8 words a block at this token scale; the second request extends the first's two blocks.
    let trace = "\
{\"timestamp\": 0, \"input_length\": 1024, \"output_length\": 64, \"hash_ids\": [1, 2]}
{\"timestamp\": 500, \"input_length\": 1280, \"output_length\": 640, \"hash_ids\": [1, 2, 3]}
{\"timestamp\": 1000, \"input_length\": 1024, \"output_length\": 64, \"hash_ids\": [1, 9]}
";
    let requests = load::requests(trace, shape(60.0)).expect("valid trace");
    assert_eq!(requests.len(), 3);
    let words = |i: usize| requests[i].prompt.split(' ').collect::<Vec<_>>();
    assert_eq!(requests[0].prompt_tokens, 16);
    assert_eq!(words(0).len(), 16);
    assert_eq!(requests[1].prompt_tokens, 20);
    assert_eq!(words(1).len(), 20);
    assert_eq!(words(1)[..16], words(0)[..]);
    // A different second block: the first 8 words agree, the next do not all agree.
    assert_eq!(words(2)[..8], words(0)[..8]);
    assert_ne!(words(2)[8..], words(0)[8..]);
    assert_eq!(requests[1].max_tokens, 10);
    assert_eq!(requests[0].max_tokens, 1);
    // Arrivals divided by the speed-up.
    assert_eq!(requests[1].at, Duration::from_millis(50));
    // Every word is in the vocabulary.
    assert!(
        requests
            .iter()
            .flat_map(|r| r.prompt.split(' '))
            .all(|w| w.strip_prefix('w').and_then(|n| n.parse::<u32>().ok()) < Some(100))
    );
}

#[test]
fn the_ceiling_counts_the_longest_prefix_an_earlier_request_sent() {
    // 8 words a block. Block 9 after [1] is new; [5, 2] shares block 2's id but not its prefix.
    let trace = "\
{\"timestamp\": 0, \"input_length\": 1024, \"output_length\": 64, \"hash_ids\": [1, 2]}
{\"timestamp\": 1, \"input_length\": 1280, \"output_length\": 64, \"hash_ids\": [1, 2, 3]}
{\"timestamp\": 2, \"input_length\": 1024, \"output_length\": 64, \"hash_ids\": [1, 9]}
{\"timestamp\": 3, \"input_length\": 1024, \"output_length\": 64, \"hash_ids\": [5, 2]}
{\"timestamp\": 4, \"input_length\": 960, \"output_length\": 64, \"hash_ids\": [1, 2]}
";
    let requests = load::requests(trace, shape(60.0)).expect("valid trace");
    let reusable: Vec<u64> = requests.iter().map(|r| r.reusable_tokens).collect();
    // The last prompt (15 words) is shorter than the two blocks it repeats.
    assert_eq!(reusable, [0, 16, 8, 0, 15]);
    // Over the engines' prompt tokens (one special token more a prompt here), served ones only.
    let mut samples: Vec<load::Sample> = requests
        .iter()
        .map(|r| load::Sample {
            prompt_tokens: r.prompt_tokens + 1,
            ..load::Sample::default()
        })
        .collect();
    let ceiling = load::ceiling_hit_rate(&requests, &samples).expect("prompt tokens");
    assert!((ceiling - 39.0 / 88.0).abs() < 1e-12, "{ceiling}");
    samples[1].error = Some("refused".to_owned());
    let ceiling = load::ceiling_hit_rate(&requests, &samples).expect("prompt tokens");
    assert!((ceiling - 23.0 / 67.0).abs() < 1e-12, "{ceiling}");
    assert_eq!(load::ceiling_hit_rate(&requests, &[]), None);
}

#[test]
fn requests_after_the_duration_are_left_out_and_bad_lines_are_named() {
    let trace = "\
{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [1]}
{\"timestamp\": 90000, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [1]}
";
    assert_eq!(load::requests(trace, shape(5.0)).expect("valid").len(), 1);
    let e = load::requests("{\"timestamp\": 0}", shape(5.0))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("trace line 1: expected a number `input_length`"),
        "{e}"
    );
    let e = load::requests("", shape(5.0)).unwrap_err().to_string();
    assert!(e.contains("no request"), "{e}");
}

#[test]
fn the_stream_scan_keeps_the_last_usage_and_sees_done() {
    let mut scan = SseScan::default();
    scan.feed(b"data: {\"choices\":[{\"text\":\"w1\"}]}\n\n")
        .unwrap();
    assert!(scan.first_choice);
    scan.feed(b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":10,")
        .unwrap();
    assert!(scan.usage.is_none());
    scan.feed(b"\"prompt_tokens_details\":{\"cached_tokens\":4}}}\n\ndata: [DONE]\n\n")
        .unwrap();
    assert!(scan.done);
    assert_eq!(
        scan.usage.as_ref().unwrap()["prompt_tokens_details"]["cached_tokens"],
        json!(4)
    );
    let mut scan = SseScan::default();
    assert!(
        scan.feed(b"data: {\"error\":{\"message\":\"x\"}}\n")
            .is_err()
    );
}

#[test]
fn figures_count_errors_and_weigh_hit_rates_by_tokens() {
    let ok = |prompt, cached, ttft_ms| Sample {
        error: None,
        ttft: Some(Duration::from_millis(ttft_ms)),
        e2e: Some(Duration::from_millis(ttft_ms * 2)),
        prompt_tokens: prompt,
        cached_tokens: cached,
        completion_tokens: 10,
    };
    let samples = vec![
        ok(100, 90, 10),
        ok(300, 0, 30),
        Sample {
            error: Some("HTTP 503".to_owned()),
            ..Sample::default()
        },
    ];
    let f = load::figures(&samples, Duration::from_secs(2));
    assert_eq!((f.requests, f.ok, f.errors), (3, 2, 1));
    assert_eq!(f.first_error.as_deref(), Some("HTTP 503"));
    assert_eq!(f.hit_rate_usage, Some(90.0 / 400.0));
    assert_eq!(f.ttft_p50_ms, Some(10.0));
    assert_eq!(
        f.ttft_mean_ms,
        Some(20.0),
        "the mean of the served requests' 10 and 30 ms"
    );
    assert_eq!(
        f.engine_ttft_mean_ms, None,
        "read from the engines, not the samples"
    );
    assert_eq!(f.ttft_p99_ms, Some(30.0));
    assert_eq!(f.e2e_p99_ms, Some(60.0));
    assert_eq!(f.output_tokens_per_s, 10.0);
}

#[test]
fn engine_lines_parse_and_counters_sum_over_labels() {
    let e = fleet::parse_line(
        "engine i=0 url=http://127.0.0.1:5000 kv_events=tcp://127.0.0.1:5001 \
         kv_events_replay=tcp://127.0.0.1:5002",
    )
    .expect("valid");
    assert_eq!(
        e,
        Engine {
            url: "http://127.0.0.1:5000".to_owned(),
            kv_events: "tcp://127.0.0.1:5001".to_owned(),
            kv_events_replay: "tcp://127.0.0.1:5002".to_owned(),
        }
    );
    let err = fleet::parse_line("engine i=0 url=http://x").unwrap_err();
    assert!(err.to_string().contains("no `kv_events=`"), "{err}");
    let text = "\
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"sim\"} 30
vllm:prefix_cache_hits_total{engine=\"1\",model_name=\"sim\"} 12.5
vllm:prefix_cache_hits_created{engine=\"0\"} 99
";
    assert_eq!(
        fleet::counter(text, "vllm:prefix_cache_hits_total").unwrap(),
        42.5
    );
    assert!(fleet::counter(text, "vllm:prefix_cache_queries_total").is_err());
}

#[test]
fn the_tokenizer_is_a_byte_level_bpe_with_a_token_for_every_word() {
    let dir = TempDir::new("kvroute-peers-test-tokenizer").unwrap();
    let path = fleet::write_tokenizer(&dir.0).unwrap();
    let tokenizer: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    assert_eq!(tokenizer["model"]["type"], "BPE");
    let vocab = tokenizer["model"]["vocab"].as_object().unwrap();
    let n = fleet::VOCABULARY;
    assert_eq!(vocab["<unk>"], json!(0));
    assert_eq!(vocab["\u{120}waaa"], json!(1));
    assert_eq!(vocab[&format!("\u{120}{}", load::word(n - 1))], json!(n));
    assert_eq!(vocab["waaa"], json!(n + 1));
    assert_eq!(
        vocab["\u{120}"],
        json!(2 * n + 1 + 32),
        "the byte-level alphabet follows"
    );
    // Every word is built by merges, letter by letter, after a space and alone.
    let merges: Vec<&str> = tokenizer["model"]["merges"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m.as_str().unwrap())
        .collect();
    assert_eq!(merges[0], "\u{120} w");
    for w in [load::word(0), load::word(n - 1)] {
        for m in [
            format!("\u{120}{} {}", &w[..3], &w[3..]),
            format!("{} {}", &w[..3], &w[3..]),
        ] {
            assert!(merges.contains(&m.as_str()), "{m}");
        }
    }
    // The last merge of each word gives the word itself, listed already.
    assert_eq!(vocab.len(), 1 + 256 + merges.len());
    let mocker = fleet::write_mocker_config(&dir.0, 0.125, 40.0).unwrap();
    let text = std::fs::read_to_string(mocker).unwrap();
    assert!(text.contains("num_blocks = 3125"), "{text}");
    assert!(text.contains("speedup = 40.0"), "{text}");
}

#[test]
fn kvroute_fleet_files_carry_events_only_when_asked() {
    let engines = vec![Engine {
        url: "http://127.0.0.1:1".to_owned(),
        kv_events: "tcp://127.0.0.1:2".to_owned(),
        kv_events_replay: "tcp://127.0.0.1:3".to_owned(),
    }];
    let with: toml::Value = toml::from_str(&routers::fleet_file(&engines, true, "vllm")).unwrap();
    let worker = &with["workers"][0];
    assert_eq!(worker["engine"].as_str(), Some("vllm"));
    assert_eq!(worker["kv_events"].as_str(), Some("tcp://127.0.0.1:2"));
    let without: toml::Value =
        toml::from_str(&routers::fleet_file(&engines, false, "llamacpp")).unwrap();
    assert!(without["workers"][0].get("kv_events").is_none());
    assert_eq!(without["workers"][0]["engine"].as_str(), Some("llamacpp"));
}

#[test]
fn readiness_counts_healthy_workers() {
    assert_eq!(routers::ready_count(true, &json!({"workers": 3})), 3);
    let peers =
        json!({"workers": [{"is_healthy": true}, {"is_healthy": false}, {"is_healthy": true}]});
    assert_eq!(routers::ready_count(false, &peers), 2);
    assert_eq!(routers::ready_count(false, &json!({})), 0);
}

#[test]
fn kvroute_serve_s_start_up_line_gives_its_address() {
    assert_eq!(
        routers::serve_address("kvroute serve: http=127.0.0.1:43210 registry=none").as_deref(),
        Some("http://127.0.0.1:43210")
    );
    assert_eq!(routers::serve_address("kvroute serve: starting"), None);
}

#[test]
fn llamacpp_defaults_are_four_engines_both_prompt_memories_and_the_routers_without_events() {
    let a = args(&["--engine", "llamacpp"]).expect("valid");
    assert_eq!(a.engine, EngineKind::Llamacpp);
    assert_eq!(a.engines, vec![4]);
    assert_eq!(a.cache_ram, vec![CacheRam::Default, CacheRam::Mib(0)]);
    assert_eq!(a.routers, Config::LLAMACPP.to_vec());
    assert!(a.routers.iter().all(|c| !c.uses_events()));
    assert!(a.workloads.is_empty());
    assert_eq!(a.rounds, 2);
    assert_eq!(a.sizing(), Sizing::FULL);
    let rows: Vec<String> = a.rows().iter().map(Workload::label).collect();
    assert_eq!(rows, ["chat, cache-ram default", "chat, cache-ram 0"]);
    assert_eq!(a.rows()[1].tag(), "chat-cache-ram-0");
    let b = args(&[
        "--engine",
        "llamacpp",
        "--engines",
        "3",
        "--cache-ram",
        "0,512",
    ])
    .unwrap();
    assert_eq!(b.engines, vec![3]);
    assert_eq!(b.cache_ram, vec![CacheRam::Mib(0), CacheRam::Mib(512)]);
    // The simulated fleet is unchanged by the new options.
    let sim = args(&["--engine", "sim"]).expect("valid");
    assert_eq!(sim, args(&[]).expect("valid"));
    assert_eq!(sim.rows().len(), 5);
}

#[test]
fn quick_on_llamacpp_is_two_engines_one_round_and_few_requests() {
    let a = args(&["--engine", "llamacpp", "--quick"]).expect("valid");
    assert_eq!(a.engines, vec![2]);
    assert_eq!(a.cache_ram, vec![CacheRam::Default]);
    assert_eq!(a.rounds, 1);
    assert_eq!(a.routers, Config::LLAMACPP.to_vec());
    assert_eq!(a.sizing(), Sizing::QUICK);
    assert!(
        Sizing::QUICK.requests() <= 30,
        "{}",
        Sizing::QUICK.requests()
    );
}

#[test]
fn llamacpp_refuses_the_event_routers_workloads_and_bad_sizes_by_name() {
    let e = args(&[
        "--engine",
        "llamacpp",
        "--routers",
        "kvroute,smg-cache-aware",
    ])
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("`kvroute (events)` reads the engines' KV events, which llama.cpp does not"),
        "{e}"
    );
    assert!(e.contains("kvroute (approx.), SMG cache_aware"), "{e}");
    let e = args(&["--engine", "llamacpp", "--routers", "vllm-kv-aware"])
        .unwrap_err()
        .to_string();
    assert!(e.contains("vLLM router kv_aware"), "{e}");
    let e = args(&["--engine", "llamacpp", "--workloads", "rag"])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("--workloads applies to --engine sim only"),
        "{e}"
    );
    let e = args(&["--cache-ram", "0"]).unwrap_err().to_string();
    assert!(
        e.contains("--cache-ram applies to --engine llamacpp only"),
        "{e}"
    );
    let e = args(&["--engine", "llamacpp", "--cache-ram", "lots"])
        .unwrap_err()
        .to_string();
    assert!(e.contains("got `lots`"), "{e}");
    let e = args(&["--engine", "gpu"]).unwrap_err().to_string();
    assert!(e.contains("gpu"), "{e}");
    let e = args(&["--engine", "llamacpp", "--engines", "0"])
        .unwrap_err()
        .to_string();
    assert!(e.contains("--engines must list 1 to 64"), "{e}");
}

#[test]
fn conversations_are_families_sharing_a_system_prompt_and_the_same_for_a_seed() {
    let sizing = Sizing::FULL;
    let c = llamacpp::conversations(7, sizing);
    assert_eq!(c.len(), sizing.families * sizing.per_family);
    assert_eq!(c.len() * sizing.turns, sizing.requests());
    assert_eq!(c, llamacpp::conversations(7, sizing), "deterministic");
    assert_ne!(
        c,
        llamacpp::conversations(8, sizing),
        "the seed changes the text"
    );
    // Families alternate: the first conversation of each, then the second of each.
    let families: Vec<usize> = c.iter().map(|c| c.family).collect();
    assert_eq!(
        families[..sizing.families],
        (0..sizing.families).collect::<Vec<_>>()
    );
    assert_eq!(families[sizing.families], 0);
    for conv in &c {
        assert_eq!(conv.turns.len(), sizing.turns);
        let first = c.iter().find(|o| o.family == conv.family).unwrap();
        assert_eq!(
            conv.system, first.system,
            "a family shares its system prompt"
        );
        // Sentences of the known words, a full stop each.
        assert_eq!(
            conv.turns[0].matches('.').count(),
            sizing.turn_sentences,
            "{}",
            conv.turns[0]
        );
        assert!(
            conv.turns
                .iter()
                .all(|t| t.split(' ').count() == 10 * sizing.turn_sentences)
        );
    }
    assert_ne!(c[0].system, c[1].system, "families differ");
    assert_ne!(
        c[0].turns, c[sizing.families].turns,
        "conversations of a family differ"
    );
    // Sized for the servers' context: a system prompt of 300-odd words, and turns.
    let words = c[0].system.split(' ').count();
    assert!((250..400).contains(&words), "{words}");
}

#[test]
fn llamacpp_server_lines_parse_and_cache_ram_reads_default_or_mib() {
    let e = llamacpp::parse_line("llamacpp i=1 url=http://127.0.0.1:4100 pid=77").unwrap();
    assert_eq!(e.url, "http://127.0.0.1:4100");
    assert!(e.kv_events.is_empty());
    let err = llamacpp::parse_line("llamacpp i=1 pid=77").unwrap_err();
    assert!(err.to_string().contains("no `url=`"), "{err}");
    assert_eq!("default".parse::<CacheRam>(), Ok(CacheRam::Default));
    assert_eq!("0".parse::<CacheRam>(), Ok(CacheRam::Mib(0)));
    assert_eq!(CacheRam::Mib(0).to_string(), "0");
    assert!("-1".parse::<CacheRam>().is_err());
}

#[test]
fn the_stream_scan_gathers_the_reply_text_of_chats_and_completions() {
    let mut chat = SseScan::default();
    chat.feed(b"data: {\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":null}}]}\n\n")
        .unwrap();
    chat.feed(b"data: {\"choices\":[{\"delta\":{\"content\":\"cache \"}}]}\n\n")
        .unwrap();
    chat.feed(b"data: {\"choices\":[{\"delta\":{\"content\":\"block\"}}],")
        .unwrap();
    chat.feed(b"\"timings\":{\"cache_n\":5}}\n\n").unwrap();
    assert_eq!(chat.content, "cache block");
    assert_eq!(chat.timings.as_ref().unwrap()["cache_n"], json!(5));
    let mut text = SseScan::default();
    text.feed(
        b"data: {\"choices\":[{\"text\":\"w1 \"}]}\n\ndata: {\"choices\":[{\"text\":\"w2\"}]}\n\n",
    )
    .unwrap();
    assert_eq!(text.content, "w1 w2");
}

#[test]
fn text_prompts_render_the_model_s_chatml_template() {
    let messages = vec![
        json!({"role": "system", "content": "You are a cache."}),
        json!({"role": "user", "content": "Hello."}),
        json!({"role": "assistant", "content": "w1 w2"}),
        json!({"role": "user", "content": "Again."}),
    ];
    assert_eq!(
        llamacpp::render(&messages),
        "<|im_start|>system\nYou are a cache.<|im_end|>\n<|im_start|>user\nHello.<|im_end|>\n\
         <|im_start|>assistant\nw1 w2<|im_end|>\n<|im_start|>user\nAgain.<|im_end|>\n\
         <|im_start|>assistant\n"
    );
    // The text form is for the llama.cpp chats only.
    let e = args(&["--routers", "vllm-cache-aware-text"])
        .unwrap_err()
        .to_string();
    assert!(e.contains("applies to --engine llamacpp only"), "{e}");
    assert!(!Config::ALL.contains(&Config::VllmCacheAwareText));
    assert!(Config::LLAMACPP.contains(&Config::VllmCacheAwareText));
}

#[test]
fn kvroute_figures_are_read_from_its_metrics() {
    let text = "\
kvroute_router_routing_overhead_seconds_sum{phase=\"hashing\"} 0.5
kvroute_router_routing_overhead_seconds_count{phase=\"tokenizing\"} 338
kvroute_router_routing_overhead_seconds_sum{phase=\"tokenizing\"} 0.3275
kvroute_router_cache_report_predicted_tokens_total{worker=\"1\"} 30
kvroute_router_cache_report_predicted_tokens_total{worker=\"2\"} 45
kvroute_router_cache_report_prompt_tokens_total{worker=\"1\"} 50
kvroute_router_cache_report_prompt_tokens_total{worker=\"2\"} 50
kvroute_router_tokenizer_encoder{model=\"sim\",encoder=\"fastokens\"} 0
kvroute_router_tokenizer_encoder{model=\"sim\",encoder=\"tokenizers\"} 1
";
    assert_eq!(kvroute_tokenizing_seconds(text), Some(0.3275));
    assert_eq!(kvroute_encoder(text).as_deref(), Some("tokenizers"));
    assert_eq!(kvroute_predicted(text).unwrap(), 0.75);
    assert!(
        kvroute_forgone(text).is_err(),
        "no forgone counter in this text"
    );
    let counted =
        "kvroute_router_input_tokens_total 400\nkvroute_router_forgone_cached_tokens_total 12\n";
    assert_eq!(kvroute_forgone(counted).unwrap(), 0.03);
    let untimed = "kvroute_router_routing_overhead_seconds_sum{phase=\"hashing\"} 0.5\n";
    assert_eq!(kvroute_tokenizing_seconds(untimed), None);
    assert_eq!(kvroute_encoder(untimed), None);
    assert!(kvroute_predicted(untimed).is_err());
}

#[test]
fn the_quick_check_wants_every_request_served_and_kvroute_tokenizing_timed_with_fastokens_and_forgone_hits_counted()
 {
    let served = Figures {
        requests: 10,
        ok: 10,
        ..Figures::default()
    };
    let run = |tokenizing: Option<f64>| Run {
        figures: served.clone(),
        predicted: None,
        tokenizing_s_per_1k: tokenizing,
        forgone: tokenizing.map(|_| 0.01),
        encoder: tokenizing.map(|_| "fastokens".to_owned()),
        failed: None,
    };
    let results = |config: Config, r: Run| -> Results {
        BTreeMap::from([(
            (4, "multi-turn".to_owned()),
            BTreeMap::from([(config, vec![r])]),
        )])
    };
    assert!(check_quick(&results(Config::Kvroute, run(Some(0.4)))).is_ok());
    assert!(check_quick(&results(Config::SmgCacheAware, run(None))).is_ok());
    let e = check_quick(&results(Config::KvrouteApprox, run(None))).unwrap_err();
    assert!(e.to_string().contains("no tokenizing time"), "{e}");
    let mut short = run(Some(0.4));
    short.figures.ok = 9;
    let e = check_quick(&results(Config::Kvroute, short)).unwrap_err();
    assert!(e.to_string().contains("served 9 of 10 requests"), "{e}");
    let mut uncounted = run(Some(0.4));
    uncounted.forgone = None;
    let e = check_quick(&results(Config::Kvroute, uncounted)).unwrap_err();
    assert!(
        e.to_string().contains("no forgone_cached_tokens_total"),
        "{e}"
    );
    // On the simulated fleet (a trace run, with a ceiling) the engines' own TTFT is wanted too.
    let mut traced = run(Some(0.4));
    traced.figures.ceiling = Some(0.5);
    let e = check_quick(&results(Config::SmgCacheAware, traced.clone())).unwrap_err();
    assert!(
        e.to_string()
            .contains("no vllm:time_to_first_token_seconds"),
        "{e}"
    );
    traced.figures.engine_ttft_mean_ms = Some(2.5);
    assert!(check_quick(&results(Config::SmgCacheAware, traced)).is_ok());
    let mut slow = run(Some(0.4));
    slow.encoder = Some("tokenizers".to_owned());
    let e = check_quick(&results(Config::Kvroute, slow)).unwrap_err();
    assert!(
        e.to_string()
            .contains("encoded by tokenizers, expected fastokens"),
        "{e}"
    );
}

#[test]
fn a_skimming_scan_sees_choices_usage_and_errors_without_the_text() {
    let mut scan = SseScan::skimming();
    scan.feed(b"data: {\"choices\": [ ]}\n\n").unwrap();
    assert!(!scan.first_choice, "an empty choices list carries no token");
    scan.feed(b"data: {\"id\":\"x\",\"choices\" : [ {\"text\":\"w1\"}]}\n\ndata: {\"cho")
        .unwrap();
    assert!(scan.first_choice);
    assert_eq!(scan.content, "", "a skimming scan gathers no text");
    scan.feed(b"ices\":[],\"usage\":{\"prompt_tokens\":3}}\n\ndata: [DONE]\n\n")
        .unwrap();
    assert_eq!(scan.usage.as_ref().unwrap()["prompt_tokens"], json!(3));
    assert!(scan.done);
    let err = SseScan::skimming()
        .feed(b"data: {\"choices\":[],\"error\":{\"message\":\"worker lost\"}}\n")
        .expect_err("an error event");
    assert!(err.to_string().contains("worker lost"), "{err}");
    let err = SseScan::skimming()
        .feed(b"data: not json\n")
        .expect_err("not JSON");
    assert!(err.to_string().contains("not JSON"), "{err}");
}
