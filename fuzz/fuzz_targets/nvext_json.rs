//! JSON decoding of `nvext`, preprocessed requests and the stream envelope, plus validation.
//! No input may panic; whatever decodes must survive a JSON and a bincode round trip unchanged.

#![no_main]

use kvroute_protocols::{
    Annotated, LLMEngineOutput, Limits, NvExt, PreprocessedRequest, codec, from_json,
    parse_nvext_json, parse_request_json,
};
use libfuzzer_sys::fuzz_target;

fn round_trip<T>(value: &T)
where
    T: serde::Serialize + serde::de::DeserializeOwned + PartialEq + std::fmt::Debug,
{
    let json = serde_json::to_vec(value).expect("a decoded value serializes");
    let back: T = from_json(&json).expect("our own JSON decodes");
    assert_eq!(&back, value, "JSON round trip");
    let frame = codec::encode(value).expect("a decoded value encodes");
    let back: T = codec::decode(&frame, frame.len()).expect("our own frame decodes");
    assert_eq!(&back, value, "bincode round trip");
}

fuzz_target!(|data: &[u8]| {
    if let Ok(ext) = parse_nvext_json(data, &Limits::default()) {
        round_trip(&ext);
        ext.validate(&Limits::default())
            .expect("validated once, valid again");
    }
    if let Ok(ext) = NvExt::from_json(data) {
        round_trip(&ext);
    }
    if let Ok(req) = from_json::<PreprocessedRequest>(data) {
        round_trip(&req);
    }
    let _ = parse_request_json(data);
    if let Ok(item) = from_json::<Annotated<LLMEngineOutput>>(data) {
        round_trip(&item);
    }
});
