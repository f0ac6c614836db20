//! The ext_proc messages the picker reads and writes: header maps in and out, metadata
//! `Struct`s, and the responses (continue, route, streamed body, immediate reply).

use std::collections::HashMap;

use axum::http::{HeaderMap, HeaderName, HeaderValue as HttpHeaderValue};
use envoy_types::pb::envoy::config::core::v3::{
    HeaderMap as EnvoyHeaderMap, HeaderValue, HeaderValueOption, Metadata,
};
use envoy_types::pb::envoy::service::ext_proc::v3::body_mutation::Mutation;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, ImmediateResponse,
    ProcessingResponse, StreamedBodyResponse, TrailersResponse,
};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::google::protobuf::value::Kind;
use envoy_types::pb::google::protobuf::{Struct, Value};
use kvroute_router::http::ApiError;

/// `HeaderValueOption.append_action`: `OVERWRITE_IF_EXISTS_OR_ADD`, so that a client cannot
/// choose its own endpoint by sending the destination header itself.
const OVERWRITE_IF_EXISTS_OR_ADD: i32 = 2;

/// Largest body piece sent back in one streamed response (Envoy recommends at most 64 KiB).
pub(crate) const MAX_CHUNK: usize = 64 * 1024;

/// The value of a header Envoy sent (`raw_value`, or `value` from older Envoys).
fn value_of(header: &HeaderValue) -> &[u8] {
    if header.raw_value.is_empty() {
        header.value.as_bytes()
    } else {
        &header.raw_value
    }
}

/// Envoy's header map as an HTTP header map; pseudo-headers (`:path`, `:method`, ...) and
/// headers that are not valid HTTP are left out (see [`pseudo`]).
pub(crate) fn http_headers(headers: Option<&EnvoyHeaderMap>) -> HeaderMap {
    let mut map = HeaderMap::new();
    for header in headers.map(|h| h.headers.as_slice()).unwrap_or_default() {
        if header.key.starts_with(':') {
            continue;
        }
        if let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(header.key.as_bytes()),
            HttpHeaderValue::from_bytes(value_of(header)),
        ) {
            map.append(name, value);
        }
    }
    map
}

/// A pseudo-header (`:path`, `:method`, `:status`) of Envoy's header map.
pub(crate) fn pseudo(headers: Option<&EnvoyHeaderMap>, name: &str) -> Option<String> {
    headers?
        .headers
        .iter()
        .find(|h| h.key == name)
        .map(|h| String::from_utf8_lossy(value_of(h)).into_owned())
}

/// The strings under `namespace` / `key` of Envoy's metadata: a list of strings, or one string
/// holding a comma-separated list. `None` when the key is absent.
pub(crate) fn metadata_strings(
    metadata: Option<&Metadata>,
    namespace: &str,
    key: &str,
) -> Option<Vec<String>> {
    let value = metadata?.filter_metadata.get(namespace)?.fields.get(key)?;
    let mut out = Vec::new();
    match &value.kind {
        Some(Kind::StringValue(s)) => out.extend(split_list(s)),
        Some(Kind::ListValue(list)) => {
            for v in &list.values {
                if let Some(Kind::StringValue(s)) = &v.kind {
                    out.extend(split_list(s));
                }
            }
        }
        _ => {}
    }
    Some(out)
}

fn split_list(s: &str) -> impl Iterator<Item = String> + '_ {
    s.split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .map(str::to_owned)
}

/// `{namespace: {key: value}}`, the shape of dynamic metadata.
pub(crate) fn namespaced(namespace: &str, key: &str, value: &str) -> Struct {
    let inner = Struct {
        fields: HashMap::from([(
            key.to_owned(),
            Value {
                kind: Some(Kind::StringValue(value.to_owned())),
            },
        )]),
    };
    Struct {
        fields: HashMap::from([(
            namespace.to_owned(),
            Value {
                kind: Some(Kind::StructValue(inner)),
            },
        )]),
    }
}

fn set_header(key: &str, value: &str) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: key.to_owned(),
            raw_value: value.as_bytes().to_vec(),
            ..HeaderValue::default()
        }),
        append_action: OVERWRITE_IF_EXISTS_OR_ADD,
        ..HeaderValueOption::default()
    }
}

/// Where the picker sends a request: the destination header (and its value in the dynamic
/// metadata, the same string), plus headers telling the client and the logs which worker.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Destination {
    /// The header and metadata key (`x-gateway-destination-endpoint`).
    pub(crate) key: String,
    /// The metadata namespace (`envoy.lb`).
    pub(crate) namespace: String,
    /// `ip:port`, or `ip:port,ip:port,...` best first.
    pub(crate) value: String,
    /// Other headers to set on the request (the chosen worker's id).
    pub(crate) extra: Vec<(String, String)>,
}

impl Destination {
    fn common(&self) -> CommonResponse {
        let mut set_headers = vec![set_header(&self.key, &self.value)];
        set_headers.extend(self.extra.iter().map(|(k, v)| set_header(k, v)));
        CommonResponse {
            header_mutation: Some(HeaderMutation {
                set_headers,
                ..HeaderMutation::default()
            }),
            // The route was chosen before the destination was known: choose again.
            clear_route_cache: true,
            ..CommonResponse::default()
        }
    }

    fn metadata(&self) -> Struct {
        namespaced(&self.namespace, &self.key, &self.value)
    }

    /// The request-headers response that routes the request (body not held back, or sent
    /// after: full-duplex streaming and bodyless requests).
    pub(crate) fn on_request_headers(&self) -> ProcessingResponse {
        ProcessingResponse {
            response: Some(Response::RequestHeaders(HeadersResponse {
                response: Some(self.common()),
            })),
            dynamic_metadata: Some(self.metadata()),
            ..ProcessingResponse::default()
        }
    }

    /// The request-body response that routes the request (buffered bodies: the headers wait
    /// for it, so they can still be changed).
    pub(crate) fn on_request_body(&self) -> ProcessingResponse {
        ProcessingResponse {
            response: Some(Response::RequestBody(BodyResponse {
                response: Some(self.common()),
            })),
            dynamic_metadata: Some(self.metadata()),
            ..ProcessingResponse::default()
        }
    }
}

/// Which side of the exchange a message is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Side {
    Request,
    Response,
}

/// "Go on unchanged" for a headers message.
pub(crate) fn headers_continue(side: Side) -> ProcessingResponse {
    let headers = HeadersResponse {
        response: Some(CommonResponse::default()),
    };
    ProcessingResponse {
        response: Some(match side {
            Side::Request => Response::RequestHeaders(headers),
            Side::Response => Response::ResponseHeaders(headers),
        }),
        ..ProcessingResponse::default()
    }
}

/// "Go on unchanged" for a body message (buffered and streamed bodies).
pub(crate) fn body_continue(side: Side) -> ProcessingResponse {
    let body = BodyResponse {
        response: Some(CommonResponse::default()),
    };
    ProcessingResponse {
        response: Some(match side {
            Side::Request => Response::RequestBody(body),
            Side::Response => Response::ResponseBody(body),
        }),
        ..ProcessingResponse::default()
    }
}

/// "Go on unchanged" for a trailers message.
pub(crate) fn trailers_continue(side: Side) -> ProcessingResponse {
    let trailers = TrailersResponse::default();
    ProcessingResponse {
        response: Some(match side {
            Side::Request => Response::RequestTrailers(trailers),
            Side::Response => Response::ResponseTrailers(trailers),
        }),
        ..ProcessingResponse::default()
    }
}

/// Full-duplex streaming: `body` handed back to Envoy unchanged, in pieces of at most
/// [`MAX_CHUNK`]; the last piece carries `end_of_stream`.
pub(crate) fn streamed_body(
    side: Side,
    body: &[u8],
    end_of_stream: bool,
) -> Vec<ProcessingResponse> {
    let piece = |bytes: &[u8], last: bool| {
        let body = BodyResponse {
            response: Some(CommonResponse {
                body_mutation: Some(BodyMutation {
                    mutation: Some(Mutation::StreamedResponse(StreamedBodyResponse {
                        body: bytes.to_vec(),
                        end_of_stream: last && end_of_stream,
                        ..StreamedBodyResponse::default()
                    })),
                }),
                ..CommonResponse::default()
            }),
        };
        ProcessingResponse {
            response: Some(match side {
                Side::Request => Response::RequestBody(body),
                Side::Response => Response::ResponseBody(body),
            }),
            ..ProcessingResponse::default()
        }
    };
    if body.is_empty() {
        return vec![piece(body, true)];
    }
    let count = body.len().div_ceil(MAX_CHUNK);
    body.chunks(MAX_CHUNK)
        .enumerate()
        .map(|(i, bytes)| piece(bytes, i + 1 == count))
        .collect()
}

/// Envoy answers the client with `status` and `body` (JSON) at once; nothing goes upstream.
pub(crate) fn immediate_json(
    status: u16,
    body: &serde_json::Value,
    details: &str,
) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(Response::ImmediateResponse(ImmediateResponse {
            status: Some(HttpStatus {
                code: i32::from(status),
            }),
            headers: Some(HeaderMutation {
                set_headers: vec![set_header("content-type", "application/json")],
                ..HeaderMutation::default()
            }),
            body: serde_json::to_vec(body).unwrap_or_default(),
            details: details.to_owned(),
            ..ImmediateResponse::default()
        })),
        ..ProcessingResponse::default()
    }
}

/// The client gets `error` at once, in OpenAI's error shape, with `Retry-After` when retrying
/// later is sound; `details` is Envoy's response-code detail for its access log.
pub(crate) fn immediate(error: &ApiError) -> ProcessingResponse {
    let mut response = immediate_json(error.status.as_u16(), &error.body(), "kvroute_epp");
    if let (Some(retry), Some(Response::ImmediateResponse(reply))) =
        (error.retry_after, response.response.as_mut())
        && let Some(headers) = reply.headers.as_mut()
    {
        let secs = retry.as_secs().max(1).to_string();
        headers.set_headers.push(set_header("retry-after", &secs));
    }
    response
}

#[cfg(test)]
mod tests {
    use envoy_types::pb::google::protobuf::ListValue;

    use super::*;

    fn metadata(namespace: &str, key: &str, value: Kind) -> Metadata {
        Metadata {
            filter_metadata: HashMap::from([(
                namespace.to_owned(),
                Struct {
                    fields: HashMap::from([(key.to_owned(), Value { kind: Some(value) })]),
                },
            )]),
            ..Metadata::default()
        }
    }

    #[test]
    fn a_subset_hint_is_read_as_a_list_or_a_comma_separated_string() {
        let list = metadata(
            "envoy.lb.subset_hint",
            "x-gateway-destination-endpoint-subset",
            Kind::ListValue(ListValue {
                values: vec![
                    Value {
                        kind: Some(Kind::StringValue("10.0.0.1:80".into())),
                    },
                    Value {
                        kind: Some(Kind::StringValue("10.0.0.2:80".into())),
                    },
                ],
            }),
        );
        let got = metadata_strings(
            Some(&list),
            "envoy.lb.subset_hint",
            "x-gateway-destination-endpoint-subset",
        );
        assert_eq!(got, Some(vec!["10.0.0.1:80".into(), "10.0.0.2:80".into()]));
        let string = metadata(
            "envoy.lb",
            "x-gateway-destination-endpoint-served",
            Kind::StringValue("10.0.0.3:80, 10.0.0.4:80".into()),
        );
        let got = metadata_strings(
            Some(&string),
            "envoy.lb",
            "x-gateway-destination-endpoint-served",
        );
        assert_eq!(got, Some(vec!["10.0.0.3:80".into(), "10.0.0.4:80".into()]));
        assert_eq!(metadata_strings(Some(&string), "envoy.lb", "other"), None);
        assert_eq!(metadata_strings(None, "envoy.lb", "x"), None);
    }

    #[test]
    fn a_large_body_goes_back_in_pieces_and_only_the_last_ends_the_stream() {
        let body = vec![b'x'; MAX_CHUNK * 2 + 10];
        let pieces = streamed_body(Side::Request, &body, true);
        assert_eq!(pieces.len(), 3);
        let ends: Vec<bool> = pieces
            .iter()
            .map(|p| match &p.response {
                Some(Response::RequestBody(b)) => match b
                    .response
                    .as_ref()
                    .and_then(|c| c.body_mutation.as_ref())
                    .and_then(|m| m.mutation.as_ref())
                {
                    Some(Mutation::StreamedResponse(s)) => s.end_of_stream,
                    _ => panic!("not a streamed body"),
                },
                _ => panic!("not a request body response"),
            })
            .collect();
        assert_eq!(ends, vec![false, false, true]);
    }

    #[test]
    fn the_destination_overwrites_a_client_supplied_header_and_names_it_in_the_metadata() {
        let d = Destination {
            key: "x-gateway-destination-endpoint".into(),
            namespace: "envoy.lb".into(),
            value: "10.0.0.1:8000".into(),
            extra: vec![],
        };
        let r = d.on_request_headers();
        let Some(Response::RequestHeaders(h)) = &r.response else {
            panic!("not a headers response")
        };
        let common = h.response.as_ref().unwrap();
        assert!(common.clear_route_cache);
        let set = &common.header_mutation.as_ref().unwrap().set_headers[0];
        assert_eq!(set.append_action, OVERWRITE_IF_EXISTS_OR_ADD);
        assert_eq!(set.header.as_ref().unwrap().raw_value, b"10.0.0.1:8000");
        let md = metadata_strings(
            Some(&Metadata {
                filter_metadata: r
                    .dynamic_metadata
                    .unwrap()
                    .fields
                    .into_iter()
                    .filter_map(|(k, v)| match v.kind {
                        Some(Kind::StructValue(s)) => Some((k, s)),
                        _ => None,
                    })
                    .collect(),
                ..Metadata::default()
            }),
            "envoy.lb",
            "x-gateway-destination-endpoint",
        );
        assert_eq!(md, Some(vec!["10.0.0.1:8000".into()]));
    }
}
