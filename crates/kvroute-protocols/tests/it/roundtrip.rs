//! Every wire type survives JSON and bincode unchanged, and JSON never carries a `null` field.

use std::fmt::Debug;

use kvroute_protocols::codec;
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::strategies::*;

/// Fields whose content is opaque JSON or a list with holes: `null` is legitimate inside them.
const OPAQUE: &[&str] = &["extra_args", "disaggregated_params", "tokens"];
/// KV events keep the reference's shape, where a chain's missing parent is an explicit `null`.
const NULLABLE: &[&str] = &["parent_hash"];

fn no_null_fields(v: &Value, path: &str) -> Result<(), TestCaseError> {
    match v {
        Value::Object(map) => {
            for (k, child) in map {
                let nullable = NULLABLE.contains(&k.as_str());
                prop_assert!(
                    nullable || !child.is_null(),
                    "{path}.{k} serialized as null"
                );
                if !OPAQUE.contains(&k.as_str()) {
                    no_null_fields(child, &format!("{path}.{k}"))?;
                }
            }
        }
        Value::Array(items) => {
            for (i, child) in items.iter().enumerate() {
                no_null_fields(child, &format!("{path}[{i}]"))?;
            }
        }
        _ => {}
    }
    Ok(())
}

fn round_trip<T>(value: &T) -> Result<(), TestCaseError>
where
    T: Serialize + DeserializeOwned + PartialEq + Debug,
{
    let json = serde_json::to_string(value).map_err(|e| TestCaseError::fail(e.to_string()))?;
    let back: T =
        serde_json::from_str(&json).map_err(|e| TestCaseError::fail(format!("{e} in {json}")))?;
    prop_assert_eq!(&back, value, "JSON {}", json);
    let tree: Value =
        serde_json::from_str(&json).map_err(|e| TestCaseError::fail(e.to_string()))?;
    no_null_fields(&tree, "")?;

    let frame = codec::encode(value).map_err(|e| TestCaseError::fail(e.to_string()))?;
    let back: T =
        codec::decode(&frame, frame.len()).map_err(|e| TestCaseError::fail(e.to_string()))?;
    prop_assert_eq!(&back, value, "bincode");
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    #[test]
    fn nvext_round_trip(v in nvext()) { round_trip(&v)?; }

    #[test]
    fn agent_hints_round_trip(v in agent_hints()) { round_trip(&v)?; }

    #[test]
    fn session_control_round_trip(v in session_control()) { round_trip(&v)?; }

    #[test]
    fn session_action_round_trip(v in session_action()) { round_trip(&v)?; }

    #[test]
    fn nvext_response_round_trip(v in nvext_response()) { round_trip(&v)?; }

    #[test]
    fn worker_id_info_round_trip(v in worker_id_info()) { round_trip(&v)?; }

    #[test]
    fn timing_info_round_trip(v in timing_info()) { round_trip(&v)?; }

    #[test]
    fn routing_hints_round_trip(v in routing_hints()) { round_trip(&v)?; }

    #[test]
    fn router_config_override_round_trip(v in router_config_override()) { round_trip(&v)?; }

    #[test]
    fn routing_constraints_round_trip(v in routing_constraints()) { round_trip(&v)?; }

    #[test]
    fn preprocessed_request_round_trip(v in preprocessed_request()) { round_trip(&v)?; }

    #[test]
    fn prefill_result_round_trip(v in prefill_result()) { round_trip(&v)?; }

    #[test]
    fn bootstrap_info_round_trip(v in bootstrap_info()) { round_trip(&v)?; }

    #[test]
    fn request_phase_round_trip(v in request_phase()) { round_trip(&v)?; }

    #[test]
    fn engine_output_round_trip(v in engine_output()) { round_trip(&v)?; }

    #[test]
    fn finish_reason_round_trip(v in finish_reason()) { round_trip(&v)?; }

    #[test]
    fn annotated_round_trip(v in annotated_output()) { round_trip(&v)?; }

    #[test]
    fn worker_with_dp_rank_round_trip(v in worker_with_dp_rank()) { round_trip(&v)?; }

    #[test]
    fn worker_load_report_round_trip(v in worker_load_report()) { round_trip(&v)?; }

    #[test]
    fn router_event_round_trip(v in router_event()) { round_trip(&v)?; }

    /// Any prefix of a valid frame is rejected cleanly, never decoded into something else.
    #[test]
    fn truncated_frames_fail(v in preprocessed_request(), cut in any::<prop::sample::Index>()) {
        let frame = codec::encode(&v).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let cut = cut.index(frame.len());
        prop_assert!(codec::decode::<kvroute_protocols::PreprocessedRequest>(&frame[..cut], frame.len()).is_err());
    }
}
