//! One ext_proc stream, which is one HTTP request passing through Envoy: its request side is
//! read and routed here, its response side followed in [`response`].
//!
//! The order of the answers is the protocol's: for each side, headers, then body, then
//! trailers. With the request body in `FULL_DUPLEX_STREAMED` mode the headers' answer waits
//! for the whole body (the destination depends on the prompt), then the body goes back
//! unchanged; in `BUFFERED` mode the headers are answered at once and the destination rides
//! on the body's answer (Envoy holds the headers until then).

mod response;
mod route;

use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse,
};
use kvroute_protocols::PreprocessedRequest;
use kvroute_router::PickedRequest;
use kvroute_router::http::{AdmissionPermit, ApiError};

use crate::follow::Follower;
use crate::messages::{
    self, Destination, Side, body_continue, headers_continue, immediate, streamed_body,
    trailers_continue,
};
use crate::metrics::Handled;
use crate::picker::Picker;

/// How Envoy sends a body (its `BodySendMode`, from the stream's `protocol_config`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BodyMode {
    /// Not sent.
    None,
    /// Sent in pieces, each answered before the headers are released: cannot be routed on.
    Streamed,
    /// Sent whole, the headers held until the answer.
    Buffered,
    /// Sent in pieces without waiting; the answer streams the body back.
    FullDuplex,
}

impl BodyMode {
    fn from_envoy(mode: i32) -> Self {
        match BodySendMode::try_from(mode) {
            Ok(BodySendMode::None) => Self::None,
            Ok(BodySendMode::Streamed) => Self::Streamed,
            Ok(BodySendMode::FullDuplexStreamed) => Self::FullDuplex,
            // Buffered, buffered partial, and values newer than this picker.
            _ => Self::Buffered,
        }
    }
}

/// A request routed and in flight: what its response is reported to.
struct Live {
    /// The router's record of it (`None` for passthrough requests, which hold no load).
    picked: Option<PickedRequest>,
    /// Its admission slot, held until the response ends.
    _permit: Option<AdmissionPermit>,
    /// The endpoint picked first.
    endpoint: String,
    /// The routed request, kept until the response's headers when Envoy was given fallback
    /// endpoints: if Envoy reports another endpoint served it, the request's load is recorded
    /// again on that endpoint's worker ([`Exchange::on_served`]).
    request: Option<PreprocessedRequest>,
    /// The response's status, once its headers passed.
    status: Option<u16>,
    /// Whether Envoy answered itself (no upstream response: the engine was not reached).
    local_reply: bool,
    follower: Option<Follower>,
    first_bytes: bool,
}

/// One ext_proc stream's state.
pub(crate) struct Exchange {
    picker: Picker,
    request_mode: BodyMode,
    response_mode: BodyMode,
    path: String,
    method: String,
    headers: axum::http::HeaderMap,
    /// The endpoints the data plane allows (`None`: any).
    subset: Option<Vec<String>>,
    body: Vec<u8>,
    /// Whether the request side has been answered with its destination.
    routed: bool,
    live: Option<Live>,
    /// An immediate response went out: Envoy ends the stream; nothing more is answered.
    finished: bool,
}

impl Exchange {
    pub(crate) fn new(picker: Picker) -> Self {
        picker.metrics().stream_opened();
        Self {
            picker,
            // Until the stream's protocol_config says otherwise (Envoys before 1.34 send none).
            request_mode: BodyMode::Buffered,
            response_mode: BodyMode::Buffered,
            path: String::new(),
            method: String::new(),
            headers: axum::http::HeaderMap::new(),
            subset: None,
            body: Vec::new(),
            routed: false,
            live: None,
            finished: false,
        }
    }

    /// Whether an immediate response ended the exchange.
    pub(crate) fn finished(&self) -> bool {
        self.finished
    }

    /// The answers to one message from Envoy, in order.
    pub(crate) async fn on_message(
        &mut self,
        message: ProcessingRequest,
    ) -> Vec<ProcessingResponse> {
        if self.finished {
            return Vec::new();
        }
        if let Some(config) = &message.protocol_config {
            self.request_mode = BodyMode::from_envoy(config.request_body_mode);
            self.response_mode = BodyMode::from_envoy(config.response_body_mode);
        }
        let config = self.picker.config();
        if let Some(subset) = messages::metadata_strings(
            message.metadata_context.as_ref(),
            &config.subset_namespace,
            &config.subset_key,
        ) {
            self.subset = Some(subset);
        }
        if let Some(served) = messages::metadata_strings(
            message.metadata_context.as_ref(),
            &config.destination_namespace,
            &config.served_key,
        ) {
            self.on_served(served).await;
        }
        match message.request {
            Some(Request::RequestHeaders(headers)) => self.on_request_headers(headers).await,
            Some(Request::RequestBody(body)) => self.on_request_body(body).await,
            Some(Request::RequestTrailers(_)) => self.on_request_trailers().await,
            Some(Request::ResponseHeaders(headers)) => self.on_response_headers(headers),
            Some(Request::ResponseBody(body)) => self.on_response_body(body),
            Some(Request::ResponseTrailers(_)) => self.on_response_trailers(),
            None => Vec::new(),
        }
    }

    async fn on_request_headers(&mut self, headers: HttpHeaders) -> Vec<ProcessingResponse> {
        let map = headers.headers.as_ref();
        self.path = messages::pseudo(map, ":path").unwrap_or_default();
        self.method = messages::pseudo(map, ":method").unwrap_or_default();
        self.headers = messages::http_headers(map);
        let bodyless = headers.end_of_stream || self.request_mode == BodyMode::None;
        if bodyless {
            return match self.route_bodyless() {
                Ok(destination) => vec![destination.on_request_headers()],
                Err(error) => self.refuse(&error),
            };
        }
        match self.request_mode {
            // The destination waits for the body.
            BodyMode::FullDuplex => Vec::new(),
            BodyMode::Buffered => vec![headers_continue(Side::Request)],
            BodyMode::Streamed | BodyMode::None => self.refuse(&ApiError::internal(
                "kvroute epp routes on the request body: configure Envoy's ext_proc filter with \
                 request_body_mode FULL_DUPLEX_STREAMED (with request_trailer_mode SEND) or \
                 BUFFERED, not STREAMED",
            )),
        }
    }

    async fn on_request_body(&mut self, body: HttpBody) -> Vec<ProcessingResponse> {
        if self.routed {
            // More of a body already routed (only when trailers ended it): pass it on.
            return match self.request_mode {
                BodyMode::FullDuplex => {
                    streamed_body(Side::Request, &body.body, body.end_of_stream)
                }
                _ => vec![body_continue(Side::Request)],
            };
        }
        let limit = self.picker.state().config().max_body_bytes;
        if self.body.len() + body.body.len() > limit {
            return self.refuse(&ApiError::too_large(
                format!("request body too large: it exceeds max_body_bytes ({limit} bytes)"),
                "request_too_large",
            ));
        }
        self.body.extend_from_slice(&body.body);
        // A buffered body arrives whole in one message (trailers may still follow).
        let complete = body.end_of_stream || self.request_mode != BodyMode::FullDuplex;
        if !complete {
            return Vec::new();
        }
        self.route_and_answer(body.end_of_stream).await
    }

    async fn on_request_trailers(&mut self) -> Vec<ProcessingResponse> {
        let mut out = Vec::new();
        if !self.routed {
            // The trailers end a body whose last piece did not say so.
            out = self.route_and_answer(false).await;
            if self.finished {
                return out;
            }
        }
        out.push(trailers_continue(Side::Request));
        out
    }

    /// Routes the whole body and answers: the destination, and in full-duplex mode the body
    /// handed back (ending the stream when `end_of_stream`).
    async fn route_and_answer(&mut self, end_of_stream: bool) -> Vec<ProcessingResponse> {
        let destination = match self.route_body().await {
            Ok(destination) => destination,
            Err(reply) => return self.finish_with(reply),
        };
        self.routed = true;
        match self.request_mode {
            BodyMode::FullDuplex => {
                let body = std::mem::take(&mut self.body);
                let mut out = vec![destination.on_request_headers()];
                out.extend(streamed_body(Side::Request, &body, end_of_stream));
                out
            }
            _ => {
                self.body = Vec::new();
                vec![destination.on_request_body()]
            }
        }
    }

    /// Answers with `error` at once, in OpenAI's shape.
    fn refuse(&mut self, error: &ApiError) -> Vec<ProcessingResponse> {
        self.picker.metrics().on_handled(Handled::Refused);
        self.finish_with(immediate(error))
    }

    /// Ends the exchange with the immediate response `reply`.
    fn finish_with(&mut self, reply: ProcessingResponse) -> Vec<ProcessingResponse> {
        use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response;
        if let Some(Response::ImmediateResponse(r)) = &reply.response {
            let status = r.status.map_or(0, |s| s.code);
            self.picker
                .metrics()
                .on_immediate(u16::try_from(status).unwrap_or(0));
        }
        self.finished = true;
        vec![reply]
    }

    /// Sets up following the response of a request sent to `destination`.
    fn start(
        &mut self,
        destination: &Destination,
        picked: Option<PickedRequest>,
        permit: Option<AdmissionPermit>,
        request: Option<PreprocessedRequest>,
    ) {
        self.live = Some(Live {
            picked,
            _permit: permit,
            request,
            endpoint: destination
                .value
                .split(',')
                .next()
                .unwrap_or_default()
                .to_owned(),
            status: None,
            local_reply: false,
            follower: None,
            first_bytes: false,
        });
    }
}

impl Drop for Exchange {
    fn drop(&mut self) {
        self.picker.metrics().stream_closed();
        if let Some(live) = self.live.take()
            && live.picked.is_some()
        {
            // The stream closed before the response ended: the client went away, or Envoy
            // reset the request. Dropping the record frees its load as cancelled.
            self.picker.metrics().on_response("cancelled");
        }
    }
}
