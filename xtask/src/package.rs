//! The `package` step of `cargo xtask ci`: every publishable crate must package as crates.io
//! would take it, so downstream projects can depend on one crate at a time.
//!
//! First a metadata check of each publishable library crate (picked up from `cargo metadata`, so
//! a new crate is included without editing this file): a description, a license, a real
//! repository URL, and a README that exists. Then one `cargo package --workspace`: cargo packages the
//! members together, resolving path dependencies on unpublished members against each other's
//! packaged versions (which is why every path dependency also states a version). `--no-verify`
//! skips rebuilding every package from its tarball (the other steps build the same sources);
//! `--allow-dirty` lets it run on a working tree with uncommitted changes.

use std::path::Path;

use anyhow::{Context, Result, bail};
use cargo_metadata::{Metadata, MetadataCommand, Package, TargetKind};

use crate::cmd::{cargo_cmd, run_command};

/// A repository URL that stands for "not set yet".
const PLACEHOLDER_HOSTS: &[&str] = &["example.invalid", "example.com", "example.org"];

pub(crate) fn run(root: &Path) -> Result<()> {
    let metadata = MetadataCommand::new()
        .current_dir(root)
        .manifest_path(root.join("Cargo.toml"))
        .no_deps()
        .exec()
        .context("running `cargo metadata`")?;
    let publishable = publishable(&metadata);
    let problems: Vec<String> = publishable
        .iter()
        .filter(|p| p.targets.iter().any(|t| t.kind.contains(&TargetKind::Lib)))
        .flat_map(|p| {
            check_metadata(p)
                .into_iter()
                .map(move |m| format!("{}: {m}", p.name))
        })
        .collect();
    if !problems.is_empty() {
        for problem in &problems {
            eprintln!("package: {problem}");
        }
        bail!("{} packaging problem(s), listed above", problems.len());
    }
    let names: Vec<&str> = publishable.iter().map(|p| p.name.as_str()).collect();
    eprintln!("packaging {} crates: {}", names.len(), names.join(", "));
    let package = |extra: &[&str]| {
        let mut cmd = cargo_cmd(root);
        cmd.args([
            "package",
            "--workspace",
            "--no-verify",
            "--locked",
            "--allow-dirty",
            "--quiet",
        ])
        .args(extra);
        run_command(&mut cmd)
    };
    // Offline, cargo resolves each package against the index cache the build steps filled, in
    // about a second; online it refreshes the index once per crate (about 20 s). Fall back to
    // online only when the cache lacks something.
    package(&["--offline"]).or_else(|e| {
        eprintln!("package: offline packaging failed ({e:#}); retrying online");
        package(&[])
    })
}

/// Workspace members that may be published (`publish` unset, `true` or a list of registries).
fn publishable(metadata: &Metadata) -> Vec<&Package> {
    metadata
        .workspace_packages()
        .into_iter()
        .filter(|p| {
            p.publish
                .as_ref()
                .is_none_or(|registries| !registries.is_empty())
        })
        .collect()
}

/// What crates.io (and a reader of the crate's page) needs beyond what `cargo package` checks.
fn check_metadata(package: &Package) -> Vec<String> {
    let mut problems = Vec::new();
    if package.description.as_deref().is_none_or(str::is_empty) {
        problems.push("needs a `description`".to_owned());
    }
    if package.license.is_none() && package.license_file.is_none() {
        problems.push("needs `license.workspace = true`".to_owned());
    }
    match package.repository.as_deref() {
        None => problems.push("needs `repository.workspace = true`".to_owned()),
        Some(url) if PLACEHOLDER_HOSTS.iter().any(|h| url.contains(h)) => {
            problems.push(format!("`repository` is a placeholder: {url}"));
        }
        Some(_) => {}
    }
    let dir = package
        .manifest_path
        .parent()
        .map(|d| d.as_std_path().to_path_buf())
        .unwrap_or_default();
    match &package.readme {
        None => problems.push(
            "needs a README.md (what the crate is for, where it sits in the layering, a usage \
             snippet, its example) and `readme = \"README.md\"`"
                .to_owned(),
        ),
        Some(readme) if !dir.join(readme.as_std_path()).is_file() => {
            problems.push(format!("`readme = \"{readme}\"` names no file"));
        }
        Some(_) => {}
    }
    problems
}
