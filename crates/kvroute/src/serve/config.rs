//! `kvroute serve` configuration: one serde + clap struct mirrors the TOML file and the command
//! line ([`ServeOptions`]); flags win over the file; [`ServeOptions::validate`] turns the merge
//! into the typed [`ServeConfig`] the service runs on, or an [`InvalidOption`] naming the key,
//! the flag, what was expected and what was given.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use kvroute_router::http::HttpConfig;
use kvroute_router::{ConditionalDisagg, DisaggMode, KvPushRouterConfig, ModelConfig};
use serde::Deserialize;

use super::fleet::FleetWorker;
use crate::cli::HumanDuration;
use crate::cli::nats::NatsAuth;

/// Every option of `kvroute serve`, as the config file and as flags. `None` means "not given
/// here": a flag overrides the file, the file overrides the default.
#[derive(Debug, Default, Clone, PartialEq, Deserialize, clap::Args)]
#[serde(default, deny_unknown_fields)]
pub(crate) struct ServeOptions {
    /// The HTTP frontend (`[http]`).
    #[command(flatten)]
    pub(crate) http: HttpOptions,
    /// The KV router (`[router]`).
    #[command(flatten)]
    pub(crate) router: RouterOptions,
    /// How workers are found (`[discovery]`).
    #[command(flatten)]
    pub(crate) discovery: DiscoveryOptions,
    /// Scale-out on NATS (`[nats]`).
    #[command(flatten)]
    pub(crate) nats: NatsOptions,
    /// Served models (`[[models]]`); a flag
    /// `--model NAME[,tokenizer=PATH][,chat_template=PATH][,lora=ADAPTER...][,fastokens=BOOL]`
    /// adds one (each `lora=` names a LoRA adapter served over it; `fastokens=false` encodes
    /// with the `tokenizers` crate only), and without any the built-in mock model `mock` is
    /// served.
    #[arg(
        long = "model",
        value_name = "NAME[,tokenizer=PATH][,chat_template=PATH][,lora=ADAPTER...][,fastokens=BOOL]"
    )]
    pub(crate) models: Vec<ModelOptions>,
    /// `kvroute epp`'s own options (`[epp]`; flags of `epp` only, ignored by `serve`).
    #[arg(skip)]
    pub(crate) epp: EppOptions,
}

/// `[epp]`: the endpoint picker's options (`kvroute epp`).
#[derive(Debug, Default, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub(crate) struct EppOptions {
    /// Address of `/metrics`, `/health` and `/live` (`--metrics-listen`).
    pub(crate) metrics_listen: Option<String>,
    /// Endpoints named per request, best first (`--fallback-endpoints`).
    pub(crate) fallback_endpoints: Option<usize>,
}

/// `[http]`: the OpenAI-compatible frontend.
#[derive(Debug, Default, Clone, PartialEq, Deserialize, clap::Args)]
#[serde(default, deny_unknown_fields)]
pub(crate) struct HttpOptions {
    /// Address the HTTP frontend listens on, ip:port (default 127.0.0.1:8000; port 0 picks one).
    #[arg(long = "listen", value_name = "IP:PORT")]
    pub(crate) listen: Option<String>,
    /// Requests in flight at most (default 4096).
    #[arg(long)]
    pub(crate) max_in_flight: Option<usize>,
    /// Requests waiting for a slot at most; one more gets 429 (default 1024).
    #[arg(long)]
    pub(crate) max_queued: Option<usize>,
    /// How long a request waits for a slot before a 503 (default 5s).
    #[arg(long, value_name = "DURATION")]
    pub(crate) queue_timeout: Option<HumanDuration>,
    /// The Retry-After advised with 429/503 (default 1s).
    #[arg(long, value_name = "DURATION")]
    pub(crate) retry_after: Option<HumanDuration>,
    /// Largest request body in bytes (default 16 MiB).
    #[arg(long)]
    pub(crate) max_body_bytes: Option<usize>,
    /// Bytes of request bodies read and parsed at once, over all clients; a body reserves its
    /// Content-Length (max_body_bytes without one) and waits while the budget is spent (default
    /// 256 MiB; at least max_body_bytes).
    #[arg(long)]
    pub(crate) max_body_memory_bytes: Option<usize>,
    /// How long a client may take to send a request's headers; then its connection is closed
    /// (default 10s).
    #[arg(long, value_name = "DURATION")]
    pub(crate) header_timeout: Option<HumanDuration>,
    /// How long a client may take to send a request's body; then it gets 408 (default 30s).
    #[arg(long, value_name = "DURATION")]
    pub(crate) body_timeout: Option<HumanDuration>,
    /// Longest prompt in tokens (default 131072).
    #[arg(long)]
    pub(crate) max_prompt_tokens: Option<usize>,
    /// Interval of SSE keep-alive comments (default 15s).
    #[arg(long, value_name = "DURATION")]
    pub(crate) keep_alive: Option<HumanDuration>,
    /// On SIGINT/SIGTERM, how long in-flight requests may take to finish (default 30s).
    #[arg(long, value_name = "DURATION")]
    pub(crate) drain_timeout: Option<HumanDuration>,
    /// Serve /v1/* only to clients sending one of the keys in FILE as `Authorization: Bearer
    /// KEY` (one key per line, # comments; re-read on SIGHUP); /health, /live and /metrics stay
    /// open. Without it, anyone who reaches --listen is served.
    #[arg(long, value_name = "FILE")]
    pub(crate) api_key_file: Option<PathBuf>,
    /// Serve HTTPS with this PEM certificate chain (leaf first; with --tls-key; both re-read
    /// on SIGHUP).
    #[arg(long, value_name = "FILE", requires = "tls_key")]
    pub(crate) tls_cert: Option<PathBuf>,
    /// The PEM private key of --tls-cert.
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    pub(crate) tls_key: Option<PathBuf>,
}

/// `[router]`: routing policy and the cost model.
#[derive(Debug, Default, Clone, PartialEq, Deserialize, clap::Args)]
#[serde(default, deny_unknown_fields)]
pub(crate) struct RouterOptions {
    /// Tokens per KV block; workers with another block size are refused at registration
    /// (default 16).
    #[arg(long)]
    pub(crate) block_size: Option<u32>,
    /// kv-locality, kv-adaptive, kv, round-robin, random or direct (default kv-locality).
    #[arg(long)]
    pub(crate) policy: Option<String>,
    /// Selection temperature, 0 picks the cheapest worker (default 0).
    #[arg(long, allow_negative_numbers = true)]
    pub(crate) temperature: Option<f64>,
    /// Weight of cached blocks against prefill work in the cost of policy kv (default 1; the
    /// kv-locality and kv-adaptive policies score with fixed weights and refuse it).
    #[arg(long, allow_negative_numbers = true)]
    pub(crate) overlap_credit: Option<f64>,
    /// Weight of a block of prefill (queued, or this prompt's uncached part) against a block of
    /// decode in the cost of policy kv (default 1; kv-locality scores with 4). Higher keeps
    /// requests on their cache under load at some cost in decode balance (see
    /// docs/benchmarks.md, "Trading hits for load").
    #[arg(long, allow_negative_numbers = true)]
    pub(crate) prefill_load_scale: Option<f64>,
    /// The prefill weight of policy kv once the fleet's prefill backlog fills a batch on every
    /// eligible worker, interpolated from prefill_load_scale's below it (default: the same,
    /// a fixed scale; kv-locality rises from 4 to 8).
    #[arg(long, allow_negative_numbers = true)]
    pub(crate) loaded_prefill_load_scale: Option<f64>,
    /// Weight of a decode block, in the cost of policy kv, on a worker whose decode load is
    /// within decode_tolerance of the eligible workers' mean; blocks above it weigh 1 (default
    /// 1, the reference's; kv-locality scores with 0.25).
    #[arg(long, allow_negative_numbers = true)]
    pub(crate) balanced_decode_weight: Option<f64>,
    /// How far above the eligible workers' mean decode load a worker's still counts as
    /// balanced in the cost of policy kv, as a fraction of the mean (default 0; kv-locality
    /// scores with 1: up to twice the mean).
    #[arg(long, allow_negative_numbers = true)]
    pub(crate) decode_tolerance: Option<f64>,
    /// How the overlap credit of policy kv falls with the cached share of the prompt: the credit
    /// per cached block is `overlap_credit * share ^ this` (default 0: every cached block alike;
    /// kv-locality scores with 2).
    #[arg(long, allow_negative_numbers = true)]
    pub(crate) cached_share_exponent: Option<f64>,
    /// Whether policy kv credits a worker's cached blocks only as far as its KV capacity (as its
    /// engine reports it) lets it keep them until the prompt is admitted (default false, the
    /// reference's; kv-locality scores with true).
    #[arg(long, value_name = "BOOL")]
    pub(crate) capacity_credit: Option<bool>,
    /// Blocks of prefill policy kv charges per block of other prompts' idle cache a placement
    /// would evict beyond what the eligible worker with the most free KV capacity would
    /// (default 0, the reference's; kv-locality scores with 1).
    #[arg(long, allow_negative_numbers = true)]
    pub(crate) eviction_weight: Option<f64>,
    /// Blocks of prefill policy kv charges per block of idle cache a placement would evict on a
    /// worker whose cache is full, times how far the new blocks routed there lately exceed the
    /// least of the eligible workers', over their mean, capped at 1 (default 0, the
    /// reference's; kv-locality scores with 0).
    #[arg(long, allow_negative_numbers = true)]
    pub(crate) churn_eviction_weight: Option<f64>,
    /// Blocks of prefill policy kv charges per new block a placement allocates, times how much
    /// fuller the worker's KV cache is than the emptiest eligible worker's, as fractions of
    /// their capacities (default 0, the reference's; kv-locality scores with 0).
    #[arg(long, allow_negative_numbers = true)]
    pub(crate) occupancy_weight: Option<f64>,
    /// Credit per cached block found on a worker's host (CPU) tier, continuing its device
    /// prefix, against a device block's 1 (default 0.75, as the reference).
    #[arg(long, allow_negative_numbers = true)]
    pub(crate) host_cache_hit_weight: Option<f64>,
    /// Credit per cached block on a worker's disk tier (default 0.25, as the reference).
    #[arg(long, allow_negative_numbers = true)]
    pub(crate) disk_cache_hit_weight: Option<f64>,
    /// How many times a request moves when its worker dies mid-stream (default 3).
    #[arg(long)]
    pub(crate) max_migrations: Option<u32>,
    /// KV mode of workers that do not say: events or approximate (default events).
    #[arg(long, value_name = "events|approximate")]
    pub(crate) kv_mode: Option<String>,
    /// Seed of the routing RNG (tie-breaking, temperature, random policy).
    #[arg(long)]
    pub(crate) seed: Option<u64>,
    /// Disaggregated serving: optional (while prefill workers are registered), enforced
    /// (refuse without them), conditional (per request: prefill on the decode worker when that
    /// is cheaper, see --max-local-prefill-tokens) or off (aggregated workers only) (default
    /// optional).
    #[arg(long, value_name = "optional|enforced|conditional|off")]
    pub(crate) disagg: Option<String>,
    /// With --disagg conditional: prefill on the decode worker when at most this many prompt
    /// tokens are uncached there (default 1000).
    #[arg(long, value_name = "TOKENS")]
    pub(crate) max_local_prefill_tokens: Option<u64>,
    /// With --disagg conditional: prefill on the decode worker when at least this share of the
    /// prompt is cached there; above 1 turns the rule off (default 0.8).
    #[arg(long, value_name = "SHARE")]
    pub(crate) min_local_cached_share: Option<f64>,
    /// With --disagg conditional: prefill on the decode worker when the prefill workers' queue
    /// (tokens to prefill, this prompt's included) is at least this many times the decode
    /// worker's (default 2).
    #[arg(long, value_name = "RATIO")]
    pub(crate) prefill_queue_ratio: Option<f64>,
}

/// `[discovery]`: registration (the default) or a static fleet file.
#[derive(Debug, Default, Clone, PartialEq, Deserialize, clap::Args)]
#[serde(default, deny_unknown_fields)]
pub(crate) struct DiscoveryOptions {
    /// Address workers register at, ip:port (default 127.0.0.1:7100; port 0 picks one).
    #[arg(long, value_name = "IP:PORT")]
    pub(crate) registry_listen: Option<String>,
    /// How long a registered worker stays listed without a heartbeat (default 5s).
    #[arg(long, value_name = "DURATION")]
    pub(crate) lease_ttl: Option<HumanDuration>,
    /// A static fleet file (TOML `[[workers]]` or JSON) instead of registration.
    #[arg(long, value_name = "FILE")]
    pub(crate) fleet: Option<PathBuf>,
    /// A static fleet written inline (`[[discovery.workers]]`, the fleet file's entries).
    #[arg(skip)]
    pub(crate) workers: Option<Vec<FleetWorker>>,
    /// The fleet's shared secret (at least 16 bytes; the file's content, trimmed): only workers
    /// proving it can register or be sent requests, and the router proves it to them. Give
    /// every worker the same file (`kvroute worker --fleet-secret-file`).
    #[arg(long, value_name = "FILE")]
    pub(crate) fleet_secret_file: Option<PathBuf>,
    /// Mutual TLS between the router and its workers (the registry and the request plane):
    /// the fleet's CA (PEM), with --fleet-cert and --fleet-key; every worker needs a
    /// certificate of this CA naming its advertised address.
    #[arg(long, value_name = "FILE", requires_all = ["fleet_cert", "fleet_key"])]
    pub(crate) fleet_ca: Option<PathBuf>,
    /// This router's certificate (PEM, signed by --fleet-ca), naming the host or IP workers
    /// reach its registry at.
    #[arg(long, value_name = "FILE", requires = "fleet_ca")]
    pub(crate) fleet_cert: Option<PathBuf>,
    /// The private key of --fleet-cert (PEM).
    #[arg(long, value_name = "FILE", requires = "fleet_ca")]
    pub(crate) fleet_key: Option<PathBuf>,
}

/// `[nats]`: several routers over one fleet, sharing discovery and KV events through NATS.
#[derive(Debug, Default, Clone, PartialEq, Deserialize, clap::Args)]
#[serde(default, deny_unknown_fields)]
pub(crate) struct NatsOptions {
    /// A NATS server with JetStream, nats://HOST:PORT: workers register there (`kvroute worker
    /// --nats`) and publish their KV events there, and every router reads both; the worker
    /// registry listener is then off.
    #[arg(long = "nats", value_name = "URL")]
    pub(crate) url: Option<String>,
    /// Prefix of the NATS subjects, stream and buckets, so that fleets can share a server
    /// (default kvroute).
    #[arg(long = "nats-namespace", value_name = "NAME")]
    pub(crate) namespace: Option<String>,
    /// With NATS: how often the routers save their shared index snapshot, which a starting or
    /// restarting router loads before reading the KV events after it (default 30s).
    #[arg(long, value_name = "DURATION")]
    pub(crate) snapshot_interval: Option<HumanDuration>,
    /// Credentials and TLS for NATS (`creds_file`, `nkey_file`, `tls_ca`).
    #[command(flatten)]
    #[serde(flatten)]
    pub(crate) auth: NatsAuth,
}

/// One `[[models]]` entry.
#[derive(Debug, Default, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ModelOptions {
    /// The name clients put in `model`.
    pub(crate) name: String,
    /// A `tokenizer.json`; omitted: the built-in mock tokenizer.
    #[serde(default)]
    pub(crate) tokenizer: Option<PathBuf>,
    /// A Jinja template or `tokenizer_config.json`; omitted: the mock template.
    #[serde(default)]
    pub(crate) chat_template: Option<PathBuf>,
    /// LoRA adapters served over this model, by the names clients put in `model`.
    #[serde(default)]
    pub(crate) lora_adapters: Vec<String>,
    /// Whether prompts are encoded with `fastokens` where it implements the tokenizer (checked
    /// against the `tokenizers` crate as it runs); omitted: true.
    #[serde(default)]
    pub(crate) fastokens: Option<bool>,
}

impl FromStr for ModelOptions {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let mut parts = s.split(',');
        let name = parts.next().unwrap_or_default().trim();
        if name.is_empty() {
            return Err(format!(
                "expected NAME[,tokenizer=PATH][,chat_template=PATH][,lora=ADAPTER...][,fastokens=BOOL], got {s:?}"
            ));
        }
        let mut model = ModelOptions {
            name: name.to_owned(),
            ..ModelOptions::default()
        };
        for part in parts {
            match part.split_once('=') {
                Some(("tokenizer", path)) => model.tokenizer = Some(path.into()),
                Some(("chat_template", path)) => model.chat_template = Some(path.into()),
                Some(("lora", adapter)) => model.lora_adapters.push(adapter.to_owned()),
                Some(("fastokens", on)) => {
                    model.fastokens = Some(on.parse().map_err(|_| {
                        format!("expected fastokens=true or fastokens=false, got {part:?}")
                    })?);
                }
                _ => {
                    return Err(format!(
                        "expected tokenizer=PATH, chat_template=PATH, lora=ADAPTER or fastokens=BOOL after the model name, got {part:?}"
                    ));
                }
            }
        }
        Ok(model)
    }
}

/// An option whose value cannot be used.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("invalid option `{key}` (flag --{flag}): expected {expected}, got {got}")]
pub(crate) struct InvalidOption {
    /// The key in the config file, `section.name`.
    pub(crate) key: &'static str,
    /// The flag.
    pub(crate) flag: &'static str,
    /// What a valid value looks like.
    pub(crate) expected: String,
    /// What was given.
    pub(crate) got: String,
}

fn invalid(
    key: &'static str,
    flag: &'static str,
    expected: &str,
    got: impl std::fmt::Debug,
) -> InvalidOption {
    InvalidOption {
        key,
        flag,
        expected: expected.to_owned(),
        got: format!("{got:?}"),
    }
}

/// How workers are found, validated.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Discovery {
    /// Workers register at `listen`; a silent one is dropped after `lease_ttl`.
    Registration {
        /// The registry's address.
        listen: SocketAddr,
        /// The lease time to live.
        lease_ttl: Duration,
    },
    /// Workers register in NATS; KV events arrive through JetStream.
    Nats {
        /// The server.
        url: String,
        /// The namespace of subjects, stream and buckets.
        namespace: String,
        /// The lease time to live.
        lease_ttl: Duration,
        /// A registry for workers that register with this router rather than with NATS
        /// (`kvroute worker --router`): the router registers them in NATS on their behalf and
        /// forwards their KV events to JetStream, so every replica serves them.
        registry_listen: Option<SocketAddr>,
        /// Credentials and TLS beyond the URL's.
        auth: NatsAuth,
    },
    /// A fixed fleet.
    Static {
        /// Its `[[workers]]`: from the fleet file, or inline.
        fleet: FleetSource,
    },
}

/// Where a static fleet's `[[workers]]` are.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum FleetSource {
    /// A fleet file.
    File(PathBuf),
    /// `[[discovery.workers]]` in the config file.
    Inline(Vec<FleetWorker>),
}

/// The validated configuration `kvroute serve` runs on.
#[derive(Debug, Clone)]
pub(crate) struct ServeConfig {
    /// Where the HTTP frontend listens.
    pub(crate) listen: SocketAddr,
    /// The frontend's limits.
    pub(crate) http: HttpConfig,
    /// How long shutdown waits for in-flight requests.
    pub(crate) drain_timeout: Duration,
    /// Client API keys (`None`: unauthenticated).
    pub(crate) api_key_file: Option<PathBuf>,
    /// HTTPS: the certificate chain and its key (`None`: plain HTTP).
    pub(crate) tls: Option<(PathBuf, PathBuf)>,
    /// The fleet's shared secret (`None`: anyone who reaches the registry may register).
    pub(crate) fleet_secret_file: Option<PathBuf>,
    /// Mutual TLS with the workers: the fleet CA, this router's certificate and key.
    pub(crate) fleet_tls: Option<[PathBuf; 3]>,
    /// The KV router (of each phase, when serving disaggregated).
    pub(crate) router: KvPushRouterConfig,
    /// Disaggregated serving, or `None` (off: aggregated workers only).
    pub(crate) disagg: Option<DisaggMode>,
    /// Where conditional disaggregation prefills (the defaults unless it is on).
    pub(crate) conditional: ConditionalDisagg,
    /// How workers are found.
    pub(crate) discovery: Discovery,
    /// The served models.
    pub(crate) models: Vec<ModelConfig>,
}

impl ServeOptions {
    /// Reads a TOML config file; errors name the line and key.
    pub(crate) fn from_toml(text: &str) -> Result<Self, toml::de::Error> {
        toml::from_str(text)
    }

    /// These options with every option `flags` gives replacing the file's.
    pub(crate) fn overridden_by(self, flags: ServeOptions) -> ServeOptions {
        fn pick<T>(file: Option<T>, flag: Option<T>) -> Option<T> {
            flag.or(file)
        }
        let (h, f) = (self.http, flags.http);
        let (r, fr) = (self.router, flags.router);
        let (d, fd) = (self.discovery, flags.discovery);
        let (n, fnats) = (self.nats, flags.nats);
        // A fleet on the command line replaces registration from the file, and the reverse.
        let (registry_listen, fleet) = match (fd.registry_listen, fd.fleet) {
            (None, None) => (d.registry_listen, d.fleet),
            given => given,
        };
        ServeOptions {
            http: HttpOptions {
                listen: pick(h.listen, f.listen),
                max_in_flight: pick(h.max_in_flight, f.max_in_flight),
                max_queued: pick(h.max_queued, f.max_queued),
                queue_timeout: pick(h.queue_timeout, f.queue_timeout),
                retry_after: pick(h.retry_after, f.retry_after),
                max_body_bytes: pick(h.max_body_bytes, f.max_body_bytes),
                max_body_memory_bytes: pick(h.max_body_memory_bytes, f.max_body_memory_bytes),
                header_timeout: pick(h.header_timeout, f.header_timeout),
                body_timeout: pick(h.body_timeout, f.body_timeout),
                max_prompt_tokens: pick(h.max_prompt_tokens, f.max_prompt_tokens),
                keep_alive: pick(h.keep_alive, f.keep_alive),
                drain_timeout: pick(h.drain_timeout, f.drain_timeout),
                api_key_file: pick(h.api_key_file, f.api_key_file),
                tls_cert: pick(h.tls_cert, f.tls_cert),
                tls_key: pick(h.tls_key, f.tls_key),
            },
            router: RouterOptions {
                block_size: pick(r.block_size, fr.block_size),
                policy: pick(r.policy, fr.policy),
                temperature: pick(r.temperature, fr.temperature),
                overlap_credit: pick(r.overlap_credit, fr.overlap_credit),
                prefill_load_scale: pick(r.prefill_load_scale, fr.prefill_load_scale),
                loaded_prefill_load_scale: pick(
                    r.loaded_prefill_load_scale,
                    fr.loaded_prefill_load_scale,
                ),
                balanced_decode_weight: pick(r.balanced_decode_weight, fr.balanced_decode_weight),
                decode_tolerance: pick(r.decode_tolerance, fr.decode_tolerance),
                cached_share_exponent: pick(r.cached_share_exponent, fr.cached_share_exponent),
                capacity_credit: pick(r.capacity_credit, fr.capacity_credit),
                eviction_weight: pick(r.eviction_weight, fr.eviction_weight),
                churn_eviction_weight: pick(r.churn_eviction_weight, fr.churn_eviction_weight),
                occupancy_weight: pick(r.occupancy_weight, fr.occupancy_weight),
                host_cache_hit_weight: pick(r.host_cache_hit_weight, fr.host_cache_hit_weight),
                disk_cache_hit_weight: pick(r.disk_cache_hit_weight, fr.disk_cache_hit_weight),
                max_migrations: pick(r.max_migrations, fr.max_migrations),
                kv_mode: pick(r.kv_mode, fr.kv_mode),
                seed: pick(r.seed, fr.seed),
                disagg: pick(r.disagg, fr.disagg),
                max_local_prefill_tokens: pick(
                    r.max_local_prefill_tokens,
                    fr.max_local_prefill_tokens,
                ),
                min_local_cached_share: pick(r.min_local_cached_share, fr.min_local_cached_share),
                prefill_queue_ratio: pick(r.prefill_queue_ratio, fr.prefill_queue_ratio),
            },
            discovery: DiscoveryOptions {
                registry_listen,
                lease_ttl: pick(d.lease_ttl, fd.lease_ttl),
                fleet,
                workers: d.workers,
                fleet_secret_file: pick(d.fleet_secret_file, fd.fleet_secret_file),
                fleet_ca: pick(d.fleet_ca, fd.fleet_ca),
                fleet_cert: pick(d.fleet_cert, fd.fleet_cert),
                fleet_key: pick(d.fleet_key, fd.fleet_key),
            },
            nats: NatsOptions {
                url: pick(n.url, fnats.url),
                namespace: pick(n.namespace, fnats.namespace),
                snapshot_interval: pick(n.snapshot_interval, fnats.snapshot_interval),
                auth: n.auth.overridden_by(fnats.auth),
            },
            models: if flags.models.is_empty() {
                self.models
            } else {
                flags.models
            },
            // Flags of `epp` are merged by `epp` itself.
            epp: self.epp,
        }
    }
}

mod defaults;
mod validate;

#[cfg(test)]
mod tests;
