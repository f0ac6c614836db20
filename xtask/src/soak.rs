//! `cargo xtask soak`: long runs that look for what only time and faults find.
//!
//! * `mock` (the default): the release-mode soak test (`crates/kvroute/tests/it`, test `soak`),
//!   `kvroute serve` over three mock workers, for `--minutes` minutes.
//! * `chaos`: `tests/python/llamacpp/chaos.py` against a release build: two routers over NATS in
//!   front of real llama.cpp engines (CPU, a tiny model the script writes) and mock workers,
//!   multi-turn chat load, and a seeded schedule of kills, freezes and restarts of engines,
//!   routers, workers and nats-server. Every request must be accounted for, 99% must complete and
//!   the routers' load must return to zero. Needs `nats-server` on PATH and the test venv (made
//!   here, as `cargo xtask ci` makes it). Not part of `cargo xtask ci`.

use std::path::Path;
use std::process::{Command, ExitStatus};
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, bail};

use crate::cmd::{cargo_command, run_command};
use crate::{python, table};

/// The longest soak `cargo xtask soak` runs (4 hours).
const MAX_SOAK_MINUTES: u64 = 240;

/// How long the chaos soak runs without `--minutes`.
const DEFAULT_CHAOS_MINUTES: u64 = 5;

/// The chaos soak's script, relative to the workspace root.
const CHAOS_SCRIPT: &str = "tests/python/llamacpp/chaos.py";

/// Which soak `cargo xtask soak` runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum SoakKind {
    /// `kvroute serve` and three mock workers, a worker killed every few seconds (the soak test).
    #[default]
    Mock,
    /// Two routers over NATS, real llama.cpp engines and mock workers, seeded faults of every
    /// kind (engines, routers, workers, nats-server) under multi-turn chat load.
    Chaos,
}

fn check_minutes(minutes: u64) -> Result<()> {
    anyhow::ensure!(
        (1..=MAX_SOAK_MINUTES).contains(&minutes),
        "--minutes {minutes}: a soak runs 1 to {MAX_SOAK_MINUTES} minutes"
    );
    Ok(())
}

/// Runs the soak of `kind`. `minutes` is required for `mock` (as it always was) and defaults to
/// [`DEFAULT_CHAOS_MINUTES`] for `chaos`; `seed` is for `chaos` only.
pub(crate) fn run(
    root: &Path,
    kind: SoakKind,
    minutes: Option<u64>,
    seed: Option<u64>,
) -> Result<()> {
    match kind {
        SoakKind::Mock => {
            let minutes = minutes.context(
                "the mock soak needs --minutes N (e.g. `cargo xtask soak --minutes 30`)",
            )?;
            anyhow::ensure!(
                seed.is_none(),
                "--seed is for the chaos soak (`cargo xtask soak chaos --seed S`)"
            );
            mock(root, minutes)
        }
        SoakKind::Chaos => chaos(
            root,
            minutes.unwrap_or(DEFAULT_CHAOS_MINUTES),
            seed.unwrap_or(0),
        ),
    }
}

/// Runs the soak test in release mode for `minutes` minutes (bounded by [`MAX_SOAK_MINUTES`]).
fn mock(root: &Path, minutes: u64) -> Result<()> {
    check_minutes(minutes)?;
    let mut cmd = cargo_command();
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
    run_command(&mut cmd)
}

/// Builds kvroute in release mode and runs the chaos script against it, its logs under the
/// target directory (`chaos-soak/<unix time>-seed<S>`).
fn chaos(root: &Path, minutes: u64, seed: u64) -> Result<()> {
    check_minutes(minutes)?;
    let nats_ok = Command::new("nats-server")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !nats_ok {
        bail!(
            "the chaos soak starts its own nats-server: put it on PATH (`sudo apt-get install \
             nats-server`, or a release binary from https://github.com/nats-io/nats-server)"
        );
    }
    let python = python::ensure(root, &python::venv_dir(root))?;
    eprintln!("building kvroute (release)");
    run_command(cargo_command().current_dir(root).args([
        "build",
        "--release",
        "--locked",
        "-p",
        "kvroute",
    ]))?;
    let target = table::target_directory(root)?;
    let kvroute = target.join("release").join("kvroute");
    let stamp = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let logs = target
        .join("chaos-soak")
        .join(format!("{stamp}-seed{seed}"));
    std::fs::create_dir_all(&logs).with_context(|| format!("cannot create {}", logs.display()))?;
    eprintln!(
        "chaos soak: {minutes} min, seed {seed}; logs in {}",
        logs.display()
    );

    let mut cmd = Command::new(&python);
    cmd.current_dir(root)
        .arg(root.join(CHAOS_SCRIPT))
        .arg(&kvroute)
        .args([
            "--minutes",
            &minutes.to_string(),
            "--seed",
            &seed.to_string(),
        ])
        .arg("--log-dir")
        .arg(&logs);
    let status = run_interruptible(&mut cmd)?;
    if !status.success() {
        bail!(
            "the chaos soak failed ({status}); its summary is above and in {}",
            logs.join("summary.txt").display()
        );
    }
    eprintln!("chaos soak passed; logs in {}", logs.display());
    Ok(())
}

/// Runs `cmd` to its end. A Ctrl-C reaches the script too (same process group), which stops
/// every process it started; this process waits for that instead of dying first. SIGTERM (sent
/// to this process alone) is passed on to the script.
fn run_interruptible(cmd: &mut Command) -> Result<ExitStatus> {
    eprintln!("$ {cmd:?}");
    let mut child = cmd
        .spawn()
        .with_context(|| format!("could not start {cmd:?}"))?;
    let pid = child.id();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    runtime.block_on(async {
        use tokio::signal::unix::{SignalKind, signal};
        let mut interrupt = signal(SignalKind::interrupt()).context("handling SIGINT")?;
        let mut terminate = signal(SignalKind::terminate()).context("handling SIGTERM")?;
        let waiter = tokio::task::spawn_blocking(move || child.wait());
        tokio::pin!(waiter);
        loop {
            tokio::select! {
                status = &mut waiter => {
                    return status
                        .context("waiting for the chaos script")?
                        .context("waiting for the chaos script");
                }
                _ = interrupt.recv() => {
                    eprintln!("interrupted: waiting for the chaos script to stop its processes");
                }
                _ = terminate.recv() => {
                    eprintln!("terminated: passing SIGTERM to the chaos script");
                    let _ = Command::new("kill").args(["-TERM", &pid.to_string()]).status();
                }
            }
        }
    })
}
