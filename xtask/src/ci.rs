//! `cargo xtask ci`: the gate. Runs each step in order, prints how long it took, and stops at the
//! first failure with a message naming the step and the command to reproduce it.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::cmd::{cargo_cmd, cargo_command, run_command};
use crate::{examples, fuzz, package, python, tidy};

/// Options of `cargo xtask ci`.
#[derive(clap::Args)]
pub(crate) struct CiArgs {
    /// Seconds each fuzz target runs for.
    #[arg(long, default_value_t = 15)]
    fuzz_seconds: u64,
    /// Skip the fuzz step (for machines without the nightly toolchain; CI never passes this).
    #[arg(long)]
    no_fuzz: bool,
}

pub(crate) fn run(root: &Path, args: &CiArgs) -> Result<()> {
    let started = Instant::now();
    let mut timings: Vec<(&str, Duration)> = Vec::new();
    let mut step = |name: &'static str, f: &mut dyn FnMut() -> Result<()>| -> Result<()> {
        eprintln!("\n==> [{name}]");
        let t = Instant::now();
        let result = f();
        let took = t.elapsed();
        timings.push((name, took));
        match result {
            Ok(()) => {
                eprintln!("==> [{name}] ok in {:.1}s", took.as_secs_f64());
                Ok(())
            }
            Err(e) => {
                print_timings(&timings);
                Err(e.context(format!("`cargo xtask ci` failed at step `{name}`")))
            }
        }
    };

    let mut python = None;
    step("nats-server", &mut ensure_nats_server)?;
    step("python", &mut || {
        python = Some(python::ensure(root, &python::venv_dir(root))?);
        Ok(())
    })?;
    let python = python.context("the python step set no interpreter")?;

    step("fmt", &mut || {
        cargo_in(root, &["fmt", "--all", "--", "--check"])
            .context("code is not formatted: run `cargo fmt --all`")
    })?;
    step("clippy", &mut || {
        cargo_in(
            root,
            &[
                "clippy",
                "--workspace",
                "--all-targets",
                "--locked",
                "--",
                "-D",
                "warnings",
            ],
        )
    })?;
    step("tidy", &mut || tidy::run_all(root))?;
    step("test", &mut || run_tests(root, &python))?;
    step("e2e", &mut || run_e2e(root, &python))?;
    step("peers", &mut || {
        crate::peers::run(root, &["--quick".to_owned()])
    })?;
    // A few seconds: real llama.cpp servers behind the same routers.
    step("peers-llamacpp", &mut || {
        crate::peers::run(
            root,
            &["--engine", "llamacpp", "--quick"].map(str::to_owned),
        )
    })?;
    step("examples", &mut || examples::run_all(root))?;
    step("package", &mut || package::run(root))?;
    step("doc", &mut || {
        let mut cmd = cargo_cmd(root);
        cmd.args(["doc", "--workspace", "--no-deps", "--locked"])
            .env("RUSTDOCFLAGS", "-D warnings");
        run_command(&mut cmd)
    })?;
    step("bench-check", &mut || {
        cargo_in(root, &["check", "--workspace", "--benches", "--locked"])?;
        check_own_workspace_benches(root)
    })?;
    step("loom", &mut || run_loom(root))?;
    if args.no_fuzz {
        eprintln!("\n==> [fuzz] skipped: --no-fuzz was given");
    } else {
        step("fuzz", &mut || fuzz::run_all(root, args.fuzz_seconds))?;
    }

    print_timings(&timings);
    eprintln!(
        "cargo xtask ci: all steps passed in {:.1}s",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// The bench crates with a workspace of their own (see `bench::OWN_WORKSPACE_BENCHES`): formatted,
/// compiling and lint-free with their own lockfile, so the comparison with the reference never
/// rots while its dependencies stay out of the main build.
fn check_own_workspace_benches(root: &Path) -> Result<()> {
    for (_, dir, _) in crate::bench::OWN_WORKSPACE_BENCHES {
        let manifest = root.join(dir).join("Cargo.toml");
        let manifest = manifest
            .to_str()
            .context("bench manifest path is not UTF-8")?;
        cargo_in(root, &["fmt", "--manifest-path", manifest, "--", "--check"]).with_context(
            || format!("{dir} is not formatted: run `cargo fmt --manifest-path {manifest}`"),
        )?;
        cargo_in(
            root,
            &[
                "clippy",
                "--manifest-path",
                manifest,
                "--all-targets",
                "--locked",
                "--",
                "-D",
                "warnings",
            ],
        )?;
    }
    Ok(())
}

fn print_timings(timings: &[(&str, Duration)]) {
    eprintln!("\nstep timings:");
    for (name, took) in timings {
        eprintln!("  {name:<12} {:>7.1}s", took.as_secs_f64());
    }
}

/// Tests: cargo-nextest when it is installed (faster, one process per test), else `cargo test`.
/// nextest does not run doctests, so those run separately. Tests that run Python find the test
/// venv's interpreter in [`python::PYTHON_ENV`].
fn run_tests(root: &Path, python: &Path) -> Result<()> {
    let cargo_in = |root: &Path, args: &[&str]| {
        let mut cmd = cargo_cmd(root);
        cmd.args(args).env(python::PYTHON_ENV, python);
        run_command(&mut cmd)
    };
    let has_nextest = cargo_command()
        .args(["nextest", "--version"])
        .output()
        .is_ok_and(|o| o.status.success());
    if has_nextest {
        cargo_in(
            root,
            &[
                "nextest",
                "run",
                "--workspace",
                "--locked",
                "--no-fail-fast",
                "--profile",
                "ci",
            ],
        )?;
        cargo_in(root, &["test", "--workspace", "--doc", "--locked"])
    } else {
        eprintln!("cargo-nextest not found; using `cargo test`");
        cargo_in(root, &["test", "--workspace", "--locked", "--no-fail-fast"])
    }
}

/// How long the OpenAI-client script may run before it is killed as hung.
const E2E_TIMEOUT: Duration = Duration::from_secs(180);

/// The black-box tests of the binary in `tests/`: a stock OpenAI client (the `openai` package
/// from PyPI, in the test venv) against `kvroute serve` and mock workers.
fn run_e2e(root: &Path, python: &Path) -> Result<()> {
    let target = target_dir(root);
    // The same build the test step made (workspace test targets unify dependency features
    // differently from `-p kvroute` alone, which would rebuild ~30 crates on a cold cache); it
    // leaves the `kvroute` binary in target/debug.
    cargo_in(root, &["build", "--workspace", "--tests", "--locked"])?;
    let binary = target.join("debug").join("kvroute");
    let mut cmd = Command::new(python);
    cmd.arg(root.join("tests").join("openai_client.py"))
        .arg(&binary)
        .current_dir(root);
    let shown = format!("{cmd:?}");
    eprintln!("$ {shown}");
    let mut child = cmd
        .spawn()
        .with_context(|| format!("could not start {shown}"))?;
    let deadline = Instant::now() + E2E_TIMEOUT;
    loop {
        if let Some(status) = child.try_wait()? {
            if !status.success() {
                bail!("command failed ({status}): {shown}");
            }
            return Ok(());
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            bail!("timed out after {E2E_TIMEOUT:?}: {shown}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn target_dir(root: &Path) -> std::path::PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) => root.join(dir),
        None => root.join("target"),
    }
}

/// Loom models compile the crate with `--cfg loom`, which changes every artifact, so they build in
/// a target directory of their own to keep the main one warm.
const LOOM_CRATES: &[&str] = &["kvroute-indexer"];

fn run_loom(root: &Path) -> Result<()> {
    let target = loom_target_dir(root);
    for krate in LOOM_CRATES {
        if !root.join("crates").join(krate).exists() {
            continue;
        }
        let mut cmd = cargo_cmd(root);
        cmd.args([
            "test",
            "--release",
            "--locked",
            "-p",
            krate,
            "--lib",
            "loom",
        ])
        .env("RUSTFLAGS", "--cfg loom")
        .env("CARGO_TARGET_DIR", &target)
        .env("LOOM_MAX_PREEMPTIONS", "3")
        // The models want optimised code, not the shipped binary's fat LTO (Cargo.toml), which
        // would add minutes of linking to a test binary for nothing.
        .env("CARGO_PROFILE_RELEASE_LTO", "false")
        .env("CARGO_PROFILE_RELEASE_CODEGEN_UNITS", "16");
        run_command(&mut cmd)?;
    }
    Ok(())
}

fn loom_target_dir(root: &Path) -> std::path::PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) => Path::new(&dir).join("loom"),
        None => root.join("target").join("loom"),
    }
}

/// The NATS tests start their own `nats-server -js` (a free port, a temporary store), so the
/// binary must be on PATH: install the Debian package when it is missing (as root, or through
/// sudo), and fail with the reason when that is impossible. Never a silent skip.
fn ensure_nats_server() -> Result<()> {
    let version = || {
        Command::new("nats-server")
            .arg("--version")
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
    };
    if let Some(v) = version() {
        eprintln!("using {v} for the NATS tests");
        return Ok(());
    }
    eprintln!("nats-server is not on PATH; installing the Debian package `nats-server`");
    let root = Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0");
    let apt = |args: &[&str]| -> Result<()> {
        let mut cmd = if root {
            Command::new("apt-get")
        } else {
            let mut sudo = Command::new("sudo");
            sudo.args(["-n", "apt-get"]);
            sudo
        };
        cmd.args(args).env("DEBIAN_FRONTEND", "noninteractive");
        run_command(&mut cmd)
    };
    apt(&["update", "-q"])
        .and_then(|()| apt(&["install", "-y", "-q", "nats-server"]))
        .context(
            "installing nats-server failed; install it yourself (`sudo apt-get install \
             nats-server`, or a release binary from https://github.com/nats-io/nats-server on \
             PATH): the NATS tests need it",
        )?;
    match version() {
        Some(v) => {
            eprintln!("installed {v}");
            Ok(())
        }
        None => bail!("nats-server was installed but does not run; the NATS tests need it"),
    }
}

fn cargo_in(root: &Path, args: &[&str]) -> Result<()> {
    let mut cmd = cargo_cmd(root);
    cmd.args(args);
    run_command(&mut cmd)
}
