//! The router configurations the bench compares, and how each is started in front of a fleet and
//! known to be ready (every engine registered and healthy).

use std::fmt::Write as _;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use serde_json::Value;
use tokio::time::Instant;

use super::fleet::{BLOCK_SIZE, Engine, MODEL};
use crate::procs::Proc;

/// How long a router may take to list every engine as healthy.
const READY_BOUND: Duration = Duration::from_secs(60);

/// One router configuration of the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, clap::ValueEnum)]
pub(crate) enum Config {
    /// `kvroute serve`, default policy, the engines' vLLM KV events (ZMQ) feeding its index.
    Kvroute,
    /// `kvroute serve`, default policy, no events: the approximate mode predicts each engine's
    /// cache from what it routed.
    KvrouteApprox,
    /// SGLang's Shepherd Model Gateway, `--policy cache_aware` (a radix tree over request text).
    SmgCacheAware,
    /// SGLang's Shepherd Model Gateway, `--policy prefix_hash`.
    SmgPrefixHash,
    /// vLLM's router, `--policy kv_aware` with `--kv-event-source` on the same ZMQ events.
    VllmKvAware,
    /// vLLM's router, `--policy cache_aware`.
    VllmCacheAware,
    /// vLLM's router, `--policy cache_aware`, sent the chats as text completions (the messages
    /// rendered with the model's template), since it reads no text from chat bodies; `--engine
    /// llamacpp` only (the simulated fleet is sent text completions anyway).
    VllmCacheAwareText,
    /// SGLang's Shepherd Model Gateway, `--policy round_robin`: the baseline.
    RoundRobin,
    /// [`Config::Kvroute`] run from the `--baseline` binary (an earlier build).
    KvrouteBase,
    /// [`Config::KvrouteApprox`] run from the `--baseline` binary.
    KvrouteApproxBase,
}

impl Config {
    /// Every configuration, in the table's order.
    pub(crate) const ALL: [Config; 7] = [
        Config::Kvroute,
        Config::KvrouteApprox,
        Config::SmgCacheAware,
        Config::SmgPrefixHash,
        Config::VllmKvAware,
        Config::VllmCacheAware,
        Config::RoundRobin,
    ];

    /// The configurations that run against llama.cpp, which publishes no KV events.
    pub(crate) const LLAMACPP: [Config; 6] = [
        Config::KvrouteApprox,
        Config::SmgCacheAware,
        Config::SmgPrefixHash,
        Config::VllmCacheAware,
        Config::VllmCacheAwareText,
        Config::RoundRobin,
    ];

    /// Whether it reads the engines' KV events.
    pub(crate) fn uses_events(self) -> bool {
        matches!(
            self,
            Config::Kvroute | Config::KvrouteBase | Config::VllmKvAware
        )
    }

    /// The column header.
    pub(crate) fn label(self) -> &'static str {
        match self {
            Config::Kvroute => "kvroute (events)",
            Config::KvrouteApprox => "kvroute (approx.)",
            Config::SmgCacheAware => "SMG cache_aware",
            Config::SmgPrefixHash => "SMG prefix_hash",
            Config::VllmKvAware => "vLLM router kv_aware",
            Config::VllmCacheAware => "vLLM router cache_aware",
            Config::VllmCacheAwareText => "vLLM router cache_aware (text)",
            Config::RoundRobin => "round-robin (SMG)",
            Config::KvrouteBase => "kvroute (events, base)",
            Config::KvrouteApproxBase => "kvroute (approx., base)",
        }
    }

    /// `kvroute serve`, with the engines' events or without, from either binary.
    pub(crate) fn is_kvroute(self) -> bool {
        matches!(
            self,
            Config::Kvroute
                | Config::KvrouteApprox
                | Config::KvrouteBase
                | Config::KvrouteApproxBase
        )
    }

    /// Run from the `--baseline` binary.
    pub(crate) fn is_baseline(self) -> bool {
        matches!(self, Config::KvrouteBase | Config::KvrouteApproxBase)
    }
}

/// What the routers are started from.
pub(crate) struct Binaries {
    pub(crate) kvroute: PathBuf,
    /// The `--baseline` build of kvroute, if one was given.
    pub(crate) baseline: Option<PathBuf>,
    pub(crate) smg: PathBuf,
    pub(crate) vllm_router: PathBuf,
    /// The model's tokenizer file (kvroute reads it; the peers route on text).
    pub(crate) tokenizer: PathBuf,
    /// The model's chat template, for a fleet that is sent chats.
    pub(crate) chat_template: Option<PathBuf>,
    /// The engines' dialect in kvroute's fleet file (`vllm`, `llamacpp`).
    pub(crate) dialect: &'static str,
    /// The core every router runs on (`--pin`), `None` to leave it to the scheduler.
    pub(crate) router_core: Option<String>,
}

impl Binaries {
    /// The command that starts `program` as a router: under `taskset -c CORE` when pinned (the
    /// router's children, SMG's Rust binary under its Python launcher, inherit the core).
    pub(crate) fn router_command(&self, program: &Path) -> Command {
        match &self.router_core {
            Some(core) => {
                let mut cmd = Command::new("taskset");
                cmd.args(["-c", core]).arg(program);
                cmd
            }
            None => Command::new(program),
        }
    }
}

/// A running router.
pub(crate) struct Router {
    pub(crate) proc: Proc,
    /// Its address, `http://127.0.0.1:PORT`.
    pub(crate) base: String,
}

/// A free loopback port (bound, then released for the child to take).
pub(crate) fn free_port() -> Result<u16> {
    let listener = TcpListener::bind("127.0.0.1:0").context("finding a free port")?;
    Ok(listener.local_addr()?.port())
}

/// Starts `config` in front of `engines` and waits until it lists every engine as healthy.
pub(crate) async fn start(
    config: Config,
    args: &super::Args,
    bin: &Binaries,
    engines: &[Engine],
    scratch: &Path,
    log: &Path,
    http: &reqwest::Client,
) -> Result<Router> {
    let urls: Vec<&str> = engines.iter().map(|e| e.url.as_str()).collect();
    let (mut proc, base) = if config.is_kvroute() {
        // Port 0, read back from serve's start-up line: no race for a port picked in advance.
        let fleet = scratch.join(format!("fleet-{}.toml", std::process::id()));
        std::fs::write(
            &fleet,
            fleet_file(engines, config.uses_events(), bin.dialect),
        )
        .with_context(|| format!("writing {}", fleet.display()))?;
        let mut model = format!("{MODEL},tokenizer={}", bin.tokenizer.display());
        if let Some(template) = &bin.chat_template {
            let _ = write!(model, ",chat_template={}", template.display());
        }
        let program = match (config.is_baseline(), &bin.baseline) {
            (false, _) => &bin.kvroute,
            (true, Some(baseline)) => baseline,
            (true, None) => bail!("{} needs --baseline", config.label()),
        };
        let mut cmd = bin.router_command(program);
        cmd.args(["serve", "--listen", "127.0.0.1:0"])
            .arg("--fleet")
            .arg(&fleet)
            .arg("--model")
            .arg(model)
            .args(["--block-size", &BLOCK_SIZE.to_string()])
            .env("RUST_LOG", args.kvroute_log.as_deref().unwrap_or("warn"));
        if matches!(config, Config::KvrouteApprox | Config::KvrouteApproxBase) {
            cmd.args(["--kv-mode", "approximate"]);
        }
        cmd.args(&args.kvroute_args);
        let (proc, line) =
            Proc::spawn_with_ready_line(config.label(), &mut cmd, log, READY_BOUND).await?;
        let base = serve_address(&line)
            .with_context(|| format!("kvroute serve's start-up line has no http=: {line}"))?;
        (proc, base)
    } else {
        let port = free_port()?;
        let mut cmd;
        if matches!(
            config,
            Config::VllmKvAware | Config::VllmCacheAware | Config::VllmCacheAwareText
        ) {
            cmd = bin.router_command(&bin.vllm_router);
            cmd.args(["--host", "127.0.0.1", "--port", &port.to_string()])
                .arg("--worker-urls")
                .args(&urls)
                .args(["--prometheus-port", &free_port()?.to_string()])
                .args(["--log-level", "warning"]);
            if config == Config::VllmKvAware {
                cmd.args(["--policy", "kv_aware"]);
                for e in engines {
                    cmd.arg("--kv-event-source")
                        .arg(format!("{}={}", e.url, e.kv_events))
                        .arg("--kv-event-replay-source")
                        .arg(format!("{}={}", e.url, e.kv_events_replay));
                }
                cmd.args(["--kv-event-block-size", &BLOCK_SIZE.to_string()])
                    .args(["--kv-event-model", MODEL]);
            } else {
                cmd.args(["--policy", "cache_aware"]);
            }
        } else {
            let policy = match config {
                Config::SmgCacheAware => "cache_aware",
                Config::SmgPrefixHash => "prefix_hash",
                _ => "round_robin",
            };
            cmd = bin.router_command(&bin.smg);
            cmd.args(["launch", "--host", "127.0.0.1", "--port", &port.to_string()])
                .arg("--worker-urls")
                .args(&urls)
                .args(["--policy", policy])
                .args(["--prometheus-port", &free_port()?.to_string()])
                .args(["--log-level", "warn", "--shutdown-grace-period-secs", "1"]);
        }
        (
            Proc::spawn(config.label(), &mut cmd, log)?,
            format!("http://127.0.0.1:{port}"),
        )
    };
    wait_ready(config, &mut proc, &base, engines.len(), http).await?;
    Ok(Router { proc, base })
}

/// `http://ADDR` from kvroute serve's start-up line `kvroute serve: http=ADDR registry=...`.
pub(crate) fn serve_address(line: &str) -> Option<String> {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix("http="))
        .map(|addr| format!("http://{addr}"))
}

/// kvroute's static fleet: one `[[workers]]` entry per engine of `dialect`, fronted by
/// `kvroute serve` itself, with the engine's KV events or without.
pub(crate) fn fleet_file(engines: &[Engine], events: bool, dialect: &str) -> String {
    let mut text = String::new();
    for (i, e) in engines.iter().enumerate() {
        let _ = writeln!(text, "[[workers]]");
        let _ = writeln!(text, "id = {}", i + 1);
        let _ = writeln!(text, "kv_block_size = {BLOCK_SIZE}");
        let _ = writeln!(text, "engine = \"{dialect}\"");
        let _ = writeln!(text, "engine_url = \"{}\"", e.url);
        if events {
            let _ = writeln!(text, "kv_events = \"{}\"", e.kv_events);
            let _ = writeln!(text, "kv_events_replay = \"{}\"", e.kv_events_replay);
        }
        text.push('\n');
    }
    text
}

/// How many engines a router's status answer lists as ready: kvroute's `/health` `workers`,
/// or the peers' `/workers` entries with `is_healthy: true`.
pub(crate) fn ready_count(kvroute: bool, body: &Value) -> usize {
    if kvroute {
        return body["workers"].as_u64().unwrap_or(0) as usize;
    }
    body["workers"].as_array().map_or(0, |workers| {
        workers
            .iter()
            .filter(|w| w["is_healthy"].as_bool() == Some(true))
            .count()
    })
}

async fn wait_ready(
    config: Config,
    proc: &mut Proc,
    base: &str,
    engines: usize,
    http: &reqwest::Client,
) -> Result<()> {
    let path = if config.is_kvroute() {
        "/health"
    } else {
        "/workers"
    };
    let started = Instant::now();
    let mut last = String::from("no answer yet");
    while started.elapsed() < READY_BOUND {
        proc.check_alive()?;
        match http.get(format!("{base}{path}")).send().await {
            Ok(response) => {
                let text = response.text().await.unwrap_or_default();
                if let Ok(body) = serde_json::from_str::<Value>(&text)
                    && ready_count(config.is_kvroute(), &body) == engines
                {
                    return Ok(());
                }
                last = text.chars().take(300).collect();
            }
            Err(e) => last = e.to_string(),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    bail!(
        "{} did not list all {engines} engines as ready within {READY_BOUND:?} (last answer of \
         {path}: {last}); {}",
        config.label(),
        proc.log_tail()
    )
}
