//! `kvroute`, the one binary of the kvroute workspace, one module per subcommand: `serve` (the
//! OpenAI-compatible KV router), `epp` (the same router as an Envoy endpoint picker), `worker` (a simulated engine, or a sidecar in front of a real
//! one), `engine-sim` (simulated engines served as vLLM servers, for trying routers on a fleet
//! without GPUs), `demo` (router and simulated fleet in one process) and `replay` (a
//! Mooncake-format trace against simulated engines in virtual time, routed by the live router
//! core, comparing routing policies on cache hit rate, latency and balance).
//!
//! This crate is the only place that parses command lines, prints tables and writes report
//! files; the cores it drives stay free of I/O. anyhow is used here and nowhere below.

mod adapter;
mod cli;
mod demo;
mod engine_sim;
mod load;
mod mocker_args;
mod replay;
mod retry;
mod serve;
mod signal;
mod worker;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// The binary allocates through mimalloc (v2) rather than the C library's allocator: a streamed
/// response allocates a few small buffers for every token it relays (the engine's chunk, the
/// parsed step, the client's chunk), and glibc's malloc and free were the largest items of
/// `kvroute serve`'s CPU profile (docs/benchmarks.md, "Against the peers"). Only this binary
/// chooses; the library crates leave the allocator to whoever links them. v2 rather than v3:
/// v3 cost 38-40 MiB more peak RSS on the same runs for a few percent less CPU. Without
/// transparent huge pages (`no_thp`): mimalloc asks the kernel for them on its segments, and each
/// first touch then faults in and zeroes 2 MiB where a 4 KiB page would do, which was a fifth to
/// a third of a fresh `kvroute serve`'s CPU over a bench run (and 20-30 MiB of its peak RSS), and
/// a stall in the first bursts of requests.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The command line.
#[derive(Debug, Parser)]
#[command(
    name = "kvroute",
    version,
    about = "KV-cache-aware routing for LLM inference fleets"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// One subcommand per mode of the binary.
#[derive(Debug, Subcommand)]
enum Command {
    /// Replay a Mooncake JSONL trace against simulated engines in virtual time and compare
    /// routing policies.
    Replay(Box<replay::ReplayArgs>),
    /// Start a router and a simulated fleet in this process, drive generated multi-turn
    /// conversations through the HTTP API with round-robin and then kv routing, and compare.
    Demo(demo::DemoArgs),
    /// Serve the OpenAI-compatible API and route requests over a fleet of workers.
    Serve(Box<serve::ServeArgs>),
    /// Serve as the endpoint picker of a Kubernetes inference gateway: an Envoy ext_proc gRPC
    /// service choosing each request's engine, over the same fleet and options as `serve`.
    Epp(Box<serve::epp::EppArgs>),
    /// Run a worker that registers with a router and publishes KV events: a simulated engine
    /// (`--mock`) or a real one behind its HTTP API (`--engine KIND --engine-url URL`).
    Worker(Box<worker::WorkerArgs>),
    /// Serve N simulated engines over HTTP in vLLM's OpenAI-compatible dialect, one port each,
    /// with vLLM's metrics and (`--kv-events`) vLLM's ZMQ KV event feed.
    EngineSim(Box<engine_sim::EngineSimArgs>),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Replay(args) => replay::run(&args),
        Command::Demo(args) => demo::run(&args),
        Command::Serve(args) => serve::run(*args),
        Command::Epp(args) => serve::epp::run(*args),
        Command::Worker(args) => worker::run(*args),
        Command::EngineSim(args) => engine_sim::run(*args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            // `{:#}` prints the whole context chain on one line: "what we did: why it failed".
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}
