//! `cargo xtask bench peers`: kvroute against the routers teams choose instead — SGLang's Shepherd
//! Model Gateway (PyPI `smg` 1.13.0) and vLLM's router (PyPI `vllm-router` 0.1.17), both Rust
//! binaries in their wheels — in front of the same simulated vLLM fleet, under the evaluation
//! workloads replayed in real time.
//!
//! For every cell (fleet size, workload) and every router configuration ([`Config`]) a run starts
//! a fresh fleet (`kvroute engine-sim --dialect vllm --kv-events`: kvroute-mocker's engine behind
//! vLLM's HTTP API, metrics and ZMQ KV events), the router in front of it, and replays the
//! workload's trace (`kvroute replay --workload NAME --write-trace`) open-loop at its own arrival
//! times divided by `--speedup` (the engines run that much faster than the modelled H100, so the
//! load they see is the workload's). Every router gets the same requests: text completions whose
//! words stand one-for-one for the trace's tokens, so text-routing and token-routing routers see
//! the same prefixes (`load.rs`). Rounds alternate the order of the configurations.
//!
//! Figures per run: the hit rate the engines reported in each response's `usage` and the one
//! their own counters give, TTFT p50/p99 and E2E p99 (real milliseconds, from each request's
//! scheduled send time), output tokens per second, errors, and the router's CPU seconds per 1,000
//! requests and peak RSS (every process of its process group, from `/proc`). kvroute's own
//! predicted hit rate (its cache-report counters) is printed beside the reported one.
//!
//! `--quick` is CI's smoke test: one small cell, every configuration once; it fails unless every
//! router served every request and every table was produced (rankings are not asserted).

pub(crate) mod fleet;
pub(crate) mod load;
mod routers;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::Parser;

use crate::cmd::{build_kvroute, run_command};
use crate::procs::{TempDir, block_on_interruptible};
use crate::python;
use crate::table::target_directory;
use load::{Figures, Shape};
use routers::{Binaries, Config};

/// The bench's name after `cargo xtask bench`.
pub(crate) const NAME: &str = "peers";
/// The share of sessions of the non-agentic workloads by default.
const DEFAULT_SCALE: f64 = 0.15;

/// Options of `cargo xtask bench peers`.
#[derive(Debug, Parser, PartialEq)]
#[command(
    name = "cargo xtask bench peers",
    about = "kvroute, SGLang's SMG and vLLM's router in front of the same simulated vLLM fleet, \
             under the evaluation workloads in real time, side by side"
)]
pub(crate) struct Args {
    /// Fleet sizes (engines), comma-separated.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "8,32",
        value_name = "N,..."
    )]
    engines: Vec<usize>,
    /// Workloads (`kvroute replay --workload` names), comma-separated.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "agentic,agentic-tools,multi-turn,rag,bursty",
        value_name = "NAME,..."
    )]
    workloads: Vec<String>,
    /// Router configurations, comma-separated [default: all].
    #[arg(long, value_enum, value_delimiter = ',', value_name = "CONFIG,...")]
    routers: Vec<Config>,
    /// Rounds; each runs every configuration once, in the other order from the round before.
    #[arg(long, default_value_t = 2, value_name = "N")]
    rounds: u32,
    /// Sessions of every workload, as a share of its full size (`kvroute replay
    /// --workload-scale`) [default: 1 for the agentic workloads, whose few long sessions arrive
    /// slowly, 0.15 for the others, so that each run offers the router tens of requests a
    /// second on two cores].
    #[arg(long, value_name = "SHARE")]
    workload_scale: Option<f64>,
    /// Prompt and output tokens, as a share of the trace's (the engines' KV capacity is scaled
    /// alike).
    #[arg(long, default_value_t = 0.125, value_name = "SHARE")]
    token_scale: f64,
    /// Arrivals come this many times faster than the trace's, and the engines run as much
    /// faster than the modelled H100.
    #[arg(long, default_value_t = 40.0, value_name = "X")]
    speedup: f64,
    /// Each run replays the trace's requests that arrive within this many (real) seconds.
    #[arg(long, default_value_t = 4.0, value_name = "SECONDS")]
    duration: f64,
    /// The workloads' seed.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// An extra argument for both `kvroute serve` configurations (repeatable), to try a policy
    /// or a weight against the same runs: `--kvroute-arg=--policy --kvroute-arg=kv`.
    #[arg(long = "kvroute-arg", value_name = "ARG", allow_hyphen_values = true)]
    kvroute_args: Vec<String>,
    /// CI's smoke test: 4 engines, `multi-turn` only, one round of every configuration, short.
    #[arg(long)]
    quick: bool,
}

impl Args {
    /// Parses the bench's arguments (what follows the bench's name), applies `--quick` and checks
    /// the ranges.
    pub(crate) fn parse(args: &[String]) -> Result<Self> {
        let argv = std::iter::once(NAME.to_owned()).chain(args.iter().cloned());
        let mut parsed = Self::try_parse_from(argv).map_err(|e| anyhow::anyhow!("{e}"))?;
        if parsed.routers.is_empty() {
            parsed.routers = Config::ALL.to_vec();
        }
        if parsed.quick {
            parsed.engines = vec![4];
            parsed.workloads = vec!["multi-turn".to_owned()];
            parsed.rounds = 1;
            parsed.workload_scale = Some(parsed.workload_scale.unwrap_or(0.03).min(0.03));
            parsed.duration = parsed.duration.min(3.0);
        }
        parsed.check()?;
        Ok(parsed)
    }

    fn check(&self) -> Result<()> {
        if self.engines.is_empty() || self.engines.iter().any(|&n| !(1..=64).contains(&n)) {
            bail!(
                "--engines must list 1 to 64 engines each, got {:?}",
                self.engines
            );
        }
        const NAMES: [&str; 5] = ["agentic", "agentic-tools", "multi-turn", "rag", "bursty"];
        if let Some(bad) = self.workloads.iter().find(|w| !NAMES.contains(&w.as_str())) {
            bail!(
                "unknown workload `{bad}`: expected one of {}",
                NAMES.join(", ")
            );
        }
        if !(1..=10).contains(&self.rounds) {
            bail!("--rounds must be 1 to 10, got {}", self.rounds);
        }
        for (name, value, low, high) in [
            (
                "--workload-scale",
                self.workload_scale.unwrap_or(1.0),
                0.001,
                1.0,
            ),
            ("--token-scale", self.token_scale, 0.01, 1.0),
            ("--speedup", self.speedup, 1.0, 1000.0),
            ("--duration", self.duration, 0.5, 600.0),
        ] {
            if !(value.is_finite() && (low..=high).contains(&value)) {
                bail!("{name} must be {low} to {high}, got {value}");
            }
        }
        Ok(())
    }

    /// The share of `workload`'s sessions its trace holds.
    fn scale(&self, workload: &str) -> f64 {
        self.workload_scale.unwrap_or(match workload {
            "agentic" | "agentic-tools" => 1.0,
            _ => DEFAULT_SCALE,
        })
    }

    fn shape(&self) -> Shape {
        Shape {
            token_scale: self.token_scale,
            speedup: self.speedup,
            max_duration: Duration::from_secs_f64(self.duration),
            vocabulary: fleet::VOCABULARY,
        }
    }
}

/// One table cell's runs: (fleet size, workload) → configuration → one entry per round.
type Results = BTreeMap<(usize, String), BTreeMap<Config, Vec<Run>>>;

/// One run's outcome.
#[derive(Debug, Clone)]
pub(crate) struct Run {
    figures: Figures,
    /// kvroute's predicted hit rate over the requests the engines reported on.
    predicted: Option<f64>,
    /// Why the router could not be run at all.
    failed: Option<String>,
}

/// Runs the bench.
pub(crate) fn run(root: &Path, args: &[String]) -> Result<()> {
    let args = Args::parse(args)?;
    let venv = python::venv_dir(root);
    let python = python::ensure(root, &venv)?;
    let bin_dir = python
        .parent()
        .context("the venv's interpreter has no directory")?
        .to_path_buf();
    // The smoke test runs the debug build CI's tests already made; figures need the release.
    let kvroute = build_kvroute(root, !args.quick)?;
    let target = target_directory(root)?;
    let logs = target.join("bench-peers");
    std::fs::create_dir_all(&logs).with_context(|| format!("cannot create {}", logs.display()))?;
    let scratch = TempDir::new("kvroute-bench-peers")?;
    let binaries = Binaries {
        kvroute,
        smg: bin_dir.join("smg"),
        vllm_router: bin_dir.join("vllm-router"),
        tokenizer: fleet::write_tokenizer(&scratch.0)?,
    };
    let traces = write_traces(&binaries.kvroute, &args, &scratch.0)?;
    let mocker = fleet::write_mocker_config(&scratch.0, args.token_scale, args.speedup)?;

    let setup = Setup {
        binaries,
        mocker,
        scratch: scratch.0.clone(),
        logs: logs.clone(),
        traces,
    };
    let result = block_on_interruptible(bench(&setup, &args));
    eprintln!("logs of every run: {}", logs.display());
    let results = result?;
    let report = report(&args, &results);
    print!("{report}");
    let path = logs.join("results.md");
    std::fs::write(&path, &report).with_context(|| format!("writing {}", path.display()))?;
    eprintln!("tables written to {}", path.display());
    if args.quick {
        check_quick(&results)?;
    }
    Ok(())
}

/// What the runs start from.
struct Setup {
    binaries: Binaries,
    mocker: PathBuf,
    scratch: PathBuf,
    logs: PathBuf,
    /// Workload name → its trace text.
    traces: BTreeMap<String, String>,
}

/// Writes each workload's trace with `kvroute replay --write-trace`; returns their texts.
fn write_traces(kvroute: &Path, args: &Args, dir: &Path) -> Result<BTreeMap<String, String>> {
    let mut out = BTreeMap::new();
    for workload in &args.workloads {
        let path = dir.join(format!("{workload}.jsonl"));
        run_command(
            Command::new(kvroute)
                .args(["replay", "--workload", workload])
                .args(["--workload-scale", &args.scale(workload).to_string()])
                .args(["--seed", &args.seed.to_string()])
                .arg("--write-trace")
                .arg(&path),
        )?;
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        out.insert(workload.clone(), text);
    }
    Ok(out)
}

async fn bench(setup: &Setup, args: &Args) -> Result<Results> {
    let http = load::client()?;
    let shape = args.shape();
    let total =
        args.engines.len() * args.workloads.len() * args.rounds as usize * args.routers.len();
    let mut step = 0;
    let mut results = Results::new();
    for &engines in &args.engines {
        for workload in &args.workloads {
            let requests = Arc::new(load::requests(&setup.traces[workload], shape)?);
            let tokens: u64 = requests.iter().map(|r| r.prompt_tokens).sum();
            eprintln!(
                "{workload} on {engines} engines: {} requests, {:.0} prompt tokens each on average",
                requests.len(),
                tokens as f64 / requests.len() as f64
            );
            for round in 1..=args.rounds {
                let mut order = args.routers.clone();
                if round % 2 == 0 {
                    order.reverse();
                }
                for config in order {
                    step += 1;
                    eprint!("[{step}/{total}] round {round}: {} ... ", config.label());
                    let cell = Cell {
                        config,
                        engines,
                        workload,
                        round,
                    };
                    let run = one_run(setup, args, &http, &cell, &requests).await;
                    eprintln!("{}", run_summary(&run));
                    results
                        .entry((engines, workload.clone()))
                        .or_default()
                        .entry(config)
                        .or_default()
                        .push(run);
                }
            }
        }
    }
    Ok(results)
}

/// One configuration on a fresh fleet; a router that cannot start is a failed run, not the end
/// of the bench.
/// One run's place in the table.
struct Cell<'a> {
    config: Config,
    engines: usize,
    workload: &'a str,
    round: u32,
}

async fn one_run(
    setup: &Setup,
    args: &Args,
    http: &reqwest::Client,
    cell: &Cell<'_>,
    requests: &Arc<Vec<load::Request>>,
) -> Run {
    match try_run(setup, args, http, cell, requests).await {
        Ok(run) => run,
        Err(e) => Run {
            figures: Figures::default(),
            predicted: None,
            failed: Some(format!("{e:#}")),
        },
    }
}

async fn try_run(
    setup: &Setup,
    args: &Args,
    http: &reqwest::Client,
    cell: &Cell<'_>,
    requests: &Arc<Vec<load::Request>>,
) -> Result<Run> {
    let Cell {
        config,
        engines,
        workload,
        round,
    } = *cell;
    let tag = format!("{engines}-{workload}-{config:?}-{round}").to_lowercase();
    let mut fleet = fleet::start(
        &setup.binaries.kvroute,
        engines,
        &setup.binaries.tokenizer,
        &setup.mocker,
        &setup.logs.join(format!("{tag}-engines.log")),
    )
    .await?;
    let mut router = routers::start(
        config,
        &args.kvroute_args,
        &setup.binaries,
        &fleet.engines,
        &setup.scratch,
        &setup.logs.join(format!("{tag}-router.log")),
        http,
    )
    .await?;
    let pgid = router.proc.pid();
    let (cpu_before, _) = fleet::group_usage(pgid);
    let (samples, wall) = load::replay(http, &router.completions, fleet::MODEL, requests).await;
    let (cpu_after, hwm_kib) = fleet::group_usage(pgid);
    router.proc.check_alive()?;
    fleet.proc.check_alive()?;
    let mut figures = load::figures(&samples, wall);
    figures.hit_rate_engines = fleet::engine_hit_rate(http, &fleet.engines).await.ok();
    figures.cpu_s_per_1k = Some((cpu_after - cpu_before) / requests.len() as f64 * 1000.0);
    figures.peak_rss_mib = Some(hwm_kib as f64 / 1024.0);
    let predicted = if matches!(config, Config::Kvroute | Config::KvrouteApprox) {
        kvroute_predicted(http, &router.completions).await.ok()
    } else {
        None
    };
    Ok(Run {
        figures,
        predicted,
        failed: None,
    })
}

/// kvroute's predicted hit rate over the requests whose engines reported cached tokens: the sum
/// of its `cache_report_predicted_tokens_total` over its `cache_report_prompt_tokens_total`.
async fn kvroute_predicted(http: &reqwest::Client, completions: &str) -> Result<f64> {
    let base = completions.trim_end_matches("/v1/completions");
    let text = http
        .get(format!("{base}/metrics"))
        .send()
        .await?
        .text()
        .await?;
    let predicted = fleet::counter(&text, "kvroute_router_cache_report_predicted_tokens_total")?;
    let prompt = fleet::counter(&text, "kvroute_router_cache_report_prompt_tokens_total")?;
    if prompt == 0.0 {
        bail!("no cache report counted");
    }
    Ok(predicted / prompt)
}

fn run_summary(run: &Run) -> String {
    if let Some(e) = &run.failed {
        return format!("FAILED: {}", first_line(e));
    }
    let f = &run.figures;
    let mut out = format!(
        "{}/{} ok, hit {} (engines {}), TTFT p50/p99 {}/{} ms, CPU {} s/1k, RSS {} MiB",
        f.ok,
        f.requests,
        pct(f.hit_rate_usage),
        pct(f.hit_rate_engines),
        num(f.ttft_p50_ms, 1),
        num(f.ttft_p99_ms, 1),
        num(f.cpu_s_per_1k, 2),
        num(f.peak_rss_mib, 0),
    );
    if let Some(p) = run.predicted {
        let _ = write!(out, ", predicted {}", pct(Some(p)));
    }
    if let Some(e) = &f.first_error {
        let _ = write!(out, "; first error: {}", first_line(e));
    }
    out
}

/// The first line of an error, and its last when it ends in a log tail (what the process said
/// last).
fn first_line(text: &str) -> String {
    let mut lines = text.lines().filter(|l| !l.trim().is_empty());
    let first = lines.next().unwrap_or_default();
    match lines.next_back() {
        Some(last) => format!("{first} … {}", last.trim()),
        None => first.to_owned(),
    }
}

fn pct(v: Option<f64>) -> String {
    v.map_or_else(|| "-".to_owned(), |v| format!("{:.1}%", v * 100.0))
}

fn num(v: Option<f64>, decimals: usize) -> String {
    v.map_or_else(|| "-".to_owned(), |v| format!("{v:.decimals$}"))
}

/// The mean over a cell's successful runs of one figure.
fn mean(runs: &[Run], figure: impl Fn(&Run) -> Option<f64>) -> Option<f64> {
    let values: Vec<f64> = runs
        .iter()
        .filter(|r| r.failed.is_none())
        .filter_map(figure)
        .collect();
    (!values.is_empty()).then(|| values.iter().sum::<f64>() / values.len() as f64)
}

/// The markdown report: a summary matrix per fleet size (hit rate and TTFT p99 per workload
/// and configuration), then every figure of every cell.
fn report(args: &Args, results: &Results) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "\nkvroute bench peers: workload scale {}, token scale {}, speed-up {}x, {} s of each \
         trace, seed {}, {} round(s); latencies in real milliseconds (multiply by the speed-up \
         for the modelled H100's); figures are means over rounds{}.\n",
        args.workloads
            .iter()
            .map(|w| format!("{w} {}", args.scale(w)))
            .collect::<Vec<_>>()
            .join(", "),
        args.token_scale,
        args.speedup,
        args.duration,
        args.seed,
        args.rounds,
        if args.kvroute_args.is_empty() {
            String::new()
        } else {
            format!("; kvroute serve given `{}`", args.kvroute_args.join(" "))
        }
    );
    for &engines in &args.engines {
        let _ = writeln!(
            out,
            "### {engines} engines: engine-reported hit rate / TTFT p99 (ms)\n"
        );
        let _ = write!(out, "| workload |");
        for config in &args.routers {
            let _ = write!(out, " {} |", config.label());
        }
        let _ = writeln!(out);
        let _ = writeln!(out, "|---|{}", "---|".repeat(args.routers.len()));
        for workload in &args.workloads {
            let _ = write!(out, "| {workload} |");
            let cell = results.get(&(engines, workload.clone()));
            for config in &args.routers {
                let runs = cell
                    .and_then(|c| c.get(config))
                    .map_or(&[][..], Vec::as_slice);
                let _ = write!(
                    out,
                    " {} / {} |",
                    pct(mean(runs, |r| r.figures.hit_rate_usage)),
                    num(mean(runs, |r| r.figures.ttft_p99_ms), 1)
                );
            }
            let _ = writeln!(out);
        }
        let _ = writeln!(out);
    }
    let _ = writeln!(out, "### Every figure\n");
    let _ = writeln!(
        out,
        "| engines | workload | router | ok / requests | hit (usage) | hit (engine counters) | \
         kvroute predicted | TTFT p50 | TTFT p99 | E2E p99 | output tok/s | router CPU s / 1k req \
         | router peak RSS MiB |"
    );
    let _ = writeln!(out, "|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for ((engines, workload), cell) in results {
        for (config, runs) in cell {
            let ok: usize = runs.iter().map(|r| r.figures.ok).sum();
            let requests: usize = runs.iter().map(|r| r.figures.requests).sum();
            let failed = runs.iter().filter(|r| r.failed.is_some()).count();
            let status = if failed > 0 {
                format!("{ok} / {requests} ({failed} run(s) failed to start)")
            } else {
                format!("{ok} / {requests}")
            };
            let _ = writeln!(
                out,
                "| {engines} | {workload} | {} | {status} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                config.label(),
                pct(mean(runs, |r| r.figures.hit_rate_usage)),
                pct(mean(runs, |r| r.figures.hit_rate_engines)),
                pct(mean(runs, |r| r.predicted)),
                num(mean(runs, |r| r.figures.ttft_p50_ms), 1),
                num(mean(runs, |r| r.figures.ttft_p99_ms), 1),
                num(mean(runs, |r| r.figures.e2e_p99_ms), 1),
                num(mean(runs, |r| Some(r.figures.output_tokens_per_s)), 0),
                num(mean(runs, |r| r.figures.cpu_s_per_1k), 2),
                num(mean(runs, |r| r.figures.peak_rss_mib), 0),
            );
        }
    }
    let failures: Vec<String> = results
        .iter()
        .flat_map(|((engines, workload), cell)| {
            cell.iter().flat_map(move |(config, runs)| {
                runs.iter().filter_map(move |r| {
                    let why = r.failed.as_deref().or(r.figures.first_error.as_deref())?;
                    Some(format!(
                        "- {engines} engines, {workload}, {}: {}",
                        config.label(),
                        first_line(why)
                    ))
                })
            })
        })
        .collect();
    if !failures.is_empty() {
        let _ = writeln!(out, "\nErrors (first of each run):\n");
        for f in failures {
            let _ = writeln!(out, "{f}");
        }
    }
    out
}

/// `--quick`: every configuration ran and served every request.
fn check_quick(results: &Results) -> Result<()> {
    let mut problems = Vec::new();
    for ((engines, workload), cell) in results {
        for (config, runs) in cell {
            for run in runs {
                if let Some(e) = &run.failed {
                    problems.push(format!(
                        "{}: did not run: {}",
                        config.label(),
                        first_line(e)
                    ));
                } else if run.figures.ok != run.figures.requests || run.figures.requests == 0 {
                    problems.push(format!(
                        "{} on {engines} engines, {workload}: served {} of {} requests{}",
                        config.label(),
                        run.figures.ok,
                        run.figures.requests,
                        run.figures
                            .first_error
                            .as_deref()
                            .map(|e| format!(" (first error: {})", first_line(e)))
                            .unwrap_or_default()
                    ));
                }
            }
        }
    }
    if !problems.is_empty() {
        bail!("bench peers --quick:\n  {}", problems.join("\n  "));
    }
    Ok(())
}
