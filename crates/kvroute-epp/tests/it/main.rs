//! Integration tests of the endpoint picker: a gRPC client plays Envoy (the ext_proc messages
//! Envoy sends in each body mode) against a real picker over a fleet of simulated workers.

mod support;

use std::time::Duration;

use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response;
use kvroute_epp::EppConfig;
use kvroute_router::http::{AdmissionConfig, HttpConfig};
use support::{
    Harness, Mode, chat, destination, endpoint_of, eventually, immediate, list_metadata, sse,
    streamed,
};

fn run<F: std::future::Future<Output = ()>>(f: F) {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
        .block_on(f);
}

/// One whole request in full-duplex mode: picks, hands the body back, follows the response.
/// Returns the endpoint picked.
async fn full_request(h: &Harness, prompt: &str, cached: u64) -> String {
    let mut s = h.stream().await;
    let body = chat(prompt, true);
    s.post_chat(None).await;
    s.request_body(&body[..10], false).await;
    s.request_body(&body[10..], true).await;
    let routed = s.next().await.unwrap();
    let (header, metadata) = destination(&routed).expect("the headers answer routes");
    assert_eq!(
        header, metadata,
        "header and metadata name the same endpoint"
    );
    let (echoed, end) = streamed(&s.next().await.unwrap()).expect("the body comes back");
    assert_eq!((echoed, end), (body, true));
    s.response_headers(200, "text/event-stream", true, None)
        .await;
    let answer = s.next().await.unwrap();
    assert!(matches!(
        answer.response,
        Some(Response::ResponseHeaders(_))
    ));
    let events = sse(3, cached);
    s.response_body(&events[..20], false).await;
    assert_eq!(
        streamed(&s.next().await.unwrap()).unwrap(),
        (events[..20].to_vec(), false)
    );
    s.response_body(&events[20..], true).await;
    assert_eq!(
        streamed(&s.next().await.unwrap()).unwrap(),
        (events[20..].to_vec(), true)
    );
    header
}

#[test]
fn a_streamed_chat_is_routed_passed_through_whole_and_leaves_no_load() {
    run(async {
        let h = Harness::start(3).await;
        let endpoint = full_request(&h, "hello there, a long enough prompt", 0).await;
        assert!((1..=3).any(|id| endpoint == endpoint_of(id)), "{endpoint}");
        h.until_idle().await;
        assert_eq!(h.picker.routed_requests(), 1);
        let metrics = h.picker.metrics_text();
        assert!(
            metrics.contains("kvroute_epp_responses_total{class=\"2xx\"} 1"),
            "{metrics}"
        );
    });
}

#[test]
fn the_same_prompt_goes_back_where_its_cache_is() {
    run(async {
        let h = Harness::start(4).await;
        let prompt = "a system prompt shared by the whole conversation, long enough for blocks";
        let first = full_request(&h, prompt, 0).await;
        h.until_idle().await;
        for _ in 0..3 {
            assert_eq!(full_request(&h, prompt, 16).await, first);
            h.until_idle().await;
        }
    });
}

#[test]
fn a_buffered_body_is_routed_on_the_body_answer() {
    run(async {
        let h = Harness::start(2).await;
        let mut s = h.stream().await;
        s.request_headers("POST", "/v1/completions", &[], false, Mode::Buffered, None)
            .await;
        let first = s.next().await.unwrap();
        assert!(matches!(first.response, Some(Response::RequestHeaders(_))));
        assert_eq!(destination(&first), None, "the headers pass unchanged");
        let body = br#"{"model":"mock","prompt":"buffered prompt","max_tokens":2}"#;
        s.request_body(body, true).await;
        let routed = s.next().await.unwrap();
        assert!(matches!(routed.response, Some(Response::RequestBody(_))));
        assert!(destination(&routed).is_some());
        s.response_headers(200, "application/json", true, None)
            .await;
        s.next().await.unwrap();
        s.response_body(
            br#"{"choices":[{"text":"ok"}],"usage":{"prompt_tokens":3,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":0}}}"#,
            true,
        )
        .await;
        let last = s.next().await.unwrap();
        assert!(matches!(last.response, Some(Response::ResponseBody(_))));
        assert_eq!(
            streamed(&last),
            None,
            "buffered: continue, not a streamed body"
        );
        h.until_idle().await;
    });
}

#[test]
fn bad_requests_are_answered_at_once_in_openai_shape_and_hold_nothing() {
    run(async {
        let h = Harness::start_with(
            2,
            HttpConfig {
                max_body_bytes: 256,
                ..HttpConfig::default()
            },
            EppConfig::default(),
        )
        .await;
        let cases: Vec<(&[u8], i32, &str)> = vec![
            (b"{not json", 400, "invalid_request_error"),
            (
                br#"{"model":"nope","messages":[{"role":"user","content":"x"}]}"#,
                404,
                "model_not_found",
            ),
            (br#"{"model":"mock","messages":[]}"#, 400, "messages"),
        ];
        for (body, status, needle) in cases {
            let mut s = h.stream().await;
            s.post_chat(None).await;
            s.request_body(body, true).await;
            let (code, json) = immediate(&s.next().await.unwrap()).expect("an immediate answer");
            assert_eq!(code, status, "{json}");
            assert!(json["error"]["message"].is_string(), "{json}");
            assert!(json.to_string().contains(needle), "{json}");
            assert!(s.next().await.is_none(), "the picker ends the stream");
        }
        // Over max_body_bytes: refused before the body ends.
        let mut s = h.stream().await;
        s.post_chat(None).await;
        s.request_body(&[b' '; 300], false).await;
        let (code, json) = immediate(&s.next().await.unwrap()).unwrap();
        assert_eq!(code, 413, "{json}");
        // A POST to a routed endpoint without a body.
        let mut s = h.stream().await;
        s.request_headers("POST", "/v1/completions", &[], true, Mode::FullDuplex, None)
            .await;
        let (code, json) = immediate(&s.next().await.unwrap()).unwrap();
        assert_eq!(code, 400, "{json}");
        assert!(
            json.to_string().contains("needs an OpenAI JSON body"),
            "{json}"
        );
        assert!(h.idle());
        assert_eq!(h.picker.routed_requests(), 0);
    });
}

#[test]
fn an_envoy_that_sends_no_body_is_told_how_to_configure_the_filter() {
    run(async {
        let h = Harness::start(2).await;
        let mut s = h.stream().await;
        s.request_headers(
            "POST",
            "/v1/chat/completions",
            &[],
            false,
            Mode::NoBody,
            None,
        )
        .await;
        let (code, json) = immediate(&s.next().await.unwrap()).unwrap();
        assert_eq!(code, 500, "{json}");
        assert!(
            json.to_string()
                .contains("FULL_DUPLEX_STREAMED or BUFFERED"),
            "{json}"
        );
        // A bodyless GET is still routed in that mode.
        let mut s = h.stream().await;
        s.request_headers("GET", "/v1/models", &[], false, Mode::NoBody, None)
            .await;
        assert!(destination(&s.next().await.unwrap()).is_some());
        assert!(h.idle());
    });
}

#[test]
fn the_subset_hint_limits_the_choice_and_an_unknown_subset_is_503() {
    run(async {
        let h = Harness::start(4).await;
        for i in 0..6 {
            let mut s = h.stream().await;
            let hint = list_metadata(
                "envoy.lb.subset_hint",
                "x-gateway-destination-endpoint-subset",
                &[&endpoint_of(2), &endpoint_of(3)],
            );
            s.post_chat(Some(hint)).await;
            s.request_body(&chat(&format!("prompt number {i}"), false), true)
                .await;
            let (endpoint, _) = destination(&s.next().await.unwrap()).unwrap();
            assert!(
                endpoint == endpoint_of(2) || endpoint == endpoint_of(3),
                "{endpoint}"
            );
        }
        h.until_idle().await;
        let mut s = h.stream().await;
        let hint = list_metadata(
            "envoy.lb.subset_hint",
            "x-gateway-destination-endpoint-subset",
            &["192.0.2.1:80"],
        );
        s.post_chat(Some(hint)).await;
        s.request_body(&chat("anything", false), true).await;
        let (code, json) = immediate(&s.next().await.unwrap()).unwrap();
        assert_eq!(code, 503, "{json}");
        assert!(json.to_string().contains("subset hint"), "{json}");
    });
}

#[test]
fn a_stream_closed_mid_response_frees_its_load() {
    run(async {
        let h = Harness::start(2).await;
        let mut s = h.stream().await;
        s.post_chat(None).await;
        s.request_body(&chat("a request the client gives up on", true), true)
            .await;
        s.next().await.unwrap();
        s.next().await.unwrap();
        s.response_headers(200, "text/event-stream", true, None)
            .await;
        s.next().await.unwrap();
        eventually("the request is held", || !h.idle()).await;
        drop(s);
        h.until_idle().await;
        let metrics = h.picker.metrics_text();
        assert!(
            metrics.contains("kvroute_epp_responses_total{class=\"cancelled\"} 1"),
            "{metrics}"
        );
    });
}

#[test]
fn an_engine_envoy_cannot_reach_is_ejected_and_the_next_requests_go_elsewhere() {
    run(async {
        let h = Harness::start(2).await;
        let prompt = "the prompt that keeps going to one engine";
        let first = full_request(&h, prompt, 0).await;
        h.until_idle().await;
        // The engine dies: Envoy answers the next request itself with 503.
        let mut s = h.stream().await;
        s.post_chat(None).await;
        s.request_body(&chat(prompt, true), true).await;
        let (endpoint, _) = destination(&s.next().await.unwrap()).unwrap();
        assert_eq!(endpoint, first);
        s.next().await.unwrap();
        s.response_headers(503, "text/plain", false, None).await;
        s.next().await.unwrap();
        s.response_body(
            b"upstream connect error or disconnect/reset before headers",
            true,
        )
        .await;
        s.next().await.unwrap();
        h.until_idle().await;
        for _ in 0..3 {
            let again = full_request(&h, prompt, 0).await;
            assert_ne!(again, first, "the unreachable engine is avoided");
            h.until_idle().await;
        }
    });
}

#[test]
fn a_request_without_a_body_goes_round_robin_and_holds_no_load() {
    run(async {
        let h = Harness::start(2).await;
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..4 {
            let mut s = h.stream().await;
            s.request_headers("GET", "/v1/models", &[], true, Mode::FullDuplex, None)
                .await;
            let (endpoint, _) = destination(&s.next().await.unwrap()).unwrap();
            seen.insert(endpoint);
            assert!(h.idle());
        }
        assert_eq!(seen.len(), 2, "{seen:?}");
        // A pin header picks the worker.
        let mut s = h.stream().await;
        s.request_headers(
            "GET",
            "/v1/models",
            &[("x-worker-instance-id", "2")],
            true,
            Mode::FullDuplex,
            None,
        )
        .await;
        assert_eq!(
            destination(&s.next().await.unwrap()).unwrap().0,
            endpoint_of(2)
        );
    });
}

#[test]
fn when_every_slot_is_taken_the_gateway_sheds_with_429() {
    run(async {
        let http = HttpConfig {
            admission: AdmissionConfig {
                max_in_flight: 1,
                max_queued: 0,
                queue_timeout: Duration::from_millis(100),
                retry_after: Duration::from_secs(1),
            },
            ..HttpConfig::default()
        };
        let h = Harness::start_with(2, http, EppConfig::default()).await;
        let mut held = h.stream().await;
        held.post_chat(None).await;
        held.request_body(&chat("the one in flight", true), true)
            .await;
        held.next().await.unwrap();
        let mut s = h.stream().await;
        s.post_chat(None).await;
        s.request_body(&chat("one too many", true), true).await;
        let (code, json) = immediate(&s.next().await.unwrap()).unwrap();
        assert_eq!(code, 429, "{json}");
        drop(held);
        h.until_idle().await;
    });
}

/// Three workers, each destination naming all three endpoints, best first.
async fn three_with_fallbacks() -> Harness {
    let epp = EppConfig {
        fallback_endpoints: 3,
        ..EppConfig::default()
    };
    Harness::start_with(3, HttpConfig::default(), epp).await
}

#[test]
fn fallback_endpoints_name_the_next_best_after_the_pick() {
    run(async {
        let h = three_with_fallbacks().await;
        let mut s = h.stream().await;
        s.post_chat(None).await;
        s.request_body(&chat("fallbacks", false), true).await;
        let (header, metadata) = destination(&s.next().await.unwrap()).unwrap();
        assert_eq!(header, metadata);
        let list: Vec<&str> = header.split(',').collect();
        assert_eq!(list.len(), 3, "{header}");
        let mut sorted = list.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), 3, "each endpoint once: {header}");
    });
}

#[test]
fn trailers_end_a_body_whose_last_piece_did_not() {
    run(async {
        let h = Harness::start(2).await;
        let mut s = h.stream().await;
        s.post_chat(None).await;
        let body = chat("with trailers", false);
        s.request_body(&body, false).await;
        s.request_trailers().await;
        assert!(destination(&s.next().await.unwrap()).is_some());
        assert_eq!(streamed(&s.next().await.unwrap()).unwrap(), (body, false));
        let trailers = s.next().await.unwrap();
        assert!(matches!(
            trailers.response,
            Some(Response::RequestTrailers(_))
        ));
    });
}

#[test]
fn the_health_service_reports_liveness_and_readiness() {
    run(async {
        let h = Harness::start(1).await;
        let channel = tonic::transport::Channel::from_shared(format!("http://{}", h.addr))
            .unwrap()
            .connect()
            .await
            .unwrap();
        let mut health = tonic_health::pb::health_client::HealthClient::new(channel);
        for service in ["liveness", "readiness", kvroute_epp::EXT_PROC_SERVICE] {
            let status = health
                .check(tonic_health::pb::HealthCheckRequest {
                    service: service.to_owned(),
                })
                .await
                .unwrap()
                .into_inner()
                .status;
            assert_eq!(
                status,
                tonic_health::pb::health_check_response::ServingStatus::Serving as i32,
                "{service}"
            );
        }
        // The last worker leaves: not ready any more, still alive.
        let mut h = h;
        h.leases.clear();
        eventually("the endpoint table is empty", || {
            h.picker.endpoints().table().is_empty()
        })
        .await;
        tokio::time::sleep(Duration::from_millis(50)).await;
        let status = health
            .check(tonic_health::pb::HealthCheckRequest {
                service: "readiness".to_owned(),
            })
            .await
            .unwrap()
            .into_inner()
            .status;
        assert_eq!(
            status,
            tonic_health::pb::health_check_response::ServingStatus::NotServing as i32
        );
    });
}

/// The worker behind `endpoint_of(id)`.
fn worker_of(endpoint: &str) -> u64 {
    endpoint
        .strip_prefix("10.0.0.")
        .and_then(|rest| rest.split(':').next())
        .and_then(|id| id.parse().ok())
        .unwrap_or_else(|| panic!("not a test endpoint: {endpoint}"))
}

/// Requests in flight on each worker, by id.
fn active_by_worker(h: &Harness) -> Vec<(u64, u64)> {
    h.router.with_core(|core| {
        let mut loads: Vec<_> = core
            .workers()
            .map(|w| (w.worker_id, core.worker_load(w).unwrap().active_requests))
            .collect();
        loads.sort_unstable();
        loads
    })
}

#[test]
fn a_request_envoy_served_from_a_fallback_endpoint_is_loaded_on_that_endpoint() {
    run(async {
        let h = three_with_fallbacks().await;
        let mut s = h.stream().await;
        s.post_chat(None).await;
        let body = chat("served by the second", true);
        s.request_body(&body, true).await;
        let (header, _) = destination(&s.next().await.unwrap()).unwrap();
        let list: Vec<&str> = header.split(',').collect();
        let (first, second) = (worker_of(list[0]), worker_of(list[1]));
        assert_eq!(streamed(&s.next().await.unwrap()).unwrap(), (body, true));
        let on = |w: u64| {
            active_by_worker(&h)
                .into_iter()
                .find(|(id, _)| *id == w)
                .map_or(0, |(_, n)| n)
        };
        assert_eq!((on(first), on(second)), (1, 0), "picked: {header}");
        // Envoy could not reach the first endpoint and says the second served.
        let served = list_metadata(
            kvroute_epp::DESTINATION_NAMESPACE,
            kvroute_epp::SERVED_ENDPOINT_KEY,
            &[list[1]],
        );
        s.response_headers(200, "text/event-stream", true, Some(served))
            .await;
        let answer = s.next().await.unwrap();
        let Some(Response::ResponseHeaders(headers)) = answer.response else {
            panic!("expected the response headers' answer: {answer:?}");
        };
        let set = &headers
            .response
            .unwrap()
            .header_mutation
            .unwrap()
            .set_headers;
        let told = set
            .iter()
            .filter_map(|h| h.header.as_ref())
            .find(|h| h.key == "x-kvroute-worker-instance-id")
            .map(|h| String::from_utf8_lossy(&h.raw_value).into_owned());
        assert_eq!(
            told,
            Some(second.to_string()),
            "the client is told the worker that served it"
        );
        assert_eq!(
            (on(first), on(second)),
            (0, 1),
            "the load moved to the endpoint that served: {:?}",
            active_by_worker(&h)
        );
        let events = sse(3, 0);
        s.response_body(&events, true).await;
        assert_eq!(streamed(&s.next().await.unwrap()).unwrap(), (events, true));
        h.until_idle().await;
        let metrics = h.picker.metrics_text();
        assert!(metrics.contains("served_elsewhere_total 1"), "{metrics}");
    });
}
