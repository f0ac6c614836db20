//! A static fleet for `kvroute serve`: `[[workers]]` entries from a fleet file (TOML, or JSON for
//! a `.json` path) or inline in serve.toml (`[[discovery.workers]]`). An entry is either a worker
//! process already listening on the request plane (`address`), or an engine this process fronts
//! itself (`engine`, `engine_url`, optionally `kv_events` / `kv_events_replay`): for each of
//! those, serve starts the same adapter `kvroute worker --engine` runs, on a loopback port of its
//! own, so `kvroute serve` alone fronts a fleet of engines with no sidecar.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, bail};
use kvroute_engines::EngineKind;
use kvroute_protocols::WorkerId;
use kvroute_runtime::{
    DEFAULT_REPORT_HEARTBEAT, ENDPOINT_METADATA, EventPlane, InstanceInfo, LocalEngines,
    LocalRegistration, StaticDiscovery, WorkerRole, WorkerServer, WorkerServerConfig,
};
use serde::Deserialize;

use crate::adapter::{Adapter, DEFAULT_ENGINE_WAIT, EngineSpec};
use crate::load::MIN_LOAD_REPORT_INTERVAL;

/// One `[[workers]]` entry.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct FleetWorker {
    /// The instance id, unique in the fleet.
    pub(crate) id: WorkerId,
    /// A worker process's request-plane address, `host:port` (not with `engine`).
    #[serde(default)]
    pub(crate) address: Option<String>,
    /// What the worker serves: aggregated (the default), prefill or decode (an engine this
    /// process fronts takes a prefill or decode role only in a dialect that disaggregates).
    #[serde(default)]
    pub(crate) role: WorkerRole,
    /// Tokens per KV block; must equal the router's block size.
    pub(crate) kv_block_size: u32,
    /// Data-parallel ranks (default 1).
    #[serde(default)]
    pub(crate) dp_size: Option<u32>,
    /// Free-form metadata.
    #[serde(default)]
    pub(crate) metadata: BTreeMap<String, String>,
    /// An engine this process fronts: its HTTP dialect.
    #[serde(default)]
    pub(crate) engine: Option<EngineKind>,
    /// The engine's HTTP address.
    #[serde(default)]
    pub(crate) engine_url: Option<String>,
    /// The engine's ZMQ KV event publisher.
    #[serde(default)]
    pub(crate) kv_events: Option<String>,
    /// The engine's ZMQ replay socket.
    #[serde(default)]
    pub(crate) kv_events_replay: Option<String>,
    /// The `model` sent to the engine instead of the request's.
    #[serde(default)]
    pub(crate) served_model_name: Option<String>,
    /// How long a request may wait for the engine's first byte before it goes back to the
    /// router (default 300000: 300 s).
    #[serde(default)]
    pub(crate) first_byte_timeout_ms: Option<u64>,
    /// The longest silence between two pieces of a started response before the request
    /// migrates (default 60000: 60 s).
    #[serde(default)]
    pub(crate) idle_timeout_ms: Option<u64>,
    /// How often the engine's `/metrics` is read and its load reported to the router, in
    /// milliseconds (default 1000, at least 50; `kvroute worker --load-report-interval`).
    #[serde(default)]
    pub(crate) load_report_interval_ms: Option<u64>,
    /// A file whose first line is the engine's API key (never logged).
    #[serde(default)]
    pub(crate) engine_api_key_file: Option<std::path::PathBuf>,
    /// Where a proxy in front of kvroute (`kvroute epp` behind Envoy) sends this worker's
    /// requests, `ip:port`; default: the host and port of `engine_url`.
    #[serde(default)]
    pub(crate) endpoint: Option<String>,
    /// A bootstrapping prefill engine's bootstrap port (SGLang's
    /// `--disaggregation-bootstrap-port`, default 8998).
    #[serde(default)]
    pub(crate) bootstrap_port: Option<u16>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FleetFile {
    workers: Vec<FleetWorker>,
}

/// Reads a fleet file (JSON for a `.json` path, TOML otherwise).
pub(crate) fn read_file(path: &Path) -> anyhow::Result<Vec<FleetWorker>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading fleet file {}", path.display()))?;
    let file: FleetFile = if path.extension().is_some_and(|e| e == "json") {
        serde_json::from_str(&text).map_err(anyhow::Error::new)
    } else {
        toml::from_str(&text).map_err(anyhow::Error::new)
    }
    .with_context(|| format!("parsing fleet file {}", path.display()))?;
    Ok(file.workers)
}

/// Refuses, before anything starts, a fleet the router could not serve: an entry whose
/// `kv_block_size` is not the router's (its blocks could never match a request, so the router
/// would leave it out and answer 503), and engines fronted with only the built-in mock
/// tokenizer (the engine would get token ids of a vocabulary it does not have).
pub(crate) fn check_against_router(
    workers: &[FleetWorker],
    block_size: u32,
    models: &[kvroute_router::ModelConfig],
) -> anyhow::Result<()> {
    for worker in workers {
        if worker.kv_block_size != block_size {
            bail!(
                "workers[id={}]: kv_block_size = {} differs from the router's block size {block_size}; \
                 set the entry's kv_block_size to the engine's block (page) size and the router's \
                 [router] block_size (--block-size) to the same value",
                worker.id,
                worker.kv_block_size
            );
        }
    }
    let engines: Vec<String> = workers
        .iter()
        .filter_map(|w| w.engine.map(|e| format!("{} (id {})", e, w.id)))
        .collect();
    let mock: Vec<&str> = models
        .iter()
        .filter(|m| m.tokenizer.is_none())
        .map(|m| m.name.as_str())
        .collect();
    if !engines.is_empty() && !mock.is_empty() {
        bail!(
            "the fleet fronts real engines ({}) but model(s) {} have no tokenizer, so the \
             built-in mock tokenizer would turn prompts into ids the engine does not know; \
             pass the model's tokenizer: --model NAME,tokenizer=/path/to/tokenizer.json\
             [,chat_template=/path/to/template.jinja] or [[models]] name/tokenizer/chat_template \
             in serve.toml",
            engines.join(", "),
            mock.iter()
                .map(|m| format!("`{m}`"))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    Ok(())
}

/// What an entry is, checked.
enum Entry {
    Process(InstanceInfo),
    /// An engine this process fronts, and how often its load is read.
    Engine(InstanceInfo, EngineSpec, Duration),
}

fn check(worker: FleetWorker) -> anyhow::Result<Entry> {
    let id = worker.id;
    let mut info = InstanceInfo::new(id, String::new(), worker.kv_block_size)
        .with_role(worker.role)
        .with_dp_size(worker.dp_size.unwrap_or(1));
    info.metadata = worker.metadata;
    let endpoint = match (&worker.endpoint, &worker.engine_url) {
        (Some(endpoint), _) => Some(
            crate::cli::endpoint::parse(endpoint)
                .with_context(|| format!("workers[id={id}].endpoint"))?,
        ),
        // Best effort: an engine URL whose host does not resolve here gives no endpoint.
        (None, Some(url)) => crate::cli::endpoint::of_url(url).ok(),
        (None, None) => None,
    };
    if let Some(endpoint) = endpoint {
        info.metadata
            .insert(ENDPOINT_METADATA.to_owned(), endpoint.to_string());
    }
    let engine_keys = worker.engine_url.is_some()
        || worker.kv_events.is_some()
        || worker.kv_events_replay.is_some()
        || worker.served_model_name.is_some()
        || worker.first_byte_timeout_ms.is_some()
        || worker.idle_timeout_ms.is_some()
        || worker.load_report_interval_ms.is_some()
        || worker.engine_api_key_file.is_some()
        || worker.bootstrap_port.is_some();
    match (worker.address, worker.engine, worker.engine_url) {
        (Some(address), None, None) if !engine_keys => {
            info.address = address;
            Ok(Entry::Process(info))
        }
        (None, Some(engine), Some(engine_url)) => {
            if let Err(e) = crate::adapter::check_role(engine, worker.role) {
                bail!("workers[id={id}]: {e}");
            }
            if worker.first_byte_timeout_ms == Some(0) || worker.idle_timeout_ms == Some(0) {
                bail!(
                    "workers[id={id}]: first_byte_timeout_ms and idle_timeout_ms must be greater than 0 (milliseconds; the defaults are 300000 and 60000)"
                );
            }
            let load_interval = match worker.load_report_interval_ms {
                None => DEFAULT_REPORT_HEARTBEAT,
                Some(ms) if Duration::from_millis(ms) >= MIN_LOAD_REPORT_INTERVAL => {
                    Duration::from_millis(ms)
                }
                Some(ms) => bail!(
                    "workers[id={id}]: load_report_interval_ms must be at least {} (milliseconds; \
                     the default is 1000), got {ms}",
                    MIN_LOAD_REPORT_INTERVAL.as_millis()
                ),
            };
            let api_key = worker
                .engine_api_key_file
                .as_deref()
                .map(crate::adapter::read_api_key)
                .transpose()
                .with_context(|| format!("workers[id={id}]"))?;
            Ok(Entry::Engine(
                info,
                EngineSpec {
                    engine,
                    engine_url,
                    kv_events: worker.kv_events,
                    kv_events_replay: worker.kv_events_replay,
                    served_model_name: worker.served_model_name,
                    first_byte_timeout: worker
                        .first_byte_timeout_ms
                        .map(std::time::Duration::from_millis),
                    idle_timeout: worker.idle_timeout_ms.map(std::time::Duration::from_millis),
                    api_key,
                    role: worker.role,
                    bootstrap_port: worker.bootstrap_port,
                },
                load_interval,
            ))
        }
        (None, Some(_), None) => bail!("workers[id={id}]: `engine` needs `engine_url`"),
        (None, None, _) => bail!(
            "workers[id={id}]: expected `address` (a worker process) or `engine` and `engine_url` (an engine this process fronts)"
        ),
        _ => bail!(
            "workers[id={id}]: `address` names a worker process, `engine`/`engine_url`/`kv_events` an engine this process fronts; give one or the other"
        ),
    }
}

/// The running static fleet: its discovery and the engines this process serves.
pub(crate) struct Fleet {
    pub(crate) discovery: StaticDiscovery,
    /// Kept alive for the life of the service.
    engines: Vec<(WorkerServer, Arc<Adapter>)>,
    /// The adapters' places in the routers' [`LocalEngines`]: the routers of this process call
    /// them directly instead of over their loopback servers, which keep serving everything else
    /// (session control, KV event feeds and ranges, load reports).
    _local: Vec<LocalRegistration>,
    /// The forwarders of the adapters' load reports onto the router's event plane
    /// ([`Fleet::forward_local`]), stopped with the fleet.
    report_forwarders: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for Fleet {
    fn drop(&mut self) {
        for task in &self.report_forwarders {
            task.abort();
        }
    }
}

impl Fleet {
    /// Starts an adapter and a loopback request-plane server for every engine entry (waiting for
    /// each engine to be healthy), registers each adapter in `local` under its server's address,
    /// then lists the whole fleet.
    pub(crate) async fn start(
        workers: Vec<FleetWorker>,
        secret: Option<kvroute_runtime::FleetSecret>,
        tls: Option<kvroute_runtime::FleetTls>,
        local: &LocalEngines,
    ) -> anyhow::Result<Self> {
        let mut instances = Vec::new();
        let mut engines = Vec::new();
        let mut registrations = Vec::new();
        for worker in workers {
            match check(worker)? {
                Entry::Process(info) => instances.push(info),
                Entry::Engine(mut info, spec, load_interval) => {
                    let adapter = Adapter::start(
                        info.id,
                        &spec,
                        info.kv_block_size,
                        DEFAULT_ENGINE_WAIT,
                        load_interval,
                    )
                    .await
                    .with_context(|| format!("starting engine worker {}", info.id))?;
                    let adapter = Arc::new(adapter);
                    let mut config = WorkerServerConfig::new(info.id)
                        .with_kv_events(adapter.publisher.clone())
                        .with_fleet_secret(secret.clone())
                        .with_tls(tls.clone());
                    if let Some(reporter) = adapter.load_reporter() {
                        config = config.with_load_reports(reporter.clone());
                    }
                    let server = WorkerServer::bind("127.0.0.1:0", adapter.engine.clone(), config)
                        .await
                        .with_context(|| {
                            format!("serving engine worker {} on loopback", info.id)
                        })?;
                    info.address = server.local_addr().to_string();
                    registrations
                        .push(local.register(info.address.clone(), adapter.engine.clone()));
                    for (key, value) in adapter.metadata() {
                        info.metadata.entry(key).or_insert(value);
                    }
                    tracing::info!(
                        id = info.id,
                        engine = %spec.engine,
                        url = %spec.engine_url,
                        kv_events = adapter.kv_events(),
                        "fronting engine"
                    );
                    instances.push(info);
                    engines.push((server, adapter));
                }
            }
        }
        let discovery = StaticDiscovery::from_instances(instances).context("invalid fleet")?;
        Ok(Self {
            discovery,
            engines,
            _local: registrations,
            report_forwarders: Vec::new(),
        })
    }

    /// Forwards the KV events and load reports of every engine this process fronts straight
    /// onto `plane`, the router's in-process event plane, and returns their worker ids, which
    /// the request-plane bridge then leaves out ([`KvEventBridge::start_except`]): no frame
    /// encoding, loopback socket or decoding between an adapter and the router beside it. The
    /// adapters' loopback servers still answer the router's range and dump requests, so a gap
    /// is repaired as for any worker.
    ///
    /// [`KvEventBridge::start_except`]: kvroute_runtime::KvEventBridge::start_except
    pub(crate) fn forward_local(
        &mut self,
        plane: &Arc<dyn EventPlane>,
    ) -> std::collections::HashSet<WorkerId> {
        let mut local = std::collections::HashSet::new();
        for (_, adapter) in &self.engines {
            // A publisher forwards to one plane; this one is new, so the call cannot refuse.
            let forwarding = adapter.publisher.forward_to(plane.clone());
            debug_assert!(
                forwarding,
                "an adapter's publisher forwards nowhere before this"
            );
            if let Some(reporter) = adapter.load_reporter() {
                self.report_forwarders
                    .push(reporter.forward_to(plane.clone()));
            }
            local.insert(adapter.publisher.worker_id());
        }
        local
    }

    /// Fails once an engine's KV event feed proves unusable (see [`Adapter::failed`]).
    pub(crate) async fn failed(&self) -> anyhow::Error {
        if self.engines.is_empty() {
            return std::future::pending().await;
        }
        let waits = self.engines.iter().map(|(_, a)| Box::pin(a.failed()));
        futures::future::select_all(waits).await.0
    }
}

#[cfg(test)]
mod tests;
