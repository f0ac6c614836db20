//! The bench's Envoy: the `gateway` listener (ext_proc with `kvroute epp`, then ORIGINAL_DST)
//! and the `direct` listener (round-robin over the engines, no picker), as
//! `docs/examples/envoy-epp.yaml` and the end-to-end test configure it.

use std::net::TcpListener;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

use crate::procs::Proc;

/// How long Envoy may take to report itself ready.
const READY_BOUND: Duration = Duration::from_secs(30);

/// A running Envoy and its listeners' ports.
pub(super) struct Envoy {
    pub(super) gateway: u16,
    pub(super) direct: u16,
    _proc: Proc,
}

fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .context("finding a free port")?
        .port())
}

fn socket(address: &str) -> Result<Value> {
    let (host, port) = address
        .rsplit_once(':')
        .with_context(|| format!("expected host:port, got {address:?}"))?;
    let port: u16 = port
        .parse()
        .with_context(|| format!("the port of {address:?}"))?;
    Ok(json!({"address": {"socket_address": {"address": host, "port_value": port}}}))
}

fn listener(name: &str, port: u16, filters: Vec<Value>, cluster: &str) -> Value {
    let mut chain = filters;
    chain.push(json!({
        "name": "envoy.filters.http.router",
        "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}
    }));
    json!({
        "name": name,
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
        "filter_chains": [{"filters": [{
            "name": "envoy.filters.network.http_connection_manager",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                "stat_prefix": name,
                "route_config": {"virtual_hosts": [{
                    "name": name, "domains": ["*"],
                    "routes": [{"match": {"prefix": "/"},
                                "route": {"cluster": cluster, "timeout": "300s"}}]}]},
                "http_filters": chain
            }}]}]
    })
}

/// The bootstrap: both listeners, the ORIGINAL_DST and round-robin clusters, the picker's.
fn config(gateway: u16, direct: u16, admin: u16, epp: &str, engines: &[String]) -> Result<Value> {
    let ext_proc = json!({
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": "kvroute_epp"}, "timeout": "10s"},
            "failure_mode_allow": false,
            "message_timeout": "10s",
            "processing_mode": {
                "request_header_mode": "SEND",
                "request_body_mode": "FULL_DUPLEX_STREAMED",
                "request_trailer_mode": "SEND",
                "response_header_mode": "SEND",
                "response_body_mode": "FULL_DUPLEX_STREAMED",
                "response_trailer_mode": "SEND"
            }
        }
    });
    let upstreams = engines
        .iter()
        .map(|e| Ok(json!({"endpoint": socket(e)?})))
        .collect::<Result<Vec<_>>>()?;
    Ok(json!({
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin}}},
        "static_resources": {
            "listeners": [
                listener("gateway", gateway, vec![ext_proc], "model_servers"),
                listener("direct", direct, vec![], "engines_rr"),
            ],
            "clusters": [
                {"name": "model_servers", "type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED",
                 "connect_timeout": "1s",
                 "original_dst_lb_config": {"use_http_header": true,
                                            "http_header_name": "x-gateway-destination-endpoint"}},
                {"name": "engines_rr", "type": "STATIC", "lb_policy": "ROUND_ROBIN",
                 "connect_timeout": "1s",
                 "load_assignment": {"cluster_name": "engines_rr",
                                     "endpoints": [{"lb_endpoints": upstreams}]}},
                {"name": "kvroute_epp", "type": "STATIC", "connect_timeout": "1s",
                 "typed_extension_protocol_options": {
                     "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                         "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                         "explicit_http_config": {"http2_protocol_options": {}}}},
                 "load_assignment": {"cluster_name": "kvroute_epp", "endpoints": [
                     {"lb_endpoints": [{"endpoint": socket(epp)?}]}]}}
            ]
        }
    }))
}

impl Envoy {
    /// Starts Envoy (`binary`) over `engines` (`host:port`) with the picker at `epp`, and waits
    /// until its admin says it is live.
    pub(super) async fn start(
        binary: &Path,
        scratch: &Path,
        logs: &Path,
        epp: &str,
        engines: &[String],
    ) -> Result<Self> {
        let (gateway, direct, admin) = (free_port()?, free_port()?, free_port()?);
        let path = scratch.join("envoy.json");
        let text = serde_json::to_string_pretty(&config(gateway, direct, admin, epp, engines)?)?;
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
        let mut cmd = Command::new(binary);
        cmd.arg("-c")
            .arg(&path)
            .args(["--disable-hot-restart", "--log-level", "warn", "--base-id"])
            .arg(std::process::id().to_string());
        let mut proc = Proc::spawn("envoy", &mut cmd, &logs.join("envoy.log"))?;
        let http = crate::http_load::client(Duration::from_secs(2))?;
        let ready = format!("http://127.0.0.1:{admin}/ready");
        let deadline = tokio::time::Instant::now() + READY_BOUND;
        loop {
            proc.check_alive()?;
            if let Ok(response) = http.get(&ready).send().await
                && response.text().await.is_ok_and(|t| t.trim() == "LIVE")
            {
                break;
            }
            if tokio::time::Instant::now() > deadline {
                bail!(
                    "Envoy was not ready within {READY_BOUND:?}: {}",
                    proc.log_tail()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(Self {
            gateway,
            direct,
            _proc: proc,
        })
    }
}
