//! [`ServeOptions::validate`]: every option checked and turned into the typed [`ServeConfig`].

use std::net::SocketAddr;
use std::time::Duration;

use kvroute_router::http::{AdmissionConfig, HttpConfig};
use kvroute_router::{DisaggMode, KvMode, KvPushRouterConfig, ModelConfig, Policy};
use kvroute_runtime::WorkerRole;

use super::{Discovery, FleetSource, InvalidOption, ServeConfig, ServeOptions, invalid};

impl ServeOptions {
    /// Checks every option and builds the typed configuration.
    pub(crate) fn validate(self) -> Result<ServeConfig, InvalidOption> {
        let h = self.http;
        let listen = parse_addr(
            "http.listen",
            "listen",
            h.listen.as_deref(),
            "127.0.0.1:8000",
        )?;
        let max_in_flight = h.max_in_flight.unwrap_or(4096);
        if max_in_flight == 0 {
            return Err(invalid(
                "http.max_in_flight",
                "max-in-flight",
                "at least 1",
                0,
            ));
        }
        let max_body_bytes = h.max_body_bytes.unwrap_or(16 << 20);
        if max_body_bytes < 1024 {
            return Err(invalid(
                "http.max_body_bytes",
                "max-body-bytes",
                "at least 1024",
                max_body_bytes,
            ));
        }
        let max_body_memory_bytes = h.max_body_memory_bytes.unwrap_or(256 << 20);
        if max_body_memory_bytes < max_body_bytes {
            return Err(invalid(
                "http.max_body_memory_bytes",
                "max-body-memory-bytes",
                "at least http.max_body_bytes",
                max_body_memory_bytes,
            ));
        }
        let header_timeout = h.header_timeout.map_or(Duration::from_secs(10), |d| d.0);
        if header_timeout.is_zero() {
            return Err(invalid(
                "http.header_timeout",
                "header-timeout",
                "a positive duration",
                "0",
            ));
        }
        let body_timeout = h.body_timeout.map_or(Duration::from_secs(30), |d| d.0);
        if body_timeout.is_zero() {
            return Err(invalid(
                "http.body_timeout",
                "body-timeout",
                "a positive duration",
                "0",
            ));
        }
        let max_prompt_tokens = h.max_prompt_tokens.unwrap_or(128 * 1024);
        if max_prompt_tokens == 0 {
            return Err(invalid(
                "http.max_prompt_tokens",
                "max-prompt-tokens",
                "at least 1",
                0,
            ));
        }
        let keep_alive = h.keep_alive.map_or(Duration::from_secs(15), |d| d.0);
        if keep_alive.is_zero() {
            return Err(invalid(
                "http.keep_alive",
                "keep-alive",
                "a positive duration",
                "0",
            ));
        }
        let r = self.router;
        let block_size = r.block_size.unwrap_or(16);
        if block_size == 0 {
            return Err(invalid("router.block_size", "block-size", "at least 1", 0));
        }
        let policy: Policy = match r.policy.as_deref() {
            None => Policy::default(),
            Some("kv-affinity") => {
                return Err(invalid(
                    "router.policy",
                    "policy",
                    "a serve policy: kv-affinity is a replay preset (kv with overlap_credit 2 and \
                     a prefill load scale of 4), not a policy of its own; kv-locality (its \
                     successor), kv-adaptive, kv, round-robin, random or direct",
                    "kv-affinity",
                ));
            }
            Some(name) => name.parse().map_err(|_| {
                invalid(
                    "router.policy",
                    "policy",
                    "one of kv-locality, kv-adaptive, kv, round-robin, random, direct",
                    name,
                )
            })?,
        };
        let kv_mode = match r.kv_mode.as_deref() {
            None | Some("events") => KvMode::Events,
            Some("approximate") => KvMode::Approximate,
            Some(other) => {
                return Err(invalid(
                    "router.kv_mode",
                    "kv-mode",
                    "events or approximate",
                    other,
                ));
            }
        };
        let mut router = KvPushRouterConfig::new(block_size);
        router.core = router.core.with_policy(policy);
        router.default_kv_mode = kv_mode;
        let disagg = match r.disagg.as_deref() {
            None | Some("optional") => Some(DisaggMode::Optional),
            Some("enforced") => Some(DisaggMode::Enforced),
            Some("off") => None,
            Some(other) => {
                return Err(invalid(
                    "router.disagg",
                    "disagg",
                    "optional, enforced or off",
                    other,
                ));
            }
        };
        // Without disaggregation only aggregated workers can serve a request whole; with it,
        // each phase's router gets a role-filtered discovery watch instead.
        if disagg.is_none() {
            router.push.role = Some(WorkerRole::Aggregated);
        }
        if let Some(seed) = r.seed {
            router.seed = seed;
        }
        if let Some(t) = r.temperature {
            if !(t.is_finite() && t >= 0.0) {
                return Err(invalid(
                    "router.temperature",
                    "temperature",
                    "a finite number >= 0",
                    t,
                ));
            }
            router.core.scheduler.temperature = t;
        }
        if let Some(c) = r.overlap_credit {
            if !(c.is_finite() && c >= 0.0) {
                return Err(invalid(
                    "router.overlap_credit",
                    "overlap-credit",
                    "a finite number >= 0",
                    c,
                ));
            }
            router.core.scheduler.cost.overlap_credit = c;
        }
        let weights = &mut router.core.scheduler.cache_hit_weights;
        for (value, key, flag, slot) in [
            (
                r.host_cache_hit_weight,
                "router.host_cache_hit_weight",
                "host-cache-hit-weight",
                &mut weights.host,
            ),
            (
                r.disk_cache_hit_weight,
                "router.disk_cache_hit_weight",
                "disk-cache-hit-weight",
                &mut weights.disk,
            ),
        ] {
            if let Some(w) = value {
                if !(0.0..=1.0).contains(&w) {
                    return Err(invalid(key, flag, "a number in 0..=1", w));
                }
                *slot = w;
            }
        }
        let d = self.discovery;
        let fleet_secret_file = d.fleet_secret_file;
        let fleet_tls = match (d.fleet_ca, d.fleet_cert, d.fleet_key) {
            (Some(ca), Some(cert), Some(key)) => Some([ca, cert, key]),
            (None, None, None) => None,
            _ => {
                return Err(invalid(
                    "discovery.fleet_ca",
                    "fleet-ca",
                    "fleet_ca, fleet_cert and fleet_key together",
                    "only some of them",
                ));
            }
        };
        let fleet = match (d.fleet, d.workers) {
            (Some(_), Some(_)) => {
                return Err(invalid(
                    "discovery.workers",
                    "fleet",
                    "either a fleet file or inline [[discovery.workers]], not both",
                    "both",
                ));
            }
            (Some(path), None) => Some(FleetSource::File(path)),
            (None, Some(workers)) => Some(FleetSource::Inline(workers)),
            (None, None) => None,
        };
        let lease_ttl = d.lease_ttl.map_or(Duration::from_secs(5), |d| d.0);
        if lease_ttl < Duration::from_millis(100) {
            return Err(invalid(
                "discovery.lease_ttl",
                "lease-ttl",
                "at least 100ms",
                lease_ttl,
            ));
        }
        let nats = self.nats;
        if nats.auth.is_set() && nats.url.is_none() {
            return Err(invalid(
                "nats.creds_file",
                "nats-creds",
                "NATS credentials and TLS only together with nats.url (--nats)",
                "a credentials, nkey or CA file",
            ));
        }
        if nats.namespace.is_some() && nats.url.is_none() {
            return Err(invalid(
                "nats.namespace",
                "nats-namespace",
                "a namespace only together with nats.url (--nats)",
                nats.namespace,
            ));
        }
        if let Some(interval) = nats.snapshot_interval {
            if nats.url.is_none() {
                return Err(invalid(
                    "nats.snapshot_interval",
                    "snapshot-interval",
                    "a snapshot interval only together with nats.url (--nats)",
                    interval,
                ));
            }
            if interval.0 < Duration::from_secs(1) {
                return Err(invalid(
                    "nats.snapshot_interval",
                    "snapshot-interval",
                    "at least 1s",
                    interval,
                ));
            }
            router.snapshot_interval = interval.0;
        }
        let discovery = match (nats.url, fleet, d.registry_listen) {
            (Some(url), None, registry_listen) => {
                let namespace = nats.namespace.unwrap_or_else(|| "kvroute".to_owned());
                if namespace.is_empty()
                    || !namespace
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
                {
                    return Err(invalid(
                        "nats.namespace",
                        "nats-namespace",
                        "letters, digits, '-' or '_'",
                        namespace,
                    ));
                }
                if url.trim().is_empty() {
                    return Err(invalid("nats.url", "nats", "nats://HOST:PORT", url));
                }
                // A registry beside NATS only when asked for: several routers on one host.
                let registry_listen = match registry_listen {
                    Some(listen) => Some(parse_addr(
                        "discovery.registry_listen",
                        "registry-listen",
                        Some(&listen),
                        "",
                    )?),
                    None => None,
                };
                Discovery::Nats {
                    url,
                    namespace,
                    lease_ttl,
                    registry_listen,
                    auth: nats.auth,
                }
            }
            (Some(_), Some(_), _) => {
                return Err(invalid(
                    "nats.url",
                    "nats",
                    "either NATS discovery or a static fleet (discovery.fleet / [[discovery.workers]]), not both",
                    "both",
                ));
            }
            (None, fleet, listen) => match (fleet, listen) {
                (Some(_), Some(listen)) => {
                    return Err(invalid(
                        "discovery.registry_listen",
                        "registry-listen",
                        "no registry address when discovery.fleet (static) is set; choose one",
                        listen,
                    ));
                }
                (Some(fleet), None) => Discovery::Static { fleet },
                (None, listen) => {
                    let listen = parse_addr(
                        "discovery.registry_listen",
                        "registry-listen",
                        listen.as_deref(),
                        "127.0.0.1:7100",
                    )?;
                    Discovery::Registration { listen, lease_ttl }
                }
            },
        };
        let mut names = std::collections::BTreeSet::new();
        for m in &self.models {
            if m.name.is_empty() || !names.insert(m.name.as_str()) {
                return Err(invalid(
                    "models.name",
                    "model",
                    "a non-empty name, unique among the models",
                    &m.name,
                ));
            }
            for adapter in &m.lora_adapters {
                if adapter.is_empty() || !names.insert(adapter.as_str()) {
                    return Err(invalid(
                        "models.lora_adapters",
                        "model",
                        "non-empty adapter names, unique among the models and adapters",
                        adapter,
                    ));
                }
            }
        }
        let models = if self.models.is_empty() {
            vec![ModelConfig::mock("mock")]
        } else {
            self.models
                .into_iter()
                .map(|m| ModelConfig {
                    name: m.name,
                    tokenizer: m.tokenizer,
                    chat_template: m.chat_template,
                    lora_adapters: m.lora_adapters,
                })
                .collect()
        };
        let http = HttpConfig {
            max_body_bytes,
            max_body_memory_bytes,
            header_timeout,
            body_timeout,
            max_prompt_tokens,
            admission: AdmissionConfig {
                max_in_flight,
                max_queued: h.max_queued.unwrap_or(1024),
                queue_timeout: h.queue_timeout.map_or(Duration::from_secs(5), |d| d.0),
                retry_after: h.retry_after.map_or(Duration::from_secs(1), |d| d.0),
            },
            keep_alive,
            max_migrations: r
                .max_migrations
                .unwrap_or(kvroute_router::DEFAULT_MAX_MIGRATIONS),
            ..HttpConfig::default()
        };
        Ok(ServeConfig {
            listen,
            http,
            drain_timeout: h.drain_timeout.map_or(Duration::from_secs(30), |d| d.0),
            api_key_file: h.api_key_file,
            tls: match (h.tls_cert, h.tls_key) {
                (Some(cert), Some(key)) => Some((cert, key)),
                (None, None) => None,
                (cert, _) => {
                    return Err(invalid(
                        if cert.is_some() {
                            "http.tls_key"
                        } else {
                            "http.tls_cert"
                        },
                        if cert.is_some() {
                            "tls-key"
                        } else {
                            "tls-cert"
                        },
                        "tls_cert and tls_key together",
                        "only one of them",
                    ));
                }
            },
            fleet_secret_file,
            fleet_tls,
            router,
            disagg,
            discovery,
            models,
        })
    }
}

fn parse_addr(
    key: &'static str,
    flag: &'static str,
    given: Option<&str>,
    default: &str,
) -> Result<SocketAddr, InvalidOption> {
    let text = given.unwrap_or(default);
    text.parse()
        .map_err(|_| invalid(key, flag, "an ip:port address such as 127.0.0.1:8000", text))
}
