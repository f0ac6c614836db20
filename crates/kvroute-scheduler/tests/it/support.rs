//! Shared helpers.

use std::time::Duration;

use kvroute_protocols::WorkerWithDpRank;
use kvroute_scheduler::{NewRequest, RequestId, Scheduler, SchedulerConfig, WorkerSpec};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

pub(crate) const BS: u32 = 16;

pub(crate) fn w(id: u64) -> WorkerWithDpRank {
    WorkerWithDpRank::from_worker_id(id)
}

pub(crate) fn rng() -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(7)
}

/// A scheduler with workers `0..n`, one rank each, block size [`BS`].
pub(crate) fn scheduler(n: u64) -> Scheduler {
    scheduler_with(SchedulerConfig::new(BS), (0..n).map(WorkerSpec::new))
}

pub(crate) fn scheduler_with(
    config: SchedulerConfig,
    specs: impl IntoIterator<Item = WorkerSpec>,
) -> Scheduler {
    let mut s = Scheduler::new(config).expect("valid config");
    for spec in specs {
        s.add_worker(&spec).expect("fresh worker");
    }
    s
}

/// Block hashes `base .. base + n`.
pub(crate) fn blocks(base: u64, n: u64) -> Vec<u64> {
    (base..base + n).collect()
}

/// Adds request `id` on `worker` with these blocks (prompt = full blocks), no overlap.
pub(crate) fn add(s: &mut Scheduler, id: u64, worker: WorkerWithDpRank, hashes: &[u64]) {
    s.add_request(
        &NewRequest {
            id: RequestId(id),
            worker,
            isl_tokens: hashes.len() as u64 * u64::from(BS),
            block_hashes: hashes,
            overlap_blocks: 0,
            expected_output_tokens: None,
        },
        Duration::ZERO,
    )
    .expect("request added");
}
