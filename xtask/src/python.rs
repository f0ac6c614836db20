//! The Python environment of the tests that drive code nobody on the project wrote: the stock
//! `openai` client, llama.cpp's own server (the `xllamacpp` wheel) and the real vLLM and SGLang
//! KV event publishers (loaded from their wheels without torch).
//!
//! One venv outside the clone (so CI keeps it between runs), filled from
//! `tests/python/requirements.txt` and, without their dependencies,
//! `tests/python/requirements-nodeps.txt` (the engines' wheels: only a few pure-Python modules of
//! them are loaded). A stamp of both files' contents skips pip when nothing changed. Tests find
//! the interpreter in `KVROUTE_PYTHON`.
//!
//! A second venv holds the reference itself (NVIDIA Dynamo 1.6.1's Python packages, ~700 MB) for
//! `cargo xtask bench replay-vs-reference` and `cargo xtask bench frontend-vs-reference`; CI never
//! builds it. See [`ensure_reference`].

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::cmd::{home_cache, run_command};

/// The variable the tests read the venv's interpreter from.
pub(crate) const PYTHON_ENV: &str = "KVROUTE_PYTHON";

/// The test venv: beside the target directory when that is outside the clone
/// (`CARGO_TARGET_DIR`; CI keeps both), else in `~/.cache/kvroute`.
pub(crate) fn venv_dir(root: &Path) -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) => root.join(dir).join("..").join("venv"),
        None => home_cache().join("venv"),
    }
}

/// The requirement files, relative to the workspace root: (path, installed with `--no-deps`).
const REQUIREMENTS: &[(&str, bool)] = &[
    ("tests/python/requirements.txt", false),
    ("tests/python/requirements-nodeps.txt", true),
];

/// The reference's pinned install, in order: what each step installs, whether without
/// dependencies, and the requirements. `pip install ai-dynamo` itself fails (it requires
/// `aisimulate==0.13.0`, a placeholder that downloads from elsewhere, and a `certifi` newer than
/// any published), so its dependencies that replay, the frontend and the mocker import are
/// installed by hand (`kubernetes` and `redis`, which it also requires, are not imported on the
/// paths the benches run). `gguf` and `numpy` are for `tests/python/llamacpp/make_model.py`, which
/// writes the model directory of `cargo xtask bench frontend-vs-reference`.
const REFERENCE_INSTALL: &[(&str, bool, &[&str])] = &[
    (
        "the reference's runtime wheel (75 MB) with its dependencies",
        false,
        &["ai-dynamo-runtime==1.6.1"],
    ),
    (
        "the reference's Python package, without its dependencies",
        true,
        &["ai-dynamo==1.6.1"],
    ),
    (
        "the pure-Python packages the reference imports",
        false,
        &[
            "aiohttp==3.14.5",
            "certifi==2026.10.18",
            "msgspec==0.22.0",
            "prometheus-client==0.26.0",
            "pyzmq==27.3.0",
            "tqdm==4.70.1",
            "typing-extensions==4.16.0",
            "zstandard==0.25.0",
        ],
    ),
    (
        "what the reference's frontend and mocker import, and what writes the bench's model",
        false,
        &[
            "transformers==5.23.0",
            "uvloop==0.23.0",
            "packaging==26.3",
            "pyyaml==6.0.3",
            "gguf==0.19.0",
            "numpy==2.4.6",
        ],
    ),
];

/// Creates or updates the venv; returns its interpreter.
pub(crate) fn ensure(root: &Path, venv: &Path) -> Result<PathBuf> {
    let python = create_venv(venv, "the tests")?;
    let mut wanted = String::new();
    for (file, _) in REQUIREMENTS {
        let path = root.join(file);
        if path.exists() {
            let text = std::fs::read_to_string(&path)
                .with_context(|| format!("reading {}", path.display()))?;
            wanted.push_str(&format!("# {file}\n{text}\n"));
        }
    }
    let stamp = venv.join("kvroute-requirements.stamp");
    if std::fs::read_to_string(&stamp).ok().as_deref() == Some(wanted.as_str()) {
        return Ok(python);
    }
    eprintln!(
        "installing the test requirements into {} (first run, or they changed)",
        venv.display()
    );
    for (file, no_deps) in REQUIREMENTS {
        let path = root.join(file);
        if !path.exists() {
            continue;
        }
        let mut pip = Command::new(&python);
        pip.args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
        ]);
        if *no_deps {
            pip.arg("--no-deps");
        }
        pip.arg("-r").arg(&path);
        run_command(&mut pip).with_context(|| {
            format!("installing {file} into the test venv (a package registry must be reachable)")
        })?;
    }
    std::fs::write(&stamp, wanted).with_context(|| format!("writing {}", stamp.display()))?;
    Ok(python)
}

/// Creates the reference's venv at `venv` once (pinned: [`REFERENCE_INSTALL`]) and checks that
/// its replay, frontend and mocker import; returns its interpreter. A stamp of the install list skips all of it on
/// later runs.
pub(crate) fn ensure_reference(venv: &Path) -> Result<PathBuf> {
    let python = create_venv(venv, "the reference")?;
    let wanted: String = REFERENCE_INSTALL
        .iter()
        .map(|(_, no_deps, reqs)| {
            let flag = if *no_deps { "--no-deps " } else { "" };
            format!("{flag}{}\n", reqs.join(" "))
        })
        .collect();
    let stamp = venv.join("kvroute-reference.stamp");
    if std::fs::read_to_string(&stamp).ok().as_deref() == Some(wanted.as_str()) {
        return Ok(python);
    }
    eprintln!(
        "installing the reference (Dynamo 1.6.1, about 700 MB) into {}; this happens once",
        venv.display()
    );
    for (i, (what, no_deps, reqs)) in REFERENCE_INSTALL.iter().enumerate() {
        eprintln!("[{}/{}] installing {what}", i + 1, REFERENCE_INSTALL.len());
        let mut pip = Command::new(&python);
        pip.args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
        ]);
        if *no_deps {
            pip.arg("--no-deps");
        }
        pip.args(*reqs);
        run_command(&mut pip).with_context(|| {
            format!(
                "installing {what} into {} (the Python package registry must be reachable)",
                venv.display()
            )
        })?;
    }
    let import = Command::new(&python)
        .args([
            "-c",
            "import dynamo.replay, dynamo.llm, dynamo.frontend.main, dynamo.mocker.main",
        ])
        .env("DYN_LOG", "warn")
        .output()
        .with_context(|| format!("could not start {}", python.display()))?;
    if !import.status.success() {
        bail!(
            "the reference installed into {} but its replay, frontend or mocker does not \
             import:\n{}",
            venv.display(),
            String::from_utf8_lossy(&import.stderr)
        );
    }
    std::fs::write(&stamp, wanted).with_context(|| format!("writing {}", stamp.display()))?;
    Ok(python)
}

/// Makes `venv` with the system's python3 unless it exists; returns its interpreter. `purpose`
/// names who needs it in errors.
fn create_venv(venv: &Path, purpose: &str) -> Result<PathBuf> {
    let python_ok = Command::new("python3")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !python_ok {
        bail!(
            "python3 with the venv module must be on PATH for {purpose} \
             (e.g. `apt-get install python3 python3-venv`)"
        );
    }
    let python = venv.join("bin").join("python");
    if !python.exists() {
        run_command(Command::new("python3").arg("-m").arg("venv").arg(venv)).with_context(
            || {
                format!(
                    "creating the venv of {purpose} at {} (is the python3 venv module installed?)",
                    venv.display()
                )
            },
        )?;
    }
    Ok(python)
}
