use super::{merge_families, prometheus_text};

fn check(first: &str, second: &str, expect: &str) {
    assert_eq!(merge_families(first, second), expect);
}

const DECODE: &str = "\
# HELP r_requests Requests.
# TYPE r_requests counter
r_requests_total{router=\"decode\"} 3
# HELP r_finished Finished.
# TYPE r_finished counter
# HELP r_active Active.
# TYPE r_active gauge
r_active{router=\"decode\",worker=\"2\",dp_rank=\"0\"} 1
# EOF
";

const PREFILL: &str = "\
# HELP r_requests Requests.
# TYPE r_requests counter
r_requests_total{router=\"prefill\"} 5
# HELP r_finished Finished.
# TYPE r_finished counter
r_finished_total{router=\"prefill\",outcome=\"ok\"} 4
# HELP r_active Active.
# TYPE r_active gauge
r_active{router=\"prefill\",worker=\"1\",dp_rank=\"0\"} 0
# EOF
";

#[test]
fn every_sample_of_both_texts_joins_its_family_once() {
    // Router-wide and per-worker series alike; a family empty in the first text still gets the
    // second's samples; metadata once; one `# EOF`.
    check(
        DECODE,
        PREFILL,
        "\
# HELP r_requests Requests.
# TYPE r_requests counter
r_requests_total{router=\"decode\"} 3
r_requests_total{router=\"prefill\"} 5
# HELP r_finished Finished.
# TYPE r_finished counter
r_finished_total{router=\"prefill\",outcome=\"ok\"} 4
# HELP r_active Active.
# TYPE r_active gauge
r_active{router=\"decode\",worker=\"2\",dp_rank=\"0\"} 1
r_active{router=\"prefill\",worker=\"1\",dp_rank=\"0\"} 0
# EOF
",
    );
}

#[test]
fn an_empty_text_leaves_the_other_as_it_is() {
    check(DECODE, "# EOF\n", DECODE);
    check("# EOF\n", PREFILL, PREFILL);
    check("", "", "# EOF\n");
}

#[test]
fn families_only_the_second_text_has_follow_the_firsts() {
    let first = "# HELP a A.\n# TYPE a gauge\na 1\n# EOF\n";
    let second = "# HELP b B.\n# TYPE b gauge\nb 2\n# HELP a A.\n# TYPE a gauge\na 3\n# EOF\n";
    check(
        first,
        second,
        "# HELP a A.\n# TYPE a gauge\na 1\na 3\n# HELP b B.\n# TYPE b gauge\nb 2\n# EOF\n",
    );
}

#[test]
fn prometheus_text_names_counters_by_their_samples_and_drops_what_0_0_4_cannot_read() {
    let open = "\
# HELP r_requests Requests.
# TYPE r_requests counter
r_requests_total 3
r_requests_created 1700000000.0
# HELP r_ttft_seconds TTFT.
# TYPE r_ttft_seconds histogram
# UNIT r_ttft_seconds seconds
r_ttft_seconds_sum 0.5
r_ttft_seconds_count 1
r_ttft_seconds_bucket{le=\"+Inf\"} 1
r_ttft_seconds_created 1700000000.0
# HELP r_active Active.
# TYPE r_active gauge
r_active{worker=\"2\"} 1
# EOF
";
    let expect = "\
# HELP r_requests_total Requests.
# TYPE r_requests_total counter
r_requests_total 3
# HELP r_ttft_seconds TTFT.
# TYPE r_ttft_seconds histogram
r_ttft_seconds_sum 0.5
r_ttft_seconds_count 1
r_ttft_seconds_bucket{le=\"+Inf\"} 1
# HELP r_active Active.
# TYPE r_active gauge
r_active{worker=\"2\"} 1
";
    assert_eq!(prometheus_text(open), expect);
}
