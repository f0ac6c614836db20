//! `cargo xtask bench frontend-vs-reference`: the reference's frontend and mocker (NVIDIA Dynamo
//! 1.6.1's `python -m dynamo.frontend --router-mode kv` with `python -m dynamo.mocker`, 4 workers
//! at 100000x speed, no etcd or NATS) and kvroute (`kvroute serve` with 4 `kvroute worker
//! --mock` at the same speed) under the same chat workload from one Rust load generator, printed
//! as one side-by-side table.
//!
//! Both serve the same locally made model directory (the tiny llama of
//! `tests/python/llamacpp/make_model.py`: its `tokenizer.json`, ChatML template and `config.json`),
//! so both cut the same prompts into the same tokens. Both systems stay up for the whole bench;
//! the runs alternate (each scenario runs on one system, then at once on the other, and the order
//! flips every round) so that drifting background load hits both alike. Every child runs in a
//! process group of its own and is killed when the bench ends, fails or is interrupted.

mod load;

use std::fmt::Write as _;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Parser;
use serde_json::Value;

use crate::cmd::{cargo_command, home_cache, run_command};
use crate::procs::{Proc, TempDir, block_on_interruptible};
use crate::python;
use load::{Figures, Pacing, Scenario, Window, Workload};

/// The bench's name after `cargo xtask bench`.
pub(crate) const NAME: &str = "frontend-vs-reference";

/// The model name both systems serve.
const MODEL: &str = "tiny";
/// Simulated engines per system.
const WORKERS: usize = 4;
/// Tokens per KV block, on both sides.
const BLOCK_SIZE: u32 = 16;
/// How much faster than the modelled GPU both mock engines run: effectively instantaneous.
const SPEEDUP: u32 = 100_000;
/// How long a system may take to start and list every worker (the reference's Python start-up
/// takes 10-30 s on a busy 2-core machine).
const START_BOUND: Duration = Duration::from_secs(180);
/// The concurrency of the closed-loop runs.
const CLOSED_CLIENTS: [usize; 2] = [1, 32];

/// kvroute's mock engine, sized as the reference's mocker runs by default (16,384 blocks, 256
/// sequences, 8,192 batched tokens, its polynomial timing and whole-prompt admission) but with
/// the bench's block size, speed and the tokenizer's vocabulary (so the text it generates decodes).
const KVROUTE_MOCKER_CONFIG: &str = "\
block_size = 16
num_blocks = 16384
max_num_seqs = 256
max_num_batched_tokens = 8192
admission = \"whole-prompt\"
vocab_size = 512
speedup = 100000.0

[timing]
model = \"polynomial\"
";

/// Options of `cargo xtask bench frontend-vs-reference`.
#[derive(Debug, Parser, PartialEq)]
#[command(
    name = "cargo xtask bench frontend-vs-reference",
    about = "The reference's frontend (Dynamo 1.6.1) and kvroute serve, each over 4 mock workers, \
             under the same chat load, side by side"
)]
pub(crate) struct Args {
    /// Rounds; each runs every scenario on both systems, alternating which goes first.
    #[arg(long, default_value_t = 2, value_name = "N")]
    rounds: u32,
    /// Warm-up before each measured window, in seconds.
    #[arg(long, default_value_t = 2.0, value_name = "SECONDS")]
    warm_up: f64,
    /// Length of each measured window, in seconds.
    #[arg(long, default_value_t = 5.0, value_name = "SECONDS")]
    measure: f64,
    /// Offered load of the open-loop run (streamed), in requests per second; the same for both.
    #[arg(long, default_value_t = 300.0, value_name = "REQ_PER_S")]
    rate: f64,
}

impl Args {
    /// Parses the bench's arguments (what follows the bench's name) and checks their ranges.
    pub(crate) fn parse(args: &[String]) -> Result<Self> {
        let argv = std::iter::once(NAME.to_owned()).chain(args.iter().cloned());
        let parsed = Self::try_parse_from(argv).map_err(|e| anyhow::anyhow!("{e}"))?;
        parsed.check()?;
        Ok(parsed)
    }

    fn check(&self) -> Result<()> {
        if !(1..=10).contains(&self.rounds) {
            bail!("--rounds must be 1 to 10, got {}", self.rounds);
        }
        if !(0.0..=60.0).contains(&self.warm_up) {
            bail!("--warm-up must be 0 to 60 seconds, got {}", self.warm_up);
        }
        if !(0.5..=600.0).contains(&self.measure) {
            bail!("--measure must be 0.5 to 600 seconds, got {}", self.measure);
        }
        if !(1.0..=20_000.0).contains(&self.rate) {
            bail!(
                "--rate must be 1 to 20000 requests per second, got {}",
                self.rate
            );
        }
        Ok(())
    }

    fn window(&self) -> Window {
        Window {
            warm_up: Duration::from_secs_f64(self.warm_up),
            measure: Duration::from_secs_f64(self.measure),
        }
    }

    /// The scenarios of a round, in order.
    fn scenarios(&self) -> Vec<Scenario> {
        let mut out = Vec::new();
        for clients in CLOSED_CLIENTS {
            for stream in [false, true] {
                out.push(Scenario {
                    pacing: Pacing::Closed { clients },
                    stream,
                });
            }
        }
        out.push(Scenario {
            pacing: Pacing::Open { rate: self.rate },
            stream: true,
        });
        out
    }
}

/// The two systems, in the table's order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum System {
    Reference,
    Kvroute,
}

impl System {
    fn name(self) -> &'static str {
        match self {
            System::Reference => "reference",
            System::Kvroute => "kvroute",
        }
    }
}

/// A running system: its processes and its chat completions address.
struct Running {
    system: System,
    procs: Vec<Proc>,
    url: String,
}

impl Running {
    fn check_alive(&mut self) -> Result<()> {
        for p in &mut self.procs {
            p.check_alive()?;
        }
        Ok(())
    }

    fn log_tails(&self) -> String {
        self.procs
            .iter()
            .map(Proc::log_tail)
            .collect::<Vec<_>>()
            .join("\n")
    }
}

/// One scenario's figures, every round, for both systems.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Row {
    pub(crate) scenario: Scenario,
    pub(crate) reference: Vec<Figures>,
    pub(crate) kvroute: Vec<Figures>,
}

/// Runs the bench.
pub(crate) fn run(root: &Path, args: &[String]) -> Result<()> {
    let args = Args::parse(args)?;
    let venv = home_cache().join("reference-venv");
    let python = python::ensure_reference(&venv).with_context(|| {
        format!(
            "the reference (Dynamo 1.6.1) is not installable into {}: it needs python3 with the \
             venv module and a reachable Python package registry",
            venv.display()
        )
    })?;

    eprintln!("building kvroute (release)");
    run_command(cargo_command().current_dir(root).args([
        "build",
        "--release",
        "--locked",
        "-p",
        "kvroute",
    ]))?;
    let target = target_directory(root)?;
    let kvroute = target.join("release").join("kvroute");
    let logs = target.join(NAME);
    std::fs::create_dir_all(&logs).with_context(|| format!("cannot create {}", logs.display()))?;

    let scratch = TempDir::new("kvroute-frontend-vs-reference")?;
    let model = scratch.0.join("model");
    eprintln!("writing the model directory {}", model.display());
    make_model(root, &python, &model)?;

    let setup = Setup {
        python,
        kvroute,
        model,
        scratch: scratch.0.clone(),
        logs: logs.clone(),
    };
    let result = block_on_interruptible(bench(&setup, &args));
    eprintln!("logs of both systems: {}", logs.display());
    drop(scratch);
    result
}

/// What the bench runs with.
struct Setup {
    python: PathBuf,
    kvroute: PathBuf,
    /// The model directory both systems serve.
    model: PathBuf,
    /// A temporary directory for the reference's file store and kvroute's mocker config.
    scratch: PathBuf,
    /// Where each process's log goes.
    logs: PathBuf,
}

async fn bench(setup: &Setup, args: &Args) -> Result<()> {
    let scenarios = args.scenarios();
    let window = args.window();
    let total = 2 + args.rounds as usize * scenarios.len() * 2;
    let mut step = 0;
    let mut progress = |what: &str| {
        step += 1;
        eprintln!("[{step}/{total}] {what}");
    };

    let http = load::client()?;
    progress(&format!(
        "starting the reference: dynamo.mocker ({WORKERS} workers, {SPEEDUP}x) and \
         dynamo.frontend (--router-mode kv)"
    ));
    let started = Instant::now();
    let mut reference = start_reference(setup, &http).await?;
    eprintln!("      ready in {:.1} s", started.elapsed().as_secs_f64());
    progress(&format!(
        "starting kvroute: serve and {WORKERS} `worker --mock` ({SPEEDUP}x)"
    ));
    let started = Instant::now();
    let mut kvroute = start_kvroute(setup, &http).await?;
    eprintln!("      ready in {:.1} s", started.elapsed().as_secs_f64());

    let workload = Arc::new(Workload::new(MODEL));
    let mut prompts = Vec::new();
    for system in [&mut reference, &mut kvroute] {
        let prompt = probe(&http, system, &workload).await?;
        eprintln!(
            "      {}: a probe request's prompt is {prompt} tokens",
            system.system.name()
        );
        prompts.push(prompt);
    }
    if prompts[0] != prompts[1] {
        bail!(
            "the two systems cut the same chat into different token counts (reference {}, \
             kvroute {}): they must serve the same tokenizer and template",
            prompts[0],
            prompts[1]
        );
    }

    let mut rows: Vec<Row> = scenarios
        .iter()
        .map(|&scenario| Row {
            scenario,
            reference: Vec::new(),
            kvroute: Vec::new(),
        })
        .collect();
    for round in 1..=args.rounds {
        for row in &mut rows {
            let order: [&mut Running; 2] = if round % 2 == 1 {
                [&mut reference, &mut kvroute]
            } else {
                [&mut kvroute, &mut reference]
            };
            for system in order {
                progress(&format!(
                    "round {round}/{}: {}, {} ({:.0} s warm-up + {:.0} s)",
                    args.rounds,
                    system.system.name(),
                    row.scenario.label(),
                    window.warm_up.as_secs_f64(),
                    window.measure.as_secs_f64()
                ));
                system.check_alive()?;
                let cpu_before = own_cpu_seconds();
                let figures = load::run(&http, &system.url, &workload, row.scenario, window).await;
                let cpu = own_cpu_seconds().zip(cpu_before).map(|(a, b)| a - b);
                system.check_alive()?;
                eprintln!("      {}", summary(&figures, cpu, window));
                if figures.ok == 0 {
                    bail!(
                        "{}: no request of `{}` succeeded{}\n{}",
                        system.system.name(),
                        row.scenario.label(),
                        figures
                            .first_error
                            .as_deref()
                            .map(|e| format!(" (first error: {e})"))
                            .unwrap_or_default(),
                        system.log_tails()
                    );
                }
                match system.system {
                    System::Reference => row.reference.push(figures),
                    System::Kvroute => row.kvroute.push(figures),
                }
            }
        }
    }
    drop((reference, kvroute));

    println!(
        "{WORKERS} mock workers per system at {SPEEDUP}x, block size {BLOCK_SIZE}; chat prompts \
         of about {} tokens (the probe's, the same on both) in {} shared-prefix families, {} \
         output tokens; {} round(s), {:.0} s \
         warm-up + {:.0} s measured per run; figures are `min-max` over rounds; the last column \
         is kvroute's advantage over the reference (mean over rounds; above 1: kvroute better)",
        prompts[0],
        load::FAMILIES,
        load::OUTPUT_TOKENS,
        args.rounds,
        window.warm_up.as_secs_f64(),
        window.measure.as_secs_f64()
    );
    print!("{}", table(&rows));
    Ok(())
}

/// The progress line of one run.
fn summary(f: &Figures, client_cpu: Option<f64>, window: Window) -> String {
    let ms = |v: Option<f64>| v.map_or_else(|| "-".to_owned(), format_ms);
    let mut out = format!("{:.0} req/s, {} ok, {} errors", f.req_per_s, f.ok, f.errors);
    if f.ttft_p50_ms.is_some() {
        let _ = write!(
            out,
            ", TTFT p50/p99 {}/{} ms",
            ms(f.ttft_p50_ms),
            ms(f.ttft_p99_ms)
        );
    }
    let _ = write!(
        out,
        ", E2E p50/p99 {}/{} ms",
        ms(f.e2e_p50_ms),
        ms(f.e2e_p99_ms)
    );
    if let Some(cpu) = client_cpu {
        let seconds = (window.warm_up + window.measure).as_secs_f64();
        let _ = write!(
            out,
            "; load generator {:.0}% of a core",
            cpu / seconds * 100.0
        );
    }
    if let Some(e) = &f.first_error {
        let _ = write!(out, "; first error: {e}");
    }
    out
}

/// This process's CPU time (user + system, every thread) in seconds, from `/proc/self/stat`
/// (in clock ticks, 100 a second on Linux).
fn own_cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // The command name may hold spaces; the fields after its closing parenthesis do not.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the whole line, 12 and 13 after the name.
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    Some(ticks as f64 / 100.0)
}

/// Writes the model directory with the shared test script, using the reference's venv (which
/// has its `gguf` and `numpy`).
fn make_model(root: &Path, python: &Path, dir: &Path) -> Result<()> {
    let script = root.join("tests/python/llamacpp/make_model.py");
    let output = Command::new(python)
        .arg(&script)
        .arg(dir)
        .args(["--seed", "0"])
        .output()
        .with_context(|| format!("could not start {}", python.display()))?;
    if !output.status.success() {
        bail!(
            "{} failed ({}):\n{}",
            script.display(),
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
    }
    for file in [
        "tokenizer.json",
        "template.jinja",
        "tokenizer_config.json",
        "config.json",
    ] {
        anyhow::ensure!(
            dir.join(file).exists(),
            "{} wrote no {file} into {}",
            script.display(),
            dir.display()
        );
    }
    Ok(())
}

/// A free TCP port on loopback (free when asked; the reference binds it a moment later).
fn free_port() -> Result<u16> {
    let listener = TcpListener::bind("127.0.0.1:0").context("finding a free loopback port")?;
    Ok(listener.local_addr()?.port())
}

async fn start_reference(setup: &Setup, http: &reqwest::Client) -> Result<Running> {
    let store = setup.scratch.join("file-kv");
    std::fs::create_dir_all(&store)
        .with_context(|| format!("cannot create {}", store.display()))?;
    let port = free_port()?;
    let reference_env = |cmd: &mut Command| {
        cmd.env("DYN_FILE_KV", &store)
            // Warnings only, as kvroute runs: the frontend otherwise logs a line per request.
            .env("DYN_LOG", "warn")
            // Keep the request and event planes on loopback.
            .env("DYN_TCP_RPC_HOST", "127.0.0.1")
            .env("DYN_EVENT_PLANE_HOST", "127.0.0.1")
            .current_dir(&setup.scratch);
    };
    let mut mocker = Command::new(&setup.python);
    mocker
        .args(["-m", "dynamo.mocker", "--model-path"])
        .arg(&setup.model)
        .args(["--model-name", MODEL])
        .args(["--num-workers", &WORKERS.to_string()])
        .args(["--speedup-ratio", &SPEEDUP.to_string()])
        .args(["--block-size", &BLOCK_SIZE.to_string()])
        .args([
            "--discovery-backend",
            "file",
            "--request-plane",
            "tcp",
            "--event-plane",
            "zmq",
        ]);
    reference_env(&mut mocker);
    let mocker = Proc::spawn(
        "the reference's mocker",
        &mut mocker,
        &setup.logs.join("reference-mocker.log"),
    )?;
    let mut frontend = Command::new(&setup.python);
    frontend
        .args(["-m", "dynamo.frontend", "--http-host", "127.0.0.1"])
        .args(["--http-port", &port.to_string()])
        .args(["--router-mode", "kv"])
        .args(["--kv-cache-block-size", &BLOCK_SIZE.to_string()])
        .args([
            "--discovery-backend",
            "file",
            "--request-plane",
            "tcp",
            "--event-plane",
            "zmq",
        ]);
    reference_env(&mut frontend);
    let frontend = Proc::spawn(
        "the reference's frontend",
        &mut frontend,
        &setup.logs.join("reference-frontend.log"),
    )?;
    let base = format!("http://127.0.0.1:{port}");
    let mut running = Running {
        system: System::Reference,
        procs: vec![mocker, frontend],
        url: format!("{base}/v1/chat/completions"),
    };
    let health = format!("{base}/health");
    let models = format!("{base}/v1/models");
    wait_until(
        &mut running,
        "its frontend to list the model and every worker",
        || async {
            let generate = get_json(http, &health)
                .await
                .map(|h| generate_instances(&h));
            let listed = get_json(http, &models)
                .await
                .map(|m| lists_model(&m, MODEL));
            matches!((generate, listed), (Some(n), Some(true)) if n >= WORKERS)
        },
    )
    .await?;
    Ok(running)
}

async fn start_kvroute(setup: &Setup, http: &reqwest::Client) -> Result<Running> {
    let config = setup.scratch.join("mocker.toml");
    std::fs::write(&config, KVROUTE_MOCKER_CONFIG)
        .with_context(|| format!("cannot write {}", config.display()))?;
    let model = format!(
        "{MODEL},tokenizer={},chat_template={}",
        setup.model.join("tokenizer.json").display(),
        setup.model.join("template.jinja").display()
    );
    let mut serve = Command::new(&setup.kvroute);
    serve
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--registry-listen",
            "127.0.0.1:0",
        ])
        .args(["--block-size", &BLOCK_SIZE.to_string()])
        // The reference's `--router-mode kv` cost (kvroute's default is kv-adaptive).
        .args(["--policy", "kv"])
        .args(["--model", &model])
        .env("RUST_LOG", "warn");
    let (serve, line) = Proc::spawn_with_ready_line(
        "kvroute serve",
        &mut serve,
        &setup.logs.join("kvroute-serve.log"),
        Duration::from_secs(30),
    )
    .await?;
    let (Some(http_addr), Some(registry)) = (field(&line, "http"), field(&line, "registry")) else {
        bail!("kvroute serve's readiness line names no http= and registry=: {line:?}");
    };
    let mut procs = vec![serve];
    for id in 1..=WORKERS {
        let mut worker = Command::new(&setup.kvroute);
        worker
            .args([
                "worker",
                "--mock",
                "--id",
                &id.to_string(),
                "--router",
                &registry,
            ])
            .arg("--mocker-config")
            .arg(&config)
            .env("RUST_LOG", "warn");
        let (worker, _) = Proc::spawn_with_ready_line(
            &format!("kvroute worker {id}"),
            &mut worker,
            &setup.logs.join(format!("kvroute-worker-{id}.log")),
            Duration::from_secs(30),
        )
        .await?;
        procs.push(worker);
    }
    let base = format!("http://{http_addr}");
    let mut running = Running {
        system: System::Kvroute,
        procs,
        url: format!("{base}/v1/chat/completions"),
    };
    let metrics = format!("{base}/metrics");
    wait_until(&mut running, "the router to list every worker", || async {
        match http.get(&metrics).send().await {
            Ok(r) => r.text().await.is_ok_and(|m| listed_workers(&m) >= WORKERS),
            Err(_) => false,
        }
    })
    .await?;
    Ok(running)
}

/// Polls `ready` every 250 ms until it holds, failing if a process of `running` exits or
/// [`START_BOUND`] passes.
async fn wait_until<F, Fut>(running: &mut Running, what: &str, mut ready: F) -> Result<()>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + START_BOUND;
    loop {
        running
            .check_alive()
            .with_context(|| format!("{} did not start", running.system.name()))?;
        if ready().await {
            return Ok(());
        }
        if Instant::now() >= deadline {
            bail!(
                "{}: waited {START_BOUND:?} for {what}\n{}",
                running.system.name(),
                running.log_tails()
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// One non-streamed request that must succeed; returns its prompt's token count.
async fn probe(http: &reqwest::Client, running: &mut Running, workload: &Workload) -> Result<u64> {
    let name = running.system.name();
    let response = http
        .post(&running.url)
        .json(&workload.body(u64::MAX, false))
        .send()
        .await
        .with_context(|| format!("{name}: the probe request failed\n{}", running.log_tails()))?;
    let status = response.status();
    let text = response.text().await.unwrap_or_default();
    if !status.is_success() {
        bail!(
            "{name}: the probe request answered {status}: {text}\n{}",
            running.log_tails()
        );
    }
    let answer: Value = serde_json::from_str(&text)
        .with_context(|| format!("{name}: the probe's answer is not JSON: {text}"))?;
    load::check_answer(&answer).with_context(|| format!("{name}: the probe's answer"))?;
    answer["usage"]["prompt_tokens"]
        .as_u64()
        .with_context(|| format!("{name}: the probe's answer has no usage.prompt_tokens: {text}"))
}

async fn get_json(http: &reqwest::Client, url: &str) -> Option<Value> {
    http.get(url).send().await.ok()?.json().await.ok()
}

/// How many `generate` endpoints the reference's `/health` lists (one per mock worker).
pub(crate) fn generate_instances(health: &Value) -> usize {
    health["instances"].as_array().map_or(0, |list| {
        list.iter().filter(|i| i["endpoint"] == "generate").count()
    })
}

/// Whether an OpenAI `/v1/models` answer lists `model`.
pub(crate) fn lists_model(models: &Value, model: &str) -> bool {
    models["data"]
        .as_array()
        .is_some_and(|list| list.iter().any(|m| m["id"] == model))
}

/// How many workers kvroute's `/metrics` reports an active-request gauge for.
pub(crate) fn listed_workers(metrics: &str) -> usize {
    metrics
        .lines()
        .filter(|l| l.starts_with("kvroute_router_worker_active_requests{"))
        .count()
}

/// The value of `key=` in a readiness line of `key=value` words.
pub(crate) fn field(line: &str, key: &str) -> Option<String> {
    line.split_whitespace()
        .filter_map(|w| w.split_once('='))
        .find(|(k, _)| *k == key)
        .map(|(_, v)| v.to_owned())
}

/// Which way a figure is better.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Better {
    Higher,
    Lower,
}

/// The side-by-side table: per scenario, a line per figure (req/s; TTFT p50 and p99 when
/// streamed; E2E p50 and p99; errors when there were any) with both systems' figures as
/// `min-max` over rounds and kvroute's advantage (the ratio of the rounds' means, oriented so that
/// above 1 is kvroute better).
pub(crate) fn table(rows: &[Row]) -> String {
    type Pick = fn(&Figures) -> Option<f64>;
    let mut lines: Vec<[String; 5]> = vec![[
        "scenario".to_owned(),
        "figure".to_owned(),
        "reference".to_owned(),
        "kvroute".to_owned(),
        "kvroute advantage".to_owned(),
    ]];
    for row in rows {
        let mut figures: Vec<(&str, Pick, Better)> =
            vec![("req/s", |f| Some(f.req_per_s), Better::Higher)];
        if row.scenario.stream {
            figures.push(("TTFT p50 (ms)", |f| f.ttft_p50_ms, Better::Lower));
            figures.push(("TTFT p99 (ms)", |f| f.ttft_p99_ms, Better::Lower));
        }
        figures.push(("E2E p50 (ms)", |f| f.e2e_p50_ms, Better::Lower));
        figures.push(("E2E p99 (ms)", |f| f.e2e_p99_ms, Better::Lower));
        let errors = row
            .reference
            .iter()
            .chain(&row.kvroute)
            .any(|f| f.errors > 0);
        let label = row.scenario.label();
        for (i, (name, pick, better)) in figures.into_iter().enumerate() {
            let reference: Vec<f64> = row.reference.iter().filter_map(pick).collect();
            let kvroute: Vec<f64> = row.kvroute.iter().filter_map(pick).collect();
            let format = if name == "req/s" {
                thousands
            } else {
                format_ms
            };
            lines.push([
                if i == 0 { label.clone() } else { String::new() },
                name.to_owned(),
                range(&reference, format),
                range(&kvroute, format),
                advantage(&reference, &kvroute, better),
            ]);
        }
        if errors {
            let count = |f: &Figures| Some(f.errors as f64);
            let reference: Vec<f64> = row.reference.iter().filter_map(count).collect();
            let kvroute: Vec<f64> = row.kvroute.iter().filter_map(count).collect();
            lines.push([
                String::new(),
                "errors".to_owned(),
                range(&reference, thousands),
                range(&kvroute, thousands),
                String::new(),
            ]);
        }
    }
    render(&lines)
}

/// Markdown table with names left and figures right, columns padded to their widest cell.
fn render(lines: &[[String; 5]]) -> String {
    crate::table::markdown(lines, 2)
}

/// `values` as one figure, or `min-max` when they format differently; `-` when there are none.
fn range(values: &[f64], format: fn(f64) -> String) -> String {
    if values.is_empty() {
        return "-".to_owned();
    }
    let min = values.iter().copied().fold(f64::INFINITY, f64::min);
    let max = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let (lo, hi) = (format(min), format(max));
    if lo == hi { lo } else { format!("{lo}-{hi}") }
}

/// kvroute's advantage: the ratio of the means, above 1 when kvroute is better.
fn advantage(reference: &[f64], kvroute: &[f64], better: Better) -> String {
    let mean = |v: &[f64]| (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64);
    let (Some(r), Some(k)) = (mean(reference), mean(kvroute)) else {
        return "-".to_owned();
    };
    let ratio = match better {
        Better::Higher => k / r,
        Better::Lower => r / k,
    };
    if ratio.is_finite() {
        format!("{ratio:.2}x")
    } else {
        "-".to_owned()
    }
}

/// Milliseconds with two significant decimals below 10, one below 100, none above.
fn format_ms(ms: f64) -> String {
    if ms < 10.0 {
        format!("{ms:.2}")
    } else if ms < 100.0 {
        format!("{ms:.1}")
    } else {
        thousands(ms)
    }
}

use crate::table::{target_directory, thousands};

#[cfg(test)]
mod tests;
