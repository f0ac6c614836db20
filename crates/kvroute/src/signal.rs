//! What the long-running subcommands share: logging to stderr and waiting for a shutdown signal.

/// Logs to stderr, filtered by `RUST_LOG` (default `info`), so stdout stays for the readiness
/// line and reports.
pub(crate) fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}

/// Completes on SIGINT (Ctrl-C) or SIGTERM and says which.
pub(crate) async fn shutdown() -> &'static str {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => tokio::select! {
                _ = tokio::signal::ctrl_c() => "SIGINT",
                _ = term.recv() => "SIGTERM",
            },
            Err(error) => {
                tracing::warn!(%error, "cannot listen for SIGTERM; only Ctrl-C stops this process");
                let _ = tokio::signal::ctrl_c().await;
                "SIGINT"
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
        "Ctrl-C"
    }
}

/// Re-reads the fleet's TLS files (on SIGHUP), saying whether it worked.
pub(crate) fn reload_fleet_tls(tls: &kvroute_runtime::FleetTls) {
    match tls.reload() {
        Ok(()) => tracing::info!("SIGHUP: reloaded the fleet's TLS files"),
        Err(error) => tracing::error!(
            error = %error,
            "SIGHUP: the fleet's TLS files were not reloaded; the old ones stay in use"
        ),
    }
}

/// Re-reads the fleet's TLS files on every SIGHUP (a worker's; `serve` has its own handler for
/// everything it reloads).
pub(crate) async fn reload_fleet_tls_on_sighup(tls: kvroute_runtime::FleetTls) {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let Ok(mut hangup) = signal(SignalKind::hangup()) else {
            tracing::warn!("cannot listen for SIGHUP; the fleet's TLS files are not reloaded");
            return;
        };
        while hangup.recv().await.is_some() {
            reload_fleet_tls(&tls);
        }
    }
    #[cfg(not(unix))]
    let _ = tls;
}
