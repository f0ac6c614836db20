//! `cargo xtask bench replay-vs-reference`: the same trace through the reference's offline replay
//! (NVIDIA Dynamo 1.6.1, installed once into its own venv) and through `kvroute replay`, on the
//! same engine sizes, printed as one side-by-side table.
//!
//! The reference runs with its mocker's defaults and the engine size below; kvroute runs with
//! `--engine-profile reference` (its reproduction of that mocker) and the same size stated
//! explicitly. The reference's `kv_router` breaks cost ties at random and cannot be seeded, so it
//! runs several times and the table shows the range over runs and the best run (by hit rate);
//! kvroute's replay is deterministic and runs once.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Parser;
use serde_json::Value;

use crate::cmd::{cargo_command, home_cache, run_command};
use crate::python;

/// The bench's name after `cargo xtask bench`.
pub(crate) const NAME: &str = "replay-vs-reference";

/// Tokens per KV block of every engine: the reference mocker's vLLM default
/// (`default_block_size()`, aisimulate-core 0.13.0 `src/engine/config.rs`).
const ENGINE_BLOCK_SIZE: u32 = 64;

/// KV blocks per engine: the reference mocker's `default_num_gpu_blocks()` (same file).
const ENGINE_BLOCKS: u32 = 16_384;

/// kvroute's policies in the table: the baseline, the reference's cost and the default.
const KVROUTE_POLICIES: [&str; 3] = ["round-robin", "kv", "kv-locality"];

/// The reference's replay of one policy: prints its summary's figures as one JSON line (the
/// same script the evaluation-set matrix runs, `benches/eval-set/matrix.sh`).
const REFERENCE_SCRIPT: &str = include_str!("../../benches/eval-set/reference_replay.py");

/// Options of `cargo xtask bench replay-vs-reference`.
#[derive(Debug, Parser, PartialEq)]
#[command(
    name = "cargo xtask bench replay-vs-reference",
    about = "Replay a Mooncake trace through the reference's replay (Dynamo 1.6.1) and kvroute's, \
             side by side"
)]
pub(crate) struct Args {
    /// Mooncake-format JSONL trace (`timestamp`, `input_length`, `output_length`, `hash_ids`).
    #[arg(long, value_name = "FILE")]
    trace: PathBuf,
    /// Tokens per trace hash id; a positive multiple of the engines' 64-token blocks.
    #[arg(long, default_value_t = 512, value_name = "T")]
    trace_block_size: u32,
    /// Engines (workers) in each replay.
    #[arg(long, default_value_t = 8, value_name = "N")]
    workers: u32,
    /// Runs of the reference's kv_router, whose replay is not deterministic.
    #[arg(long, default_value_t = 3, value_name = "K")]
    reference_runs: u32,
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
        if self.trace_block_size == 0 || !self.trace_block_size.is_multiple_of(ENGINE_BLOCK_SIZE) {
            bail!(
                "--trace-block-size must be a positive multiple of the engines' \
                 {ENGINE_BLOCK_SIZE}-token blocks, got {}",
                self.trace_block_size
            );
        }
        if self.workers == 0 {
            bail!("--workers must be at least 1, got 0");
        }
        if !(1..=20).contains(&self.reference_runs) {
            bail!(
                "--reference-runs must be 1 to 20, got {}",
                self.reference_runs
            );
        }
        Ok(())
    }
}

/// What one replay of one policy measured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Figures {
    /// Cached prompt tokens over prompt tokens, 0 to 1.
    pub(crate) hit_rate: f64,
    pub(crate) ttft_p50_ms: f64,
    pub(crate) ttft_p99_ms: f64,
    pub(crate) e2e_p99_ms: f64,
}

/// One row of the table: a policy of one system, with every run's figures.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Row {
    pub(crate) system: &'static str,
    pub(crate) policy: String,
    pub(crate) runs: Vec<Figures>,
}

/// Runs the bench.
pub(crate) fn run(root: &Path, args: &[String]) -> Result<()> {
    let args = Args::parse(args)?;
    check_trace(&args.trace, args.trace_block_size)?;
    let trace = std::fs::canonicalize(&args.trace)
        .with_context(|| format!("cannot resolve {}", args.trace.display()))?;

    let venv = home_cache().join("reference-venv");
    let python = python::ensure_reference(&venv)?;

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
    let out_dir = target.join(NAME);
    std::fs::create_dir_all(&out_dir)
        .with_context(|| format!("cannot create {}", out_dir.display()))?;

    let total = 2 + args.reference_runs;
    let mut step = 0;
    let mut progress = |what: &str| {
        step += 1;
        eprintln!("[{step}/{total}] {what} ...");
        Instant::now()
    };

    let started = progress(&format!(
        "kvroute replay ({}) on {} workers",
        KVROUTE_POLICIES.join(", "),
        args.workers
    ));
    let json_path = out_dir.join("kvroute.json");
    let (oracle, kvroute_rows) = run_kvroute(&kvroute, &trace, &args, &json_path)?;
    eprintln!("      done in {:.1} s", started.elapsed().as_secs_f64());

    let mut reference_rows = Vec::new();
    for (mode, runs) in [("round_robin", 1), ("kv_router", args.reference_runs)] {
        let mut row = Row {
            system: "reference",
            policy: mode.to_owned(),
            runs: Vec::new(),
        };
        for run in 1..=runs {
            let started = progress(&format!(
                "reference replay, {mode}{}",
                if runs > 1 {
                    format!(" (run {run} of {runs})")
                } else {
                    String::new()
                }
            ));
            row.runs.push(run_reference(&python, &trace, &args, mode)?);
            eprintln!("      done in {:.1} s", started.elapsed().as_secs_f64());
        }
        reference_rows.push(row);
    }

    let rows: Vec<Row> = reference_rows.into_iter().chain(kvroute_rows).collect();
    println!(
        "{} on {} workers, {} blocks of {} tokens each, {} tokens per hash id; oracle hit rate \
         {:.2}%",
        trace.display(),
        args.workers,
        ENGINE_BLOCKS,
        ENGINE_BLOCK_SIZE,
        args.trace_block_size,
        oracle * 100.0
    );
    print!("{}", table(&rows, oracle));
    eprintln!("kvroute's JSON report: {}", json_path.display());
    Ok(())
}

/// The reference refuses a line whose hash ids cover fewer tokens than its input; say which.
pub(crate) fn check_trace(path: &Path, trace_block_size: u32) -> Result<()> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read trace {}", path.display()))?;
    check_trace_text(&text, trace_block_size)
        .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))
}

fn check_trace_text(text: &str, trace_block_size: u32) -> Result<()> {
    let mut lines = 0;
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        lines += 1;
        let n = i + 1;
        let record: Value =
            serde_json::from_str(line).with_context(|| format!("line {n}: not a JSON object"))?;
        let input = record["input_length"]
            .as_u64()
            .with_context(|| format!("line {n}: expected a non-negative integer input_length"))?;
        let ids = record["hash_ids"]
            .as_array()
            .with_context(|| format!("line {n}: expected a hash_ids array"))?
            .len() as u64;
        let covered = ids * u64::from(trace_block_size);
        if covered < input {
            bail!(
                "line {n}: {ids} hash ids x {trace_block_size} tokens cover {covered} tokens, \
                 fewer than its input_length {input}; the reference's replay refuses such a \
                 line (pass the trace's own --trace-block-size)"
            );
        }
    }
    if lines == 0 {
        bail!("the trace has no requests; expected one JSON object per line");
    }
    Ok(())
}

/// `kvroute replay` of [`KVROUTE_POLICIES`]; returns the trace's oracle hit rate and a row per
/// policy.
fn run_kvroute(
    binary: &Path,
    trace: &Path,
    args: &Args,
    json_path: &Path,
) -> Result<(f64, Vec<Row>)> {
    let mut cmd = Command::new(binary);
    cmd.arg("replay")
        .arg("--trace")
        .arg(trace)
        .args(["--engine-profile", "reference"])
        .args(["--workers", &args.workers.to_string()])
        .args(["--trace-block-size", &args.trace_block_size.to_string()])
        .args(["--block-size", &ENGINE_BLOCK_SIZE.to_string()])
        .args(["--cache-blocks", &ENGINE_BLOCKS.to_string()]);
    for policy in KVROUTE_POLICIES {
        cmd.args(["--policy", policy]);
    }
    cmd.arg("--json").arg(json_path);
    let output = cmd
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("could not start {}", binary.display()))?;
    if !output.status.success() {
        bail!("kvroute replay failed ({})", output.status);
    }
    let text = std::fs::read_to_string(json_path)
        .with_context(|| format!("cannot read {}", json_path.display()))?;
    parse_kvroute_json(&text).with_context(|| format!("reading {}", json_path.display()))
}

/// The oracle hit rate and one row per policy of `kvroute replay --json`.
pub(crate) fn parse_kvroute_json(text: &str) -> Result<(f64, Vec<Row>)> {
    let json: Value = serde_json::from_str(text).context("not JSON")?;
    let oracle = number(&json["oracle"], "token_hit_rate")?;
    let policies = json["policies"]
        .as_array()
        .context("expected a policies array")?;
    let mut rows = Vec::new();
    for p in policies {
        let policy = p["policy"]
            .as_str()
            .context("expected each policy's name")?
            .to_owned();
        let (requests, completed) = (number(p, "requests")?, number(p, "completed")?);
        if completed < requests {
            eprintln!(
                "warning: kvroute {policy}: {completed} of {requests} requests completed; the \
                 figures cover those only"
            );
        }
        rows.push(Row {
            system: "kvroute",
            runs: vec![Figures {
                hit_rate: number(p, "hit_rate")?,
                ttft_p50_ms: number(p, "ttft_p50_ms")?,
                ttft_p99_ms: number(p, "ttft_p99_ms")?,
                e2e_p99_ms: number(p, "e2e_p99_ms")?,
            }],
            policy,
        });
    }
    Ok((oracle, rows))
}

/// One run of the reference's replay of `mode`.
fn run_reference(python: &Path, trace: &Path, args: &Args, mode: &str) -> Result<Figures> {
    let output = Command::new(python)
        .arg("-c")
        .arg(REFERENCE_SCRIPT)
        .arg(trace)
        .arg(mode)
        .args([
            args.workers.to_string(),
            args.trace_block_size.to_string(),
            ENGINE_BLOCK_SIZE.to_string(),
            ENGINE_BLOCKS.to_string(),
        ])
        .env("DYN_LOG", "warn")
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("could not start {}", python.display()))?;
    if !output.status.success() {
        bail!("the reference's replay ({mode}) failed ({})", output.status);
    }
    let stdout = String::from_utf8_lossy(&output.stdout);
    let line = stdout
        .lines()
        .rev()
        .find(|l| l.trim_start().starts_with('{'))
        .with_context(|| format!("the reference's replay ({mode}) printed no summary"))?;
    parse_reference_summary(line).with_context(|| format!("the reference's {mode} summary"))
}

/// The figures of the reference replay's summary (as [`REFERENCE_SCRIPT`] prints it).
pub(crate) fn parse_reference_summary(line: &str) -> Result<Figures> {
    let json: Value = serde_json::from_str(line).context("not JSON")?;
    let (requests, completed) = (
        number(&json, "num_requests")?,
        number(&json, "completed_requests")?,
    );
    if completed < requests {
        eprintln!(
            "warning: the reference completed {completed} of {requests} requests; its figures \
             cover those only"
        );
    }
    Ok(Figures {
        hit_rate: number(&json, "prefix_cache_reused_ratio")?,
        ttft_p50_ms: number(&json, "median_ttft_ms")?,
        ttft_p99_ms: number(&json, "p99_ttft_ms")?,
        e2e_p99_ms: number(&json, "p99_e2e_latency_ms")?,
    })
}

fn number(json: &Value, key: &str) -> Result<f64> {
    json[key]
        .as_f64()
        .filter(|v| v.is_finite())
        .with_context(|| format!("expected a number `{key}`, got {}", json[key]))
}

/// The side-by-side table: a row per policy (figures as `min-max` over runs when they differ),
/// and for a policy run more than once a row with its best run by hit rate.
pub(crate) fn table(rows: &[Row], oracle: f64) -> String {
    let mut lines = vec![[
        "system".to_owned(),
        "policy".to_owned(),
        "runs".to_owned(),
        "hit rate".to_owned(),
        "hit/oracle".to_owned(),
        "TTFT p50".to_owned(),
        "TTFT p99".to_owned(),
        "E2E p99".to_owned(),
    ]];
    for row in rows {
        lines.push(cells(row.system, &row.policy, &row.runs, oracle));
        if row.runs.len() > 1
            && let Some(best) = row
                .runs
                .iter()
                .max_by(|a, b| a.hit_rate.total_cmp(&b.hit_rate))
        {
            let policy = format!("{} (best run)", row.policy);
            let mut best_cells = cells(row.system, &policy, std::slice::from_ref(best), oracle);
            best_cells[2] = "1".to_owned();
            lines.push(best_cells);
        }
    }
    crate::table::markdown(&lines, 2)
}

fn cells(system: &str, policy: &str, runs: &[Figures], oracle: f64) -> [String; 8] {
    let pick = |f: fn(&Figures) -> f64| runs.iter().map(f).collect::<Vec<f64>>();
    let hit = pick(|f| f.hit_rate);
    let of_oracle: Vec<f64> = hit
        .iter()
        .map(|h| if oracle > 0.0 { h / oracle } else { 0.0 })
        .collect();
    [
        system.to_owned(),
        policy.to_owned(),
        runs.len().to_string(),
        range(&hit, |v| format!("{:.2}", v * 100.0), "%"),
        range(&of_oracle, |v| format!("{:.1}", v * 100.0), "%"),
        range(&pick(|f| f.ttft_p50_ms), thousands, " ms"),
        range(&pick(|f| f.ttft_p99_ms), thousands, " ms"),
        range(
            &pick(|f| f.e2e_p99_ms),
            |v| format!("{:.2}", v / 1000.0),
            " s",
        ),
    ]
}

/// `values` formatted as one figure, or `min-max` when they format differently; `unit` once.
fn range(values: &[f64], format: impl Fn(f64) -> String, unit: &str) -> String {
    if values.is_empty() {
        return "-".to_owned();
    }
    let min = values.iter().copied().fold(f64::INFINITY, f64::min);
    let max = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let (lo, hi) = (format(min), format(max));
    if lo == hi {
        format!("{lo}{unit}")
    } else {
        format!("{lo}-{hi}{unit}")
    }
}

use crate::table::{target_directory, thousands};

#[cfg(test)]
mod tests;
