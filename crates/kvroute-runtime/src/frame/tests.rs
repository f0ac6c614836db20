use super::*;

fn check(raw: &[u8], expect: Result<(Kind, u64, &[u8]), &str>) {
    let got = Frame::parse(BytesMut::from(raw));
    match (got, expect) {
        (Ok(f), Ok((kind, stream, body))) => {
            assert_eq!((f.kind, f.stream, &f.body[..]), (kind, stream, body))
        }
        (Err(e), Err(fragment)) => assert!(
            e.to_string().contains(fragment),
            "{e} should mention {fragment:?}"
        ),
        (got, expect) => panic!("{raw:?}: got {got:?}, expected {expect:?}"),
    }
}

#[test]
fn frames_parse_or_are_refused_with_a_reason() {
    check(&[0x83, 5, 0, 0, 0, 0, 0, 0, 0], Ok((Kind::End, 5, &[])));
    check(
        &[0x02, 1, 1, 0, 0, 0, 0, 0, 0, 9, 9],
        Ok((Kind::Request, 257, &[9, 9])),
    );
    check(&[0x02, 1, 1], Err("shorter than the 9-byte header"));
    check(&[], Err("shorter"));
    check(
        &[0x7f, 0, 0, 0, 0, 0, 0, 0, 0],
        Err("unknown frame kind 0x7f"),
    );
}

#[test]
fn encoded_frames_round_trip_and_respect_the_limit() {
    let f = encode(Kind::Reply, 42, &(7u64, "x".to_owned()), 1024).unwrap();
    let parsed = Frame::parse(BytesMut::from(&f[..])).unwrap();
    assert_eq!((parsed.kind, parsed.stream), (Kind::Reply, 42));
    assert_eq!(
        decode::<(u64, String)>(&parsed.body, 1024),
        Ok((7, "x".to_owned()))
    );
    assert!(
        decode::<(u64, String)>(&[1, 2, 3], 1024).is_err(),
        "truncated bodies are refused"
    );
    match encode(Kind::Item, 1, &vec![0u8; 2000], 1024) {
        Err(RequestError::FrameTooLarge { max: 1024, .. }) => {}
        other => panic!("expected FrameTooLarge, got {other:?}"),
    }
    let body = kvroute_protocols::codec::encode(&(1u32, "y".to_owned())).unwrap();
    assert_eq!(
        decode::<(u32, String)>(&body, 1024),
        Ok((1, "y".to_owned())),
        "bodies agree with protocols' codec"
    );
}

#[test]
fn hellos_are_checked() {
    assert_eq!(check_hello(&hello_body(&[7; 16])), Ok([7; 16]));
    assert_eq!(PROTOCOL_VERSION, 5);
    assert!(check_hello(b"KVRT\x05\x00").unwrap_err().contains("nonce"));
    for (older_or_newer, named) in [
        (b"KVRT\x04\x00", "version 4"),
        (b"KVRT\x06\x00", "version 6"),
    ] {
        assert!(
            check_hello(older_or_newer).unwrap_err().contains(named),
            "{named} is refused by name"
        );
    }
    assert!(check_hello(b"HTTP/1").unwrap_err().contains("magic"));
    assert_eq!(cancel_kind(&[1]), Ok(CancelKind::Kill));
    assert!(cancel_kind(&[1, 0]).is_err());
}
