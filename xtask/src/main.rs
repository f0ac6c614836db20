//! Project automation for kvroute, run as `cargo xtask <command>` (the alias lives in
//! `.cargo/config.toml`). `cargo xtask ci` is the one gate CI runs: formatting, lints, tests, docs,
//! benches compiling, the tidy checks, loom models and short fuzz runs, each timed.
//!
//! xtask depends on no kvroute crate: it drives them through `cargo`, so it builds fast and never
//! needs the code under test to compile before it can report what is broken.

mod ci;
mod examples;
mod frontend_vs_reference;
mod fuzz;
mod package;
mod python;
mod replay_vs_reference;
mod table;
mod tidy;

use std::path::{Path, PathBuf};

use anyhow::Result;
use clap::{Parser, Subcommand};

/// kvroute's project automation.
#[derive(Parser)]
#[command(name = "cargo xtask", bin_name = "cargo xtask")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// The whole gate: fmt, clippy, tests, docs, benches compile, tidy, loom, short fuzz.
    Ci(ci::CiArgs),
    /// Only the tidy checks (crate docs, workspace dependencies, layering).
    Tidy,
    /// Run every fuzz target (or one) for a while. Needs the nightly toolchain and cargo-fuzz.
    Fuzz(fuzz::FuzzArgs),
    /// Run a benchmark binary with its own arguments, e.g. `bench indexer --trace FILE`.
    Bench {
        /// Which bench: `indexer` (trace replay through the KV index), `indexer-soak`, `mocker`
        /// (simulation speed), `request-plane` (TCP round trips), `router-overhead` or
        /// `engine-adapter` (what kvroute adds in front of an engine's HTTP API),
        /// `indexer-compare` (kvroute's indexer against the reference's, side by side),
        /// `replay-vs-reference` (a trace through the reference's replay and kvroute's, side by
        /// side: `--trace FILE [--trace-block-size T] [--workers N] [--reference-runs K]`; installs
        /// the reference, ~700 MB, into ~/.cache/kvroute/reference-venv once),
        /// `frontend-vs-reference` (the reference's frontend and kvroute serve, each over 4 mock
        /// workers, under the same chat load: `[--rounds N] [--warm-up S] [--measure S]
        /// [--rate R]`; the same venv).
        which: String,
        /// Arguments passed through to the bench binary.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Soak a real `kvroute serve` with three mock workers for N minutes: mixed streaming
    /// traffic, sessions, client errors, cancellations, and a worker SIGKILLed and restarted every
    /// few seconds; at the end it checks that every request is accounted for (ok, client error,
    /// retryable, cancelled), the router holds no load, no worker holds a session and the
    /// router's RSS stayed flat, and prints a one-line summary.
    ///
    /// Runs `cargo test --release -p kvroute --test it soak -- --nocapture` with
    /// `KVROUTE_SOAK_SECONDS` = N * 60, e.g. `cargo xtask soak --minutes 30`. CI runs the same
    /// test for 15 s in a debug build as part of the ordinary tests.
    Soak {
        /// How long the traffic runs, in minutes (1 to 240).
        #[arg(long)]
        minutes: u64,
    },
}

/// The longest soak `cargo xtask soak` runs (4 hours).
const MAX_SOAK_MINUTES: u64 = 240;

fn main() -> Result<()> {
    let cli = Cli::parse();
    let root = project_root();
    match cli.command {
        Command::Ci(args) => ci::run(&root, &args),
        Command::Tidy => tidy::run_all(&root),
        Command::Fuzz(args) => fuzz::run(&root, &args),
        Command::Bench { which, args } => bench(&root, &which, &args),
        Command::Soak { minutes } => soak(&root, minutes),
    }
}

/// The workspace root (the parent of `xtask/`).
fn project_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives one level below the workspace root")
        .to_path_buf()
}

/// Bench binaries (harness = false) that print figures; `cargo xtask bench NAME` runs them in
/// release mode with the caller's arguments.
const BENCHES: &[(&str, &str, &str)] = &[
    ("indexer", "kvroute-indexer", "trace_replay"),
    ("indexer-soak", "kvroute-indexer", "churn_soak"),
    ("mocker", "kvroute-mocker", "simulate"),
    ("request-plane", "kvroute-runtime", "request_plane"),
    ("router-overhead", "kvroute", "router_overhead"),
    ("engine-adapter", "kvroute", "engine_adapter"),
    ("nats-scaleout", "kvroute", "nats_scaleout"),
];

/// Bench binaries in a workspace of their own under `benches/` (they depend on the reference's
/// crates, which stay out of the main workspace): name, manifest directory, bench target.
pub(crate) const OWN_WORKSPACE_BENCHES: &[(&str, &str, &str)] = &[(
    "indexer-compare",
    "benches/indexer-compare",
    "indexer_compare",
)];

fn bench(root: &Path, which: &str, args: &[String]) -> Result<()> {
    if which == replay_vs_reference::NAME {
        return replay_vs_reference::run(root, args);
    }
    if which == frontend_vs_reference::NAME {
        return frontend_vs_reference::run(root, args);
    }
    if let Some((_, dir, bench)) = OWN_WORKSPACE_BENCHES.iter().find(|(n, _, _)| *n == which) {
        let manifest = root.join(dir).join("Cargo.toml");
        let mut cmd = std::process::Command::new(cargo());
        cmd.current_dir(root)
            .args(["bench", "--quiet", "--locked", "--manifest-path"])
            .arg(manifest)
            .args(["--bench", bench, "--"])
            .args(args);
        return ci::run_command(&mut cmd);
    }
    let Some((_, package, bench)) = BENCHES.iter().find(|(name, _, _)| *name == which) else {
        let known: Vec<_> = BENCHES
            .iter()
            .chain(OWN_WORKSPACE_BENCHES)
            .map(|(name, _, _)| *name)
            .chain([replay_vs_reference::NAME, frontend_vs_reference::NAME])
            .collect();
        anyhow::bail!(
            "unknown bench `{which}`: expected one of {}",
            known.join(", ")
        );
    };
    let mut cmd = std::process::Command::new(cargo());
    cmd.current_dir(root)
        .args(["bench", "--quiet", "-p", package, "--bench", bench, "--"])
        .args(args);
    ci::run_command(&mut cmd)
}

/// The cargo that invoked us (so `cargo +toolchain xtask` stays on that toolchain).
fn cargo() -> String {
    std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned())
}

/// Runs the soak test in release mode for `minutes` minutes (bounded by [`MAX_SOAK_MINUTES`]).
fn soak(root: &Path, minutes: u64) -> Result<()> {
    anyhow::ensure!(
        (1..=MAX_SOAK_MINUTES).contains(&minutes),
        "--minutes {minutes}: a soak runs 1 to {MAX_SOAK_MINUTES} minutes"
    );
    let mut cmd = std::process::Command::new(cargo());
    cmd.current_dir(root)
        .env("KVROUTE_SOAK_SECONDS", (minutes * 60).to_string())
        .args([
            "test",
            "--release",
            "-p",
            "kvroute",
            "--test",
            "it",
            "soak",
            "--",
            "--nocapture",
        ]);
    ci::run_command(&mut cmd)
}
