//! Replays a Mooncake-format trace on simulated engines in virtual time and reports how much
//! faster than real time the simulation runs.
//!
//! ```text
//! cargo bench -p kvroute-mocker --bench simulate -- --trace FILE [--workers 8] [--config FILE.json|FILE.toml]
//! ```
//!
//! Requests are assigned round-robin. Each hash id expands into 512 synthetic tokens
//! (512 / block_size blocks). Prints simulated seconds, wall seconds and their ratio (the goal is
//! at least 200x on the Mooncake conversation trace with 8 workers), plus latency and cache
//! figures of the simulated fleet.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, bail};
use kvroute_mocker::MockerConfig;
use kvroute_mocker::sim::{RoundRobin, Simulation};
use kvroute_mocker::trace;

struct Args {
    trace: PathBuf,
    workers: usize,
    config: Option<PathBuf>,
}

fn parse_args() -> anyhow::Result<Args> {
    let mut trace = None;
    let mut workers = 8;
    let mut config = None;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--trace" => trace = Some(PathBuf::from(args.next().context("--trace needs a file")?)),
            "--workers" => {
                workers = args.next().context("--workers needs a number")?.parse()?;
            }
            "--config" => {
                config = Some(PathBuf::from(args.next().context("--config needs a file")?));
            }
            // `cargo bench` passes `--bench` to every harness-less bench.
            "--bench" => {}
            other => bail!(
                "unknown argument {other:?}; expected --trace FILE [--workers N] [--config FILE]"
            ),
        }
    }
    let trace = trace.or_else(|| std::env::var_os("KVROUTE_TRACE").map(PathBuf::from));
    let Some(trace) = trace else {
        bail!("no trace: pass --trace FILE (Mooncake JSONL) or set KVROUTE_TRACE");
    };
    if workers == 0 {
        bail!("--workers must be at least 1");
    }
    Ok(Args {
        trace,
        workers,
        config,
    })
}

fn main() -> anyhow::Result<()> {
    let args = match parse_args() {
        Ok(args) => args,
        Err(err) => {
            // Without a trace there is nothing to measure; `cargo bench` over the workspace must
            // not fail because of that.
            println!("simulate: skipped ({err})");
            return Ok(());
        }
    };
    let config = match &args.config {
        Some(path) => MockerConfig::from_file(path)?,
        None => MockerConfig::default(),
    };
    let text = std::fs::read_to_string(&args.trace)
        .with_context(|| format!("reading {}", args.trace.display()))?;
    let records = trace::parse_jsonl(&text)?;

    let wall = Instant::now();
    let mut sim = Simulation::new(&config, args.workers)?;
    let report = sim.run(trace::arrivals(&records), &mut RoundRobin::default())?;
    let wall = wall.elapsed().as_secs_f64();

    let simulated = report.simulated.as_secs_f64();
    let hit = report.cached_prompt_tokens as f64 / report.prompt_tokens.max(1) as f64;
    println!("trace                 {}", args.trace.display());
    println!(
        "workers               {} (round-robin), block size {}, {} blocks each",
        args.workers, config.block_size, config.num_blocks
    );
    println!(
        "requests              {} arrived, {} completed, {} rejected",
        report.arrived, report.completed, report.rejected
    );
    println!(
        "prompt tokens         {} ({:.2}% from prefix cache)",
        report.prompt_tokens,
        hit * 100.0
    );
    println!("output tokens         {}", report.output_tokens);
    println!("engine steps          {}", report.steps);
    println!("kv events             {}", report.kv_events);
    println!("preemptions           {}", report.preemptions);
    println!(
        "ttft                  mean {:.1} ms, p50 {:.1} ms, p99 {:.1} ms",
        ms(report.ttft.mean),
        ms(report.ttft.p50),
        ms(report.ttft.p99)
    );
    println!(
        "e2e                   mean {:.2} s, p99 {:.2} s",
        report.e2e.mean.as_secs_f64(),
        report.e2e.p99.as_secs_f64()
    );
    println!("simulated seconds     {simulated:.1}");
    println!("wall seconds          {wall:.2}");
    println!("speed                 {:.0}x real time", simulated / wall);
    Ok(())
}

fn ms(d: std::time::Duration) -> f64 {
    d.as_secs_f64() * 1e3
}
