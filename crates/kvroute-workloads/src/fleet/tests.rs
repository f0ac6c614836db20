use kvroute_indexer::KvIndex;
use kvroute_protocols::WorkerWithDpRank;

use super::*;

fn fleet(workers: usize, cache_blocks: usize) -> Fleet {
    Fleet {
        workers,
        block_size: 16,
        cache_blocks,
    }
}

/// Requests sharing prefixes of ids, some longer than their ids cover, some ending mid-block.
fn requests() -> Vec<(usize, Vec<u64>)> {
    (0..40u64)
        .map(|r| {
            let ids: Vec<u64> = (0..1 + r % 5).map(|k| (r % 3) * 100 + k).collect();
            (ids.len() * 64 - (r as usize % 20), ids)
        })
        .collect()
}

#[test]
fn a_real_index_fed_the_recorded_events_gives_every_expected_answer() {
    let requests = requests();
    let recorded = Recorded::simulate(&requests, &fleet(3, 12), 64).expect("valid fleet");
    assert!(
        recorded.removed_blocks > 0,
        "the cache is small enough to evict"
    );
    let mut index = KvIndex::new();
    for op in &recorded.ops {
        match *op {
            Op::Query(r) => {
                let scores = index.find_matches(recorded.query(r));
                for w in 0..recorded.workers {
                    let got = scores.score(WorkerWithDpRank::from_worker_id(w as u64));
                    assert_eq!(
                        got,
                        recorded.expected[r * recorded.workers + w],
                        "request {r}"
                    );
                }
            }
            Op::Event(i) => {
                let outcome = index.apply_event(&recorded.events[i]);
                assert!(outcome.result.is_ok() && outcome.gap.is_none());
            }
        }
    }
    assert_eq!(recorded.requests(), requests.len());
}

#[test]
fn tokens_rebuild_the_hashed_blocks() {
    let requests = requests();
    let recorded = Recorded::simulate(&requests, &fleet(2, 1000), 64).expect("valid fleet");
    let mut tokens = Vec::new();
    for r in 0..recorded.requests() {
        recorded.tokens(r, &mut tokens);
        let hashes = kvroute_indexer::hash::compute_block_hashes(&tokens, 16, &HashSalt::default());
        assert_eq!(hashes, recorded.query(r), "request {r}");
    }
}

#[test]
fn bad_fleets_are_refused() {
    let requests = requests();
    assert_eq!(
        Recorded::simulate(&requests, &fleet(65, 10), 64).unwrap_err(),
        FleetError::Workers(65)
    );
    let err = Recorded::simulate(&requests, &fleet(2, 10), 40).unwrap_err();
    assert_eq!(
        err.to_string(),
        "the trace block size (40) must be a positive multiple of the engine block size (16)"
    );
}
