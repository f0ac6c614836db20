//! Tidy checks: facts about the tree that the compiler does not enforce (crate docs, manifests,
//! layering, the routing core's freedom from I/O crates, file and function size, no import circle
//! between a crate's files). Each check returns the list of problems it found; `cargo xtask tidy`
//! (and the `tidy` step of `cargo xtask ci`) runs them all, and each is also a `#[test]` so plain
//! `cargo test` runs them too.

mod core_io;
mod crate_docs;
mod file_size;
mod fn_size;
mod import_cycles;
mod layering;
mod manifests;

use std::path::Path;

use anyhow::{Context, Result, bail};
use cargo_metadata::{Metadata, MetadataCommand};

pub(crate) fn run_all(root: &Path) -> Result<()> {
    let metadata = metadata(root)?;
    let mut problems = Vec::new();
    problems.extend(crate_docs::check(&metadata));
    problems.extend(manifests::check(&metadata));
    problems.extend(layering::check(&metadata));
    problems.extend(core_io::check(&metadata));
    problems.extend(file_size::check(&metadata));
    problems.extend(fn_size::check(&metadata));
    problems.extend(import_cycles::check(&metadata));
    if problems.is_empty() {
        eprintln!("tidy: ok");
        return Ok(());
    }
    for problem in &problems {
        eprintln!("tidy: {problem}");
    }
    bail!("{} tidy problem(s), listed above", problems.len())
}

fn metadata(root: &Path) -> Result<Metadata> {
    MetadataCommand::new()
        .current_dir(root)
        .manifest_path(root.join("Cargo.toml"))
        .exec()
        .context("running `cargo metadata`")
}

#[cfg(test)]
fn workspace_metadata() -> Metadata {
    metadata(&crate::cmd::project_root()).expect("cargo metadata on this workspace")
}
