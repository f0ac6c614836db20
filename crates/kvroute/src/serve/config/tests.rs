use std::time::Duration;

use clap::Parser;

use kvroute_runtime::WorkerRole;

use super::*;

/// Parses `file` as the config file and `flags` as the command line, validates the merge, and
/// compares a rendering of the result (or the error's message) with `expect`.
fn check(file: &str, flags: &[&str], expect: Result<&str, &str>) {
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        options: ServeOptions,
    }
    let from_file = ServeOptions::from_toml(file).map_err(|e| e.to_string());
    let from_flags = Cli::try_parse_from(std::iter::once("serve").chain(flags.iter().copied()))
        .map(|c| c.options)
        .map_err(|e| e.to_string());
    let got = from_file
        .and_then(|file| from_flags.map(|flags| file.overridden_by(flags)))
        .and_then(|options| options.validate().map_err(|e| e.to_string()))
        .map(|c| render(&c));
    match expect {
        Ok(expect) => assert_eq!(got.as_deref(), Ok(expect)),
        Err(fragment) => {
            let error = got.expect_err("expected an error");
            assert!(
                error.contains(fragment),
                "{error:?} should contain {fragment:?}"
            );
        }
    }
}

fn render(c: &ServeConfig) -> String {
    let discovery = match &c.discovery {
        Discovery::Registration { listen, lease_ttl } => {
            format!("registry {listen} ttl {lease_ttl:?}")
        }
        Discovery::Nats {
            url,
            namespace,
            lease_ttl,
            registry_listen,
            auth,
        } => format!(
            "nats {url} ns {namespace} ttl {lease_ttl:?}{}; snapshots every {:?}{}",
            registry_listen.map_or(String::new(), |r| format!(" + registry {r}")),
            c.router.snapshot_interval,
            auth.tls_ca
                .as_ref()
                .map_or(String::new(), |ca| format!("; tls ca {}", ca.display()))
        ),
        Discovery::Static {
            fleet: FleetSource::File(path),
        } => format!("fleet {}", path.display()),
        Discovery::Static {
            fleet: FleetSource::Inline(workers),
        } => {
            let ids: Vec<u64> = workers.iter().map(|w| w.id).collect();
            format!("inline fleet {ids:?}")
        }
    };
    let models: Vec<&str> = c.models.iter().map(|m| m.name.as_str()).collect();
    format!(
        "http {} in_flight {} queue {:?} drain {:?}; block {} policy {} migrations {}; {discovery}; models {models:?}",
        c.listen,
        c.http.admission.max_in_flight,
        c.http.admission.queue_timeout,
        c.drain_timeout,
        c.router.core.block_size(),
        c.router.core.policy,
        c.http.max_migrations,
    )
}

#[test]
fn defaults_serve_the_mock_model_with_registration() {
    check(
        "",
        &[],
        Ok(
            "http 127.0.0.1:8000 in_flight 4096 queue 5s drain 30s; block 16 policy kv-locality migrations 3; registry 127.0.0.1:7100 ttl 5s; models [\"mock\"]",
        ),
    );
}

#[test]
fn nats_replaces_the_registry_and_takes_the_lease_ttl() {
    check(
        "[nats]\nurl = \"nats://10.0.0.5:4222\"\n[discovery]\nlease_ttl = \"2s\"",
        &["--nats-namespace", "fleet-1"],
        Ok(
            "http 127.0.0.1:8000 in_flight 4096 queue 5s drain 30s; block 16 policy kv-locality migrations 3; nats nats://10.0.0.5:4222 ns fleet-1 ttl 2s; snapshots every 30s; models [\"mock\"]",
        ),
    );
    // A registry beside NATS only when asked for, and the snapshot interval from either side.
    check(
        "[nats]\nurl = \"nats://10.0.0.5:4222\"\nsnapshot_interval = \"5s\"",
        &["--registry-listen", "127.0.0.1:7101"],
        Ok(
            "http 127.0.0.1:8000 in_flight 4096 queue 5s drain 30s; block 16 policy kv-locality migrations 3; nats nats://10.0.0.5:4222 ns kvroute ttl 5s + registry 127.0.0.1:7101; snapshots every 5s; models [\"mock\"]",
        ),
    );
    // Credentials and TLS for NATS, from the file or a flag (which wins), only with a URL.
    check(
        "[nats]\nurl = \"tls://10.0.0.5:4222\"\ntls_ca = \"/etc/file-ca.pem\"",
        &["--nats-tls-ca", "/etc/flag-ca.pem"],
        Ok(
            "http 127.0.0.1:8000 in_flight 4096 queue 5s drain 30s; block 16 policy kv-locality migrations 3; nats tls://10.0.0.5:4222 ns kvroute ttl 5s; snapshots every 30s; tls ca /etc/flag-ca.pem; models [\"mock\"]",
        ),
    );
    check(
        "",
        &["--nats-creds", "/etc/fleet.creds"],
        Err("NATS credentials and TLS only together with nats.url (--nats)"),
    );
}

#[test]
fn the_file_sets_options_and_flags_override_it() {
    let file = r#"
        [http]
        listen = "0.0.0.0:9000"
        max_in_flight = 8
        queue_timeout = "250ms"
        [router]
        block_size = 32
        policy = "round-robin"
        max_migrations = 1
        [discovery]
        registry_listen = "127.0.0.1:0"
        lease_ttl = "2s"
        [[models]]
        name = "llama"
    "#;
    check(
        file,
        &[],
        Ok(
            "http 0.0.0.0:9000 in_flight 8 queue 250ms drain 30s; block 32 policy round-robin migrations 1; registry 127.0.0.1:0 ttl 2s; models [\"llama\"]",
        ),
    );
    check(
        file,
        &[
            "--max-in-flight",
            "2",
            "--policy",
            "kv",
            "--fleet",
            "fleet.toml",
            "--model",
            "a",
            "--drain-timeout",
            "1m",
        ],
        Ok(
            "http 0.0.0.0:9000 in_flight 2 queue 250ms drain 60s; block 32 policy kv migrations 1; fleet fleet.toml; models [\"a\"]",
        ),
    );
}

#[test]
fn bad_values_name_the_key_the_flag_and_what_was_expected() {
    check(
        "[http]\nmax_in_flight = 0",
        &[],
        Err("`http.max_in_flight` (flag --max-in-flight): expected at least 1, got 0"),
    );
    check(
        "[http]\nlisten = \"localhost\"",
        &[],
        Err("`http.listen` (flag --listen): expected an ip:port address"),
    );
    check(
        "[router]\npolicy = \"fastest\"",
        &[],
        Err(
            "`router.policy` (flag --policy): expected one of kv-locality, kv-adaptive, kv, round-robin, random, direct, got \"fastest\"",
        ),
    );
    check(
        "[router]\nkv_mode = \"both\"",
        &[],
        Err("expected events or approximate"),
    );
    check("[router]\nblock_size = 0", &[], Err("`router.block_size`"));
    check(
        "[router]\ndisagg = \"always\"",
        &[],
        Err(
            "`router.disagg` (flag --disagg): expected optional, enforced, conditional or off, got \"always\"",
        ),
    );
    check(
        "[router]\ntemperature = -1.0",
        &[],
        Err("`router.temperature`"),
    );
    check(
        "[discovery]\nfleet = \"f.toml\"\nregistry_listen = \"127.0.0.1:1\"",
        &[],
        Err(
            "`discovery.registry_listen` (flag --registry-listen): expected no registry address when discovery.fleet",
        ),
    );
    check(
        "[discovery]\nfleet = \"f.toml\"",
        &["--nats", "nats://127.0.0.1:4222"],
        Err("`nats.url` (flag --nats): expected either NATS discovery or a static fleet"),
    );
    check(
        "[discovery]\nregistry_listen = \"127.0.0.1\"",
        &["--nats", "nats://127.0.0.1:4222"],
        Err(
            "`discovery.registry_listen` (flag --registry-listen): expected an ip:port address such as 127.0.0.1:8000, got \"127.0.0.1\"",
        ),
    );
    check(
        "",
        &["--snapshot-interval", "5s"],
        Err(
            "`nats.snapshot_interval` (flag --snapshot-interval): expected a snapshot interval only together with nats.url",
        ),
    );
    check(
        "[nats]\nurl = \"nats://n:4222\"\nsnapshot_interval = \"10ms\"",
        &[],
        Err("`nats.snapshot_interval` (flag --snapshot-interval): expected at least 1s"),
    );
    check(
        "[nats]\nnamespace = \"a.b\"\nurl = \"nats://n:4222\"",
        &[],
        Err(
            "`nats.namespace` (flag --nats-namespace): expected letters, digits, '-' or '_', got \"a.b\"",
        ),
    );
    check(
        "",
        &["--nats-namespace", "fleet1"],
        Err(
            "`nats.namespace` (flag --nats-namespace): expected a namespace only together with nats.url",
        ),
    );
    check(
        "[discovery]\nlease_ttl = \"5\"",
        &[],
        Err("expected a duration like 250ms, 5s, 2m or 1h, got \"5\""),
    );
    check(
        "[discovery]\nlease_ttl = \"10ms\"",
        &[],
        Err("`discovery.lease_ttl` (flag --lease-ttl): expected at least 100ms"),
    );
    check(
        "[[models]]\nname = \"a\"\n[[models]]\nname = \"a\"",
        &[],
        Err("unique among the models"),
    );
    check(
        "[http]\nlisten_on = \"x\"",
        &[],
        Err("unknown field `listen_on`"),
    );
    check(
        "",
        &["--model", "a,vocab=x"],
        Err("expected tokenizer=PATH, chat_template=PATH, lora=ADAPTER or fastokens=BOOL"),
    );
    check("", &["--queue-timeout", "soon"], Err("expected a duration"));
}

/// The default every `--help` text states, as the constant or the router's configuration has it.
#[test]
fn defaults_in_help_are_the_constants() {
    let config = ServeOptions::default()
        .validate()
        .expect("the defaults validate");
    let scheduler = &config.router.core.scheduler;
    let secs = |d: Duration| crate::cli::HumanDuration(d).to_string();
    let mib = |bytes: usize| {
        assert!(
            bytes.is_multiple_of(1 << 20),
            "{bytes} is a whole number of MiB"
        );
        format!("{} MiB", bytes >> 20)
    };
    let expected: &[(&str, String)] = &[
        ("listen", defaults::LISTEN.to_owned()),
        ("max_in_flight", defaults::MAX_IN_FLIGHT.to_string()),
        ("max_queued", defaults::MAX_QUEUED.to_string()),
        ("queue_timeout", secs(defaults::QUEUE_TIMEOUT)),
        ("retry_after", secs(defaults::RETRY_AFTER)),
        ("max_body_bytes", mib(defaults::MAX_BODY_BYTES)),
        (
            "max_body_memory_bytes",
            mib(defaults::MAX_BODY_MEMORY_BYTES),
        ),
        ("header_timeout", secs(defaults::HEADER_TIMEOUT)),
        ("body_timeout", secs(defaults::BODY_TIMEOUT)),
        ("max_prompt_tokens", defaults::MAX_PROMPT_TOKENS.to_string()),
        ("keep_alive", secs(defaults::KEEP_ALIVE)),
        ("drain_timeout", secs(crate::cli::DEFAULT_DRAIN_TIMEOUT)),
        ("block_size", defaults::BLOCK_SIZE.to_string()),
        ("policy", kvroute_router::Policy::default().to_string()),
        ("temperature", scheduler.temperature.to_string()),
        (
            "host_cache_hit_weight",
            scheduler.cache_hit_weights.host.to_string(),
        ),
        (
            "disk_cache_hit_weight",
            scheduler.cache_hit_weights.disk.to_string(),
        ),
        ("max_migrations", config.http.max_migrations.to_string()),
        ("kv_mode", "events".to_owned()),
        ("disagg", "optional".to_owned()),
        (
            "max_local_prefill_tokens",
            config.conditional.max_local_prefill_tokens.to_string(),
        ),
        (
            "min_local_cached_share",
            config.conditional.min_local_cached_share.to_string(),
        ),
        (
            "prefill_queue_ratio",
            config.conditional.prefill_queue_ratio.to_string(),
        ),
        ("registry_listen", defaults::REGISTRY_LISTEN.to_owned()),
        ("lease_ttl", secs(crate::cli::DEFAULT_LEASE_TTL)),
        ("namespace", crate::cli::DEFAULT_NATS_NAMESPACE.to_owned()),
        ("snapshot_interval", secs(config.router.snapshot_interval)),
    ];
    assert_eq!(
        config.router.default_kv_mode,
        kvroute_router::KvMode::Events
    );
    assert_eq!(config.disagg, Some(kvroute_router::DisaggMode::Optional));
    let command = <ServeOptions as clap::Args>::augment_args(clap::Command::new("serve"));
    for (id, default) in expected {
        let arg = command
            .get_arguments()
            .find(|a| a.get_id() == *id)
            .unwrap_or_else(|| panic!("no argument {id}"));
        let help = arg.get_help().map(ToString::to_string).unwrap_or_default();
        assert!(
            help.contains(&format!("(default {default}")),
            "--{} says {help:?}, but its default is {default}",
            arg.get_long().unwrap_or(id)
        );
    }
}

/// `docs/examples/serve.toml` says every value it shows is the default unless noted: validated,
/// it is the configuration of no options at all.
#[test]
fn the_example_config_file_shows_the_defaults() {
    let text = include_str!("../../../../../docs/examples/serve.toml");
    let example = ServeOptions::from_toml(text)
        .expect("docs/examples/serve.toml parses")
        .validate()
        .expect("docs/examples/serve.toml validates");
    let default = ServeOptions::default()
        .validate()
        .expect("the defaults validate");
    assert_eq!(format!("{example:#?}"), format!("{default:#?}"));
}

#[test]
fn the_example_config_file_is_valid() {
    let text = include_str!("../../../../../docs/examples/serve.toml");
    let options = ServeOptions::from_toml(text).expect("docs/examples/serve.toml parses");
    options
        .validate()
        .expect("docs/examples/serve.toml validates");
}

#[test]
fn disagg_defaults_to_optional_and_off_routes_aggregated_workers_only() {
    let validate = |file: &str| {
        ServeOptions::from_toml(file)
            .expect("toml")
            .validate()
            .expect("valid")
    };
    let cases = [
        ("", Some(DisaggMode::Optional), None),
        (
            "[router]\ndisagg = \"optional\"",
            Some(DisaggMode::Optional),
            None,
        ),
        (
            "[router]\ndisagg = \"enforced\"",
            Some(DisaggMode::Enforced),
            None,
        ),
        (
            "[router]\ndisagg = \"conditional\"",
            Some(DisaggMode::Conditional),
            None,
        ),
        (
            "[router]\ndisagg = \"off\"",
            None,
            Some(WorkerRole::Aggregated),
        ),
    ];
    for (file, mode, role) in cases {
        let c = validate(file);
        assert_eq!((c.disagg, c.router.push.role), (mode, role), "{file:?}");
    }
}

#[test]
fn a_static_fleet_of_engines_can_be_written_inline() {
    let file = r#"
        [[discovery.workers]]
        id = 1
        engine = "vllm"
        engine_url = "http://127.0.0.1:8000"
        kv_events = "tcp://127.0.0.1:5557"
        kv_block_size = 16

        [[discovery.workers]]
        id = 2
        address = "127.0.0.1:7200"
        kv_block_size = 16

        [[models]]
        name = "llama"
        lora_adapters = ["sql-lora"]
    "#;
    let options = ServeOptions::from_toml(file).unwrap();
    let config = options.validate().unwrap();
    assert!(
        render(&config).contains("inline fleet [1, 2]"),
        "{}",
        render(&config)
    );
    assert_eq!(config.models[0].lora_adapters, vec!["sql-lora".to_owned()]);
    check(
        "[[discovery.workers]]\nid = 1\naddress = \"h:1\"\nkv_block_size = 16\n",
        &["--fleet", "fleet.toml"],
        Err("either a fleet file or inline [[discovery.workers]], not both"),
    );
    check(
        "[[models]]\nname = \"llama\"\nlora_adapters = [\"llama\"]\n",
        &[],
        Err("non-empty adapter names, unique among the models and adapters"),
    );
    check(
        "",
        &["--model", "llama,lora=sql-lora,lora=chat-lora"],
        Ok(
            "http 127.0.0.1:8000 in_flight 4096 queue 5s drain 30s; block 16 policy kv-locality migrations 3; registry 127.0.0.1:7100 ttl 5s; models [\"llama\"]",
        ),
    );
}

#[test]
fn fastokens_is_on_unless_a_model_turns_it_off() {
    let models = |file: &str, flags: &[&str]| -> Result<Vec<bool>, String> {
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            options: ServeOptions,
        }
        let file = ServeOptions::from_toml(file).map_err(|e| e.to_string())?;
        let flags = Cli::try_parse_from(std::iter::once("serve").chain(flags.iter().copied()))
            .map_err(|e| e.to_string())?
            .options;
        let config = file
            .overridden_by(flags)
            .validate()
            .map_err(|e| e.to_string())?;
        Ok(config.models.iter().map(|m| m.fastokens).collect())
    };
    assert_eq!(models("", &[]), Ok(vec![true]), "the mock model");
    assert_eq!(
        models(
            "[[models]]\nname = \"a\"\n[[models]]\nname = \"b\"\nfastokens = false\n",
            &[]
        ),
        Ok(vec![true, false])
    );
    assert_eq!(
        models(
            "",
            &[
                "--model",
                "a,fastokens=false",
                "--model",
                "b,fastokens=true"
            ]
        ),
        Ok(vec![false, true])
    );
    let err = models("", &["--model", "a,fastokens=no"]).unwrap_err();
    assert!(
        err.contains("expected fastokens=true or fastokens=false, got \"fastokens=no\""),
        "{err}"
    );
    let err = models("[[models]]\nname = \"a\"\nfastokens = \"yes\"\n", &[]).unwrap_err();
    assert!(err.contains("fastokens"), "{err}");
}

#[test]
fn lower_tier_cache_hit_weights_default_to_the_references_and_are_checked() {
    let weights = |file: &str, flags: &[&str]| {
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            options: ServeOptions,
        }
        let flags = Cli::try_parse_from(std::iter::once("serve").chain(flags.iter().copied()))
            .unwrap()
            .options;
        ServeOptions::from_toml(file)
            .unwrap()
            .overridden_by(flags)
            .validate()
            .map(|c| {
                let w = c.router.core.scheduler.cache_hit_weights;
                (w.host, w.disk)
            })
            .map_err(|e| e.to_string())
    };
    assert_eq!(weights("", &[]), Ok((0.75, 0.25)));
    assert_eq!(
        weights(
            "[router]\nhost_cache_hit_weight = 0.5\n",
            &["--disk-cache-hit-weight", "0"]
        ),
        Ok((0.5, 0.0))
    );
    let error = weights("[router]\ndisk_cache_hit_weight = 1.5\n", &[]).unwrap_err();
    assert!(
        error.contains("router.disk_cache_hit_weight") && error.contains("0..=1"),
        "{error}"
    );
}

#[test]
fn read_timeouts_and_the_body_memory_budget_default_and_are_checked() {
    let defaults = ServeOptions::default().validate().unwrap();
    assert_eq!(defaults.http.header_timeout, Duration::from_secs(10));
    assert_eq!(defaults.http.body_timeout, Duration::from_secs(30));
    assert_eq!(defaults.http.max_body_memory_bytes, 256 << 20);
    let file = ServeOptions::from_toml(
        "[http]\nheader_timeout = \"2s\"\nbody_timeout = \"500ms\"\nmax_body_memory_bytes = 33554432",
    )
    .unwrap();
    let flags = ServeOptions {
        http: HttpOptions {
            body_timeout: Some(HumanDuration(Duration::from_secs(5))),
            ..HttpOptions::default()
        },
        ..ServeOptions::default()
    };
    let set = file.overridden_by(flags).validate().unwrap();
    assert_eq!(set.http.header_timeout, Duration::from_secs(2));
    assert_eq!(set.http.body_timeout, Duration::from_secs(5));
    assert_eq!(set.http.max_body_memory_bytes, 32 << 20);
    check(
        "[http]\nheader_timeout = \"0s\"",
        &[],
        Err("`http.header_timeout` (flag --header-timeout): expected a positive duration"),
    );
    check(
        "[http]\nbody_timeout = \"0ms\"",
        &[],
        Err("`http.body_timeout` (flag --body-timeout): expected a positive duration"),
    );
    check(
        "[http]\nmax_body_bytes = 4096\nmax_body_memory_bytes = 2048",
        &[],
        Err(
            "`http.max_body_memory_bytes` (flag --max-body-memory-bytes): expected at least http.max_body_bytes, got 2048",
        ),
    );
    check("", &["--body-timeout", "soon"], Err("expected a duration"));
}

#[test]
fn kv_affinity_is_named_a_replay_preset_and_type_errors_name_the_key() {
    check(
        "[router]\npolicy = \"kv-affinity\"\n",
        &[],
        Err("kv-affinity is a replay preset"),
    );
    let error = ServeOptions::from_toml("[http]\nmax_in_flight = \"many\"\n")
        .unwrap_err()
        .to_string();
    assert!(error.contains("max_in_flight"), "{error}");
}

#[test]
fn a_negative_number_flag_is_a_value_refused_by_range_not_an_unknown_flag() {
    check("", &["--temperature", "-1"], Err("router.temperature"));
    check(
        "",
        &["--overlap-credit", "-2"],
        Err("router.overlap_credit"),
    );
    check(
        "[router]\npolicy = \"kv\"\n",
        &["--prefill-load-scale", "-1"],
        Err("router.prefill_load_scale"),
    );
    check(
        "[router]\npolicy = \"kv\"\ncached_share_exponent = inf\n",
        &[],
        Err("router.cached_share_exponent"),
    );
}

#[test]
fn an_overlap_credit_is_refused_by_the_policies_with_fixed_weights() {
    // The default policy (kv-locality) and kv-adaptive would ignore it.
    check(
        "",
        &["--overlap-credit", "3"],
        Err("no overlap credit with policy kv-locality"),
    );
    check(
        "[router]\npolicy = \"kv-adaptive\"\noverlap_credit = 3.0\n",
        &[],
        Err("no overlap credit with policy kv-adaptive"),
    );
    // Policy kv scores with the configured weights: there it applies.
    let options = ServeOptions::from_toml("[router]\npolicy = \"kv\"\noverlap_credit = 3.0\n")
        .expect("toml")
        .validate()
        .expect("valid");
    assert_eq!(options.router.core.scheduler.cost.overlap_credit, 3.0);
}

#[test]
fn policy_kv_takes_the_locality_weights_one_by_one_and_the_presets_refuse_them() {
    check(
        "",
        &["--prefill-load-scale", "16"],
        Err("no prefill load scale with policy kv-locality"),
    );
    check(
        "[router]\npolicy = \"kv-adaptive\"\ncached_share_exponent = 2.0\n",
        &[],
        Err("no cached share exponent with policy kv-adaptive"),
    );
    check(
        "",
        &["--capacity-credit", "false"],
        Err("no capacity credit setting with policy kv-locality"),
    );
    let options = ServeOptions::from_toml(
        "[router]\npolicy = \"kv\"\nprefill_load_scale = 16.0\noverlap_credit = 1.5\n\
         cached_share_exponent = 2.0\n",
    )
    .expect("toml")
    .validate()
    .expect("valid");
    let cost = options.router.core.scheduler.cost;
    // kv-locality's weights with a fixed prefill scale of 16 instead of 4.
    assert_eq!(
        (
            cost.prefill_load_scale,
            cost.loaded_prefill_load_scale,
            cost.overlap_credit,
            cost.cached_share_exponent
        ),
        (16.0, 16.0, 1.5, 2.0)
    );
    // Flags override the file, weight by weight.
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        options: ServeOptions,
    }
    let flags = Cli::try_parse_from(["serve", "--prefill-load-scale", "8"])
        .expect("flags")
        .options;
    let options = ServeOptions::from_toml("[router]\npolicy = \"kv\"\nprefill_load_scale = 16.0\n")
        .expect("toml")
        .overridden_by(flags)
        .validate()
        .expect("valid");
    assert_eq!(options.router.core.scheduler.cost.prefill_load_scale, 8.0);
    assert_eq!(
        options.router.core.scheduler.cost.cached_share_exponent,
        0.0
    );
}

#[test]
fn policy_kv_takes_every_weight_of_kv_locality_and_scores_as_it() {
    let options = ServeOptions::from_toml(
        "[router]\npolicy = \"kv\"\noverlap_credit = 1.5\nprefill_load_scale = 4.0\n\
         loaded_prefill_load_scale = 8.0\ncached_share_exponent = 2.0\n\
         balanced_decode_weight = 0.25\ndecode_tolerance = 1.0\ncapacity_credit = true\n\
         eviction_weight = 1.0\n",
    )
    .expect("toml")
    .validate()
    .expect("valid");
    assert_eq!(
        Some(options.router.core.scheduler.cost),
        kvroute_router_core::Policy::KvLocality.cost_weights()
    );
    // A balanced decode block cannot weigh more than an unbalanced one.
    check(
        "[router]\npolicy = \"kv\"\nbalanced_decode_weight = 1.5\n",
        &[],
        Err("router.balanced_decode_weight"),
    );
    check(
        "[router]\npolicy = \"kv\"\n",
        &["--decode-tolerance", "-1"],
        Err("router.decode_tolerance"),
    );
    check(
        "",
        &["--decode-tolerance", "2"],
        Err("no decode tolerance with policy kv-locality"),
    );
    check(
        "[router]\npolicy = \"kv\"\n",
        &["--eviction-weight", "-0.5"],
        Err("router.eviction_weight"),
    );
    check(
        "[router]\neviction_weight = 0.5\n",
        &[],
        Err("no eviction weight with policy kv-locality"),
    );
    check(
        "[router]\npolicy = \"kv\"\n",
        &["--churn-eviction-weight", "-1"],
        Err("router.churn_eviction_weight"),
    );
    check(
        "[router]\nchurn_eviction_weight = 1.0\n",
        &[],
        Err("no churn eviction weight with policy kv-locality"),
    );
    let options =
        ServeOptions::from_toml("[router]\npolicy = \"kv\"\nchurn_eviction_weight = 1.0\n")
            .expect("toml")
            .validate()
            .expect("valid");
    assert_eq!(
        options.router.core.scheduler.cost.churn_eviction_weight,
        1.0
    );
    check(
        "[router]\npolicy = \"kv\"\n",
        &["--occupancy-weight", "-1"],
        Err("router.occupancy_weight"),
    );
    check(
        "[router]\noccupancy_weight = 1.0\n",
        &[],
        Err("no occupancy weight with policy kv-locality"),
    );
    let options = ServeOptions::from_toml("[router]\npolicy = \"kv\"\noccupancy_weight = 0.5\n")
        .expect("toml")
        .validate()
        .expect("valid");
    assert_eq!(options.router.core.scheduler.cost.occupancy_weight, 0.5);
}

#[test]
fn conditional_thresholds_apply_to_conditional_disaggregation_only() {
    let validate = |file: &str| {
        ServeOptions::from_toml(file)
            .expect("toml")
            .validate()
            .map_err(|e| e.to_string())
    };
    let c = validate(
        "[router]\ndisagg = \"conditional\"\nmax_local_prefill_tokens = 256\n\
         min_local_cached_share = 1.5\nprefill_queue_ratio = 3.0",
    )
    .expect("valid");
    assert_eq!(
        c.conditional,
        ConditionalDisagg {
            max_local_prefill_tokens: 256,
            min_local_cached_share: 1.5,
            prefill_queue_ratio: 3.0,
        }
    );
    assert_eq!(
        validate("[router]\nmax_local_prefill_tokens = 256").unwrap_err(),
        "invalid option `router.max_local_prefill_tokens` (flag --max-local-prefill-tokens): \
         expected to be set only with disagg = \"conditional\", got it with disagg = \"optional\""
    );
    assert!(
        validate("[router]\ndisagg = \"conditional\"\nprefill_queue_ratio = 0.0")
            .unwrap_err()
            .contains("expected a finite number > 0, got 0.0")
    );
    assert!(
        validate("[router]\ndisagg = \"conditional\"\nmin_local_cached_share = -1.0")
            .unwrap_err()
            .contains("min-local-cached-share")
    );
}
