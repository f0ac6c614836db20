//! Picks workers with the cost model: cache overlap (from an indexer) weighed against each
//! worker's load, then tracks a request's load from routing to completion.
//!
//! Run with `cargo run -p kvroute-scheduler --example select_worker`.

use std::time::Duration;

use kvroute_protocols::WorkerWithDpRank;
use kvroute_scheduler::{
    NewRequest, RequestId, Scheduler, SchedulerConfig, SelectRequest, WorkerSpec,
};
use rand::SeedableRng;
use rand::rngs::StdRng;

const BLOCK_SIZE: u32 = 16;

fn main() {
    let mut scheduler = Scheduler::new(SchedulerConfig::new(BLOCK_SIZE)).expect("valid config");
    for id in [1, 2] {
        scheduler
            .add_worker(&WorkerSpec::new(id))
            .expect("new worker");
    }
    // Temperature 0 (the default) picks the cheapest worker; the RNG only breaks exact ties.
    let mut rng = StdRng::seed_from_u64(7);
    let now = Duration::ZERO;
    let (w1, w2) = (
        WorkerWithDpRank::from_worker_id(1),
        WorkerWithDpRank::from_worker_id(2),
    );

    // An 8-block prompt whose first 6 blocks worker 2 already holds (the indexer says so).
    let prompt: Vec<u64> = (100..108).collect();
    let overlaps = [(w2, 6)];
    let request = SelectRequest::new(8 * u64::from(BLOCK_SIZE), &prompt, &overlaps);
    let decision = scheduler
        .select(&request, &mut rng)
        .expect("a worker is eligible");
    for candidate in decision.candidates {
        println!("{candidate}");
    }
    let chosen = decision.chosen;
    println!("cached prefix wins: worker {}\n", chosen.worker);
    assert_eq!(chosen.worker, w2);

    // Selection records nothing; the caller adds the request once it is sent.
    scheduler
        .add_request(
            &NewRequest {
                id: RequestId(1),
                worker: chosen.worker,
                isl_tokens: 8 * u64::from(BLOCK_SIZE),
                block_hashes: &prompt,
                overlap_blocks: chosen.overlap_blocks,
                expected_output_tokens: Some(64),
            },
            now,
        )
        .expect("request added");

    // A long prompt nobody holds goes to the idle worker: worker 2 now carries request 1's load.
    let other: Vec<u64> = (500..532).collect();
    let request = SelectRequest::new(32 * u64::from(BLOCK_SIZE), &other, &[]);
    let decision = scheduler
        .select(&request, &mut rng)
        .expect("a worker is eligible");
    for candidate in decision.candidates {
        println!("{candidate}");
    }
    println!(
        "no overlap anywhere, load decides: worker {}\n",
        decision.chosen.worker
    );
    assert_eq!(decision.chosen.worker, w1);

    // Request 1 runs to completion; afterwards no load is left anywhere.
    scheduler
        .mark_prefill_completed(RequestId(1))
        .expect("active");
    scheduler
        .add_output_tokens(RequestId(1), 64)
        .expect("active");
    let load = scheduler.worker_load(w2).expect("registered");
    println!("worker 2 while decoding: {load:?}");
    assert_eq!((load.active_requests, load.prefill_tokens), (1, 0));
    scheduler.free(RequestId(1)).expect("active");
    println!(
        "after free: {} active requests",
        scheduler.active_requests()
    );
    assert_eq!(scheduler.active_requests(), 0);
    assert_eq!(
        scheduler.worker_load(w2).expect("registered").decode_blocks,
        0.0
    );
}
