//! [`WorkerArgs`]: the command line of `kvroute worker`.

use std::net::SocketAddr;
use std::path::PathBuf;

use kvroute_engines::EngineKind;

use crate::cli::nats::NatsAuth;
use crate::cli::{DEFAULT_DRAIN_TIMEOUT, DEFAULT_LEASE_TTL, DEFAULT_NATS_NAMESPACE, HumanDuration};
use crate::mocker_args::MockerArgs;

/// `kvroute worker` arguments.
#[derive(Debug, clap::Args)]
#[command(group = clap::ArgGroup::new("backend").required(true).args(["mock", "engine"]))]
pub(crate) struct WorkerArgs {
    /// Serve the simulated engine (kvroute-mocker).
    #[arg(long)]
    pub(super) mock: bool,
    /// Serve a real engine through its HTTP API, prompts sent as token ids: vllm, trtllm and
    /// openai through `/v1/completions`, sglang through `/generate`, llamacpp through
    /// `/completion`.
    #[arg(
        long,
        value_name = "vllm|sglang|trtllm|llamacpp|openai",
        requires = "engine_url"
    )]
    pub(super) engine: Option<EngineKind>,
    /// The engine's HTTP address, e.g. http://127.0.0.1:8000.
    #[arg(long, value_name = "URL", requires = "engine")]
    pub(super) engine_url: Option<String>,
    /// Where a proxy in front of kvroute (`kvroute epp` behind Envoy) sends this worker's
    /// requests: the engine's ip:port as the proxy reaches it, e.g. the pod's IP (default: the
    /// host and port of --engine-url).
    #[arg(long, value_name = "IP:PORT", requires = "engine")]
    pub(super) endpoint: Option<String>,
    /// The engine's ZMQ KV event publisher, e.g. tcp://127.0.0.1:5557 (vLLM
    /// `--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
    /// "endpoint": "tcp://*:5557"}'`). Without it the router predicts this worker's cache from its
    /// own decisions (approximate mode).
    #[arg(long, value_name = "tcp://HOST:PORT", requires = "engine")]
    pub(super) kv_events: Option<String>,
    /// The engine's ZMQ replay socket (vLLM `"replay_endpoint"`), to recover missed event batches.
    #[arg(long, value_name = "tcp://HOST:PORT", requires = "kv_events")]
    pub(super) kv_events_replay: Option<String>,
    /// Tokens per KV block of the engine (vLLM `--block-size`, SGLang `--page-size`); must
    /// equal the router's `[router] block_size` (default 16).
    #[arg(long, value_name = "TOKENS", conflicts_with = "mock")]
    pub(super) kv_block_size: Option<u32>,
    /// The `model` sent to the engine instead of each request's own.
    #[arg(long, value_name = "NAME", requires = "engine")]
    pub(super) served_model_name: Option<String>,
    /// How long a request may wait for the engine's first byte (its queue wait plus prefill:
    /// engines send nothing before the first token). When it passes, the request goes back to
    /// the router, which moves it to another worker (or answers 504 `timeout` when none can
    /// take it), and the router's passive health counts it against this worker.
    #[arg(
        long,
        default_value = "300s",
        value_name = "DURATION",
        requires = "engine"
    )]
    pub(super) first_byte_timeout: HumanDuration,
    /// The longest silence between two pieces of a started response (a frozen engine, a
    /// connection cut without a reset): when it passes, the request migrates with the tokens
    /// generated so far.
    #[arg(
        long,
        default_value = "60s",
        value_name = "DURATION",
        requires = "engine"
    )]
    pub(super) idle_timeout: HumanDuration,
    /// A file whose first line is the engine's API key, sent as `Authorization: Bearer`
    /// (`vllm serve --api-key`, an OpenAI server). Also read from the environment variable
    /// KVROUTE_ENGINE_API_KEY. Never logged.
    #[arg(long, value_name = "FILE", requires = "engine")]
    pub(super) engine_api_key_file: Option<PathBuf>,
    /// How long to wait at start for the engine to answer its health check (250ms, 5s, 2m, ...).
    #[arg(long, default_value = "120s", value_name = "DURATION")]
    pub(super) engine_wait: HumanDuration,
    /// What the worker serves. With --engine, prefill or decode needs an engine whose
    /// disaggregation exchange kvroute speaks (vllm: its KV connector handshake; sglang: its
    /// bootstrap rooms).
    #[arg(long, value_enum, default_value = "aggregated")]
    pub(super) role: RoleArg,
    /// With --engine sglang --role prefill: the engine's `--disaggregation-bootstrap-port`,
    /// advertised (with the --engine-url host) for its decode partners [default: 8998].
    #[arg(long, value_name = "PORT", requires = "engine")]
    pub(super) bootstrap_port: Option<u16>,
    /// The request-plane address, ip:port (port 0 picks a free port).
    #[arg(long, default_value = "127.0.0.1:0", value_name = "IP:PORT")]
    pub(super) listen: SocketAddr,
    /// The address the router should dial (default: the bound address; 127.0.0.1 when bound to
    /// an unspecified ip).
    #[arg(long, value_name = "HOST:PORT")]
    pub(super) advertise: Option<String>,
    /// The instance id, unique in the fleet (default: random).
    #[arg(long)]
    pub(super) id: Option<u64>,
    /// The router's registry address (`[discovery] registry_listen` of `kvroute serve`), host:port.
    /// Without it the worker only serves (for a static fleet file).
    #[arg(long, value_name = "HOST:PORT")]
    pub(super) router: Option<String>,
    /// A NATS server with JetStream, nats://HOST:PORT, instead of --router: the worker
    /// registers in NATS and publishes its KV events to JetStream, where every `kvroute serve
    /// --nats` router finds them.
    #[arg(long = "nats", value_name = "URL", conflicts_with = "router")]
    pub(super) nats: Option<String>,
    /// The NATS namespace (as `kvroute serve --nats-namespace`; default kvroute).
    #[arg(
        long = "nats-namespace",
        value_name = "NAME",
        requires = "nats",
        default_value = DEFAULT_NATS_NAMESPACE
    )]
    pub(super) nats_namespace: String,
    /// With --nats: how long the registration stays listed without renewal (renewed every third
    /// of it), as `kvroute serve --lease-ttl`.
    #[arg(
        long,
        value_name = "DURATION",
        requires = "nats",
        default_value_t = HumanDuration(DEFAULT_LEASE_TTL)
    )]
    pub(super) lease_ttl: HumanDuration,
    /// Credentials and TLS for NATS, as `kvroute serve`'s.
    #[command(flatten)]
    pub(super) nats_auth: NatsAuth,
    /// The fleet's shared secret, the same file as the router's `--fleet-secret-file`: the
    /// worker proves it when it registers and serves only routers that prove it.
    #[arg(long, value_name = "FILE")]
    pub(super) fleet_secret_file: Option<PathBuf>,
    /// Mutual TLS with the routers: the fleet's CA (PEM), as `kvroute serve --fleet-ca`.
    #[arg(long, value_name = "FILE", requires_all = ["fleet_cert", "fleet_key"])]
    pub(super) fleet_ca: Option<PathBuf>,
    /// This worker's certificate (PEM, signed by --fleet-ca), naming the host or IP it is
    /// reached at (--advertise).
    #[arg(long, value_name = "FILE", requires = "fleet_ca")]
    pub(super) fleet_cert: Option<PathBuf>,
    /// The private key of --fleet-cert (PEM).
    #[arg(long, value_name = "FILE", requires = "fleet_ca")]
    pub(super) fleet_key: Option<PathBuf>,
    /// The simulated engine (--mock).
    #[command(flatten)]
    pub(super) mocker: MockerArgs,
    /// Serve `/metrics` (Prometheus text) and `/health` over HTTP on this address.
    #[arg(long, value_name = "IP:PORT")]
    pub(super) metrics_listen: Option<SocketAddr>,
    /// On SIGINT/SIGTERM, how long in-flight requests may take to finish (250ms, 5s, 2m, ...;
    /// the same flag and format as `kvroute serve --drain-timeout`).
    #[arg(
        long,
        default_value_t = HumanDuration(DEFAULT_DRAIN_TIMEOUT),
        value_name = "DURATION"
    )]
    pub(super) drain_timeout: HumanDuration,
    /// How often the worker reads its engine's load (requests running and waiting, KV blocks
    /// in use) and reports it to the routers, which hold their predicted load against it
    /// (at least 50ms). The report is repeated at this interval while it does not change.
    #[arg(long, default_value = "1s", value_name = "DURATION")]
    pub(super) load_report_interval: HumanDuration,
}

/// `--role` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(super) enum RoleArg {
    Aggregated,
    Prefill,
    Decode,
}
