//! Bounded bincode decoding of request-plane frames. No input may panic or over-allocate; whatever
//! decodes re-encodes to a frame that decodes to the same bytes again.

#![no_main]

use kvroute_protocols::{Annotated, LLMEngineOutput, PreprocessedRequest, codec};
use libfuzzer_sys::fuzz_target;

const LIMIT: usize = 1 << 16;

fn stable<T: serde::Serialize + serde::de::DeserializeOwned>(data: &[u8]) {
    let Ok(value) = codec::decode::<T>(data, LIMIT) else {
        return;
    };
    // Floats may be NaN, so compare encodings rather than values.
    let first = codec::encode(&value).expect("a decoded value encodes");
    let again: T = codec::decode(&first, first.len()).expect("our own frame decodes");
    let second = codec::encode(&again).expect("re-encodes");
    assert_eq!(first, second, "encoding is stable");
}

fuzz_target!(|data: &[u8]| {
    stable::<PreprocessedRequest>(data);
    stable::<Annotated<LLMEngineOutput>>(data);
});
