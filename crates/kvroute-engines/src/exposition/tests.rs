use super::*;

/// Parses `input` and renders each sample as `name{labels} value`, one a line, or the error.
fn check(input: &str, expect: &str) {
    let got = match parse(input) {
        Ok(samples) => samples
            .iter()
            .map(|s| format!("{s} {:?}", s.value))
            .collect::<Vec<_>>()
            .join("\n"),
        Err(e) => format!("error: {e}"),
    };
    assert_eq!(got, expect, "input:\n{input}");
}

#[test]
fn names_with_colons_and_labels() {
    check(
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n\
         # TYPE vllm:num_requests_running gauge\n\
         vllm:num_requests_running{engine=\"0\",model_name=\"Qwen/Qwen3-0.6B\"} 3.0\n",
        "vllm:num_requests_running{engine=\"0\",model_name=\"Qwen/Qwen3-0.6B\"} 3.0",
    );
    check(
        "llamacpp:requests_deferred 2",
        "llamacpp:requests_deferred 2.0",
    );
    check("a_b:c9 1e3\n\n   \n", "a_b:c9 1000.0");
}

#[test]
fn special_values_timestamps_and_exemplars() {
    check(
        "a NaN\nb +Inf\nc -Inf\nd -0.5e-1 1395066363000\ne 1 # {trace_id=\"x\"} 2\n",
        "a NaN\nb inf\nc -inf\nd -0.05\ne 1.0",
    );
}

#[test]
fn label_values_are_unescaped_and_may_hold_braces() {
    check(
        r#"m{a="x\"y",b="c:\\d",c="line\nnext",d="{[]}", } 1"#,
        r#"m{a="x\"y",b="c:\\d",c="line\nnext",d="{[]}"} 1.0"#,
    );
    check(r#"m{} 4"#, "m 4.0");
    check("m{ a = \"1\" } \t 4", "m{a=\"1\"} 4.0");
}

#[test]
fn crlf_line_ends() {
    check("a 1\r\nb 2\r\n", "a 1.0\nb 2.0");
}

#[test]
fn garbage_is_an_error_with_its_line() {
    check(
        "a 1\n<!DOCTYPE html>\n",
        "error: line 2: expected a metric name in `<!DOCTYPE html>`",
    );
    check("a", "error: line 1: expected a value in `a`");
    check("a one", "error: line 1: `one` is not a number in `a one`");
    check(
        "a 0x10",
        "error: line 1: `0x10` is not a number in `a 0x10`",
    );
    check(
        "a{b=\"1\" 2",
        "error: line 1: expected `,` or `}` after label `b` in `a{b=\"1\" 2`",
    );
    check(
        "a{b=1} 2",
        "error: line 1: expected a quoted value for label `b` in `a{b=1} 2`",
    );
    check(
        "a{b=\"open} 2",
        "error: line 1: expected a quoted value for label `b` in `a{b=\"open} 2`",
    );
    check(
        "a 1 later",
        "error: line 1: `later` is not a timestamp in milliseconds in `a 1 later`",
    );
    check(
        "a 1 2 3",
        "error: line 1: unexpected `3` after the timestamp in `a 1 2 3`",
    );
    check(
        "{a=\"1\"} 2",
        "error: line 1: expected a metric name in `{a=\"1\"} 2`",
    );
}

#[test]
fn the_recorded_llamacpp_text_parses() {
    let text = include_str!("../../tests/fixtures/metrics/llamacpp_busy.txt");
    let samples = parse(text).expect("parses");
    assert_eq!(samples.len(), 15);
    assert!(samples.iter().all(|s| s.labels.is_empty()));
}
