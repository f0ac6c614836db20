//! Running commands: the cargo that invoked xtask, a command's echo and exit status, and where
//! xtask keeps things outside the clone. Every step (ci, package, fuzz, python, the benches and
//! soaks) runs its commands through these, so none of them needs another step's module.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

/// The cargo that invoked us (so `cargo +toolchain xtask` stays on that toolchain).
pub(crate) fn cargo() -> String {
    std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned())
}

/// The cargo that invoked us, without the variables `cargo run` sets for xtask itself.
///
/// `cargo xtask` is `cargo run -p xtask`, which hands xtask `CARGO_MANIFEST_DIR`,
/// `CARGO_PKG_NAME` and the like (xtask's). Build scripts that watch those variables in cargo's
/// environment (ring's does) then see other values than in a plain `cargo build`, so every build
/// made from xtask and every plain one rebuilt ring, rustls and what depends on them for the other.
pub(crate) fn cargo_command() -> Command {
    let mut cmd = Command::new(cargo());
    for (key, _) in std::env::vars_os() {
        let Some(key) = key.to_str() else { continue };
        if key.starts_with("CARGO_PKG_")
            || matches!(
                key,
                "CARGO_MANIFEST_DIR"
                    | "CARGO_MANIFEST_PATH"
                    | "CARGO_MANIFEST_LINKS"
                    | "CARGO_CRATE_NAME"
                    | "CARGO_BIN_NAME"
                    | "CARGO_PRIMARY_PACKAGE"
            )
        {
            cmd.env_remove(key);
        }
    }
    cmd
}

/// `cargo` with `root` as its working directory ([`cargo_command`]).
pub(crate) fn cargo_cmd(root: &Path) -> Command {
    let mut cmd = cargo_command();
    cmd.current_dir(root);
    cmd
}

/// Runs a command with inherited output; a non-zero exit is an error that shows the command line.
pub(crate) fn run_command(cmd: &mut Command) -> Result<()> {
    let shown = format!("{cmd:?}");
    eprintln!("$ {shown}");
    let status = cmd
        .status()
        .with_context(|| format!("could not start {shown}"))?;
    if !status.success() {
        bail!("command failed ({status}): {shown}");
    }
    Ok(())
}

/// `~/.cache/kvroute`: what xtask keeps outside the clone.
pub(crate) fn home_cache() -> PathBuf {
    let home = std::env::var_os("HOME").unwrap_or_else(|| ".".into());
    Path::new(&home).join(".cache").join("kvroute")
}

/// The workspace root (the parent of `xtask/`).
///
/// Read from `CARGO_MANIFEST_DIR` as `cargo run` (the `cargo xtask` alias) sets it for this run,
/// and only without it from the path this binary was compiled at: two checkouts sharing one
/// `CARGO_TARGET_DIR` (CI's cache, a worktree) share one xtask binary whenever xtask's own
/// sources are alike, since cargo finds it fresh, and the compiled-in path would then be the
/// other checkout's: its code would be built, tested and benched instead of this one's.
pub(crate) fn project_root() -> PathBuf {
    let manifest_dir = std::env::var_os("CARGO_MANIFEST_DIR")
        .map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from);
    manifest_dir
        .parent()
        .expect("xtask lives one level below the workspace root")
        .to_path_buf()
}

/// Builds the `kvroute` binary (release, or the debug build CI's tests already made when
/// `release` is false: smoke runs) and returns its path.
pub(crate) fn build_kvroute(root: &Path, release: bool) -> Result<PathBuf> {
    let profile = if release { "release" } else { "debug" };
    eprintln!("building kvroute ({profile})");
    let mut build = cargo_command();
    build
        .current_dir(root)
        .args(["build", "--locked", "-p", "kvroute"]);
    if release {
        build.arg("--release");
    }
    run_command(&mut build)?;
    Ok(crate::table::target_directory(root)?
        .join(profile)
        .join("kvroute"))
}
