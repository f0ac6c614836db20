use super::decode_override;

#[test]
fn decode_override_matches_the_prefill_routers() {
    assert_eq!(
        decode_override(),
        kvroute_prefill::request::decode_override(None)
    );
}
