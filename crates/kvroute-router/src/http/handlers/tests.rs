use super::merge_worker_series;

fn check(main: &str, extra: &str, expect: &str) {
    assert_eq!(merge_worker_series(main, extra), expect);
}

#[test]
fn per_worker_series_of_the_other_router_join_their_family() {
    let main = "\
# HELP r_requests Requests.
# TYPE r_requests counter
r_requests_total 3
# HELP r_active Active.
# TYPE r_active gauge
r_active{worker=\"2\",dp_rank=\"0\"} 1
# EOF
";
    let extra = "\
# HELP r_requests Requests.
# TYPE r_requests counter
r_requests_total 5
# HELP r_active Active.
# TYPE r_active gauge
r_active{worker=\"1\",dp_rank=\"0\"} 0
# EOF
";
    // The router-wide counter stays main's; worker 1's gauge joins its family before `# EOF`.
    check(
        main,
        extra,
        "\
# HELP r_requests Requests.
# TYPE r_requests counter
r_requests_total 3
# HELP r_active Active.
# TYPE r_active gauge
r_active{worker=\"2\",dp_rank=\"0\"} 1
r_active{worker=\"1\",dp_rank=\"0\"} 0
# EOF
",
    );
    check(main, "# EOF\n", main);
}
