//! The endpoint a proxy sends a worker's requests to (`ip:port`, the engine's own HTTP
//! server), registered as [`kvroute_runtime::ENDPOINT_METADATA`] by `worker --endpoint` and by
//! `serve`/`epp` static fleet entries (`endpoint`, else their `engine_url`).

use std::net::{SocketAddr, ToSocketAddrs};

use anyhow::{Context as _, bail};

/// `text` as an endpoint: an `ip:port` (a name is resolved, IPv4 first).
pub(crate) fn parse(text: &str) -> anyhow::Result<SocketAddr> {
    if let Ok(addr) = text.trim().parse::<SocketAddr>() {
        return Ok(addr);
    }
    resolve(text.trim())
        .with_context(|| format!("expected an endpoint ip:port (or host:port), got {text:?}"))
}

/// The endpoint of an engine's URL (`http://host:port/...`): its host, resolved, and port.
pub(crate) fn of_url(url: &str) -> anyhow::Result<SocketAddr> {
    let parsed = reqwest::Url::parse(url).with_context(|| format!("parsing the URL {url:?}"))?;
    let host = parsed
        .host_str()
        .with_context(|| format!("the URL {url:?} names no host"))?;
    let port = parsed
        .port_or_known_default()
        .with_context(|| format!("the URL {url:?} names no port"))?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    match host.parse::<std::net::IpAddr>() {
        Ok(ip) => Ok(SocketAddr::new(ip, port)),
        Err(_) => resolve(&format!("{host}:{port}")),
    }
}

fn resolve(host_port: &str) -> anyhow::Result<SocketAddr> {
    let addrs: Vec<SocketAddr> = host_port
        .to_socket_addrs()
        .with_context(|| format!("resolving {host_port}"))?
        .collect();
    match addrs.iter().find(|a| a.is_ipv4()).or(addrs.first()) {
        Some(addr) => Ok(*addr),
        None => bail!("{host_port} resolves to no address"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_come_from_addresses_urls_and_names() {
        assert_eq!(parse("10.1.2.3:8000").unwrap().to_string(), "10.1.2.3:8000");
        assert_eq!(parse("localhost:81").unwrap().to_string(), "127.0.0.1:81");
        assert_eq!(
            of_url("http://127.0.0.1:8000/v1").unwrap().to_string(),
            "127.0.0.1:8000"
        );
        assert_eq!(
            of_url("http://[::1]:9000").unwrap().to_string(),
            "[::1]:9000"
        );
        assert_eq!(
            of_url("http://localhost").unwrap().to_string(),
            "127.0.0.1:80"
        );
        let err = parse("not an endpoint").unwrap_err();
        assert!(
            format!("{err:#}").contains("expected an endpoint ip:port"),
            "{err:#}"
        );
        assert!(of_url("not a url").is_err());
    }
}
