//! `kvroute epp`: kvroute as the endpoint picker of a Kubernetes inference gateway (an Envoy
//! `ext_proc` gRPC service, see kvroute-epp), over the same fleet, models, policy, sessions and
//! NATS options as `kvroute serve` (the same config file): serve's other front door, so it
//! lives beside it and starts the fleet with the same code.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::{Context as _, bail};
use kvroute_epp::{Endpoints, EppConfig, Picker};
use kvroute_router::http::AppState;

use super::config::ServeOptions;
use super::{ServeConfig, load_options, start};
use crate::signal;

/// Where the picker's gRPC server listens without `--listen`.
pub(crate) const EPP_LISTEN: &str = "127.0.0.1:9002";
/// Where `/metrics`, `/health` and `/live` listen without `--metrics-listen`.
pub(crate) const EPP_METRICS_LISTEN: &str = "127.0.0.1:9090";

/// `kvroute epp` arguments: serve's, with `--listen` the gRPC address.
#[derive(Debug, clap::Args)]
pub(crate) struct EppArgs {
    /// A TOML config file, as `kvroute serve`'s (docs/examples/serve.toml), with an optional
    /// `[epp]` section (`metrics_listen`, `fallback_endpoints`); flags override its values.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Address of `/metrics`, `/health` and `/live`, ip:port (default 127.0.0.1:9090; port 0
    /// picks one).
    #[arg(long, value_name = "IP:PORT")]
    metrics_listen: Option<String>,
    /// Endpoints named per request, best first (default 1: the picked one, as an ORIGINAL_DST
    /// cluster needs; more let a data plane that reads the list fall back down it).
    #[arg(long, value_name = "N")]
    fallback_endpoints: Option<usize>,
    /// Serve's options; `--listen` is the gRPC (ext_proc) address here (default
    /// 127.0.0.1:9002).
    #[command(flatten)]
    options: ServeOptions,
}

/// Runs the picker until a shutdown signal.
pub(crate) fn run(args: EppArgs) -> anyhow::Result<()> {
    let mut options = load_options(args.config.as_deref(), args.options)?;
    refuse_frontend_options(&options)?;
    let metrics_listen = args
        .metrics_listen
        .or(options.epp.metrics_listen.take())
        .unwrap_or_else(|| EPP_METRICS_LISTEN.to_owned());
    let metrics_listen: SocketAddr = metrics_listen.parse().map_err(|_| {
        anyhow::anyhow!(
            "invalid option `epp.metrics_listen` (flag --metrics-listen): expected ip:port, got {metrics_listen:?}"
        )
    })?;
    let fallback_endpoints = args
        .fallback_endpoints
        .or(options.epp.fallback_endpoints)
        .unwrap_or(1);
    if fallback_endpoints == 0 {
        bail!(
            "invalid option `epp.fallback_endpoints` (flag --fallback-endpoints): expected at least 1, got 0"
        );
    }
    options
        .http
        .listen
        .get_or_insert_with(|| EPP_LISTEN.to_owned());
    // Envoy sends each request to one engine: the picker serves aggregated workers only.
    options.router.disagg = Some("off".to_owned());
    let config = options.validate()?;
    signal::init_tracing();
    let epp = EppConfig {
        fallback_endpoints,
        ..EppConfig::default()
    };
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the tokio runtime")?
        .block_on(serve_epp(config, metrics_listen, epp))
}

/// Options of serve's HTTP frontend that mean nothing behind Envoy, refused rather than ignored.
fn refuse_frontend_options(options: &ServeOptions) -> anyhow::Result<()> {
    let http = &options.http;
    let given = [
        (
            "http.api_key_file",
            "--api-key-file",
            http.api_key_file.is_some(),
        ),
        ("http.tls_cert", "--tls-cert", http.tls_cert.is_some()),
        ("http.tls_key", "--tls-key", http.tls_key.is_some()),
        ("http.keep_alive", "--keep-alive", http.keep_alive.is_some()),
        (
            "http.header_timeout",
            "--header-timeout",
            http.header_timeout.is_some(),
        ),
    ];
    if let Some((key, flag, _)) = given.iter().find(|(_, _, set)| *set) {
        bail!(
            "`{key}` ({flag}) is an option of serve's HTTP frontend; behind kvroute epp, Envoy \
             terminates the clients' connections (TLS, authentication, timeouts are Envoy's)"
        );
    }
    match options.router.disagg.as_deref() {
        None | Some("off") => Ok(()),
        Some(mode) => bail!(
            "invalid option `router.disagg` (flag --disagg): kvroute epp routes aggregated \
             workers only (Envoy sends each request to one engine); expected off, got {mode:?}"
        ),
    }
}

async fn serve_epp(
    mut config: ServeConfig,
    metrics_listen: SocketAddr,
    epp: EppConfig,
) -> anyhow::Result<()> {
    let started = start(&mut config).await?;
    let state = AppState::new(
        started.router.clone(),
        started.models.clone(),
        config.http.clone(),
    );
    let state = match started.extra_metrics.clone() {
        Some(metrics) => state.with_extra_metrics(metrics),
        None => state,
    };
    let picker = Picker::new(state, Endpoints::follow(started.instances.clone()), epp);
    let grpc = tokio::net::TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("binding the endpoint picker on {}", config.listen))?;
    let metrics = tokio::net::TcpListener::bind(metrics_listen)
        .await
        .with_context(|| format!("binding the metrics listener on {metrics_listen}"))?;
    let (grpc_addr, metrics_addr) = (grpc.local_addr()?, metrics.local_addr()?);
    // One machine-readable line, so scripts and tests can find the ports when they used port 0.
    println!(
        "kvroute epp: grpc={grpc_addr} metrics={metrics_addr} registry={}",
        started.registry_addr
    );
    tracing::info!(%grpc_addr, %metrics_addr, "serving the endpoint picker");
    let app = kvroute_epp::metrics_app(picker.clone());
    let metrics_server = tokio::spawn(async move { axum::serve(metrics, app).await });
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(kvroute_epp::serve(grpc, picker.clone(), async move {
        let _ = stop_rx.await;
    }));
    let failure = tokio::select! {
        signal_name = signal::shutdown() => {
            tracing::info!(signal = signal_name, in_flight = picker.state().in_flight(), "draining");
            None
        }
        error = started.engine_failure() => {
            tracing::error!(error = %format!("{error:#}"), "an engine's KV event feed is unusable; stopping");
            Some(error)
        }
    };
    let _ = stop_tx.send(());
    match tokio::time::timeout(config.drain_timeout, server).await {
        Ok(result) => result.context("the endpoint picker's task")??,
        Err(_) => tracing::warn!(
            in_flight = picker.state().in_flight(),
            after = ?config.drain_timeout,
            "drain timeout: exiting with requests in flight"
        ),
    }
    metrics_server.abort();
    drop(started);
    tracing::info!("stopped");
    failure.map_or(Ok(()), Err)
}
