use super::{SseDecoder, SseError, SseEvent};

/// Feeds `input` in pieces of `split` bytes (every split point must give the same events) and
/// checks the events, each written `data=...`, `error=...` or `ERR=...`.
fn check(input: &str, expect: &[&str]) {
    for split in [1, 2, 3, 7, input.len().max(1)] {
        let mut decoder = SseDecoder::default();
        let mut got = Vec::new();
        for piece in input.as_bytes().chunks(split) {
            decoder.push(piece);
            while let Some(event) = decoder.next_event() {
                got.push(show(event));
            }
        }
        while let Some(event) = decoder.finish() {
            got.push(show(event));
        }
        assert_eq!(got, expect, "input {input:?} split every {split} bytes");
    }
}

fn show(event: Result<SseEvent, SseError>) -> String {
    match event {
        Ok(SseEvent::Data(d)) => format!("data={d}"),
        Ok(SseEvent::Error(e)) => format!("error={e}"),
        Err(e) => format!("ERR={e:?}"),
    }
}

#[test]
fn data_lines_and_done() {
    check(
        "data: {\"a\":1}\n\ndata: {\"b\":2}\n\ndata: [DONE]\n\n",
        &["data={\"a\":1}", "data={\"b\":2}", "data=[DONE]"],
    );
}

#[test]
fn crlf_and_no_space_after_colon() {
    check("data:{\"a\":1}\r\n\r\n", &["data={\"a\":1}"]);
}

#[test]
fn multi_line_data_is_joined() {
    check("data: a\ndata: b\n\n", &["data=a\nb"]);
}

#[test]
fn comments_and_unknown_fields_are_skipped() {
    check(
        ": ping\n\nid: 7\nretry: 10\ndata: x\n\n: ping\n\n",
        &["data=x"],
    );
}

#[test]
fn llamacpp_error_field_is_kept() {
    check(
        "data: {\"content\":\"a\"}\n\nerror: {\"code\":500,\"message\":\"boom\"}\n\n",
        &[
            "data={\"content\":\"a\"}",
            "error={\"code\":500,\"message\":\"boom\"}",
        ],
    );
}

#[test]
fn error_event_makes_its_data_an_error() {
    check(
        "event: error\ndata: {\"m\":1}\n\ndata: y\n\n",
        &["error={\"m\":1}", "data=y"],
    );
}

#[test]
fn unterminated_last_event_is_dispatched_at_the_end() {
    check("data: a\n\ndata: b", &["data=a", "data=b"]);
    check("data: a\n\ndata: b\n", &["data=a", "data=b"]);
}

#[test]
fn invalid_utf8_is_an_error() {
    let mut decoder = SseDecoder::default();
    decoder.push(b"data: \xff\n\n");
    assert_eq!(decoder.next_event(), Some(Err(SseError::NotUtf8)));
}
