//! Event-id gap detection through the index.

use kvroute_indexer::{EventGap, KvIndex};
use kvroute_protocols::WorkerWithDpRank;
use kvroute_protocols::kv_events::{KvCacheEvent, KvCacheEventData, RouterEvent, StorageTier};

fn cleared(worker: u64, dp_rank: u32, event_id: u64) -> RouterEvent {
    RouterEvent {
        worker_id: worker,
        storage_tier: StorageTier::Device,
        event: KvCacheEvent {
            event_id,
            data: KvCacheEventData::Cleared,
            dp_rank,
        },
    }
}

/// Feeds (worker, rank, id) triples and lists the gaps reported.
fn check(ids: &[(u64, u32, u64)], expect: &[(u64, u32, std::ops::Range<u64>)]) {
    let mut index = KvIndex::new();
    let got: Vec<EventGap> = ids
        .iter()
        .filter_map(|&(w, dp, id)| index.apply_event(&cleared(w, dp, id)).gap)
        .collect();
    let expect: Vec<EventGap> = expect
        .iter()
        .map(|(w, dp, r)| EventGap {
            worker: WorkerWithDpRank::new(*w, *dp),
            missing: r.clone(),
        })
        .collect();
    assert_eq!(got, expect);
}

#[test]
fn in_order_streams_have_no_gaps() {
    check(
        &[(1, 0, 5), (1, 0, 6), (2, 0, 0), (1, 0, 7), (2, 0, 1)],
        &[],
    );
}

#[test]
fn a_skip_reports_the_missing_range() {
    check(
        &[(1, 0, 0), (1, 0, 1), (1, 0, 4), (1, 0, 5)],
        &[(1, 0, 2..4)],
    );
}

#[test]
fn ranks_are_tracked_separately() {
    check(
        &[(1, 0, 0), (1, 1, 0), (1, 1, 3), (1, 0, 1)],
        &[(1, 1, 1..3)],
    );
}

#[test]
fn late_events_are_applied_and_counted_not_reported() {
    let mut index = KvIndex::new();
    for id in [0, 3, 1, 2, 4] {
        let _ = index.apply_event(&cleared(1, 0, id));
    }
    assert_eq!(index.late_events(), 2);
    assert_eq!(index.gaps_detected(), 1);
}

#[test]
fn removing_a_worker_forgets_its_ids() {
    let mut index = KvIndex::new();
    let _ = index.apply_event(&cleared(1, 0, 10));
    index.remove_worker(1);
    // A restarted worker counting from 0 again is not a gap.
    assert_eq!(index.apply_event(&cleared(1, 0, 0)).gap, None);
}
