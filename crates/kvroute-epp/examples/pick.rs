//! The endpoint picker over two workers, with a gRPC client playing Envoy: one chat request's
//! headers and body go in (full-duplex mode), the picked endpoint comes back as a header and as
//! dynamic metadata, then the response passes and the request leaves the router.
//!
//! `cargo run -p kvroute-epp --example pick`

use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpBody, HttpHeaders, ProcessingRequest, ProtocolConfiguration,
};
use kvroute_epp::{Endpoints, EppConfig, Picker};
use kvroute_router::http::{AppState, HttpConfig};
use kvroute_router::{KvMode, KvPushRouter, KvPushRouterConfig, ModelRegistry};
use kvroute_runtime::{
    Discovery as _, ENDPOINT_METADATA, InProcessDiscovery, InProcessEventPlane, InstanceInfo,
};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
    HeaderMap {
        headers: pairs
            .iter()
            .map(|(k, v)| HeaderValue {
                key: (*k).to_owned(),
                raw_value: v.as_bytes().to_vec(),
                ..HeaderValue::default()
            })
            .collect(),
    }
}

fn message(request: Request) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(request),
        protocol_config: Some(ProtocolConfiguration {
            request_body_mode: BodySendMode::FullDuplexStreamed as i32,
            response_body_mode: BodySendMode::FullDuplexStreamed as i32,
            send_body_without_waiting_for_header_response: false,
        }),
        ..ProcessingRequest::default()
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Two workers whose engines Envoy reaches at 10.0.0.1:8000 and 10.0.0.2:8000 (nothing needs
    // to listen there: this example plays Envoy).
    let discovery = InProcessDiscovery::new(Duration::from_secs(30));
    let mut leases = Vec::new();
    for id in 1..=2u64 {
        let mut info = InstanceInfo::new(id, format!("127.0.0.1:{}", 9 + id), 16);
        info.metadata
            .insert(ENDPOINT_METADATA.to_owned(), format!("10.0.0.{id}:8000"));
        leases.push(discovery.register(info).await?);
    }
    let mut config = KvPushRouterConfig::new(16);
    config.default_kv_mode = KvMode::Approximate;
    let router = KvPushRouter::start(
        config,
        discovery.watch(),
        Arc::new(InProcessEventPlane::new(64)),
    )
    .await?;
    let state = AppState::new(
        router.clone(),
        ModelRegistry::mock("mock"),
        HttpConfig::default(),
    );
    let picker = Picker::new(
        state,
        Endpoints::follow(discovery.watch()),
        EppConfig::default(),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(kvroute_epp::serve(listener, picker, std::future::pending()));

    // Envoy's side of one request.
    let mut client = ExternalProcessorClient::connect(format!("http://{addr}")).await?;
    let (tx, rx) = mpsc::channel(8);
    let mut answers = client.process(ReceiverStream::new(rx)).await?.into_inner();
    tx.send(message(Request::RequestHeaders(HttpHeaders {
        headers: Some(headers(&[
            (":method", "POST"),
            (":path", "/v1/chat/completions"),
            ("content-type", "application/json"),
        ])),
        ..HttpHeaders::default()
    })))
    .await?;
    let body = br#"{"model":"mock","messages":[{"role":"user","content":"hello there"}]}"#;
    tx.send(message(Request::RequestBody(HttpBody {
        body: body.to_vec(),
        end_of_stream: true,
        ..HttpBody::default()
    })))
    .await?;
    let routed = answers.message().await?.ok_or("no answer")?;
    if let Some(Response::RequestHeaders(h)) = &routed.response {
        for set in &h
            .response
            .as_ref()
            .ok_or("empty")?
            .header_mutation
            .as_ref()
            .ok_or("no mutation")?
            .set_headers
        {
            let header = set.header.as_ref().ok_or("empty header")?;
            println!(
                "{}: {}",
                header.key,
                String::from_utf8_lossy(&header.raw_value)
            );
        }
    }
    println!("dynamic metadata: {:?}", routed.dynamic_metadata);
    let _body_back = answers.message().await?;
    println!(
        "requests held by the router now: {}",
        router.with_core(|c| c.active_requests())
    );
    // The engine's response passes through Envoy: headers, then the whole body.
    tx.send(message(Request::ResponseHeaders(HttpHeaders {
        headers: Some(headers(&[
            (":status", "200"),
            ("content-type", "application/json"),
            ("x-envoy-upstream-service-time", "2"),
        ])),
        ..HttpHeaders::default()
    })))
    .await?;
    let _ = answers.message().await?;
    tx.send(message(Request::ResponseBody(HttpBody {
        body: br#"{"choices":[{"message":{"content":"hi"}}]}"#.to_vec(),
        end_of_stream: true,
        ..HttpBody::default()
    })))
    .await?;
    let _ = answers.message().await?;
    println!(
        "after the response: {}",
        router.with_core(|c| c.active_requests())
    );
    Ok(())
}
