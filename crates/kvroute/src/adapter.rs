//! The engine adapter: a real inference engine (vLLM, SGLang, TensorRT-LLM, llama.cpp, any
//! OpenAI server) behind the request plane, with its KV events. One implementation serves both
//! shapes users run: the sidecar (`kvroute worker --engine ...`, registering with a router) and
//! the static fleet of `kvroute serve` (`[[workers]] engine = ...`, served in-process on
//! loopback).
//!
//! Requests go to the engine's HTTP API as token ids (kvroute-engines). KV events, when the
//! engine publishes them over ZMQ (`kv_events`), are republished by a [`ZmqKvListener`] through
//! a [`KvEventPublisher`] that also keeps the blocks they leave held, so a router that joins
//! later rebuilds this worker's state from a dump; the listener starts with the adapter, so what
//! the engine caches from then on is known. Blocks the engine cached before the adapter
//! subscribed are not: start the adapter with the engine, or restart the engine's cache
//! (`AllBlocksCleared`, an engine restart) to bring them in line. Engines without events run in
//! approximate mode (the router predicts from its own decisions, with a TTL).
//!
//! The engine's own load (requests running and waiting, KV blocks in use) is read from its
//! Prometheus `/metrics` every interval (vLLM; SGLang with `--enable-metrics`; llama.cpp with
//! `--metrics`) into a [`LoadReporter`], which the worker serves to routers. A read that fails
//! (metrics not enabled) is logged and nothing is reported until one succeeds.

use std::collections::BTreeMap;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, bail};
use kvroute_engines::{EngineKind, HttpEngine, HttpEngineConfig};
use kvroute_indexer::hash::{HashSalt, compute_block_hash};
use kvroute_protocols::WorkerId;
use kvroute_protocols::{BOOTSTRAP_HOST_KEY, BOOTSTRAP_PORT_KEY};
use kvroute_runtime::{
    BlockHasher, DEFAULT_RING_CAPACITY, KV_EVENTS_METADATA, KvEventPublisher,
    LOAD_REPORTS_METADATA, LoadReporter, WorkerRole, ZmqKvListener, ZmqKvListenerConfig,
    ZmqListenerStats,
};

use crate::load::{LoadSampler, spawn_load_sampler};

/// Where an engine is and what it publishes: the flags of `kvroute worker --engine` and the
/// engine keys of a fleet file's `[[workers]]`.
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct EngineSpec {
    /// The engine's HTTP dialect.
    pub(crate) engine: EngineKind,
    /// The engine's HTTP address, `http://host:port`.
    pub(crate) engine_url: String,
    /// The engine's ZMQ KV event publisher, `tcp://host:port`; none: approximate mode.
    pub(crate) kv_events: Option<String>,
    /// The engine's ZMQ replay socket, `tcp://host:port` (fills gaps in the event feed).
    pub(crate) kv_events_replay: Option<String>,
    /// The `model` sent to the engine instead of the request's (default: the request's, which
    /// keeps LoRA adapters selectable by name).
    pub(crate) served_model_name: Option<String>,
    /// How long a request may wait for the engine's first byte (queueing plus prefill) before
    /// it goes back to the router, which moves it to another worker; `None` keeps the default
    /// (kvroute-engines' 300 s).
    pub(crate) first_byte_timeout: Option<Duration>,
    /// The longest silence between two pieces of a started response before the engine is
    /// given up on and the request migrates; `None` keeps the default (60 s).
    pub(crate) idle_timeout: Option<Duration>,
    /// Sent as `Authorization: Bearer <key>` to the engine (read from a file or the
    /// environment, never from the command line; never logged).
    pub(crate) api_key: Option<String>,
    /// The engine's part in disaggregated serving (checked by [`check_role`]).
    pub(crate) role: WorkerRole,
    /// A bootstrapping prefill engine's bootstrap server port (SGLang's
    /// `--disaggregation-bootstrap-port`); `None` takes [`DEFAULT_BOOTSTRAP_PORT`].
    pub(crate) bootstrap_port: Option<u16>,
}

/// SGLang's default `--disaggregation-bootstrap-port`.
pub(crate) const DEFAULT_BOOTSTRAP_PORT: u16 = 8998;

/// The bootstrap endpoint a prefill engine advertises (SGLang's: the router hands it to both
/// engines of a pair): the engine URL's host and the bootstrap port. `None` for engines that
/// take no bootstrap.
fn bootstrap_endpoint(spec: &EngineSpec) -> anyhow::Result<Option<(String, u16)>> {
    let bootstraps = spec.role == WorkerRole::Prefill && spec.engine.bootstraps();
    if !bootstraps {
        if let Some(port) = spec.bootstrap_port {
            bail!(
                "a bootstrap port ({port}) is for a prefill engine that bootstraps (sglang with \
                 role prefill); got engine {} with another role",
                spec.engine
            );
        }
        return Ok(None);
    }
    let port = spec.bootstrap_port.unwrap_or(DEFAULT_BOOTSTRAP_PORT);
    if port == 0 {
        bail!("the bootstrap port must be 1..=65535, got 0");
    }
    let url = reqwest::Url::parse(&spec.engine_url)
        .with_context(|| format!("engine_url {}", spec.engine_url))?;
    let host = url
        .host_str()
        .with_context(|| format!("engine_url {} has no host", spec.engine_url))?;
    Ok(Some((host.to_owned(), port)))
}

/// Refuses a prefill or decode role for an engine whose disaggregation exchange kvroute does
/// not speak.
pub(crate) fn check_role(engine: EngineKind, role: WorkerRole) -> anyhow::Result<()> {
    if role != WorkerRole::Aggregated && !engine.disaggregates() {
        let speaking: Vec<&str> = EngineKind::ALL
            .into_iter()
            .filter(|k| k.disaggregates())
            .map(EngineKind::as_str)
            .collect();
        let role = match role {
            WorkerRole::Prefill => "prefill",
            _ => "decode",
        };
        bail!(
            "engine {engine} cannot take role {role}: kvroute speaks the disaggregation exchange \
             of {} only; serve it aggregated",
            speaking.join(", ")
        );
    }
    Ok(())
}

// Hand-written so that the API key never reaches a log.
impl std::fmt::Debug for EngineSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineSpec")
            .field("engine", &self.engine)
            .field("engine_url", &self.engine_url)
            .field("kv_events", &self.kv_events)
            .field("kv_events_replay", &self.kv_events_replay)
            .field("served_model_name", &self.served_model_name)
            .field("first_byte_timeout", &self.first_byte_timeout)
            .field("idle_timeout", &self.idle_timeout)
            .field("api_key", &self.api_key.as_ref().map(|_| "<redacted>"))
            .field("role", &self.role)
            .field("bootstrap_port", &self.bootstrap_port)
            .finish()
    }
}

/// Reads an engine API key from `path`: the first non-empty line, trimmed.
pub(crate) fn read_api_key(path: &std::path::Path) -> anyhow::Result<String> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading the engine API key file {}", path.display()))?;
    text.lines()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .map(str::to_owned)
        .with_context(|| {
            format!(
                "the engine API key file {} is empty; expected the key on its first line",
                path.display()
            )
        })
}

/// A running adapter: the engine client, the event publisher and, with events, the listener;
/// for engines whose load can be read, the load reports and the task reading them.
pub(crate) struct Adapter {
    pub(crate) engine: Arc<HttpEngine>,
    pub(crate) publisher: KvEventPublisher,
    listener: Option<ZmqKvListener>,
    kind: EngineKind,
    load: Option<(LoadReporter, LoadSampler)>,
    /// The bootstrap endpoint it advertises (a bootstrapping prefill engine).
    bootstrap: Option<(String, u16)>,
}

/// How long the adapter waits for an engine to answer its health check at start.
pub(crate) const DEFAULT_ENGINE_WAIT: Duration = Duration::from_secs(120);

impl Adapter {
    /// Checks `spec`, waits (up to `wait`) for the engine to be healthy, subscribes to its
    /// KV events, expecting `block_size` tokens per block, and, when the engine publishes its
    /// load, reads it every `load_interval` into load reports.
    pub(crate) async fn start(
        id: WorkerId,
        spec: &EngineSpec,
        block_size: u32,
        wait: Duration,
        load_interval: Duration,
    ) -> anyhow::Result<Self> {
        if spec.kv_events_replay.is_some() && spec.kv_events.is_none() {
            bail!("kv_events_replay needs kv_events (the engine's event publisher) as well");
        }
        check_role(spec.engine, spec.role)?;
        let bootstrap = bootstrap_endpoint(spec)?;
        let mut config =
            HttpEngineConfig::new(spec.engine, spec.engine_url.clone()).with_role(spec.role);
        config.served_model_name = spec.served_model_name.clone();
        config.api_key = spec.api_key.clone();
        if let Some(limit) = spec.first_byte_timeout {
            config.first_byte_timeout = Some(limit);
        }
        if let Some(limit) = spec.idle_timeout {
            config.idle_timeout = Some(limit);
        }
        let engine = Arc::new(
            HttpEngine::new(config)
                .with_context(|| format!("engine {} at {}", spec.engine, spec.engine_url))?,
        );
        wait_healthy(&engine, &spec.engine_url, wait).await?;
        let identity = engine.identify().await?;
        tracing::info!(
            url = %spec.engine_url,
            engine = %spec.engine,
            found = ?identity.found,
            context_length = ?identity.context_length,
            "engine identified"
        );
        // Numbered from this process's start time, so a restart never reuses an event id.
        let publisher = KvEventPublisher::tracking_blocks(id, DEFAULT_RING_CAPACITY).starting_at(
            kvroute_runtime::incarnation_event_base(std::time::SystemTime::now()),
        );
        let listener = match &spec.kv_events {
            None => None,
            Some(endpoint) => {
                let mut config =
                    ZmqKvListenerConfig::new(endpoint.clone()).with_block_size(block_size);
                if let Some(replay) = &spec.kv_events_replay {
                    config = config.with_replay(replay.clone());
                }
                let listener = ZmqKvListener::connect(config, block_hasher(), publisher.clone())
                    .await
                    .with_context(|| {
                        format!("subscribing to the engine's KV events at {endpoint}")
                    })?;
                Some(listener)
            }
        };
        let load = match NonZeroU32::new(block_size) {
            Some(block_size) if spec.engine.publishes_load() => {
                let reporter = LoadReporter::new(id, load_interval);
                let read = engine.clone();
                let sampler = spawn_load_sampler(reporter.clone(), load_interval, move || {
                    let read = read.clone();
                    async move {
                        let loads = read.load(block_size).await?;
                        anyhow::Ok(loads.iter().map(|l| l.report(id)).collect())
                    }
                });
                Some((reporter, sampler))
            }
            _ => None,
        };
        Ok(Self {
            engine,
            publisher,
            listener,
            kind: spec.engine,
            load,
            bootstrap,
        })
    }

    /// The engine's load reports, when its load can be read (see
    /// [`EngineKind::publishes_load`]); read every interval given at start.
    pub(crate) fn load_reporter(&self) -> Option<&LoadReporter> {
        self.load.as_ref().map(|(reporter, _)| reporter)
    }

    /// Whether the engine publishes KV events (else the router runs it in approximate mode).
    pub(crate) fn kv_events(&self) -> bool {
        self.listener.is_some()
    }

    /// The discovery metadata a worker serving this adapter advertises.
    pub(crate) fn metadata(&self) -> BTreeMap<String, String> {
        let mut metadata = BTreeMap::from([
            ("engine".to_owned(), self.kind.to_string()),
            (KV_EVENTS_METADATA.to_owned(), self.kv_events().to_string()),
            (
                LOAD_REPORTS_METADATA.to_owned(),
                self.load.is_some().to_string(),
            ),
        ]);
        if let Some((host, port)) = &self.bootstrap {
            metadata.insert(BOOTSTRAP_HOST_KEY.to_owned(), host.clone());
            metadata.insert(BOOTSTRAP_PORT_KEY.to_owned(), port.to_string());
        }
        metadata
    }

    /// The KV event listener's counters, when the engine publishes events.
    pub(crate) fn listener_stats(&self) -> Option<ZmqListenerStats> {
        self.listener.as_ref().map(ZmqKvListener::stats)
    }

    /// Completes with an error once the event feed cannot work as configured (the engine's
    /// blocks are of another size than the router's): nothing it publishes could ever match,
    /// so a worker stops rather than serve with a blind index.
    pub(crate) async fn failed(&self) -> anyhow::Error {
        let Some(listener) = &self.listener else {
            return std::future::pending().await;
        };
        loop {
            if let Err(error) = listener.check() {
                return error.into();
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

/// The router's content hash of a block, under the LoRA adapter and cache salt the engine
/// stored it with (the salt is the cache namespace the router hashes requests under).
fn block_hasher() -> BlockHasher {
    Arc::new(|tokens, salt| {
        compute_block_hash(tokens, &HashSalt::new(salt.lora_name, salt.cache_salt))
    })
}

/// Polls the engine's health endpoint until it answers, backing off up to 2 s between tries,
/// for `wait` in all: the last try is at the deadline, not a backoff step before it.
async fn wait_healthy(engine: &HttpEngine, url: &str, wait: Duration) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + wait;
    let mut delay = Duration::from_millis(100);
    let mut logged = false;
    loop {
        match engine.health().await {
            Ok(()) => return Ok(()),
            Err(error) => {
                let now = tokio::time::Instant::now();
                if now >= deadline {
                    return Err(anyhow::Error::new(error).context(format!(
                        "the engine at {url} did not become healthy within {wait:?}"
                    )));
                }
                if !logged {
                    tracing::info!(%url, %error, "waiting for the engine to become healthy");
                    logged = true;
                }
                tokio::time::sleep(delay.min(deadline - now)).await;
                delay = (delay * 2).min(Duration::from_secs(2));
            }
        }
    }
}

#[cfg(test)]
mod tests;
