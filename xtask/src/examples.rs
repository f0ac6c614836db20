//! The `examples` step of `cargo xtask ci`: every workspace crate's examples, built once and run,
//! each a check (they assert what they print). Every library crate must have at least one, so a
//! downstream user always finds a runnable starting point next to its README.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use cargo_metadata::{Message, Metadata, MetadataCommand, TargetKind};

use crate::cmd::cargo_cmd;

/// How long one example may run before it is killed as hung (they take well under a second).
const EXAMPLE_TIMEOUT: Duration = Duration::from_secs(30);

/// Crates that are tooling, not libraries for others: they need no example.
const NO_EXAMPLE_NEEDED: &[&str] = &["xtask"];

/// One example: its package, its name, and the binary cargo built for it.
struct Example {
    package: String,
    name: String,
    binary: std::path::PathBuf,
}

pub(crate) fn run_all(root: &Path) -> Result<()> {
    let metadata = MetadataCommand::new()
        .current_dir(root)
        .manifest_path(root.join("Cargo.toml"))
        .no_deps()
        .exec()
        .context("running `cargo metadata`")?;
    let missing = libraries_without_examples(&metadata);
    if !missing.is_empty() {
        bail!(
            "library crate(s) without a runnable example: {} (add `examples/<name>.rs` using the \
             crate's public API, asserting what it prints; see any crate's README)",
            missing.join(", ")
        );
    }
    let examples = build(root, &metadata)?;
    for example in &examples {
        run_one(root, example)?;
    }
    eprintln!("examples: {} ran and passed", examples.len());
    Ok(())
}

/// Library crates of the workspace (a `lib` target) that have no example target.
fn libraries_without_examples(metadata: &Metadata) -> Vec<String> {
    metadata
        .workspace_packages()
        .into_iter()
        .filter(|p| !NO_EXAMPLE_NEEDED.contains(&p.name.as_str()))
        .filter(|p| p.targets.iter().any(|t| t.kind.contains(&TargetKind::Lib)))
        .filter(|p| {
            !p.targets
                .iter()
                .any(|t| t.kind.contains(&TargetKind::Example))
        })
        .map(|p| p.name.to_string())
        .collect()
}

/// Builds every example of the workspace in one cargo call (the dev profile the tests also use,
/// with the same feature unification as `--workspace` test builds) and returns their binaries.
fn build(root: &Path, metadata: &Metadata) -> Result<Vec<Example>> {
    let mut cmd = cargo_cmd(root);
    cmd.args([
        "build",
        "--workspace",
        "--examples",
        "--locked",
        "--message-format=json-render-diagnostics",
    ])
    .stdout(Stdio::piped());
    eprintln!("$ {cmd:?}");
    let mut child = cmd.spawn().context("could not start cargo build")?;
    let stdout = child.stdout.take().context("cargo's stdout")?;
    let mut examples = Vec::new();
    for message in Message::parse_stream(std::io::BufReader::new(stdout)) {
        if let Message::CompilerArtifact(artifact) = message.context("reading cargo's output")?
            && artifact.target.kind.contains(&TargetKind::Example)
            && let Some(binary) = artifact.executable
        {
            let package = metadata
                .packages
                .iter()
                .find(|p| p.id == artifact.package_id)
                .map_or_else(|| artifact.package_id.repr.clone(), |p| p.name.to_string());
            examples.push(Example {
                package,
                name: artifact.target.name.clone(),
                binary: binary.into_std_path_buf(),
            });
        }
    }
    let status = child.wait()?;
    if !status.success() {
        bail!("building the examples failed ({status}): {cmd:?}");
    }
    examples.sort_by(|a, b| (&a.package, &a.name).cmp(&(&b.package, &b.name)));
    Ok(examples)
}

fn run_one(root: &Path, example: &Example) -> Result<()> {
    let repro = format!(
        "cargo run -p {} --example {}",
        example.package, example.name
    );
    eprintln!("--> {repro}");
    let started = Instant::now();
    let mut child = Command::new(&example.binary)
        .current_dir(root)
        .spawn()
        .with_context(|| format!("could not start {}", example.binary.display()))?;
    loop {
        if let Some(status) = child.try_wait()? {
            if !status.success() {
                bail!("example failed ({status}); reproduce with `{repro}`");
            }
            eprintln!("    ok in {:.2}s", started.elapsed().as_secs_f64());
            return Ok(());
        }
        if started.elapsed() > EXAMPLE_TIMEOUT {
            let _ = child.kill();
            let _ = child.wait();
            bail!("example still running after {EXAMPLE_TIMEOUT:?}; reproduce with `{repro}`");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}
