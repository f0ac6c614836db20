//! `kvroute engine-sim`: N simulated engines in one process, each kvroute-mocker's live engine
//! (paged prefix cache with eviction, continuous batching, the timing profiles) served over HTTP
//! on its own port in vLLM's OpenAI-compatible dialect (`http.rs`, `generate.rs`,
//! `openai.rs`), with vLLM's Prometheus names (`metrics.rs`) and, with `--kv-events`, vLLM's
//! ZMQ KV event feed (`kv_events.rs` over kvroute-runtime's `VllmKvPublisher`). A fleet for
//! testing and benchmarking routers, kvroute's own `worker --engine vllm` sidecars among them,
//! without GPUs.
//!
//! Every engine runs on the one tokio runtime (a driver task per engine, no thread of its own),
//! so a fleet of dozens fits on two cores. Start-up prints one line per engine to stdout,
//! `engine i=0 url=http://127.0.0.1:PORT [kv_events=tcp://... kv_events_replay=tcp://...]`,
//! then the process serves until SIGINT or SIGTERM.

mod generate;
mod http;
mod kv_events;
mod kv_transfer;
mod metrics;
mod openai;
mod sglang;
mod state;

use std::io::Write as _;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use anyhow::{Context as _, bail};
use kvroute_mocker::MockerConfig;
use kvroute_mocker::disagg::{DecodeConfig, Role};
use kvroute_mocker::live::LiveMocker;
use kvroute_router::tokenizer::{ChatTemplate, HfTokenizer, MockTokenizer, Tokenizer};
use kvroute_runtime::KvEventPublisher;

use crate::mocker_args::MockerArgs;
use crate::signal;
use kv_transfer::{EngineAddress, Transfers};
use metrics::{CacheShape, Counters};
use state::{Sim, TextSide};

/// `kvroute engine-sim` arguments.
#[derive(Debug, clap::Args)]
pub(crate) struct EngineSimArgs {
    /// The HTTP dialect the engines speak.
    #[arg(long, value_enum, default_value = "vllm")]
    dialect: SimDialect,
    /// How many engines to serve.
    #[arg(long, default_value_t = 1, value_name = "N")]
    engines: usize,
    /// The first engine's address; engine i listens on PORT+i (port 0: each on a free port).
    #[arg(long, default_value = "127.0.0.1:0", value_name = "IP:PORT")]
    listen: SocketAddr,
    /// Publish each engine's KV events as vLLM does: a ZMQ PUB socket and a replay ROUTER
    /// socket per engine, on free ports of the listen address.
    #[arg(long)]
    kv_events: bool,
    /// How many event batches each engine keeps for its replay socket (vLLM's `buffer_steps`
    /// is 10,000; a fleet of simulated engines in one process keeps fewer).
    #[arg(
        long,
        default_value_t = 1000,
        value_name = "BATCHES",
        requires = "kv_events"
    )]
    kv_events_buffer: usize,
    /// The served model name (`/v1/models`; requests naming another model get 404).
    #[arg(long, default_value = "kvroute-sim", value_name = "NAME")]
    model: String,
    /// A Hugging Face tokenizer.json for text prompts [default: kvroute's mock tokenizer, one
    /// token per whitespace-separated word].
    #[arg(long, value_name = "PATH")]
    tokenizer: Option<PathBuf>,
    /// A chat template (Jinja, or a tokenizer_config.json) (default: `<|role|> content` lines).
    #[arg(long, value_name = "PATH")]
    chat_template: Option<PathBuf>,
    /// The context length the engines state and enforce (prompt plus output tokens).
    #[arg(long, default_value_t = 8192, value_name = "TOKENS")]
    max_model_len: u32,
    /// With --dialect sglang: every engine's part in SGLang's prefill/decode disaggregation
    /// (as SGLang's own flag): null, prefill (requests fill their bootstrap room; the engine's
    /// HTTP port is its bootstrap port) or decode (requests fetch their room first).
    #[arg(long, value_enum, default_value = "null", value_name = "MODE")]
    disaggregation_mode: sglang::Mode,
    /// How long an engine holds a prefill's blocks for remote decode (vLLM's KV connector
    /// handshake: a request with `kv_transfer_params.do_remote_decode`); a decode request
    /// naming them later is refused, as a real engine frees blocks nobody read.
    #[arg(long, default_value = "480s", value_name = "DURATION")]
    kv_transfer_ttl: crate::cli::HumanDuration,
    /// The simulated engine.
    #[command(flatten)]
    mocker: MockerArgs,
}

/// `--dialect` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum SimDialect {
    /// vLLM's OpenAI-compatible server.
    Vllm,
    /// SGLang's native `/generate` API (no OpenAI endpoints).
    Sglang,
}

/// Runs the engines until a shutdown signal.
pub(crate) fn run(args: EngineSimArgs) -> anyhow::Result<()> {
    if args.engines == 0 {
        bail!("--engines must be at least 1, got 0");
    }
    if args.listen.port() != 0 && usize::from(args.listen.port()) + args.engines - 1 > 65_535 {
        bail!(
            "--listen port {} plus {} engines passes port 65535",
            args.listen.port(),
            args.engines
        );
    }
    if args.max_model_len < 2 {
        bail!(
            "--max-model-len must be at least 2 tokens, got {}",
            args.max_model_len
        );
    }
    if args.dialect != SimDialect::Sglang && args.disaggregation_mode != sglang::Mode::Null {
        bail!("--disaggregation-mode is SGLang's: it needs --dialect sglang");
    }
    let mocker = args.mocker.config()?;
    let tokenizer: Arc<dyn Tokenizer> = match &args.tokenizer {
        Some(path) => Arc::new(HfTokenizer::from_file(path)?),
        None => Arc::new(MockTokenizer),
    };
    let template = match &args.chat_template {
        Some(path) => ChatTemplate::from_file(path)?,
        None => ChatTemplate::mock(),
    };
    let text = Arc::new(TextSide {
        tokenizer,
        template,
    });
    signal::init_tracing();
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the tokio runtime")?
        .block_on(serve(args, mocker, text))
}

async fn serve(
    args: EngineSimArgs,
    mocker: MockerConfig,
    text: Arc<TextSide>,
) -> anyhow::Result<()> {
    let mut servers = Vec::with_capacity(args.engines);
    let transfers = Arc::new(Transfers::new(args.kv_transfer_ttl.0));
    let rooms = Arc::new(sglang::Rooms::default());
    let client = reqwest::Client::builder()
        .timeout(std::time::Duration::from_secs(30))
        .build()
        .context("building the KV transfer client")?;
    for i in 0..args.engines {
        let shared = Shared {
            text: Arc::clone(&text),
            transfers: Arc::clone(&transfers),
            client: client.clone(),
            rooms: Arc::clone(&rooms),
        };
        let (line, server) = start_engine(&args, i, &mocker, shared).await?;
        println!("{line}");
        servers.push(server);
    }
    std::io::stdout()
        .flush()
        .context("writing the engine lines")?;
    let signal = signal::shutdown().await;
    tracing::info!(signal, engines = args.engines, "engine-sim stopping");
    for server in servers {
        server.abort();
    }
    Ok(())
}

/// What every engine of the process shares.
struct Shared {
    text: Arc<TextSide>,
    transfers: Arc<Transfers>,
    client: reqwest::Client,
    rooms: Arc<sglang::Rooms>,
}

/// Starts engine `i`: its mocker, its event feed, its HTTP server. Returns its stdout line.
async fn start_engine(
    args: &EngineSimArgs,
    i: usize,
    mocker: &MockerConfig,
    shared: Shared,
) -> anyhow::Result<(String, tokio::task::JoinHandle<()>)> {
    let mut addr = args.listen;
    if addr.port() != 0 {
        addr.set_port(addr.port() + i as u16);
    }
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("engine {i}: binding {addr}"))?;
    let addr = listener.local_addr()?;
    let mut config = mocker.clone();
    // Each engine samples its own tokens.
    config.seed = config.seed.wrapping_add(i as u64);
    let publisher = KvEventPublisher::new(i as u64, 1024);
    let mut line = format!("engine i={i} url=http://{addr}");
    let blocks = if args.kv_events {
        let host = addr.ip().to_string();
        let (zmq, blocks) =
            kv_events::start(&host, &publisher, config.block_size, args.kv_events_buffer).await?;
        line.push_str(&format!(
            " kv_events={} kv_events_replay={}",
            zmq.endpoint(),
            zmq.replay_endpoint()
        ));
        // The feed task holds the publisher; this handle is only for the endpoints.
        drop(zmq);
        Some(blocks)
    } else {
        None
    };
    let cache = CacheShape {
        block_size: config.block_size,
        num_blocks: config.num_blocks,
    };
    // The decode role serves ordinary requests whole and takes a prefill result's KV as
    // transferred: every engine can play either side of the handshake, as vLLM's `kv_both`.
    let role = Role::Decode(DecodeConfig::default());
    let engine = LiveMocker::spawn_with_role(config, 0, publisher, role)
        .with_context(|| format!("engine {i}: starting the simulated engine"))?;
    let address = EngineAddress {
        engine_id: format!("engine-sim-{i}-{}", addr.port()),
        host: addr.ip().to_string(),
        port: addr.port(),
    };
    let sim = Arc::new(Sim {
        engine,
        model: args.model.clone(),
        text: shared.text,
        cache,
        max_model_len: args.max_model_len,
        counters: Counters::default(),
        blocks,
        next_id: AtomicU64::new(0),
        started: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        transfers: shared.transfers,
        address,
        client: shared.client,
    });
    let app = match args.dialect {
        SimDialect::Vllm => http::app(sim),
        SimDialect::Sglang => sglang::app(sim, args.disaggregation_mode, shared.rooms),
    };
    // As vLLM's server (uvicorn) does: each streamed token leaves at once, not held back by
    // Nagle's algorithm until the previous one is acknowledged.
    let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
        let _ = tcp.set_nodelay(true);
    });
    let server = tokio::spawn(async move {
        if let Err(error) = axum::serve(listener, app).await {
            tracing::error!(%error, engine = i, "engine HTTP server failed");
        }
    });
    Ok((line, server))
}
