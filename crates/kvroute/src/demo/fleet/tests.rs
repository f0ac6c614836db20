use super::*;

fn check(text: &str, expect: &[&str]) {
    let got = nonzero_worker_gauges(text);
    let expect: Vec<String> = expect.iter().map(|l| format!("/metrics: {l}")).collect();
    assert_eq!(got, expect, "{text}");
}

#[test]
fn only_nonzero_per_worker_load_gauges_are_reported() {
    check(
        "# HELP kvroute_router_worker_active_requests Requests in flight per worker rank\n\
         kvroute_router_worker_active_requests{worker=\"1\",dp_rank=\"0\"} 0\n\
         kvroute_router_worker_active_requests{worker=\"2\",dp_rank=\"0\"} 3\n\
         kvroute_router_worker_prefill_tokens{worker=\"1\",dp_rank=\"0\"} 0\n\
         kvroute_router_worker_active_blocks{worker=\"1\",dp_rank=\"0\"} 0.0\n\
         kvroute_router_worker_active_blocks{worker=\"2\",dp_rank=\"0\"} 1.5\n\
         kvroute_router_requests_total 12\n",
        &[
            "kvroute_router_worker_active_requests{worker=\"2\",dp_rank=\"0\"} 3",
            "kvroute_router_worker_active_blocks{worker=\"2\",dp_rank=\"0\"} 1.5",
        ],
    );
    // A value that does not parse is not taken for zero.
    check(
        "kvroute_router_worker_prefill_tokens{worker=\"1\",dp_rank=\"0\"} NaN?\n",
        &["kvroute_router_worker_prefill_tokens{worker=\"1\",dp_rank=\"0\"} NaN?"],
    );
    check("kvroute_router_requests_total 5\n", &[]);
}
