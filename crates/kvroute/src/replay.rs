//! `kvroute replay`: a Mooncake trace against N simulated engines in virtual time, routed by the
//! live router core, once per policy, compared in one table.
//!
//! Each policy gets a fresh fleet ([`kvroute_mocker::sim::Simulation`]) and a fresh
//! [`kvroute_router_core::KvRouterCore`] with the same seed, so runs are independent and the same
//! inputs always give the same numbers; policies run on parallel threads only to save wall time.

mod disagg;
mod dispatch;
mod html;
mod metrics;
mod oracle;
mod policy;
mod progress;
mod replicas;
mod report;
mod workload;

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::builder::PossibleValuesParser;
use indicatif::ProgressBar;
use kvroute_mocker::MockerConfig;
use kvroute_mocker::disagg::DecodeConfig;
use kvroute_mocker::sim::{DisaggSimulation, SimReport, Simulation};
use kvroute_mocker::trace::TraceRecord;
use kvroute_router_core::{ConditionalDisagg, CostTuning, KvMode, KvRouterCore, WorkerSpec};
use kvroute_workloads::synth::{self, Workload};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use disagg::DisaggRouterDispatcher;
use disagg::args::{DisaggArgs, DisaggPlan};
use dispatch::{RouterDispatcher, RunState, SessionTracker};
use metrics::Recorder;
use oracle::{Oracle, ratio};
use policy::{ReplayPolicy, validate_kv_weights};
use replicas::ReplicaDispatcher;
use report::{OracleJson, PolicyReport, ReplayJson, Setup, ms};
use workload::{Synthesis, Trace};

/// Options of `kvroute replay`.
#[derive(Debug, clap::Args)]
pub(crate) struct ReplayArgs {
    /// Mooncake-format JSONL trace: one object a line with `timestamp` (ms), `input_length`,
    /// `output_length` and `hash_ids`, and optionally `session_id` (a number or a string: the
    /// turns of one conversation or agent). Exactly one of --trace and --workload.
    #[arg(
        long,
        value_name = "FILE",
        required_unless_present = "workload",
        conflicts_with = "workload"
    )]
    trace: Option<PathBuf>,
    /// A generated workload of the evaluation set instead of a trace, from --seed: agentic (agent
    /// sessions, 20k-200k-token contexts, sub-agents), agentic-tools (the same with tool-call
    /// turns and idle gaps), multi-turn (chat over shared system prompts), rag (questions over
    /// shared documents), bursty (the others mixed, in bursts). Its requests carry sessions.
    #[arg(long, value_name = "NAME", value_parser = PossibleValuesParser::new(Workload::NAMES))]
    workload: Option<String>,
    /// Scale the --workload's sessions by X (0.1 is a tenth of the requests, same shape).
    #[arg(long, default_value_t = 1.0, value_name = "X")]
    workload_scale: f64,
    /// Write the --workload's requests to FILE as a Mooncake JSONL trace (with `session_id`,
    /// and `parent_session_id` for sub-agents) and exit without replaying: the same workload can
    /// then be fed to another replay, such as the reference's.
    #[arg(long, value_name = "FILE")]
    write_trace: Option<PathBuf>,
    /// Send each request's session to the router as a sticky session (`session_control` with
    /// `bind` on every turn, the reference's router-only binding with its 300 s default
    /// timeout): a session's turns follow its first turn's worker while the binding lives.
    /// Without it, sessions are only measured (session continuity), not routed on.
    #[arg(long)]
    sticky_sessions: bool,
    /// Simulated engines (router workers).
    #[arg(long, default_value_t = 8, value_name = "N")]
    workers: usize,
    /// A routing policy to compare (repeatable): round-robin, random, kv (the reference's
    /// default cost), kv-locality (the router's default: prefill and a prompt's own cache weigh
    /// more than decode load), kv-adaptive (prefill weighs more as prefill queues build),
    /// kv-affinity (an earlier tuning of kv's weights), or default (whatever `kvroute serve` uses
    /// when no policy is set: today kv-locality). Without --policy: round-robin, random, kv and
    /// kv-locality.
    #[arg(long = "policy", value_name = "P", value_parser = ReplayPolicy::parse)]
    policies: Vec<ReplayPolicy>,
    /// Policy kv's overlap credit: blocks of prefill credited per cached block (default 1, the
    /// reference's; kv-locality scores with 1.5).
    #[arg(long, value_name = "X")]
    overlap_credit: Option<f64>,
    /// Policy kv's weight of a block of prefill against a block of decode (default 1, the
    /// reference's; kv-locality scores with 4).
    #[arg(long, value_name = "X")]
    prefill_load_scale: Option<f64>,
    /// Policy kv's prefill weight once the fleet's prefill backlog fills a batch on every
    /// eligible worker, interpolated from --prefill-load-scale's below it (default: the same
    /// scale, fixed; kv-adaptive rises from 1 to 8).
    #[arg(long, value_name = "X")]
    loaded_prefill_load_scale: Option<f64>,
    /// Policy kv's fall of the credit with the cached share: `credit * share ^ X` per cached
    /// block (default 0; kv-locality scores with 2).
    #[arg(long, value_name = "X")]
    cached_share_exponent: Option<f64>,
    /// Policy kv's weight of a decode block on a worker whose decode load is within
    /// --decode-tolerance of the eligible workers' mean; blocks above weigh 1 (default 1, the
    /// reference's; kv-locality scores with 0.25).
    #[arg(long, value_name = "X")]
    balanced_decode_weight: Option<f64>,
    /// Policy kv's tolerance of decode load above the eligible workers' mean, as a fraction of
    /// it (default 0; kv-locality scores with 1: up to twice the mean).
    #[arg(long, value_name = "X")]
    decode_tolerance: Option<f64>,
    /// Policy kv credits a worker's cached blocks only as far as its KV capacity lets it keep
    /// them until the prompt is admitted (default false, the reference's; kv-locality scores
    /// with true).
    #[arg(long, value_name = "BOOL")]
    capacity_credit: Option<bool>,
    /// Policy kv's charge, in blocks of prefill, per block of other prompts' idle cache a
    /// placement would evict beyond what the eligible worker with the most free KV capacity
    /// would (default 0, the reference's; kv-locality scores with 1).
    #[arg(long, value_name = "X")]
    eviction_weight: Option<f64>,
    /// Policy kv's charge, in blocks of prefill, per block of idle cache a placement would
    /// evict on a worker whose cache is full, times how far the new blocks routed there lately
    /// exceed the least of the eligible workers', over their mean, capped at 1 (default 0, the
    /// reference's; kv-locality scores with 0).
    #[arg(long, value_name = "X")]
    churn_eviction_weight: Option<f64>,
    /// Policy kv's charge, in blocks of prefill, per new block a placement allocates, times how
    /// much fuller the worker's KV cache is than the emptiest eligible worker's, as fractions of
    /// their capacities (default 0, the reference's; kv-locality scores with 0).
    #[arg(long, value_name = "X")]
    occupancy_weight: Option<f64>,
    /// Replay speed: 2.0 makes requests arrive twice as fast as the trace says.
    #[arg(long, default_value_t = 1.0, value_name = "X")]
    speed: f64,
    /// Engine sizing and step timing: `reference` (Dynamo 1.6.1's mocker: 16,384 blocks of 64
    /// tokens per engine and its polynomial step times, so figures compare with the reference's
    /// replay) or `h100-8b` (kvroute's model of an 8B BF16 model on one H100: 25,000 blocks of 16
    /// tokens, roofline step times). --block-size and --cache-blocks override the sizing.
    #[arg(long, value_enum, default_value_t = EngineProfile::Reference, value_name = "P")]
    engine_profile: EngineProfile,
    /// Engine (and router) KV block size in tokens [default: the profile's].
    #[arg(long, value_name = "B")]
    block_size: Option<u32>,
    /// Tokens per trace hash id; must be a multiple of --block-size.
    #[arg(long, default_value_t = 512, value_name = "T")]
    trace_block_size: u32,
    /// KV cache capacity of each engine, in blocks [default: the profile's].
    #[arg(long, value_name = "C")]
    cache_blocks: Option<u32>,
    /// Disaggregated serving: N prefill engines before the --workers decode engines. Each
    /// request is prefilled (one token) on a prefill engine routed by the policy, then its KV is
    /// transferred to a decode engine routed without overlap credit (with --disagg conditional,
    /// only where the router's rule says so); TTFT is the first decode token, hit rate counts
    /// cached prompt tokens where prompts were computed.
    #[arg(long, value_name = "N")]
    prefill_workers: Option<usize>,
    #[command(flatten)]
    disagg: DisaggArgs,
    /// Router replicas sharing the fleet, as `kvroute serve --nats` runs them: arrivals go to
    /// them in turn, and each learns the others' requests and every worker's KV events
    /// --router-sync-delay after they happen (aggregated serving only).
    #[arg(long, default_value_t = 1, value_name = "R")]
    routers: usize,
    /// How late a replica learns another's requests and a worker's KV events (the event plane's
    /// latency; NATS on one host measured 0.2 ms p50, 1.4 ms p99).
    #[arg(long, default_value = "1ms", value_name = "DURATION")]
    router_sync_delay: crate::cli::HumanDuration,
    /// Seed of every random choice (router tie-breaks, the random policy, generated tokens).
    #[arg(long, default_value_t = 0, value_name = "S")]
    seed: u64,
    /// Write the results as JSON here, and an HTML report beside it (same name, .html).
    #[arg(long, value_name = "OUT")]
    json: Option<PathBuf>,
    /// Write one JSON line per request and policy to FILE: where it was routed, its prompt
    /// length, the blocks cached there and on the best candidate, the chosen worker's load terms
    /// at routing, and its time to first token; to see which requests were slow and why.
    #[arg(long, value_name = "FILE")]
    requests_out: Option<PathBuf>,
}

/// How each simulated engine is sized and timed; --block-size and --cache-blocks override the
/// sizing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum EngineProfile {
    /// [`MockerConfig::reference`]: the reference's own simulated engine (Dynamo 1.6.1's mocker
    /// defaults: 16,384 blocks of 64 tokens, ~1M tokens of KV, and its polynomial step timing),
    /// so that figures compare with the reference's replay.
    Reference,
    /// [`MockerConfig::default`]: an 8B BF16 model on one H100, ~400k tokens of KV per engine
    /// (25,000 blocks of vLLM's default 16 tokens) and kvroute's roofline step timing
    /// (derivation in the mocker's config module).
    #[value(name = "h100-8b")]
    #[serde(rename = "h100-8b")]
    H100Llama8b,
}

impl EngineProfile {
    /// The engine configuration before the command line's overrides.
    pub(crate) fn mocker(self) -> MockerConfig {
        match self {
            Self::Reference => MockerConfig::reference(),
            Self::H100Llama8b => MockerConfig::default(),
        }
    }
}

/// The arguments, checked.
struct Plan {
    policies: Vec<ReplayPolicy>,
    workers: usize,
    /// Prefill engines in disaggregated replay; `None` is aggregated serving.
    prefill_workers: Option<usize>,
    /// Conditional disaggregation's rule; `None` prefills every request remotely.
    conditional: Option<ConditionalDisagg>,
    mocker: MockerConfig,
    synthesis: Synthesis,
    seed: u64,
    /// Router replicas and how late they learn each other's state (see `replicas`).
    routers: usize,
    sync_delay: Duration,
    /// Sessions go to the router as sticky sessions.
    sticky_sessions: bool,
    /// Policy kv's weights, where given.
    kv_weights: CostTuning,
}

impl Plan {
    fn new(args: &ReplayArgs) -> anyhow::Result<Self> {
        if args.prefill_workers == Some(0) {
            bail!(
                "--prefill-workers must be at least 1, got 0; leave the flag out for aggregated \
                 serving"
            );
        }
        if let Some(json) = &args.json
            && json.extension().is_some_and(|e| e == "html")
        {
            bail!(
                "--json {}: the HTML report is written beside the JSON with an .html extension, \
                 so the JSON path must not end in .html; expected e.g. replay.json",
                json.display()
            );
        }
        if args.workers == 0 {
            bail!("--workers must be at least 1, got 0");
        }
        if args.routers == 0 {
            bail!("--routers must be at least 1, got 0");
        }
        if args.routers > 1 && args.prefill_workers.is_some() {
            bail!(
                "--routers {} with --prefill-workers: replicas are modelled for aggregated serving \
                 only; leave one of the flags out",
                args.routers
            );
        }
        if args.workload.is_none() && (args.write_trace.is_some() || args.workload_scale != 1.0) {
            bail!(
                "--write-trace and --workload-scale apply to a generated workload: add \
                 --workload NAME"
            );
        }
        if !(args.workload_scale.is_finite() && args.workload_scale > 0.0) {
            bail!(
                "--workload-scale must be a finite number > 0, got {}",
                args.workload_scale
            );
        }
        if !(args.speed.is_finite() && args.speed > 0.0) {
            bail!("--speed must be a finite number > 0, got {}", args.speed);
        }
        let (workers, prefill_workers, conditional) =
            match args.disagg.plan(args.prefill_workers.is_some())? {
                DisaggPlan::Enforced => (args.workers, args.prefill_workers, None),
                DisaggPlan::Conditional(rule) => (args.workers, args.prefill_workers, Some(rule)),
                DisaggPlan::Never => (args.workers + args.prefill_workers.unwrap_or(0), None, None),
            };
        let profile = args.engine_profile.mocker();
        let block_size = args.block_size.unwrap_or(profile.block_size);
        if block_size == 0 {
            bail!("--block-size must be at least 1, got 0");
        }
        if args.trace_block_size == 0 || !args.trace_block_size.is_multiple_of(block_size) {
            bail!(
                "--trace-block-size must be a positive multiple of --block-size ({block_size}), \
                 got {}",
                args.trace_block_size
            );
        }
        let num_blocks = args.cache_blocks.unwrap_or(profile.num_blocks);
        if num_blocks == 0 {
            bail!("--cache-blocks must be at least 1, got 0");
        }
        let mocker = MockerConfig {
            block_size,
            num_blocks,
            seed: args.seed,
            ..profile
        };
        mocker.validate().context("invalid engine settings")?;
        let asked: &[ReplayPolicy] = if args.policies.is_empty() {
            &ReplayPolicy::DEFAULT
        } else {
            &args.policies
        };
        let kv_weights = CostTuning {
            overlap_credit: args.overlap_credit,
            prefill_load_scale: args.prefill_load_scale,
            loaded_prefill_load_scale: args.loaded_prefill_load_scale,
            cached_share_exponent: args.cached_share_exponent,
            balanced_decode_weight: args.balanced_decode_weight,
            decode_tolerance: args.decode_tolerance,
            capacity_credit: args.capacity_credit,
            eviction_weight: args.eviction_weight,
            churn_eviction_weight: args.churn_eviction_weight,
            occupancy_weight: args.occupancy_weight,
        };
        validate_kv_weights(&kv_weights, asked)?;
        // A policy named twice would only print the same row twice.
        let mut policies: Vec<ReplayPolicy> = Vec::new();
        for &p in asked {
            if !policies.contains(&p) {
                policies.push(p);
            }
        }
        Ok(Self {
            policies,
            workers,
            prefill_workers,
            conditional,
            mocker,
            synthesis: Synthesis {
                trace_block_tokens: args.trace_block_size as usize,
                speed: args.speed,
            },
            seed: args.seed,
            routers: args.routers,
            sync_delay: args.router_sync_delay.0,
            sticky_sessions: args.sticky_sessions,
            kv_weights,
        })
    }
}

/// Everything one policy's run produced.
struct PolicyRun {
    sim: SimReport,
    recorder: Recorder,
    sessions: SessionTracker,
}

/// The --workload asked for, scaled.
fn generator(args: &ReplayArgs) -> anyhow::Result<Option<Workload>> {
    let Some(name) = &args.workload else {
        return Ok(None);
    };
    let workload = Workload::from_name(name)?;
    Ok(Some(if args.workload_scale == 1.0 {
        workload
    } else {
        workload.scaled(args.workload_scale)
    }))
}

/// The trace to replay, generated (`--workload`) or read (`--trace`), and how the report names
/// it; `None` when the generated trace was only to be written (`--write-trace`).
fn load_trace(args: &ReplayArgs) -> anyhow::Result<Option<(Trace, String)>> {
    Ok(Some(match (generator(args)?, &args.trace) {
        (Some(generator), _) => {
            let requests = generator.generate(args.seed);
            if let Some(path) = &args.write_trace {
                write(path, &synth::to_jsonl(&requests))?;
                eprintln!(
                    "wrote {} requests of workload {} to {}",
                    requests.len(),
                    args.workload.as_deref().unwrap_or_default(),
                    path.display()
                );
                return Ok(None);
            }
            let source = format!(
                "workload {} (seed {}, scale {})",
                args.workload.as_deref().unwrap_or_default(),
                args.seed,
                args.workload_scale
            );
            (workload::generated(requests), source)
        }
        (None, Some(path)) => (workload::load(path)?, path.display().to_string()),
        (None, None) => bail!("expected --trace FILE or --workload NAME"),
    }))
}

/// Runs `kvroute replay`.
pub(crate) fn run(args: &ReplayArgs) -> anyhow::Result<()> {
    let plan = Plan::new(args)?;
    let Some((trace, source)) = load_trace(args)? else {
        return Ok(());
    };
    let records = &trace.records;
    let oracle = Oracle::compute(
        records,
        u64::from(args.trace_block_size),
        u64::from(plan.mocker.block_size),
    );
    let setup = Setup {
        trace: source,
        sticky_sessions: plan.sticky_sessions,
        requests: records.len() as u64,
        workers: plan.workers,
        engine_profile: args.engine_profile,
        prefill_workers: plan.prefill_workers.unwrap_or(0),
        block_size: plan.mocker.block_size,
        trace_block_size: args.trace_block_size,
        cache_blocks: plan.mocker.num_blocks,
        speed: args.speed,
        seed: plan.seed,
    };

    let wall = Instant::now();
    let progress = progress::bar((records.len() * plan.policies.len()) as u64);
    let runs = run_all(&plan, &trace, &progress);
    progress.finish_and_clear();
    let runs = runs?;
    let wall = wall.elapsed();

    let mut reports = Vec::new();
    let mut sorted_ttfts = Vec::new();
    for (policy, run) in plan.policies.iter().zip(&runs) {
        let mut ttft = run.recorder.ttft.clone();
        ttft.sort_unstable();
        reports.push(policy_report(
            *policy,
            run,
            &ttft,
            &oracle,
            trace.has_sessions(),
        ));
        sorted_ttfts.push(ttft);
    }
    let table = report::table(&reports);
    print!("{table}");
    // Let the table reach the terminal before the summary on stderr.
    let _ = std::io::Write::flush(&mut std::io::stdout());
    eprintln!(
        "replayed {} requests x {} policies on {} workers{}{} in {:.1} s wall time; oracle hit rate \
         {:.2}% by tokens ({:.2}% by trace blocks)",
        records.len(),
        plan.policies.len(),
        plan.workers,
        plan.prefill_workers
            .map_or_else(String::new, |n| format!(" (decode) + {n} prefill workers")),
        if plan.routers > 1 {
            format!(
                " through {} router replicas ({:?} sync delay)",
                plan.routers, plan.sync_delay
            )
        } else {
            String::new()
        },
        wall.as_secs_f64(),
        oracle.token_hit_rate() * 100.0,
        oracle.block_hit_rate() * 100.0,
    );

    if let Some(path) = &args.requests_out {
        write(path, &request_lines(&plan.policies, &runs, &trace)?)?;
        eprintln!("wrote {}", path.display());
    }
    if let Some(json_path) = &args.json {
        let json = ReplayJson {
            setup: &setup,
            oracle: OracleJson::new(oracle),
            policies: &reports,
        };
        let text = serde_json::to_string_pretty(&json).context("serializing the results")?;
        write(json_path, &text)?;
        let series: Vec<Vec<Vec<f64>>> = runs.iter().map(|r| r.recorder.load.series()).collect();
        let curves: Vec<html::PolicyCurves<'_>> = reports
            .iter()
            .zip(&runs)
            .zip(&sorted_ttfts)
            .zip(&series)
            .map(|(((report, run), ttft), load)| html::PolicyCurves {
                report,
                ttft_sorted: ttft,
                load,
                bucket: run.recorder.load.bucket(),
            })
            .collect();
        let html_path = json_path.with_extension("html");
        write(&html_path, &html::render(&setup, &table, &curves))?;
        eprintln!("wrote {} and {}", json_path.display(), html_path.display());
    }
    Ok(())
}

/// The `--requests-out` lines: one JSON object per request and policy.
fn request_lines(
    policies: &[ReplayPolicy],
    runs: &[PolicyRun],
    trace: &Trace,
) -> anyhow::Result<String> {
    #[derive(serde::Serialize)]
    struct Line<'a> {
        policy: &'a str,
        id: usize,
        session: Option<u64>,
        #[serde(flatten)]
        detail: &'a metrics::RequestDetail,
    }
    let mut out = String::new();
    for (policy, run) in policies.iter().zip(runs) {
        for (id, detail) in run.recorder.details.iter().enumerate() {
            let line = Line {
                policy: policy.name(),
                id,
                session: trace.sessions.get(id).copied().flatten(),
                detail,
            };
            out.push_str(&serde_json::to_string(&line).context("serializing a request line")?);
            out.push('\n');
        }
    }
    Ok(out)
}

fn write(path: &Path, text: &str) -> anyhow::Result<()> {
    std::fs::write(path, text).with_context(|| format!("cannot write {}", path.display()))
}

/// Runs every policy, on as many threads as there are cores, returning runs in policy order.
fn run_all(plan: &Plan, trace: &Trace, progress: &ProgressBar) -> anyhow::Result<Vec<PolicyRun>> {
    let threads = std::thread::available_parallelism()
        .map_or(1, usize::from)
        .min(plan.policies.len())
        .max(1);
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<anyhow::Result<PolicyRun>>>> =
        Mutex::new((0..plan.policies.len()).map(|_| None).collect());
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(&policy) = plan.policies.get(i) else {
                        break;
                    };
                    let result = run_policy(plan, policy, trace, progress.clone());
                    if let Ok(mut slots) = results.lock() {
                        slots[i] = Some(result);
                    }
                }
            });
        }
    });
    let slots = results
        .into_inner()
        .map_err(|_| anyhow::anyhow!("a replay thread panicked"))?;
    slots
        .into_iter()
        .zip(&plan.policies)
        .map(|(slot, policy)| {
            slot.unwrap_or_else(|| Err(anyhow::anyhow!("policy {policy}: the run did not finish")))
        })
        .collect()
}

/// One policy: a fresh fleet and a fresh router core, the whole trace, then a drain check.
fn run_policy(
    plan: &Plan,
    policy: ReplayPolicy,
    trace: &Trace,
    progress: ProgressBar,
) -> anyhow::Result<PolicyRun> {
    let records = &trace.records;
    let sessions = SessionTracker::new(trace.sessions.clone(), plan.sticky_sessions);
    if let Some(prefill) = plan.prefill_workers {
        return run_disagg_policy(plan, policy, prefill, records, progress, sessions);
    }
    let mut sim = Simulation::new(&plan.mocker, plan.workers).context("invalid engine settings")?;
    let config = policy.router_config(plan.mocker.block_size, &plan.kv_weights);
    if plan.routers > 1 {
        let cores = (0..plan.routers)
            .map(|_| new_core(plan, config.clone(), plan.workers))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let recorder = Recorder::new(plan.workers, load_bucket(plan, records));
        let rng = ChaCha8Rng::seed_from_u64(plan.seed);
        let run = RunState::new(rng, recorder, progress, sessions);
        let mut dispatcher = ReplicaDispatcher::new(cores, plan.sync_delay, run);
        let result = sim.run(workload::arrivals(records, plan.synthesis), &mut dispatcher);
        let (cores, run) = dispatcher.into_parts();
        return finish_run(policy, result, &cores, run);
    }
    let core = new_core(plan, config, plan.workers)?;
    let recorder = Recorder::new(plan.workers, load_bucket(plan, records));
    let rng = ChaCha8Rng::seed_from_u64(plan.seed);
    let mut dispatcher =
        RouterDispatcher::new(core, RunState::new(rng, recorder, progress, sessions));
    let result = sim.run(workload::arrivals(records, plan.synthesis), &mut dispatcher);
    let (cores, run) = dispatcher.into_parts();
    finish_run(policy, result, &cores, run)
}

/// The end of every policy's run, whatever the serving mode: a routing error or a failed
/// simulation fails the policy, then every core must be drained.
fn finish_run(
    policy: ReplayPolicy,
    result: Result<SimReport, kvroute_mocker::sim::SimError>,
    cores: &[(&str, KvRouterCore)],
    mut run: RunState,
) -> anyhow::Result<PolicyRun> {
    run.pacer.flush();
    if let Some(e) = run.error.take() {
        bail!("policy {policy}: the router could not route a request: {e}");
    }
    let sim_report = result.with_context(|| format!("policy {policy}: simulation failed"))?;
    check_drained(policy, cores, run.recorder.in_flight())?;
    warn_gaps(policy, run.gaps, run.expired);
    let mut recorder = run.recorder;
    recorder.load.finish(sim_report.simulated);
    Ok(PolicyRun {
        sim: sim_report,
        recorder,
        sessions: run.sessions,
    })
}

/// A router core over `workers` engines `0..`, registered as live mocker workers register.
fn new_core(
    plan: &Plan,
    config: kvroute_router_core::RouterConfig,
    workers: usize,
) -> anyhow::Result<KvRouterCore> {
    let mut core = KvRouterCore::new(config).context("invalid router settings")?;
    for worker in 0..workers {
        let spec = WorkerSpec::new(worker as u64)
            .with_kv_capacity(u64::from(plan.mocker.num_blocks))
            .with_max_batched_tokens(u64::from(plan.mocker.max_num_batched_tokens));
        core.add_worker(&spec, KvMode::Events)
            .with_context(|| format!("registering worker {worker}"))?;
    }
    Ok(core)
}

/// The load timeline's bucket: about 200 over the trace; the run's tail adds a few more.
fn load_bucket(plan: &Plan, records: &[TraceRecord]) -> Duration {
    let span = records
        .iter()
        .map(|r| workload::arrival_time(r.timestamp, plan.synthesis.speed))
        .max()
        .unwrap_or_default();
    (span / 200).max(Duration::from_millis(10))
}

/// One policy in disaggregated serving: `prefill` prefill engines and `plan.workers` decode
/// engines, a prefill core with the policy's cost and a decode core with the decode overrides,
/// the whole trace, then a drain check of both cores.
fn run_disagg_policy(
    plan: &Plan,
    policy: ReplayPolicy,
    prefill: usize,
    records: &[TraceRecord],
    progress: ProgressBar,
    sessions: SessionTracker,
) -> anyhow::Result<PolicyRun> {
    let mut sim =
        DisaggSimulation::new(&plan.mocker, prefill, plan.workers, DecodeConfig::default())
            .context("invalid engine settings")?;
    let config = policy.router_config(plan.mocker.block_size, &plan.kv_weights);
    let prefill_core = new_core(plan, config.clone(), prefill)?;
    let decode_core = new_core(plan, config, plan.workers)?;
    let recorder = Recorder::new(prefill + plan.workers, load_bucket(plan, records));
    let rng = ChaCha8Rng::seed_from_u64(plan.seed);
    let run = RunState::new(rng, recorder, progress, sessions);
    let mut dispatcher = DisaggRouterDispatcher::new(prefill_core, decode_core, prefill, run);
    if let Some(rule) = plan.conditional {
        dispatcher = dispatcher.with_conditional(rule);
    }
    let result = sim.run(workload::arrivals(records, plan.synthesis), &mut dispatcher);
    if plan.conditional.is_some() {
        eprintln!(
            "policy {policy}: prefill placements {:?}",
            dispatcher.placements
        );
    }
    let (cores, run) = dispatcher.into_parts();
    finish_run(policy, result, &cores, run)
}

/// Every request that entered the router left it: no request, load or in-flight entry remains
/// in any of `cores` (named by role, empty for the aggregated router).
fn check_drained(
    policy: ReplayPolicy,
    cores: &[(&str, KvRouterCore)],
    in_flight: usize,
) -> anyhow::Result<()> {
    for (role, core) in cores {
        let loaded: Vec<_> = core
            .workers()
            .filter_map(|w| core.worker_load(w).map(|l| (w, l)))
            .filter(|(_, l)| l.active_requests > 0 || l.prefill_tokens > 0 || l.decode_blocks > 0.0)
            .collect();
        if core.active_requests() > 0 || !loaded.is_empty() || in_flight > 0 {
            let role = if role.is_empty() {
                String::new()
            } else {
                format!(" ({role})")
            };
            bail!(
                "policy {policy}: after the trace drained the router{role} still holds {} \
                 requests and load on {loaded:?} ({in_flight} unfinished in the simulation); \
                 every request must free its load",
                core.active_requests(),
            );
        }
    }
    Ok(())
}

fn warn_gaps(policy: ReplayPolicy, gaps: u64, expired: u64) {
    if gaps > 0 || expired > 0 {
        eprintln!(
            "warning: policy {policy}: {gaps} KV event gaps and {expired} expired requests during \
             replay"
        );
    }
}

fn policy_report(
    policy: ReplayPolicy,
    run: &PolicyRun,
    ttft: &[Duration],
    oracle: &Oracle,
    has_sessions: bool,
) -> PolicyReport {
    let sim = &run.sim;
    let r = &run.recorder;
    let mut itl = r.itl.clone();
    itl.sort_unstable();
    let mut e2e = r.e2e.clone();
    e2e.sort_unstable();
    let mean_ttft = if ttft.is_empty() {
        0.0
    } else {
        ttft.iter().map(|d| ms(*d)).sum::<f64>() / ttft.len() as f64
    };
    let simulated = sim.simulated.as_secs_f64();
    let mean_load = r.load.mean_per_worker(sim.simulated);
    PolicyReport {
        policy: policy.name().to_owned(),
        requests: sim.arrived,
        completed: sim.completed,
        rejected: sim.rejected,
        prompt_tokens: sim.prompt_tokens,
        cached_prompt_tokens: sim.cached_prompt_tokens,
        hit_rate: ratio(sim.cached_prompt_tokens, sim.prompt_tokens),
        oracle_hit_rate: oracle.token_hit_rate(),
        oracle_block_hit_rate: oracle.block_hit_rate(),
        ttft_mean_ms: mean_ttft,
        ttft_p50_ms: ms(metrics::quantile(ttft, 0.50)),
        ttft_p99_ms: ms(metrics::quantile(ttft, 0.99)),
        itl_p50_ms: ms(metrics::quantile(&itl, 0.50)),
        e2e_p50_ms: ms(metrics::quantile(&e2e, 0.50)),
        e2e_p99_ms: ms(metrics::quantile(&e2e, 0.99)),
        output_tokens_per_s: if simulated > 0.0 {
            sim.output_tokens as f64 / simulated
        } else {
            0.0
        },
        max_over_mean_load: metrics::max_over_mean(&mean_load),
        mean_load_per_worker: mean_load,
        simulated_s: simulated,
        preemptions: sim.preemptions,
        kv_events: sim.kv_events,
        session_continuity: if has_sessions {
            run.sessions.continuity()
        } else {
            None
        },
        session_later_turns: run.sessions.later_turns,
    }
}
