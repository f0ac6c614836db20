//! Fuzzing with cargo-fuzz (libFuzzer). cargo-fuzz needs a nightly toolchain; the project pins
//! stable 1.95.0 for everything else, so fuzzing alone runs as `cargo +nightly fuzz`.

use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::cmd::run_command;

/// Options of `cargo xtask fuzz`.
#[derive(clap::Args)]
pub(crate) struct FuzzArgs {
    /// Seconds each target runs for.
    #[arg(long, default_value_t = 120)]
    seconds: u64,
    /// Run only this target (default: all of them).
    target: Option<String>,
}

pub(crate) fn run(root: &Path, args: &FuzzArgs) -> Result<()> {
    match &args.target {
        Some(target) => {
            check_prerequisites(root)?;
            let targets = list_targets(root)?;
            if !targets.contains(target) {
                bail!(
                    "unknown fuzz target `{target}`: expected one of {}",
                    targets.join(", ")
                );
            }
            run_target(root, target, args.seconds)
        }
        None => run_all(root, args.seconds),
    }
}

/// Runs every target for `seconds` each; a crash fails with the artifact path libFuzzer printed.
pub(crate) fn run_all(root: &Path, seconds: u64) -> Result<()> {
    check_prerequisites(root)?;
    let targets = list_targets(root)?;
    if targets.is_empty() {
        bail!("fuzz/fuzz_targets holds no targets: expected at least one `*.rs`");
    }
    for target in &targets {
        run_target(root, target, seconds)?;
    }
    Ok(())
}

fn run_target(root: &Path, target: &str, seconds: u64) -> Result<()> {
    // Corpus under fuzz/corpus (git-ignored) grows across runs on one machine.
    let mut cmd = Command::new("cargo");
    cmd.current_dir(root.join("fuzz"))
        .args(["+nightly", "fuzz", "run", target, "--"])
        .arg(format!("-max_total_time={seconds}"))
        .arg("-rss_limit_mb=4096")
        .env_remove("RUSTFLAGS");
    run_command(&mut cmd).with_context(|| {
        format!(
            "fuzz target `{target}` failed: the crashing input is under fuzz/artifacts/{target}/"
        )
    })
}

fn list_targets(root: &Path) -> Result<Vec<String>> {
    let dir = root.join("fuzz").join("fuzz_targets");
    let mut targets = Vec::new();
    for entry in std::fs::read_dir(&dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "rs")
            && let Some(stem) = path.file_stem().and_then(|s| s.to_str())
        {
            targets.push(stem.to_owned());
        }
    }
    targets.sort();
    Ok(targets)
}

/// Fuzzing needs the nightly toolchain and the cargo-fuzz subcommand: installs cargo-fuzz when it
/// is missing, and says how to get a nightly instead of failing inside cargo.
fn check_prerequisites(root: &Path) -> Result<()> {
    if !root.join("fuzz").join("Cargo.toml").exists() {
        bail!("no fuzz/Cargo.toml: the fuzz workspace is missing");
    }
    let nightly = Command::new("cargo")
        .args(["+nightly", "--version"])
        .output();
    if !nightly.is_ok_and(|o| o.status.success()) {
        bail!(
            "fuzzing needs the nightly toolchain (`cargo +nightly`), which this machine lacks: \
             install it with `rustup toolchain install nightly`, or pass `--no-fuzz` to \
             `cargo xtask ci` to skip this step on a developer machine"
        );
    }
    let has_fuzz = || {
        Command::new("cargo")
            .args(["+nightly", "fuzz", "--version"])
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if !has_fuzz() {
        // A fresh machine: build cargo-fuzz from crates.io with the pinned toolchain (it runs
        // under any toolchain once installed), from `/` so that this workspace's
        // rust-toolchain.toml and lockfile stay out of it.
        eprintln!("cargo-fuzz is missing: installing it (`cargo install cargo-fuzz --locked`)");
        let mut install = Command::new("cargo");
        install
            .current_dir("/")
            .args(["+1.95.0", "install", "cargo-fuzz", "--locked", "--quiet"]);
        run_command(&mut install).context(
            "installing cargo-fuzz failed: install it by hand with              `cargo install cargo-fuzz --locked`, or pass `--no-fuzz` to skip fuzzing",
        )?;
        if !has_fuzz() {
            bail!("cargo-fuzz was installed but `cargo +nightly fuzz --version` still fails");
        }
    }
    Ok(())
}
