//! `kvroute demo`: the router and a small simulated fleet in one process, a generated workload of
//! multi-turn conversations driven through the real HTTP path, first with round-robin and then
//! with a KV-aware policy (the router's default, or `--policy kv`), compared side by side. No
//! files, no services.
//!
//! Each policy gets a fresh fleet (so caches start cold) and a fresh router; both see exactly the
//! same conversations (one seed). The hit rate comes from the engines themselves: every finished
//! request reports the prompt tokens its engine found cached (see [`fleet`]). After each run every
//! per-worker load must read zero again, in the router, on `/metrics` and on the workers; the demo
//! fails loudly otherwise.

mod drive;
mod fleet;
mod summary;
mod workload;

use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use kvroute_mocker::MockerConfig;
use kvroute_router::Policy;
use serde_json::json;

use drive::Driver;
use fleet::{Fleet, Service};
use summary::{RunReport, table};
use workload::{Workload, WorkloadSpec};

/// Options of `kvroute demo`.
#[derive(Debug, clap::Args)]
pub(crate) struct DemoArgs {
    /// Simulated workers.
    #[arg(long, default_value_t = 4, value_name = "N")]
    workers: usize,
    /// Conversations (simulated users), each over one of a few shared system prompts.
    #[arg(long, default_value_t = 96, value_name = "N")]
    conversations: usize,
    /// Turns per conversation; each turn resends the conversation so far.
    #[arg(long, default_value_t = 4, value_name = "N")]
    turns: usize,
    /// How much faster than the modelled GPU the simulated engines (and the users) run.
    #[arg(long, default_value_t = 2.0, value_name = "X")]
    speedup: f64,
    /// KV cache capacity of each simulated worker, in 16-token blocks. The default (16k tokens)
    /// is smaller than the workload's working set, as a busy GPU's cache is: where requests go
    /// then decides what stays cached.
    #[arg(long, default_value_t = 1024, value_name = "BLOCKS")]
    cache_blocks: u32,
    /// Seed of the workload and of the router's random choices.
    #[arg(long, default_value_t = 0, value_name = "S")]
    seed: u64,
    /// The KV-aware policy compared with round-robin: kv (the reference's cost) or another
    /// that kvroute-router offers [default: the router's default policy].
    #[arg(long, value_name = "P", value_parser = parse_policy)]
    policy: Option<Policy>,
    /// Also write the results as JSON here.
    #[arg(long, value_name = "OUT")]
    json: Option<PathBuf>,
}

/// Runs the demo.
pub(crate) fn run(args: &DemoArgs) -> anyhow::Result<()> {
    let spec = spec(args)?;
    let workload = Arc::new(Workload::generate(&spec));
    let mocker = MockerConfig {
        speedup: args.speedup,
        seed: args.seed,
        num_blocks: args.cache_blocks,
        ..MockerConfig::default()
    };
    mocker
        .validate()
        .context("the simulated engines' configuration")?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    eprintln!(
        "kvroute demo: {} conversations x {} turns over {} shared system prompts ({} requests), \
         {} simulated workers, speedup {}x",
        spec.conversations,
        spec.turns,
        workload.system_prompts.len(),
        workload.requests(),
        args.workers,
        args.speedup,
    );
    let mut runs = Vec::new();
    for policy in [Policy::RoundRobin, args.policy.unwrap_or_default()] {
        let report = runtime.block_on(run_policy(policy, args, &mocker, &workload))?;
        runs.push(report);
    }
    print!("{}", render(&runs, args));
    if let Some(path) = &args.json {
        let doc = json!({
            "setup": {
                "workers": args.workers,
                "conversations": spec.conversations,
                "turns": spec.turns,
                "system_prompts": spec.system_prompts,
                "requests": workload.requests(),
                "speedup": args.speedup,
                "cache_blocks": args.cache_blocks,
                "seed": args.seed,
                "hit_rate_source": "engines: cached prompt tokens reported in each finished request's usage",
            },
            "runs": runs,
        });
        let text = serde_json::to_string_pretty(&doc).context("serialising the results")?;
        std::fs::write(path, text + "\n").with_context(|| format!("writing {}", path.display()))?;
    }
    let failed: usize = runs.iter().map(|r| r.failed).sum();
    if failed > 0 {
        let first = runs
            .iter()
            .flat_map(|r| r.errors.iter())
            .next()
            .cloned()
            .unwrap_or_default();
        bail!("{failed} requests failed; the first: {first}");
    }
    Ok(())
}

fn parse_policy(name: &str) -> Result<Policy, String> {
    let policy: Policy = name.parse().map_err(|e| format!("{e}"))?;
    if matches!(policy, Policy::RoundRobin | Policy::Direct) {
        return Err(format!(
            "{policy} is not a KV-aware policy; the demo compares one with round-robin"
        ));
    }
    Ok(policy)
}

/// The workload the arguments describe, checked.
fn spec(args: &DemoArgs) -> anyhow::Result<WorkloadSpec> {
    if args.workers == 0 {
        bail!("--workers must be at least 1, got 0");
    }
    if args.conversations == 0 {
        bail!("--conversations must be at least 1, got 0");
    }
    if args.turns == 0 {
        bail!("--turns must be at least 1, got 0");
    }
    if args.cache_blocks == 0 {
        bail!("--cache-blocks must be at least 1, got 0");
    }
    if !(args.speedup.is_finite() && args.speedup > 0.0) {
        bail!(
            "--speedup must be a finite number > 0, got {}",
            args.speedup
        );
    }
    Ok(WorkloadSpec {
        conversations: args.conversations,
        turns: args.turns,
        // A few shared prompts: enough that one worker cannot be the home of all of them.
        system_prompts: (args.conversations / 8).clamp(1, 2 * args.workers),
        system_words: 1500,
        user_words: (60, 200),
        reply_tokens: (32, 96),
        arrival_gap: Duration::from_millis(150),
        think_time: (Duration::from_millis(500), Duration::from_millis(2500)),
        seed: args.seed,
    })
}

/// One policy's run on a fresh fleet; checks afterwards that every load is back to zero.
async fn run_policy(
    policy: Policy,
    args: &DemoArgs,
    mocker: &MockerConfig,
    workload: &Arc<Workload>,
) -> anyhow::Result<RunReport> {
    let fleet = Fleet::start(args.workers, mocker).await?;
    let service = Service::start(&fleet, policy, args.seed).await?;
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(120))
        .build()
        .context("building the HTTP client")?;
    let driver = Driver {
        client: client.clone(),
        base: service.base.clone(),
        speedup: args.speedup,
    };
    let progress = progress_bar(policy, workload.requests() as u64);
    let began = Instant::now();
    let results = driver.run(workload, &progress).await;
    let wall = began.elapsed();
    progress.finish_and_clear();
    let report = RunReport::new(policy.name(), &results, &fleet, wall);
    eprintln!(
        "{:>12}: {} requests in {:.1} s, hit rate {:.1}%",
        policy.name(),
        report.requests,
        report.wall_s,
        report.hit_rate * 100.0
    );
    service
        .check_idle(&fleet, &client)
        .await
        .with_context(|| format!("after the {policy} run"))?;
    service.shutdown().await?;
    drop(fleet);
    Ok(report)
}

/// A bar over one run's requests on stderr, hidden unless a person watches a terminal.
fn progress_bar(policy: Policy, total: u64) -> ProgressBar {
    let watched = std::io::stderr().is_terminal() && std::env::var_os("CI").is_none();
    if !watched {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
    if let Ok(style) = ProgressStyle::with_template(&format!(
        "{{spinner}} {:>11} [{{elapsed_precise}}] {{wide_bar}} {{pos}}/{{len}} requests",
        policy.name()
    )) {
        bar.set_style(style);
    }
    bar
}

/// The printed summary.
fn render(runs: &[RunReport], args: &DemoArgs) -> String {
    let mut out = String::new();
    out.push('\n');
    out.push_str(&table(runs));
    out.push_str(&format!(
        "\nKV hit rate (engines): prompt tokens the workers found in their prefix caches, as they \
         reported them.\nThroughput follows the simulated users' pace (arrivals and think \
         times), so it matches; routing shows in hit rate and latency.\nTimes are wall-clock at \
         --speedup {}: the modelled GPU would take {}x longer.\n",
        args.speedup, args.speedup
    ));
    out
}
