//! How disaggregated serving splits one client request: which prefill workers discovery lists
//! (and which offer a bootstrap room), the prefill-phase request (one output token, pinned to the
//! prefill worker) and the decode-phase request (the handoff, and no credit for cached overlap,
//! since the prompt's KV arrives from the prefill worker).
//!
//! Run with `cargo run -p kvroute-prefill --example disagg_requests`.

use std::collections::BTreeMap;

use kvroute_prefill::PrefillFleet;
use kvroute_prefill::request::{Handoff, decode_request, prefill_request};
use kvroute_protocols::{
    BOOTSTRAP_HOST_KEY, BOOTSTRAP_PORT_KEY, BootstrapInfo, PreprocessedRequest, WorkerWithDpRank,
};
use kvroute_runtime::{InstanceInfo, WorkerRole};

fn main() {
    // A discovery snapshot: one decode worker and two prefill workers, one with a bootstrap
    // server (SGLang-style KV transfer) and one without (the prefill-result path).
    let mut instances = BTreeMap::new();
    let decode = InstanceInfo::new(1, "10.0.0.1:7000", 16).with_role(WorkerRole::Decode);
    let mut with_room = InstanceInfo::new(2, "10.0.0.2:7000", 16).with_role(WorkerRole::Prefill);
    with_room
        .metadata
        .insert(BOOTSTRAP_HOST_KEY.into(), "10.0.0.2".into());
    with_room
        .metadata
        .insert(BOOTSTRAP_PORT_KEY.into(), "8998".into());
    let plain = InstanceInfo::new(3, "10.0.0.3:7000", 16).with_role(WorkerRole::Prefill);
    for info in [decode, with_room, plain] {
        instances.insert(info.id, info);
    }
    let fleet = PrefillFleet::from_instances(&instances);
    for worker in fleet.workers() {
        println!(
            "prefill worker {}: bootstrap {:?}",
            worker.id, worker.bootstrap
        );
    }
    assert_eq!(fleet.len(), 2);
    assert!(fleet.get(2).and_then(|w| w.bootstrap.as_ref()).is_some());
    assert!(fleet.get(3).and_then(|w| w.bootstrap.as_ref()).is_none());

    // The client's request, as the frontend tokenized it.
    let mut request = PreprocessedRequest::new("llama", (0..64).collect());
    request.stop_conditions.max_tokens = Some(256);

    // Prefill on worker 2, through its bootstrap room.
    let endpoint = fleet
        .get(2)
        .and_then(|w| w.bootstrap.clone())
        .expect("advertised");
    let room = BootstrapInfo {
        bootstrap_host: endpoint.host,
        bootstrap_port: endpoint.port,
        bootstrap_room: 42,
    };
    let target = WorkerWithDpRank::from_worker_id(2);
    let prefill = prefill_request(&request, Some(target), Some(room.clone()));
    let routing = prefill.routing.as_ref().expect("pinned");
    println!(
        "prefill request: max_tokens {:?}, pinned to worker {:?}, room {:?}",
        prefill.stop_conditions.max_tokens, routing.prefill_worker_id, prefill.bootstrap_info
    );
    assert_eq!(prefill.stop_conditions.max_tokens, Some(1));
    assert_eq!(routing.prefill_worker_id, Some(2));

    // Decode starts at once, meeting the prefill worker in the same room.
    let decode = decode_request(request, Some(Handoff::Bootstrap(room.clone())), None);
    let overrides = decode
        .router_config_override
        .as_ref()
        .expect("decode overrides");
    println!(
        "decode request: max_tokens {:?}, room {:?}, overlap credit {:?}",
        decode.stop_conditions.max_tokens, decode.bootstrap_info, overrides.overlap_score_credit
    );
    assert_eq!(decode.stop_conditions.max_tokens, Some(256));
    assert_eq!(decode.bootstrap_info, Some(room));
    assert_eq!(overrides.overlap_score_credit, Some(0.0));
}
