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
//! `--engine llamacpp` puts real llama.cpp servers behind the routers instead (`llamacpp.rs`):
//! the project's tiny model on the CPU, one slot each, fresh per run, 4 of them by default, under
//! streamed multi-turn chats over shared system prompts; its rows are llama.cpp's host-memory
//! prompt cache sizes (`--cache-ram default,0`). llama.cpp publishes no KV events, so kvroute
//! runs in approximate mode (a static fleet of `engine = "llamacpp"` workers, with the model's
//! tokenizer and chat template) and the configurations that read events are refused. vLLM's
//! router 0.1.17 reads no text from chat bodies, so its `cache_aware` routes these on load alone.
//! The engine-reported hit rate is checked against llama.cpp's own counters
//! (`llamacpp:prompt_tokens_cached_total`, `llamacpp:prompt_tokens_total`).
//!
//! `--quick` is CI's smoke test: one small cell, every configuration once; it fails unless every
//! router served every request and every table was produced (rankings are not asserted). With
//! `--engine llamacpp` it is 2 engines, llama.cpp's default prompt memory, 24 requests.

pub(crate) mod fleet;
mod llamacpp;
pub(crate) mod load;
mod report;
mod routers;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
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
use llamacpp::{Api, CacheRam, Conversation, ModelFiles, Sizing};
use load::{Figures, Shape};
use report::{check_quick, report, run_summary};
use routers::{Binaries, Config};

/// The bench's name after `cargo xtask bench`.
pub(crate) const NAME: &str = "peers";
/// The share of sessions of the non-agentic workloads by default.
const DEFAULT_SCALE: f64 = 0.15;

/// The workloads of the simulated fleet, every one by default.
const WORKLOADS: [&str; 5] = ["agentic", "agentic-tools", "multi-turn", "rag", "bursty"];

/// The engines behind the routers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum EngineKind {
    /// `kvroute engine-sim` as vLLM (with ZMQ KV events), under the evaluation workloads.
    Sim,
    /// Real llama.cpp servers (one slot each, no KV events), under multi-turn chats.
    Llamacpp,
}

/// Options of `cargo xtask bench peers`.
#[derive(Debug, Parser, PartialEq)]
#[command(
    name = "cargo xtask bench peers",
    about = "kvroute, SGLang's SMG and vLLM's router in front of the same fleet (simulated vLLM \
             engines under the evaluation workloads, or real llama.cpp servers under multi-turn \
             chats), side by side"
)]
pub(crate) struct Args {
    /// The engines: `sim` (simulated vLLM engines replaying the evaluation workloads) or
    /// `llamacpp` (real llama.cpp servers on the CPU with the project's tiny model, one slot
    /// each, fresh per run, under streamed multi-turn chats over shared system prompts).
    #[arg(long, value_enum, default_value_t = EngineKind::Sim)]
    engine: EngineKind,
    /// Fleet sizes (engines), comma-separated [default: 8,32; 4 with --engine llamacpp].
    #[arg(long, value_delimiter = ',', value_name = "N,...")]
    engines: Vec<usize>,
    /// Workloads (`kvroute replay --workload` names), comma-separated [default: all five;
    /// --engine sim only].
    #[arg(long, value_delimiter = ',', value_name = "NAME,...")]
    workloads: Vec<String>,
    /// llama.cpp's host-memory prompt cache per server (its `--cache-ram`, MiB), comma-separated,
    /// each a cell of its own: `default` (llama.cpp's 8 GiB) or a size, 0 turning it off
    /// [default: default,0; --engine llamacpp only].
    #[arg(long, value_delimiter = ',', value_name = "default|MIB,...")]
    cache_ram: Vec<CacheRam>,
    /// Router configurations, comma-separated [default: all; with --engine llamacpp, all but
    /// the two that read KV events].
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
    /// `RUST_LOG` of both `kvroute serve` configurations [default: warn]; for example
    /// `warn,kvroute_router::push=debug` writes every routing decision (worker, cached blocks,
    /// the cached tokens forgone against the best cached worker, load terms) to each run's
    /// router log.
    #[arg(long, value_name = "FILTER")]
    kvroute_log: Option<String>,
    /// CI's smoke test: 4 engines, `multi-turn` only, one round of every configuration, short
    /// (with --engine llamacpp: 2 engines, llama.cpp's default prompt memory, 24 requests).
    #[arg(long)]
    quick: bool,
    /// Runs each router on the machine's last core and the fleet, the load generator and the
    /// rest on the others (util-linux's `taskset`; Linux, at least 2 cores), as a deployment
    /// keeps routers off the engines' cores. Without it, on a small machine the 40x cells also
    /// measure how each router shares its cores with the fleet's bursts.
    #[arg(long)]
    pin: bool,
    /// A kvroute binary to compare against, say the release build of the commit before a
    /// change, copied aside: both kvroute configurations run from it too (`kvroute-base`,
    /// `kvroute-approx-base`, added to --routers), in the same rounds, so that the change is
    /// measured within one run; between separate runs this machine's drift is larger than
    /// most changes.
    #[arg(long, value_name = "PATH")]
    baseline: Option<PathBuf>,
}

/// One row of the table: a workload on the simulated fleet, or the chats on llama.cpp with one
/// prompt-memory size.
#[derive(Debug, Clone, PartialEq)]
enum Workload {
    Trace(String),
    Chat(CacheRam),
}

impl Workload {
    /// The row's name in the table.
    fn label(&self) -> String {
        match self {
            Workload::Trace(name) => name.clone(),
            Workload::Chat(cache_ram) => format!("chat, cache-ram {cache_ram}"),
        }
    }

    /// The row's name in log file names.
    fn tag(&self) -> String {
        match self {
            Workload::Trace(name) => name.clone(),
            Workload::Chat(cache_ram) => format!("chat-cache-ram-{cache_ram}"),
        }
    }
}

impl Args {
    /// Parses the bench's arguments (what follows the bench's name), applies `--quick` and checks
    /// the ranges.
    pub(crate) fn parse(args: &[String]) -> Result<Self> {
        let argv = std::iter::once(NAME.to_owned()).chain(args.iter().cloned());
        let mut parsed = Self::try_parse_from(argv).map_err(|e| anyhow::anyhow!("{e}"))?;
        match parsed.engine {
            EngineKind::Sim => parsed.sim_defaults()?,
            EngineKind::Llamacpp => parsed.llamacpp_defaults()?,
        }
        parsed.add_baseline()?;
        parsed.check()?;
        Ok(parsed)
    }

    /// With `--baseline`, the baseline twin of each kvroute configuration chosen; without it,
    /// none may be chosen.
    fn add_baseline(&mut self) -> Result<()> {
        let Some(path) = &self.baseline else {
            if let Some(bad) = self.routers.iter().find(|c| c.is_baseline()) {
                bail!(
                    "`{}` runs the --baseline binary: give --baseline PATH",
                    bad.label()
                );
            }
            return Ok(());
        };
        if !path.is_file() {
            bail!(
                "--baseline {} is not a file; expected a kvroute binary",
                path.display()
            );
        }
        for (config, base) in [
            (Config::Kvroute, Config::KvrouteBase),
            (Config::KvrouteApprox, Config::KvrouteApproxBase),
        ] {
            if self.routers.contains(&config) && !self.routers.contains(&base) {
                self.routers.push(base);
            }
        }
        Ok(())
    }

    fn sim_defaults(&mut self) -> Result<()> {
        if !self.cache_ram.is_empty() {
            bail!(
                "--cache-ram applies to --engine llamacpp only (the simulated engines have none)"
            );
        }
        if self.routers.contains(&Config::VllmCacheAwareText) {
            bail!(
                "`{}` applies to --engine llamacpp only: the simulated fleet is sent text \
                 completions in every configuration",
                Config::VllmCacheAwareText.label()
            );
        }
        if self.engines.is_empty() {
            self.engines = vec![8, 32];
        }
        if self.workloads.is_empty() {
            self.workloads = WORKLOADS.map(str::to_owned).to_vec();
        }
        if self.routers.is_empty() {
            self.routers = Config::ALL.to_vec();
        }
        if self.quick {
            self.engines = vec![4];
            self.workloads = vec!["multi-turn".to_owned()];
            self.rounds = 1;
            self.workload_scale = Some(self.workload_scale.unwrap_or(0.03).min(0.03));
            self.duration = self.duration.min(3.0);
        }
        Ok(())
    }

    fn llamacpp_defaults(&mut self) -> Result<()> {
        if !self.workloads.is_empty() {
            bail!(
                "--workloads applies to --engine sim only: --engine llamacpp runs its multi-turn \
                 chats (its rows are the --cache-ram sizes)"
            );
        }
        if let Some(bad) = self.routers.iter().find(|c| c.uses_events()) {
            bail!(
                "`{}` reads the engines' KV events, which llama.cpp does not publish: with \
                 --engine llamacpp choose from {}",
                bad.label(),
                Config::LLAMACPP.map(|c| c.label()).join(", ")
            );
        }
        if self.engines.is_empty() {
            self.engines = vec![4];
        }
        if self.cache_ram.is_empty() {
            self.cache_ram = vec![CacheRam::Default, CacheRam::Mib(0)];
        }
        if self.routers.is_empty() {
            self.routers = Config::LLAMACPP.to_vec();
        }
        if self.quick {
            self.engines = vec![2];
            self.cache_ram = vec![CacheRam::Default];
            self.rounds = 1;
        }
        Ok(())
    }

    fn check(&self) -> Result<()> {
        if self.engines.is_empty() || self.engines.iter().any(|&n| !(1..=64).contains(&n)) {
            bail!(
                "--engines must list 1 to 64 engines each, got {:?}",
                self.engines
            );
        }
        if let Some(bad) = self
            .workloads
            .iter()
            .find(|w| !WORKLOADS.contains(&w.as_str()))
        {
            bail!(
                "unknown workload `{bad}`: expected one of {}",
                WORKLOADS.join(", ")
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

    /// The table's rows.
    fn rows(&self) -> Vec<Workload> {
        match self.engine {
            EngineKind::Sim => self
                .workloads
                .iter()
                .cloned()
                .map(Workload::Trace)
                .collect(),
            EngineKind::Llamacpp => self.cache_ram.iter().copied().map(Workload::Chat).collect(),
        }
    }

    /// The size of the llama.cpp conversations.
    fn sizing(&self) -> Sizing {
        if self.quick {
            Sizing::QUICK
        } else {
            Sizing::FULL
        }
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
    /// kvroute's time tokenizing prompts (wall seconds on its workers) per 1,000 requests.
    tokenizing_s_per_1k: Option<f64>,
    /// The share of kvroute's prompt tokens cached on a better eligible worker than the one
    /// chosen (its `forgone_cached_tokens_total` over `input_tokens_total`): the hits its cost
    /// model traded for load.
    forgone: Option<f64>,
    /// What encoded kvroute's prompts (`fastokens`, `tokenizers`), from its metrics.
    encoder: Option<String>,
    /// Why the router could not be run at all.
    failed: Option<String>,
}

/// Runs the bench.
pub(crate) fn run(root: &Path, args: &[String]) -> Result<()> {
    let args = Args::parse(args)?;
    let pin = if args.pin { Some(pin_cores()?) } else { None };
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
    let mut binaries = Binaries {
        kvroute,
        baseline: args.baseline.clone(),
        smg: bin_dir.join("smg"),
        vllm_router: bin_dir.join("vllm-router"),
        tokenizer: PathBuf::new(),
        chat_template: None,
        dialect: "vllm",
        router_core: pin,
    };
    let (mut mocker, mut llama, mut traces) = (None, None, BTreeMap::new());
    match args.engine {
        EngineKind::Sim => {
            binaries.tokenizer = fleet::write_tokenizer(&scratch.0)?;
            traces = write_traces(&binaries.kvroute, &args, &scratch.0)?;
            mocker = Some(fleet::write_mocker_config(
                &scratch.0,
                args.token_scale,
                args.speedup,
            )?);
        }
        EngineKind::Llamacpp => {
            let model = llamacpp::write_model(&python, root, &scratch.0.join("model"))?;
            binaries.tokenizer = model.tokenizer.clone();
            binaries.chat_template = Some(model.template.clone());
            binaries.dialect = "llamacpp";
            llama = Some(Llama {
                python: python.clone(),
                root: root.to_owned(),
                model,
            });
        }
    }

    let setup = Setup {
        binaries,
        mocker,
        llama,
        scratch: scratch.0.clone(),
        logs: logs.clone(),
        traces,
    };
    let result = block_on_interruptible(bench(&setup, &args));
    eprintln!("logs of every run: {}", logs.display());
    let results = result?;
    let report = report(&args, &results);
    print!("{report}");
    let path = logs.join(match args.engine {
        EngineKind::Sim => "results.md",
        EngineKind::Llamacpp => "results-llamacpp.md",
    });
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
    /// The simulated engines' mocker config (`--engine sim`).
    mocker: Option<PathBuf>,
    /// What llama.cpp servers start from (`--engine llamacpp`).
    llama: Option<Llama>,
    scratch: PathBuf,
    logs: PathBuf,
    /// Workload name → its trace text.
    traces: BTreeMap<String, String>,
}

/// What llama.cpp servers are started from.
struct Llama {
    python: PathBuf,
    root: PathBuf,
    model: ModelFiles,
}

/// One row's load, the same for every configuration.
enum Load {
    /// Text completions replayed open-loop.
    Trace(Arc<Vec<load::Request>>),
    /// Conversations run closed-loop.
    Chat(Arc<Vec<Conversation>>),
}

/// Writes each workload's trace with `kvroute replay --write-trace`; returns their texts.
/// Moves this process (every thread: the load generator, and whatever it starts from now on)
/// onto every core but the last, which it returns for the routers (`--pin`).
fn pin_cores() -> Result<String> {
    let cores = std::thread::available_parallelism()
        .context("counting the cores")?
        .get();
    if cores < 2 {
        bail!("--pin needs at least 2 cores (this machine has {cores}): one for the routers");
    }
    let rest = if cores == 2 {
        "0".to_owned()
    } else {
        format!("0-{}", cores - 2)
    };
    let status = Command::new("taskset")
        .args(["-a", "-p", "-c", &rest, &std::process::id().to_string()])
        .stdout(std::process::Stdio::null())
        .status()
        .context("--pin runs util-linux's `taskset`, which could not be started")?;
    if !status.success() {
        bail!("`taskset -a -p -c {rest}` on the bench's own process failed ({status})");
    }
    eprintln!(
        "pinned: routers on core {}, the rest on cores {rest}",
        cores - 1
    );
    Ok((cores - 1).to_string())
}

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
    let rows = args.rows();
    let total = args.engines.len() * rows.len() * args.rounds as usize * args.routers.len();
    let mut step = 0;
    let mut results = Results::new();
    for &engines in &args.engines {
        for workload in &rows {
            let requests = match workload {
                Workload::Trace(name) => {
                    let requests = Arc::new(load::requests(&setup.traces[name], shape)?);
                    let tokens: u64 = requests.iter().map(|r| r.prompt_tokens).sum();
                    eprintln!(
                        "{name} on {engines} engines: {} requests, {:.0} prompt tokens each on \
                         average",
                        requests.len(),
                        tokens as f64 / requests.len() as f64
                    );
                    Load::Trace(requests)
                }
                Workload::Chat(_) => {
                    let sizing = args.sizing();
                    eprintln!(
                        "{} on {engines} engines: {} conversations of {} turns ({} requests), \
                         {} clients",
                        workload.label(),
                        sizing.families * sizing.per_family,
                        sizing.turns,
                        sizing.requests(),
                        sizing.clients
                    );
                    Load::Chat(Arc::new(llamacpp::conversations(args.seed, sizing)))
                }
            };
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
                        .entry((engines, workload.label()))
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

/// One run's place in the table.
struct Cell<'a> {
    config: Config,
    engines: usize,
    workload: &'a Workload,
    round: u32,
}

/// One configuration on a fresh fleet; a router that cannot start is a failed run, not the end
/// of the bench.
async fn one_run(
    setup: &Setup,
    args: &Args,
    http: &reqwest::Client,
    cell: &Cell<'_>,
    requests: &Load,
) -> Run {
    match try_run(setup, args, http, cell, requests).await {
        Ok(run) => run,
        Err(e) => Run {
            figures: Figures::default(),
            predicted: None,
            tokenizing_s_per_1k: None,
            forgone: None,
            encoder: None,
            failed: Some(format!("{e:#}")),
        },
    }
}

async fn try_run(
    setup: &Setup,
    args: &Args,
    http: &reqwest::Client,
    cell: &Cell<'_>,
    requests: &Load,
) -> Result<Run> {
    let Cell {
        config,
        engines,
        workload,
        round,
    } = *cell;
    let tag = format!("{engines}-{}-{config:?}-{round}", workload.tag()).to_lowercase();
    let engine_log = setup.logs.join(format!("{tag}-engines.log"));
    let mut fleet = match (workload, &setup.mocker, &setup.llama) {
        (Workload::Trace(_), Some(mocker), _) => {
            let fleet = fleet::start(
                &setup.binaries.kvroute,
                engines,
                &setup.binaries.tokenizer,
                mocker,
                &engine_log,
            )
            .await?;
            fleet::check_tokenizer(http, &fleet.engines[0]).await?;
            fleet
        }
        (Workload::Chat(cache_ram), _, Some(llama)) => {
            let servers = llamacpp::Servers {
                python: &llama.python,
                root: &llama.root,
                model: &llama.model,
                log_dir: &setup.logs.join(format!("{tag}-llamacpp")),
            };
            llamacpp::start(&servers, engines, *cache_ram, &engine_log).await?
        }
        _ => bail!(
            "the bench was set up for another engine than {}",
            workload.label()
        ),
    };
    let mut router = routers::start(
        config,
        args,
        &setup.binaries,
        &fleet.engines,
        &setup.scratch,
        &setup.logs.join(format!("{tag}-router.log")),
        http,
    )
    .await?;
    let pgid = router.proc.pid();
    let (cpu_before, _) = fleet::group_usage(pgid);
    let (samples, wall) = match requests {
        Load::Trace(requests) => {
            let url = format!("{}/v1/completions", router.base);
            load::replay(http, &url, fleet::MODEL, requests).await
        }
        Load::Chat(conversations) => {
            let api = if config == Config::VllmCacheAwareText {
                Api::Text
            } else {
                Api::Chat
            };
            llamacpp::converse(http, &router.base, api, conversations, args.sizing()).await
        }
    };
    let (cpu_after, hwm_kib) = fleet::group_usage(pgid);
    write_samples(&setup.logs.join(format!("{tag}-requests.jsonl")), &samples)?;
    router.proc.check_alive()?;
    fleet.proc.check_alive()?;
    let mut figures = load::figures(&samples, wall);
    figures.hit_rate_engines = match requests {
        Load::Trace(requests) => {
            figures.ceiling = load::ceiling_hit_rate(requests, &samples);
            figures.engine_ttft_mean_ms =
                fleet::engine_ttft_mean_ms(http, &fleet.engines).await.ok();
            fleet::engine_hit_rate(http, &fleet.engines).await.ok()
        }
        Load::Chat(_) => llamacpp::engine_hit_rate(http, &fleet.engines).await.ok(),
    };
    figures.cpu_s_per_1k = Some((cpu_after - cpu_before) / samples.len() as f64 * 1000.0);
    figures.peak_rss_mib = Some(hwm_kib as f64 / 1024.0);
    let (mut predicted, mut tokenizing_s_per_1k, mut forgone, mut encoder) =
        (None, None, None, None);
    if config.is_kvroute() {
        let keep = setup.logs.join(format!("{tag}-metrics.txt"));
        if let Ok(text) = kvroute_metrics(http, &router.base, &keep).await {
            predicted = kvroute_predicted(&text).ok();
            tokenizing_s_per_1k =
                kvroute_tokenizing_seconds(&text).map(|s| s / samples.len().max(1) as f64 * 1000.0);
            forgone = kvroute_forgone(&text).ok();
            encoder = kvroute_encoder(&text);
        }
    }
    Ok(Run {
        figures,
        predicted,
        tokenizing_s_per_1k,
        forgone,
        encoder,
        failed: None,
    })
}

/// Every request's sample of one run, one JSON line each in the requests' order (`i`, TTFT and
/// E2E in real ms, prompt, cached and output tokens, error), for comparing two routers request by
/// request afterwards.
fn write_samples(path: &Path, samples: &[load::Sample]) -> Result<()> {
    let ms = |d: Option<Duration>| d.map(|d| d.as_secs_f64() * 1e3);
    let mut text = String::new();
    for (i, s) in samples.iter().enumerate() {
        let line = serde_json::json!({
            "i": i,
            "ttft_ms": ms(s.ttft),
            "e2e_ms": ms(s.e2e),
            "prompt_tokens": s.prompt_tokens,
            "cached_tokens": s.cached_tokens,
            "completion_tokens": s.completion_tokens,
            "error": s.error,
        });
        text.push_str(&line.to_string());
        text.push('\n');
    }
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

/// kvroute's `/metrics` text at the end of a run, also kept in `keep` (beside the run's logs)
/// for a look at the router's own histograms (routing overhead by phase, time to first token)
/// afterwards.
async fn kvroute_metrics(http: &reqwest::Client, base: &str, keep: &Path) -> Result<String> {
    let text = http
        .get(format!("{base}/metrics"))
        .send()
        .await?
        .text()
        .await?;
    std::fs::write(keep, &text).with_context(|| format!("writing {}", keep.display()))?;
    Ok(text)
}

/// The seconds kvroute spent tokenizing, from its metrics `text`: the sum of its
/// `routing_overhead_seconds` histogram's `tokenizing` phase.
fn kvroute_tokenizing_seconds(text: &str) -> Option<f64> {
    text.lines()
        .filter(|l| l.starts_with("kvroute_router_routing_overhead_seconds_sum{"))
        .find(|l| l.contains("phase=\"tokenizing\""))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// The encoder that tokenized kvroute's prompts, from its metrics `text`: the `encoder` label of
/// the `tokenizer_encoder` sample reading 1.
fn kvroute_encoder(text: &str) -> Option<String> {
    text.lines()
        .filter(|l| l.starts_with("kvroute_router_tokenizer_encoder{") && l.ends_with("} 1"))
        .find_map(|l| {
            let (_, rest) = l.split_once("encoder=\"")?;
            rest.split_once('"').map(|(encoder, _)| encoder.to_owned())
        })
}

/// The share of kvroute's prompt tokens that were cached on a better eligible worker than the one
/// it chose, from its metrics `text`: `forgone_cached_tokens_total` over `input_tokens_total`.
fn kvroute_forgone(text: &str) -> Result<f64> {
    let forgone = fleet::counter(text, "kvroute_router_forgone_cached_tokens_total")?;
    let input = fleet::counter(text, "kvroute_router_input_tokens_total")?;
    if input == 0.0 {
        bail!("no prompt token counted");
    }
    Ok(forgone / input)
}

/// kvroute's predicted hit rate over the requests whose engines reported cached tokens, from its
/// metrics `text`: the sum of its `cache_report_predicted_tokens_total` over its
/// `cache_report_prompt_tokens_total`.
fn kvroute_predicted(text: &str) -> Result<f64> {
    let predicted = fleet::counter(text, "kvroute_router_cache_report_predicted_tokens_total")?;
    let prompt = fleet::counter(text, "kvroute_router_cache_report_prompt_tokens_total")?;
    if prompt == 0.0 {
        bail!("no cache report counted");
    }
    Ok(predicted / prompt)
}
