//! The Python environment of the tests that drive code nobody on the project wrote: the stock
//! `openai` client, llama.cpp's own server (the `xllamacpp` wheel) and the real vLLM and SGLang
//! KV event publishers (loaded from their wheels without torch).
//!
//! One venv outside the clone (so CI keeps it between runs), filled from
//! `tests/python/requirements.txt` and, without their dependencies,
//! `tests/python/requirements-nodeps.txt` (the engines' wheels: only a few pure-Python modules of
//! them are loaded). A stamp of both files' contents skips pip when nothing changed. Tests find
//! the interpreter in `KVROUTE_PYTHON`.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::ci::run_command;

/// The variable the tests read the venv's interpreter from.
pub(crate) const PYTHON_ENV: &str = "KVROUTE_PYTHON";

/// The requirement files, relative to the workspace root: (path, installed with `--no-deps`).
const REQUIREMENTS: &[(&str, bool)] = &[
    ("tests/python/requirements.txt", false),
    ("tests/python/requirements-nodeps.txt", true),
];

/// Creates or updates the venv; returns its interpreter.
pub(crate) fn ensure(root: &Path, venv: &Path) -> Result<PathBuf> {
    let python_ok = Command::new("python3")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !python_ok {
        bail!(
            "the tests need python3 with the venv module on PATH \
             (e.g. `apt-get install python3 python3-venv`)"
        );
    }
    let python = venv.join("bin").join("python");
    if !python.exists() {
        run_command(Command::new("python3").arg("-m").arg("venv").arg(venv))
            .context("creating the test venv (is the python3 venv module installed?)")?;
    }
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
