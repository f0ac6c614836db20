//! `kvroute engine-sim`: the simulated vLLM servers' HTTP shapes and metrics, and the whole path
//! `kvroute serve` → `kvroute worker --engine vllm --kv-events` sidecars → simulated engines,
//! whose ZMQ KV events reach the router's index.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;

use serde_json::{Value, json};

use crate::e2e::{BOUND, Fleet, Proc, Sse, active_requests, gauge};
use crate::support::scratch;

/// The served model name the simulator is started with.
pub(crate) const MODEL: &str = "sim-model";

/// An `engine-sim` process and its engines' lines; killed when dropped.
pub(crate) struct EngineSim {
    child: Child,
    engines: Vec<Vec<(String, String)>>,
}

impl EngineSim {
    fn start(test: &str, engines: usize) -> EngineSim {
        Self::start_with(test, engines, &[])
    }

    /// `engines` simulated engines with `extra` flags (vLLM with `--kv-events` unless they name
    /// a `--dialect`; `--speedup 50` unless they say).
    pub(crate) fn start_with(test: &str, engines: usize, extra: &[&str]) -> EngineSim {
        let log = scratch(&format!("engine-sim-{test}-engines")).join("engine-sim.log");
        let n = engines.to_string();
        let vllm = !extra.contains(&"--dialect");
        let mut child = Command::new(env!("CARGO_BIN_EXE_kvroute"))
            .args(["engine-sim", "--engines", &n])
            .args(if vllm {
                &["--dialect", "vllm", "--kv-events"][..]
            } else {
                &[][..]
            })
            .args(["--listen", "127.0.0.1:0", "--model", MODEL])
            .args(if extra.contains(&"--speedup") {
                &[][..]
            } else {
                &["--speedup", "50"][..]
            })
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).expect("create log"))
            .spawn()
            .expect("spawn kvroute engine-sim");
        let stdout = child.stdout.take().expect("stdout piped");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let engines = (0..engines)
            .map(|i| {
                let line = rx.recv_timeout(BOUND).unwrap_or_else(|_| {
                    let log = std::fs::read_to_string(&log).unwrap_or_default();
                    panic!("engine-sim printed no line for engine {i}; log:\n{log}")
                });
                assert!(line.starts_with(&format!("engine i={i} ")), "{line}");
                line.split_whitespace()
                    .filter_map(|w| w.split_once('='))
                    .map(|(k, v)| (k.to_owned(), v.to_owned()))
                    .collect()
            })
            .collect();
        EngineSim { child, engines }
    }

    pub(crate) fn field(&self, engine: usize, key: &str) -> &str {
        self.engines[engine]
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
            .unwrap_or_else(|| panic!("no {key}= for engine {engine}: {:?}", self.engines))
    }
}

impl EngineSim {
    /// Kills the process (every engine of it) now.
    pub(crate) fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for EngineSim {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub(crate) fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(BOUND)
        .build()
        .expect("http client")
}

/// A prompt of several 16-token blocks.
pub(crate) fn long_prompt(tag: &str) -> String {
    (0..80).map(|i| format!("{tag}{i} ")).collect()
}

async fn post(http: &reqwest::Client, url: &str, body: &Value) -> Value {
    let response = http.post(url).json(body).send().await.expect("POST");
    assert_eq!(response.status(), 200, "POST {url}");
    response.json().await.expect("JSON body")
}

/// Every `data:` payload of a streamed response, `[DONE]` included.
async fn stream(http: &reqwest::Client, url: &str, body: &Value) -> Vec<String> {
    let response = http.post(url).json(body).send().await.expect("POST");
    assert_eq!(response.status(), 200, "POST {url}");
    let content_type = response.headers()["content-type"].to_str().unwrap_or("");
    assert!(
        content_type.starts_with("text/event-stream"),
        "{content_type}"
    );
    let mut sse = Sse::new(response);
    let mut events = Vec::new();
    while let Some(data) = sse.next().await {
        events.push(data);
    }
    events
}

pub(crate) fn cached(usage: &Value) -> u64 {
    usage["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or_else(|| panic!("no prompt_tokens_details.cached_tokens in {usage}"))
}

/// The value of an unlabelled-but-for-engine vLLM sample.
pub(crate) fn vllm_sample(metrics: &str, name: &str) -> f64 {
    let prefix = format!("{name}{{");
    metrics
        .lines()
        .find_map(|l| {
            l.strip_prefix(&prefix)?
                .split_once("} ")?
                .1
                .trim()
                .parse()
                .ok()
        })
        .unwrap_or_else(|| panic!("no {name} in\n{metrics}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_sim_speaks_vllms_http_shapes_and_metrics() {
    let sim = EngineSim::start("shapes", 2);
    let http = client();
    let base = sim.field(0, "url").to_owned();
    assert!(sim.field(1, "kv_events").starts_with("tcp://127.0.0.1:"));
    assert!(
        sim.field(1, "kv_events_replay")
            .starts_with("tcp://127.0.0.1:")
    );
    assert_ne!(sim.field(0, "url"), sim.field(1, "url"));

    let health = http
        .get(format!("{base}/health"))
        .send()
        .await
        .expect("GET");
    assert_eq!(health.status(), 200);
    let models = http.get(format!("{base}/v1/models")).send().await.unwrap();
    let models: Value = models.json().await.unwrap();
    let models = &models["data"][0];
    assert_eq!(
        (&models["id"], &models["owned_by"], &models["max_model_len"]),
        (&json!(MODEL), &json!("vllm"), &json!(8192))
    );
    let tokens = post(
        &http,
        &format!("{base}/tokenize"),
        &json!({"prompt": "a b c"}),
    )
    .await;
    assert_eq!(tokens["count"], 3);

    // Whole: the first call computes the prompt, the repeated one finds it cached.
    let url = format!("{base}/v1/completions");
    let body = json!({"model": MODEL, "prompt": long_prompt("w"), "max_tokens": 4});
    let first = post(&http, &url, &body).await;
    assert_eq!(first["object"], "text_completion");
    assert_eq!(first["choices"][0]["finish_reason"], "length");
    assert!(first["choices"][0]["text"].is_string());
    assert_eq!(first["usage"]["prompt_tokens"], 80);
    assert_eq!(first["usage"]["completion_tokens"], 4);
    assert_eq!(cached(&first["usage"]), 0);
    let second = post(&http, &url, &body).await;
    assert!(cached(&second["usage"]) > 0, "{second}");

    // Streamed, token ids in, token ids and usage out.
    let ids: Vec<u32> = (100..164).collect();
    let body = json!({"model": MODEL, "prompt": ids, "max_tokens": 3, "stream": true,
        "stream_options": {"include_usage": true}, "return_token_ids": true});
    let events = stream(&http, &url, &body).await;
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{events:?}"
    );
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).expect("chunk JSON"))
        .collect();
    assert_eq!(chunks[0]["choices"][0]["prompt_token_ids"], json!(ids));
    let output: usize = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["token_ids"].as_array())
        .map(Vec::len)
        .sum();
    assert_eq!(output, 3);
    let usage = chunks.last().expect("a usage chunk");
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["prompt_tokens"], 64);
    assert_eq!(cached(&usage["usage"]), 0);

    // Chat, whole and streamed.
    let url = format!("{base}/v1/chat/completions");
    let messages = json!([{"role": "user", "content": long_prompt("c")}]);
    let body = json!({"model": MODEL, "messages": messages, "max_tokens": 2});
    let whole = post(&http, &url, &body).await;
    assert_eq!(whole["object"], "chat.completion");
    assert_eq!(whole["choices"][0]["message"]["role"], "assistant");
    let body = json!({"model": MODEL, "messages": messages, "max_tokens": 2, "stream": true,
        "stream_options": {"include_usage": true}});
    let events = stream(&http, &url, &body).await;
    let usage: Value = serde_json::from_str(&events[events.len() - 2]).expect("usage JSON");
    assert_eq!(usage["object"], "chat.completion.chunk");
    assert!(cached(&usage["usage"]) > 0, "{usage}");

    // An unknown model is vLLM's 404.
    let body = json!({"model": "other", "prompt": "a", "max_tokens": 1});
    let response = http
        .post(format!("{base}/v1/completions"))
        .json(&body)
        .send();
    assert_eq!(response.await.unwrap().status(), 404);

    let metrics = http.get(format!("{base}/metrics")).send().await.unwrap();
    let metrics = metrics.text().await.unwrap();
    assert_eq!(vllm_sample(&metrics, "vllm:num_requests_running"), 0.0);
    assert_eq!(vllm_sample(&metrics, "vllm:num_requests_waiting"), 0.0);
    let usage = vllm_sample(&metrics, "vllm:kv_cache_usage_perc");
    assert!((0.0..=1.0).contains(&usage), "{usage}");
    assert!(vllm_sample(&metrics, "vllm:prefix_cache_queries_total") > 0.0);
    assert!(vllm_sample(&metrics, "vllm:prefix_cache_hits_total") > 0.0);
    // Every request above that produced a token counted its time to first token.
    let ttft_count = vllm_sample(&metrics, "vllm:time_to_first_token_seconds_count");
    assert_eq!(ttft_count, 5.0, "five requests made tokens");
    assert!(vllm_sample(&metrics, "vllm:time_to_first_token_seconds_sum") > 0.0);
    assert!(
        metrics.contains(&format!(
            "vllm:time_to_first_token_seconds_bucket{{engine=\"0\",model_name=\"{MODEL}\",le=\"+Inf\"}} {ttft_count:?}"
        )),
        "{metrics}"
    );
    assert!(
        metrics.contains("vllm:cache_config_info{block_size=\"16\""),
        "{metrics}"
    );
}

/// A word-level `tokenizer.json` knowing the words of [`long_prompt`] (the router refuses to
/// front real engines with its mock tokenizer) and the mock model's chat template; returns the
/// `--model` value for `kvroute serve`.
pub(crate) fn word_level_model(dir: &std::path::Path) -> String {
    let mut vocab = serde_json::Map::new();
    vocab.insert("[UNK]".into(), json!(0));
    for tag in ["a", "b", "c", "d"] {
        for i in 0..80 {
            let id = vocab.len();
            vocab.insert(format!("{tag}{i}"), json!(id));
        }
    }
    let tokenizer = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": null, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"},
    });
    let tokenizer_path = dir.join("tokenizer.json");
    std::fs::write(&tokenizer_path, tokenizer.to_string()).expect("write tokenizer");
    let template_path = dir.join("template.jinja");
    let template = "{% for m in messages %}<|{{ m.role }}|> {{ m.content }}\n{% endfor %}\
                    {% if add_generation_prompt %}<|assistant|>{% endif %}";
    std::fs::write(&template_path, template).expect("write template");
    format!(
        "mock,tokenizer={},chat_template={}",
        tokenizer_path.display(),
        template_path.display()
    )
}

/// The fleet: `kvroute serve`, and a `worker --engine vllm --kv-events` sidecar (ids 1, 2) in
/// front of each simulated engine.
async fn fleet_over(sim: &EngineSim, test: &str) -> Fleet {
    let dir = scratch(&format!("engine-sim-{test}"));
    let model = word_level_model(&dir);
    let serve = Proc::start(
        &[
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--registry-listen",
            "127.0.0.1:0",
            "--model",
            &model,
        ],
        &dir.join("serve.log"),
    );
    let registry = serve.field("registry").to_owned();
    let workers = (0..2)
        .map(|i| {
            let id = (i + 1).to_string();
            let args = [
                "worker",
                "--engine",
                "vllm",
                "--engine-url",
                sim.field(i, "url"),
                "--kv-events",
                sim.field(i, "kv_events"),
                "--kv-events-replay",
                sim.field(i, "kv_events_replay"),
                "--served-model-name",
                MODEL,
                "--id",
                &id,
                "--router",
                &registry,
                "--load-report-interval",
                "100ms",
            ];
            Proc::start(&args, &dir.join(format!("worker-{id}.log")))
        })
        .collect();
    listed(Fleet {
        base: format!("http://{}", serve.field("http")),
        serve,
        workers,
        http: client(),
    })
    .await
}

/// `kvroute serve` fronting both engines itself, from a static fleet file (each entry with the
/// TOML lines `extra` too): its own engine adapters read the ZMQ events, and its KV event
/// bridge carries them to the router.
async fn static_fleet_over(sim: &EngineSim, test: &str, extra: &str) -> Fleet {
    let dir = scratch(&format!("engine-sim-{test}"));
    let mut file = String::new();
    for i in 0..2 {
        file.push_str(&format!(
            "[[workers]]\nid = {}\nkv_block_size = 16\nengine = \"vllm\"\nengine_url = \"{}\"\n\
             kv_events = \"{}\"\nkv_events_replay = \"{}\"\nserved_model_name = \"{MODEL}\"\n{extra}\n",
            i + 1,
            sim.field(i, "url"),
            sim.field(i, "kv_events"),
            sim.field(i, "kv_events_replay"),
        ));
    }
    serve_fleet_file(&dir, &file, &[]).await
}

/// `kvroute serve` over the fleet `workers` (TOML `[[workers]]` entries for ids 1 and 2) written
/// in `dir`, serving the word-level model, with `extra` flags; returns once the router lists both
/// workers.
pub(crate) async fn serve_fleet_file(dir: &Path, workers: &str, extra: &[&str]) -> Fleet {
    let model = word_level_model(dir);
    let fleet = dir.join("fleet.toml");
    std::fs::write(&fleet, workers).expect("write the fleet file");
    let mut args = vec![
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--fleet",
        fleet.to_str().expect("utf-8 path"),
        "--model",
        &model,
    ];
    args.extend_from_slice(extra);
    let serve = Proc::start(&args, &dir.join("serve.log"));
    listed(Fleet {
        base: format!("http://{}", serve.field("http")),
        serve,
        workers: Vec::new(),
        http: client(),
    })
    .await
}

/// `fleet`, once its router lists both workers.
async fn listed(fleet: Fleet) -> Fleet {
    fleet
        .eventually("the router to list both workers", |m| {
            (1..=2).all(|w| active_requests(m, w).is_some())
        })
        .await;
    fleet
}

/// The router's counter `name` (no labels).
fn counter(metrics: &str, name: &str) -> f64 {
    let prefix = format!("kvroute_router_{name} ");
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(&prefix)?.trim().parse().ok())
        .unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sidecars_over_engine_sim_route_a_repeated_prompt_to_the_engine_with_its_events() {
    let sim = EngineSim::start("fleet", 2);
    let fleet = fleet_over(&sim, "fleet").await;
    a_repeated_prompt_goes_to_the_engine_with_its_events(&fleet).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_static_fleet_over_engine_sim_routes_a_repeated_prompt_to_the_engine_with_its_events() {
    let sim = EngineSim::start("static-fleet", 2);
    let fleet = static_fleet_over(&sim, "static-fleet", "").await;
    a_repeated_prompt_goes_to_the_engine_with_its_events(&fleet).await;
}

/// A static fleet's engines state their load, and with it their KV capacity, to the router as
/// soon as it starts, not a report interval later: the router subscribes before the engines'
/// first reports are forwarded (`serve::start`). With the engines' load read once an hour, only
/// that first report can arrive; before the fix it was sent before the router listened, and the
/// first second of requests was routed blind to every engine's capacity.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_static_fleets_first_load_reports_reach_the_router_at_start() {
    let sim = EngineSim::start("first-reports", 2);
    let fleet =
        static_fleet_over(&sim, "first-reports", "load_report_interval_ms = 3600000\n").await;
    fleet
        .eventually(
            "both engines' first load reports to reach the router",
            |m| (1..=2).all(|w| gauge(m, "worker_reported_requests", w) == Some(0.0)),
        )
        .await;
}

/// Four long prompts, each sent until the router predicts it cached (its engine's KV events
/// reached the router's index), then on the worker that served it first, which reports cached
/// tokens; every load back to zero after.
async fn a_repeated_prompt_goes_to_the_engine_with_its_events(fleet: &Fleet) {
    let nvext = json!({"extra_fields": ["worker_id"]});
    let body = |tag: &str| {
        let messages = json!([{"role": "user", "content": long_prompt(tag)}]);
        json!({"model": "mock", "messages": messages, "max_tokens": 4, "nvext": nvext})
    };
    for tag in ["a", "b", "c", "d"] {
        let (status, first) = fleet.chat(&body(tag), None).await;
        assert_eq!(status, 200, "{first}");
        let home = crate::e2e::decode_worker(&first);
        // The engine's events reach the router's index: the repeat is predicted cached there.
        let before = counter(
            &fleet.router_metrics().await,
            "predicted_cached_tokens_total",
        );
        let mut predicted = before;
        let deadline = tokio::time::Instant::now() + BOUND;
        while predicted <= before {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the router never predicted prompt {tag} cached: no KV events arrived"
            );
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            let (status, again) = fleet.chat(&body(tag), None).await;
            assert_eq!(status, 200, "{again}");
            let metrics = fleet.router_metrics().await;
            predicted = counter(&metrics, "predicted_cached_tokens_total");
            if predicted > before {
                assert_eq!(crate::e2e::decode_worker(&again), home, "prompt {tag}");
                let usage = &again["usage"];
                assert!(cached(usage) > 0, "engine-reported cached tokens: {usage}");
            }
        }
    }
    fleet.assert_idle(&[1, 2]).await;
    let metrics = fleet.router_metrics().await;
    for worker in [1, 2] {
        assert_eq!(gauge(&metrics, "worker_active_blocks", worker), Some(0.0));
    }
}
