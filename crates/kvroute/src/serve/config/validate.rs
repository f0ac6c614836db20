//! [`ServeOptions::validate`]: every option checked and turned into the typed [`ServeConfig`],
//! one function per section of the file. The checks run in a fixed order (`[http]`, `[router]`,
//! the fleet's security and `[discovery]`, `[nats]`, how workers are found, `[[models]]`, the
//! frontend's TLS pair last), so that of several bad options the same one is reported.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use kvroute_router::http::{AdmissionConfig, HttpConfig};
use kvroute_router::{
    ConditionalDisagg, DisaggMode, KvMode, KvPushRouterConfig, ModelConfig, Policy,
};
use kvroute_router_core::CostTuning;
use kvroute_router_core::disagg::ConditionalDisaggError;
use kvroute_runtime::WorkerRole;

use super::{
    Discovery, FleetSource, FleetWorker, HttpOptions, InvalidOption, ModelOptions, NatsOptions,
    RouterOptions, ServeConfig, ServeOptions, defaults, invalid,
};
use crate::cli::{DEFAULT_DRAIN_TIMEOUT, DEFAULT_LEASE_TTL, DEFAULT_NATS_NAMESPACE, HumanDuration};

impl ServeOptions {
    /// Checks every option and builds the typed configuration.
    pub(crate) fn validate(self) -> Result<ServeConfig, InvalidOption> {
        // `[epp]` is `kvroute epp`'s, read before validation (serve ignores it).
        let ServeOptions {
            http,
            router,
            discovery,
            nats,
            models,
            epp: _,
        } = self;
        let frontend = Frontend::validate(http)?;
        let (mut router_config, disagg) = validate_router(&router)?;
        let conditional = validate_conditional(&router, disagg)?;
        let d = discovery;
        let fleet_tls = validate_fleet_tls(d.fleet_ca, d.fleet_cert, d.fleet_key)?;
        let fleet = validate_static_fleet(d.fleet, d.workers)?;
        let lease_ttl = or_default(d.lease_ttl, DEFAULT_LEASE_TTL);
        if lease_ttl < Duration::from_millis(100) {
            return Err(invalid(
                "discovery.lease_ttl",
                "lease-ttl",
                "at least 100ms",
                lease_ttl,
            ));
        }
        validate_nats_extras(&nats, &mut router_config)?;
        let discovery = validate_discovery(nats, fleet, d.registry_listen, lease_ttl)?;
        let models = validate_models(models)?;
        let mut http = frontend.http;
        http.max_migrations = router
            .max_migrations
            .unwrap_or(kvroute_router::DEFAULT_MAX_MIGRATIONS);
        Ok(ServeConfig {
            listen: frontend.listen,
            http,
            drain_timeout: frontend.drain_timeout,
            api_key_file: frontend.api_key_file,
            tls: validate_frontend_tls(frontend.tls_cert, frontend.tls_key)?,
            fleet_secret_file: d.fleet_secret_file,
            fleet_tls,
            router: router_config,
            disagg,
            conditional,
            discovery,
            models,
        })
    }
}

/// `[http]` checked, but for its TLS pair, which is checked last.
struct Frontend {
    listen: SocketAddr,
    /// Everything but `max_migrations`, which is a `[router]` option.
    http: HttpConfig,
    drain_timeout: Duration,
    api_key_file: Option<PathBuf>,
    tls_cert: Option<PathBuf>,
    tls_key: Option<PathBuf>,
}

impl Frontend {
    fn validate(h: HttpOptions) -> Result<Self, InvalidOption> {
        let listen = parse_addr(
            "http.listen",
            "listen",
            h.listen.as_deref(),
            defaults::LISTEN,
        )?;
        let max_in_flight = h.max_in_flight.unwrap_or(defaults::MAX_IN_FLIGHT);
        if max_in_flight == 0 {
            return Err(invalid(
                "http.max_in_flight",
                "max-in-flight",
                "at least 1",
                0,
            ));
        }
        let max_body_bytes = h.max_body_bytes.unwrap_or(defaults::MAX_BODY_BYTES);
        if max_body_bytes < 1024 {
            return Err(invalid(
                "http.max_body_bytes",
                "max-body-bytes",
                "at least 1024",
                max_body_bytes,
            ));
        }
        let max_body_memory_bytes = h
            .max_body_memory_bytes
            .unwrap_or(defaults::MAX_BODY_MEMORY_BYTES);
        if max_body_memory_bytes < max_body_bytes {
            return Err(invalid(
                "http.max_body_memory_bytes",
                "max-body-memory-bytes",
                "at least http.max_body_bytes",
                max_body_memory_bytes,
            ));
        }
        let header_timeout = positive(
            h.header_timeout,
            defaults::HEADER_TIMEOUT,
            "http.header_timeout",
            "header-timeout",
        )?;
        let body_timeout = positive(
            h.body_timeout,
            defaults::BODY_TIMEOUT,
            "http.body_timeout",
            "body-timeout",
        )?;
        let max_prompt_tokens = h.max_prompt_tokens.unwrap_or(defaults::MAX_PROMPT_TOKENS);
        if max_prompt_tokens == 0 {
            return Err(invalid(
                "http.max_prompt_tokens",
                "max-prompt-tokens",
                "at least 1",
                0,
            ));
        }
        let keep_alive = positive(
            h.keep_alive,
            defaults::KEEP_ALIVE,
            "http.keep_alive",
            "keep-alive",
        )?;
        let http = HttpConfig {
            max_body_bytes,
            max_body_memory_bytes,
            header_timeout,
            body_timeout,
            max_prompt_tokens,
            admission: AdmissionConfig {
                max_in_flight,
                max_queued: h.max_queued.unwrap_or(defaults::MAX_QUEUED),
                queue_timeout: or_default(h.queue_timeout, defaults::QUEUE_TIMEOUT),
                retry_after: or_default(h.retry_after, defaults::RETRY_AFTER),
            },
            keep_alive,
            ..HttpConfig::default()
        };
        Ok(Frontend {
            listen,
            http,
            drain_timeout: or_default(h.drain_timeout, DEFAULT_DRAIN_TIMEOUT),
            api_key_file: h.api_key_file,
            tls_cert: h.tls_cert,
            tls_key: h.tls_key,
        })
    }
}

/// `[router]`'s conditional disaggregation thresholds, which only `disagg = "conditional"`
/// uses: given with another mode they would silently do nothing, so they are refused.
fn validate_conditional(
    r: &RouterOptions,
    disagg: Option<DisaggMode>,
) -> Result<ConditionalDisagg, InvalidOption> {
    let defaults = ConditionalDisagg::default();
    let rule = ConditionalDisagg {
        max_local_prefill_tokens: r
            .max_local_prefill_tokens
            .unwrap_or(defaults.max_local_prefill_tokens),
        min_local_cached_share: r
            .min_local_cached_share
            .unwrap_or(defaults.min_local_cached_share),
        prefill_queue_ratio: r
            .prefill_queue_ratio
            .unwrap_or(defaults.prefill_queue_ratio),
    };
    let given = [
        (
            "router.max_local_prefill_tokens",
            "max-local-prefill-tokens",
            r.max_local_prefill_tokens.is_some(),
        ),
        (
            "router.min_local_cached_share",
            "min-local-cached-share",
            r.min_local_cached_share.is_some(),
        ),
        (
            "router.prefill_queue_ratio",
            "prefill-queue-ratio",
            r.prefill_queue_ratio.is_some(),
        ),
    ];
    if disagg != Some(DisaggMode::Conditional)
        && let Some(&(key, flag, _)) = given.iter().find(|(_, _, set)| *set)
    {
        return Err(InvalidOption {
            key,
            flag,
            expected: "to be set only with disagg = \"conditional\"".to_owned(),
            got: format!(
                "it with disagg = {:?}",
                r.disagg.as_deref().unwrap_or("optional")
            ),
        });
    }
    rule.validated().map_err(|e| match e {
        ConditionalDisaggError::CachedShare(v) => invalid(
            "router.min_local_cached_share",
            "min-local-cached-share",
            "a number >= 0",
            v,
        ),
        ConditionalDisaggError::QueueRatio(v) => invalid(
            "router.prefill_queue_ratio",
            "prefill-queue-ratio",
            "a finite number > 0",
            v,
        ),
        other => invalid("router", "disagg", "valid conditional thresholds", other),
    })
}

/// `[router]` but `max_migrations` (an HTTP setting): the router's configuration and the
/// disaggregation mode (`None`: off).
fn validate_router(
    r: &RouterOptions,
) -> Result<(KvPushRouterConfig, Option<DisaggMode>), InvalidOption> {
    let block_size = r.block_size.unwrap_or(defaults::BLOCK_SIZE);
    if block_size == 0 {
        return Err(invalid("router.block_size", "block-size", "at least 1", 0));
    }
    let policy = parse_policy(r.policy.as_deref())?;
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
        Some("conditional") => Some(DisaggMode::Conditional),
        Some("off") => None,
        Some(other) => {
            return Err(invalid(
                "router.disagg",
                "disagg",
                "optional, enforced, conditional or off",
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
    validate_cost(r, &mut router)?;
    Ok((router, disagg))
}

/// `[router] policy`.
fn parse_policy(given: Option<&str>) -> Result<Policy, InvalidOption> {
    match given {
        None => Ok(Policy::default()),
        Some("kv-affinity") => Err(invalid(
            "router.policy",
            "policy",
            "a serve policy: kv-affinity is a replay preset (kv with overlap_credit 2 and \
             a prefill load scale of 4), not a policy of its own; kv-locality (its \
             successor), kv-adaptive, kv, round-robin, random or direct",
            "kv-affinity",
        )),
        Some(name) => name.parse().map_err(|_| {
            invalid(
                "router.policy",
                "policy",
                "one of kv-locality, kv-adaptive, kv, round-robin, random, direct",
                name,
            )
        }),
    }
}

/// `[router]`'s cost model: temperature, overlap credit and the lower tiers' cache-hit weights.
/// The refusal of a cost weight given with a policy whose weights are fixed.
fn fixed_weights(
    policy: impl std::fmt::Display,
    key: &'static str,
    flag: &'static str,
    what: &str,
    got: impl std::fmt::Debug,
) -> InvalidOption {
    let expected = format!(
        "no {what} with policy {policy}, whose weights are fixed (it applies to policy kv: set \
         policy = \"kv\" to tune the cost's weights)"
    );
    invalid(key, flag, &expected, got)
}

fn validate_cost(r: &RouterOptions, router: &mut KvPushRouterConfig) -> Result<(), InvalidOption> {
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
    // The cost's weights of policy kv. The presets score with fixed weights
    // (`Policy::cost_weights`): a weight given with one of them would be silently ignored.
    let policy = router.core.policy;
    let cost = &mut router.core.scheduler.cost;
    for (value, key, flag, what) in [
        (
            r.overlap_credit,
            "router.overlap_credit",
            "overlap-credit",
            "overlap credit",
        ),
        (
            r.prefill_load_scale,
            "router.prefill_load_scale",
            "prefill-load-scale",
            "prefill load scale",
        ),
        (
            r.loaded_prefill_load_scale,
            "router.loaded_prefill_load_scale",
            "loaded-prefill-load-scale",
            "loaded prefill load scale",
        ),
        (
            r.cached_share_exponent,
            "router.cached_share_exponent",
            "cached-share-exponent",
            "cached share exponent",
        ),
        (
            r.balanced_decode_weight,
            "router.balanced_decode_weight",
            "balanced-decode-weight",
            "balanced decode weight",
        ),
        (
            r.decode_tolerance,
            "router.decode_tolerance",
            "decode-tolerance",
            "decode tolerance",
        ),
        (
            r.eviction_weight,
            "router.eviction_weight",
            "eviction-weight",
            "eviction weight",
        ),
        (
            r.churn_eviction_weight,
            "router.churn_eviction_weight",
            "churn-eviction-weight",
            "churn eviction weight",
        ),
        (
            r.occupancy_weight,
            "router.occupancy_weight",
            "occupancy-weight",
            "occupancy weight",
        ),
    ] {
        let Some(v) = value else { continue };
        if !(v.is_finite() && v >= 0.0) {
            return Err(invalid(key, flag, "a finite number >= 0", v));
        }
        if flag == "balanced-decode-weight" && v > 1.0 {
            return Err(invalid(
                key,
                flag,
                "at most 1 (the weight of a decode block above the tolerance)",
                v,
            ));
        }
        if policy.cost_weights().is_some() {
            return Err(fixed_weights(policy, key, flag, what, v));
        }
    }
    if let Some(v) = r.capacity_credit
        && policy.cost_weights().is_some()
    {
        let what = "capacity credit setting";
        return Err(fixed_weights(
            policy,
            "router.capacity_credit",
            "capacity-credit",
            what,
            v,
        ));
    }
    *cost = cost.with_tuning(&CostTuning {
        overlap_credit: r.overlap_credit,
        prefill_load_scale: r.prefill_load_scale,
        loaded_prefill_load_scale: r.loaded_prefill_load_scale,
        cached_share_exponent: r.cached_share_exponent,
        balanced_decode_weight: r.balanced_decode_weight,
        decode_tolerance: r.decode_tolerance,
        capacity_credit: r.capacity_credit,
        eviction_weight: r.eviction_weight,
        churn_eviction_weight: r.churn_eviction_weight,
        occupancy_weight: r.occupancy_weight,
    });
    validate_cache_hit_weights(r, router)
}

/// `[router] host_cache_hit_weight` and `disk_cache_hit_weight`: each in 0..=1; every policy's
/// cost uses them.
fn validate_cache_hit_weights(
    r: &RouterOptions,
    router: &mut KvPushRouterConfig,
) -> Result<(), InvalidOption> {
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
    Ok(())
}

/// `[discovery] fleet_ca`, `fleet_cert`, `fleet_key`: all three or none.
fn validate_fleet_tls(
    ca: Option<PathBuf>,
    cert: Option<PathBuf>,
    key: Option<PathBuf>,
) -> Result<Option<[PathBuf; 3]>, InvalidOption> {
    match (ca, cert, key) {
        (Some(ca), Some(cert), Some(key)) => Ok(Some([ca, cert, key])),
        (None, None, None) => Ok(None),
        _ => Err(invalid(
            "discovery.fleet_ca",
            "fleet-ca",
            "fleet_ca, fleet_cert and fleet_key together",
            "only some of them",
        )),
    }
}

/// `[discovery] fleet` or `[[discovery.workers]]`, not both.
fn validate_static_fleet(
    file: Option<PathBuf>,
    inline: Option<Vec<FleetWorker>>,
) -> Result<Option<FleetSource>, InvalidOption> {
    match (file, inline) {
        (Some(_), Some(_)) => Err(invalid(
            "discovery.workers",
            "fleet",
            "either a fleet file or inline [[discovery.workers]], not both",
            "both",
        )),
        (Some(path), None) => Ok(Some(FleetSource::File(path))),
        (None, Some(workers)) => Ok(Some(FleetSource::Inline(workers))),
        (None, None) => Ok(None),
    }
}

/// The `[nats]` options that need `nats.url`; the snapshot interval goes into `router`.
fn validate_nats_extras(
    nats: &NatsOptions,
    router: &mut KvPushRouterConfig,
) -> Result<(), InvalidOption> {
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
            &nats.namespace,
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
    Ok(())
}

/// How workers are found: NATS, a static fleet, or registration (the default).
fn validate_discovery(
    nats: NatsOptions,
    fleet: Option<FleetSource>,
    registry_listen: Option<String>,
    lease_ttl: Duration,
) -> Result<Discovery, InvalidOption> {
    match (nats.url, fleet, registry_listen) {
        (Some(url), None, registry_listen) => {
            let namespace = nats
                .namespace
                .unwrap_or_else(|| DEFAULT_NATS_NAMESPACE.to_owned());
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
            Ok(Discovery::Nats {
                url,
                namespace,
                lease_ttl,
                registry_listen,
                auth: nats.auth,
            })
        }
        (Some(_), Some(_), _) => Err(invalid(
            "nats.url",
            "nats",
            "either NATS discovery or a static fleet (discovery.fleet / [[discovery.workers]]), not both",
            "both",
        )),
        (None, Some(_), Some(listen)) => Err(invalid(
            "discovery.registry_listen",
            "registry-listen",
            "no registry address when discovery.fleet (static) is set; choose one",
            listen,
        )),
        (None, Some(fleet), None) => Ok(Discovery::Static { fleet }),
        (None, None, listen) => {
            let listen = parse_addr(
                "discovery.registry_listen",
                "registry-listen",
                listen.as_deref(),
                defaults::REGISTRY_LISTEN,
            )?;
            Ok(Discovery::Registration { listen, lease_ttl })
        }
    }
}

/// `[[models]]`: unique non-empty names over models and adapters; none given serves the mock.
fn validate_models(models: Vec<ModelOptions>) -> Result<Vec<ModelConfig>, InvalidOption> {
    let mut names = BTreeSet::new();
    for m in &models {
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
    if models.is_empty() {
        return Ok(vec![ModelConfig::mock(defaults::MOCK_MODEL)]);
    }
    Ok(models
        .into_iter()
        .map(|m| ModelConfig {
            name: m.name,
            tokenizer: m.tokenizer,
            chat_template: m.chat_template,
            lora_adapters: m.lora_adapters,
            fastokens: m.fastokens.unwrap_or(true),
        })
        .collect())
}

/// `[http] tls_cert` and `tls_key`: both or neither.
fn validate_frontend_tls(
    cert: Option<PathBuf>,
    key: Option<PathBuf>,
) -> Result<Option<(PathBuf, PathBuf)>, InvalidOption> {
    match (cert, key) {
        (Some(cert), Some(key)) => Ok(Some((cert, key))),
        (None, None) => Ok(None),
        (Some(_), None) => Err(invalid(
            "http.tls_key",
            "tls-key",
            "tls_cert and tls_key together",
            "only one of them",
        )),
        (None, Some(_)) => Err(invalid(
            "http.tls_cert",
            "tls-cert",
            "tls_cert and tls_key together",
            "only one of them",
        )),
    }
}

/// A given duration, or the default.
fn or_default(given: Option<HumanDuration>, default: Duration) -> Duration {
    given.map_or(default, |d| d.0)
}

/// A given duration, or the default, that must not be zero.
fn positive(
    given: Option<HumanDuration>,
    default: Duration,
    key: &'static str,
    flag: &'static str,
) -> Result<Duration, InvalidOption> {
    let duration = or_default(given, default);
    if duration.is_zero() {
        return Err(invalid(key, flag, "a positive duration", "0"));
    }
    Ok(duration)
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
