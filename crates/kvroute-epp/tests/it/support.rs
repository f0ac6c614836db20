//! A picker over a small fleet of simulated workers, and a gRPC client that plays Envoy.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, Metadata};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::body_mutation::Mutation;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpBody, HttpHeaders, HttpTrailers, ProcessingRequest, ProcessingResponse,
    ProtocolConfiguration,
};
use envoy_types::pb::google::protobuf::value::Kind;
use envoy_types::pb::google::protobuf::{ListValue, Struct, Value};
use kvroute_epp::{Endpoints, EppConfig, Picker};
use kvroute_router::http::{AppState, HttpConfig};
use kvroute_router::{KvMode, KvPushRouter, KvPushRouterConfig, ModelRegistry};
use kvroute_runtime::{
    Discovery as _, ENDPOINT_METADATA, InProcessDiscovery, InProcessEventPlane, InstanceInfo, Lease,
};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;

pub(crate) const BLOCK: u32 = 4;
pub(crate) const MODEL: &str = "mock";

/// The endpoint worker `id` registers (nothing listens there: Envoy is played by the test).
pub(crate) fn endpoint_of(id: u64) -> String {
    format!("10.0.0.{id}:8000")
}

pub(crate) struct Harness {
    pub(crate) picker: Picker,
    pub(crate) router: KvPushRouter,
    pub(crate) grpc: ExternalProcessorClient<Channel>,
    pub(crate) addr: std::net::SocketAddr,
    pub(crate) _discovery: InProcessDiscovery,
    pub(crate) leases: HashMap<u64, Lease>,
}

impl Harness {
    /// `n` workers (ids 1..=n) with endpoints, in approximate mode, and a picker over them.
    pub(crate) async fn start(n: u64) -> Self {
        Self::start_with(n, HttpConfig::default(), EppConfig::default()).await
    }

    pub(crate) async fn start_with(n: u64, http: HttpConfig, epp: EppConfig) -> Self {
        let discovery = InProcessDiscovery::new(Duration::from_secs(30));
        let mut leases = HashMap::new();
        for id in 1..=n {
            // Nothing needs to reach the worker: the picker only routes (Envoy, played by the
            // test, would carry the request to the endpoint), and approximate mode needs no
            // events. Its request-plane address is a port that was free.
            let address = std::net::TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .unwrap();
            let mut info = InstanceInfo::new(id, address.to_string(), BLOCK);
            info.metadata
                .insert(ENDPOINT_METADATA.to_owned(), endpoint_of(id));
            leases.insert(id, discovery.register(info).await.unwrap());
        }
        let mut config = KvPushRouterConfig::new(BLOCK);
        config.default_kv_mode = KvMode::Approximate;
        let router = KvPushRouter::start(
            config,
            discovery.watch(),
            Arc::new(InProcessEventPlane::new(1024)),
        )
        .await
        .unwrap();
        let state = AppState::new(router.clone(), ModelRegistry::mock(MODEL), http);
        let picker = Picker::new(state, Endpoints::follow(discovery.watch()), epp);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(kvroute_epp::serve(
            listener,
            picker.clone(),
            std::future::pending(),
        ));
        let grpc = ExternalProcessorClient::connect(format!("http://{addr}"))
            .await
            .unwrap();
        Self {
            picker,
            router,
            grpc,
            addr,
            _discovery: discovery,
            leases,
        }
    }

    /// Opens one ext_proc stream: one HTTP request passing through Envoy.
    pub(crate) async fn stream(&self) -> Stream {
        let (tx, rx) = mpsc::channel(16);
        let responses = self
            .grpc
            .clone()
            .process(ReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        Stream { tx, responses }
    }

    /// Whether the router holds no request and every worker's load reads zero.
    pub(crate) fn idle(&self) -> bool {
        self.router.with_core(|core| {
            let workers: Vec<_> = core.workers().collect();
            core.active_requests() == 0
                && workers.iter().all(|&w| {
                    core.worker_load(w)
                        .is_some_and(|l| l.active_requests == 0 && l.prefill_tokens == 0)
                })
        })
    }

    /// Waits (bounded) until the router is idle.
    pub(crate) async fn until_idle(&self) {
        eventually("the router holds no load", || self.idle()).await;
    }
}

/// Waits (bounded) until `cond` holds; panics with `what` after 5 s.
pub(crate) async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    for _ in 0..500 {
        if cond() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("timed out waiting until {what}");
}

/// One ext_proc stream, as Envoy drives it.
pub(crate) struct Stream {
    tx: mpsc::Sender<ProcessingRequest>,
    responses: tonic::Streaming<ProcessingResponse>,
}

/// How the request's body is sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    FullDuplex,
    Buffered,
    /// Envoy configured not to send the body at all.
    NoBody,
}

fn header_map(headers: &[(&str, &str)]) -> HeaderMap {
    HeaderMap {
        headers: headers
            .iter()
            .map(|(k, v)| HeaderValue {
                key: (*k).to_owned(),
                raw_value: v.as_bytes().to_vec(),
                ..HeaderValue::default()
            })
            .collect(),
    }
}

/// Filter metadata with `{namespace: {key: [values]}}`.
pub(crate) fn list_metadata(namespace: &str, key: &str, values: &[&str]) -> Metadata {
    let list = Value {
        kind: Some(Kind::ListValue(ListValue {
            values: values
                .iter()
                .map(|v| Value {
                    kind: Some(Kind::StringValue((*v).to_owned())),
                })
                .collect(),
        })),
    };
    Metadata {
        filter_metadata: HashMap::from([(
            namespace.to_owned(),
            Struct {
                fields: HashMap::from([(key.to_owned(), list)]),
            },
        )]),
        ..Metadata::default()
    }
}

impl Stream {
    async fn send(&self, request: Request, metadata: Option<Metadata>, mode: Option<Mode>) {
        let protocol_config = mode.map(|m| {
            let body = match m {
                Mode::FullDuplex => BodySendMode::FullDuplexStreamed,
                Mode::Buffered => BodySendMode::Buffered,
                Mode::NoBody => BodySendMode::None,
            };
            ProtocolConfiguration {
                request_body_mode: body as i32,
                response_body_mode: body as i32,
                send_body_without_waiting_for_header_response: false,
            }
        });
        self.tx
            .send(ProcessingRequest {
                request: Some(request),
                metadata_context: metadata,
                protocol_config,
                ..ProcessingRequest::default()
            })
            .await
            .unwrap();
    }

    /// The next answer, or `None` when the picker closed the stream (bounded wait).
    pub(crate) async fn next(&mut self) -> Option<ProcessingResponse> {
        tokio::time::timeout(Duration::from_secs(5), self.responses.message())
            .await
            .expect("the picker answers within 5 s")
            .expect("the stream is healthy")
    }

    /// Sends the request headers (`POST path`, plus `extra`), as the first message.
    pub(crate) async fn request_headers(
        &self,
        method: &str,
        path: &str,
        extra: &[(&str, &str)],
        end_of_stream: bool,
        mode: Mode,
        metadata: Option<Metadata>,
    ) {
        let mut headers = vec![
            (":method", method),
            (":path", path),
            (":authority", "gateway"),
            ("content-type", "application/json"),
        ];
        headers.extend_from_slice(extra);
        self.send(
            Request::RequestHeaders(HttpHeaders {
                headers: Some(header_map(&headers)),
                end_of_stream,
                ..HttpHeaders::default()
            }),
            metadata,
            Some(mode),
        )
        .await;
    }

    /// The headers of `POST /v1/chat/completions` with a body to follow, full-duplex.
    pub(crate) async fn post_chat(&self, metadata: Option<Metadata>) {
        self.request_headers(
            "POST",
            "/v1/chat/completions",
            &[],
            false,
            Mode::FullDuplex,
            metadata,
        )
        .await;
    }

    pub(crate) async fn request_body(&self, body: &[u8], end_of_stream: bool) {
        self.send(
            Request::RequestBody(HttpBody {
                body: body.to_vec(),
                end_of_stream,
                ..HttpBody::default()
            }),
            None,
            None,
        )
        .await;
    }

    pub(crate) async fn request_trailers(&self) {
        self.send(
            Request::RequestTrailers(HttpTrailers::default()),
            None,
            None,
        )
        .await;
    }

    /// Sends the response headers; `from_upstream` adds the header Envoy's router sets on an
    /// engine's response (without it, the response is Envoy's own reply).
    pub(crate) async fn response_headers(
        &self,
        status: u16,
        content_type: &str,
        from_upstream: bool,
        metadata: Option<Metadata>,
    ) {
        let status = status.to_string();
        let mut headers = vec![(":status", status.as_str()), ("content-type", content_type)];
        if from_upstream {
            headers.push(("x-envoy-upstream-service-time", "3"));
        }
        self.send(
            Request::ResponseHeaders(HttpHeaders {
                headers: Some(header_map(&headers)),
                ..HttpHeaders::default()
            }),
            metadata,
            None,
        )
        .await;
    }

    pub(crate) async fn response_body(&self, body: &[u8], end_of_stream: bool) {
        self.send(
            Request::ResponseBody(HttpBody {
                body: body.to_vec(),
                end_of_stream,
                ..HttpBody::default()
            }),
            None,
            None,
        )
        .await;
    }
}

/// The destination a request-side answer sets: the header's value and the dynamic metadata's.
pub(crate) fn destination(answer: &ProcessingResponse) -> Option<(String, String)> {
    let common = match answer.response.as_ref()? {
        Response::RequestHeaders(h) => h.response.as_ref()?,
        Response::RequestBody(b) => b.response.as_ref()?,
        _ => return None,
    };
    let header = common
        .header_mutation
        .as_ref()?
        .set_headers
        .iter()
        .filter_map(|h| h.header.as_ref())
        .find(|h| h.key == "x-gateway-destination-endpoint")?;
    let header = String::from_utf8(header.raw_value.clone()).unwrap();
    let metadata = answer.dynamic_metadata.as_ref()?;
    let Some(Kind::StructValue(inner)) = &metadata.fields.get("envoy.lb")?.kind else {
        return None;
    };
    let Some(Kind::StringValue(value)) = &inner.fields.get("x-gateway-destination-endpoint")?.kind
    else {
        return None;
    };
    Some((header, value.clone()))
}

/// The body a streamed body answer hands back, with its end-of-stream flag.
pub(crate) fn streamed(answer: &ProcessingResponse) -> Option<(Vec<u8>, bool)> {
    let common = match answer.response.as_ref()? {
        Response::RequestBody(b) | Response::ResponseBody(b) => b.response.as_ref()?,
        _ => return None,
    };
    match common.body_mutation.as_ref()?.mutation.as_ref()? {
        Mutation::StreamedResponse(s) => Some((s.body.clone(), s.end_of_stream)),
        _ => None,
    }
}

/// The status and JSON body of an immediate response.
pub(crate) fn immediate(answer: &ProcessingResponse) -> Option<(i32, serde_json::Value)> {
    match answer.response.as_ref()? {
        Response::ImmediateResponse(r) => Some((
            r.status.map_or(0, |s| s.code),
            serde_json::from_slice(&r.body).unwrap_or(serde_json::Value::Null),
        )),
        _ => None,
    }
}

/// A chat request body.
pub(crate) fn chat(content: &str, stream: bool) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "stream": stream,
        "max_tokens": 4,
    }))
    .unwrap()
}

/// A streamed response's events: `n` tokens, then a usage chunk with `cached` tokens.
pub(crate) fn sse(n: usize, cached: u64) -> Vec<u8> {
    let mut out = String::new();
    for i in 0..n {
        out.push_str(&format!(
            "data: {{\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"t{i}\"}}}}]}}\n\n"
        ));
    }
    out.push_str(&format!(
        "data: {{\"choices\":[],\"usage\":{{\"prompt_tokens\":20,\"completion_tokens\":{n},\"prompt_tokens_details\":{{\"cached_tokens\":{cached}}}}}}}\n\ndata: [DONE]\n\n"
    ));
    out.into_bytes()
}
