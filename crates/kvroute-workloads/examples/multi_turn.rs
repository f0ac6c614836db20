//! A seeded synthetic workload, written as a Mooncake-format trace and read back: the same seed
//! always gives the same requests, later turns of a conversation repeat its earlier full blocks,
//! and the JSONL round trip loses nothing.
//!
//! Run with `cargo run -p kvroute-workloads --example multi_turn`.

use std::collections::HashMap;

use kvroute_workloads::synth::Workload;
use kvroute_workloads::trace;

fn main() -> anyhow::Result<()> {
    let workload = Workload::from_name("multi-turn")?;
    let requests = workload.generate(7);
    assert_eq!(
        requests,
        workload.generate(7),
        "the same seed gives the same workload"
    );
    assert!(!requests.is_empty());

    // A conversation's later turn starts with every full block of its previous one (a partial
    // trailing block gets a fresh id each time it is sent).
    let mut last: HashMap<u64, &[u64]> = HashMap::new();
    let mut continued = 0;
    for r in &requests {
        if let Some(previous) = last.get(&r.session_id) {
            let full = &previous[..previous.len().saturating_sub(1)];
            assert!(
                r.record.hash_ids.starts_with(full),
                "a turn extends its conversation: {previous:?} then {:?}",
                r.record.hash_ids
            );
            continued += 1;
        }
        last.insert(r.session_id, &r.record.hash_ids);
    }
    assert!(continued > 0);

    let jsonl = kvroute_workloads::synth::to_jsonl(&requests);
    let records = trace::parse_jsonl(&jsonl)?;
    assert_eq!(records.len(), requests.len());
    assert!(records.iter().zip(&requests).all(|(a, b)| *a == b.record));
    println!(
        "multi-turn, seed 7: {} requests in {} conversations, {continued} later turns reuse their prefix; \
         the JSONL trace reads back identical",
        requests.len(),
        last.len()
    );
    Ok(())
}
