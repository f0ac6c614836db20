//! `cargo xtask bench NAME`: the benches that print figures, run in release mode, and the
//! comparisons with the reference ([`crate::replay_vs_reference`],
//! [`crate::frontend_vs_reference`]) and with the peers ([`crate::peers`]).

use std::path::Path;

use anyhow::Result;

use crate::cmd::{cargo_command, run_command};
use crate::{epp_bench, frontend_vs_reference, peers, replay_vs_reference};

/// Bench binaries (harness = false) that print figures; `cargo xtask bench NAME` runs them in
/// release mode with the caller's arguments.
const BENCHES: &[(&str, &str, &str)] = &[
    ("indexer", "kvroute-workloads", "trace_replay"),
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

/// Runs the bench `which` with `args`.
pub(crate) fn run(root: &Path, which: &str, args: &[String]) -> Result<()> {
    if which == replay_vs_reference::NAME {
        return replay_vs_reference::run(root, args);
    }
    if which == frontend_vs_reference::NAME {
        return frontend_vs_reference::run(root, args);
    }
    if which == peers::NAME {
        return peers::run(root, args);
    }
    if which == epp_bench::NAME {
        return epp_bench::run(root, args);
    }
    if let Some((_, dir, bench)) = OWN_WORKSPACE_BENCHES.iter().find(|(n, _, _)| *n == which) {
        let manifest = root.join(dir).join("Cargo.toml");
        let mut cmd = cargo_command();
        cmd.current_dir(root)
            .args(["bench", "--quiet", "--locked", "--manifest-path"])
            .arg(manifest)
            .args(["--bench", bench, "--"])
            .args(args);
        return run_command(&mut cmd);
    }
    let Some((_, package, bench)) = BENCHES.iter().find(|(name, _, _)| *name == which) else {
        let known: Vec<_> = BENCHES
            .iter()
            .chain(OWN_WORKSPACE_BENCHES)
            .map(|(name, _, _)| *name)
            .chain([
                replay_vs_reference::NAME,
                frontend_vs_reference::NAME,
                peers::NAME,
                epp_bench::NAME,
            ])
            .collect();
        anyhow::bail!(
            "unknown bench `{which}`: expected one of {}",
            known.join(", ")
        );
    };
    let mut cmd = cargo_command();
    cmd.current_dir(root)
        .args(["bench", "--quiet", "-p", package, "--bench", bench, "--"])
        .args(args);
    run_command(&mut cmd)
}
