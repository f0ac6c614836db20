//! Index snapshots: what is restored equals what was saved, bad snapshots change nothing, and a
//! worker's lives are told apart by the first event id it announces.

use kvroute_indexer::hash::{HashSalt, compute_block_hashes};
use kvroute_protocols::WorkerWithDpRank;
use kvroute_protocols::kv_events::{
    ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheRemoveData, KvCacheStoreData,
    KvCacheStoredBlockData, RouterEvent, StorageTier,
};
use kvroute_scheduler::WorkerSpec;

use crate::{IndexSnapshot, KvMode, KvRouterCore, RouterConfig, SnapshotError};

const BS: u32 = 4;

fn core(workers: &[u64]) -> KvRouterCore {
    let mut core = KvRouterCore::new(RouterConfig::new(BS)).unwrap();
    for &id in workers {
        core.add_worker(&WorkerSpec::new(id).with_dp_ranks(0, 2), KvMode::Events)
            .unwrap();
    }
    core
}

/// `Stored` for every full block of `tokens`, engine ids `base + i`, on `tier` and `dp_rank`.
fn stored(worker: u64, event_id: u64, tokens: &[u32], base: u64, tier: StorageTier) -> RouterEvent {
    let local = compute_block_hashes(tokens, BS as usize, &HashSalt::default());
    RouterEvent {
        worker_id: worker,
        storage_tier: tier,
        event: KvCacheEvent {
            event_id,
            dp_rank: u32::from(tier != StorageTier::Device),
            data: KvCacheEventData::Stored(KvCacheStoreData {
                parent_hash: None,
                blocks: local
                    .iter()
                    .enumerate()
                    .map(|(i, &h)| KvCacheStoredBlockData {
                        block_hash: ExternalSequenceBlockHash(base + i as u64),
                        tokens_hash: h,
                    })
                    .collect(),
            }),
        },
    }
}

fn removed(worker: u64, event_id: u64, blocks: &[u64]) -> RouterEvent {
    RouterEvent {
        worker_id: worker,
        storage_tier: StorageTier::Device,
        event: KvCacheEvent {
            event_id,
            dp_rank: 0,
            data: KvCacheEventData::Removed(KvCacheRemoveData {
                block_hashes: blocks
                    .iter()
                    .map(|&b| ExternalSequenceBlockHash(b))
                    .collect(),
            }),
        },
    }
}

fn tokens(seed: u32, len: u32) -> Vec<u32> {
    (0..len).map(|i| seed * 10_000 + i).collect()
}

/// Three workers with shared and private prefixes, two tiers, two ranks, and removals.
fn busy_core() -> KvRouterCore {
    let mut core = core(&[1, 2, 3]);
    let shared = tokens(1, 64);
    for worker in 1..=3u64 {
        let mut id = 100 * worker;
        core.apply_event(&stored(worker, id, &shared, 1_000, StorageTier::Device));
        id += 1;
        let own = [shared.clone(), tokens(worker as u32 + 10, 32)].concat();
        core.apply_event(&stored(
            worker,
            id,
            &own,
            5_000 * worker,
            StorageTier::Device,
        ));
        id += 1;
        core.apply_event(&stored(worker, id, &own, 9_000, StorageTier::HostPinned));
        id += 1;
        core.apply_event(&removed(worker, id, &[5_000 * worker + 23]));
    }
    core
}

#[test]
fn a_restored_snapshot_holds_the_same_blocks_answers_and_event_ids() {
    let source = busy_core();
    let snapshot = source.snapshot(42);
    assert_eq!(snapshot.sequence, 42);
    assert_eq!(snapshot.workers.len(), 3);
    let decoded = IndexSnapshot::decode(&snapshot.encode()).expect("round trip");
    assert_eq!(decoded, snapshot);

    let mut restored = KvRouterCore::new(RouterConfig::new(BS)).unwrap();
    let blocks = restored.restore(&decoded).unwrap();
    assert_eq!(blocks, snapshot.blocks());
    assert!(blocks > 60, "{blocks} blocks");
    assert!(restored.with_index(|a| source.with_index(|b| a.same_content(b))));
    for worker in 1..=3 {
        assert_eq!(
            restored.expected_event_id(worker),
            source.expected_event_id(worker),
            "worker {worker}"
        );
    }
    // The same questions get the same answers, device and host tier alike.
    for probe in [
        tokens(1, 64),
        [tokens(1, 64), tokens(12, 32)].concat(),
        tokens(7, 16),
    ] {
        let local = compute_block_hashes(&probe, BS as usize, &HashSalt::default());
        assert_eq!(
            restored.with_index(|i| i.find_matches(&local)),
            source.with_index(|i| i.find_matches(&local))
        );
    }
    // Later events continue where the snapshot stopped: in order, no gap, none late.
    let next = restored.expected_event_id(2).unwrap();
    assert_eq!(
        restored.apply_event(&stored(
            2,
            next,
            &tokens(40, 8),
            70_000,
            StorageTier::Device
        )),
        None
    );
    assert_eq!(restored.stats().gaps_detected, 0);
}

#[test]
fn a_snapshot_skips_workers_not_registered_or_in_approximate_mode() {
    let mut source = busy_core();
    source
        .add_worker(&WorkerSpec::new(9), KvMode::Approximate)
        .unwrap();
    // Events of a worker discovery has not listed yet are neither indexed nor snapshotted.
    source.apply_event(&stored(8, 0, &tokens(3, 16), 1, StorageTier::Device));
    let ids: Vec<u64> = source
        .snapshot(1)
        .workers
        .iter()
        .map(|w| w.worker_id)
        .collect();
    assert_eq!(ids, vec![1, 2, 3]);
}

#[test]
fn a_bad_snapshot_is_refused_whole_and_changes_nothing() {
    let source = busy_core();
    let bytes = source.snapshot(7).encode();
    let mut target = core(&[1]);
    target.apply_event(&stored(1, 0, &tokens(5, 16), 1, StorageTier::Device));
    let before = target.with_index(|i| i.dump().count());

    assert!(matches!(
        IndexSnapshot::decode(b"not a snapshot"),
        Err(SnapshotError::Format { .. })
    ));
    let truncated = IndexSnapshot::decode(&bytes[..bytes.len() / 2]);
    assert!(
        matches!(truncated, Err(SnapshotError::Corrupt(_))),
        "{truncated:?}"
    );
    let mut other = source.snapshot(7);
    other.block_size = 16;
    let error = target.restore(&other).unwrap_err();
    assert_eq!(
        error,
        SnapshotError::BlockSize {
            snapshot: 16,
            router: BS
        }
    );
    assert!(error.to_string().contains("16 tokens per block"), "{error}");
    assert_eq!(target.with_index(|i| i.dump().count()), before);
    assert_eq!(target.expected_event_id(1), Some(1));
}

#[test]
fn a_workers_new_life_replaces_the_old_one_and_its_current_life_is_kept() {
    let source = busy_core();
    let mut core = KvRouterCore::new(RouterConfig::new(BS)).unwrap();
    core.restore(&source.snapshot(3)).unwrap();
    let worker_blocks = |core: &KvRouterCore, id: u64| {
        core.with_index(|i| {
            i.block_count(WorkerWithDpRank::from_worker_id(id), StorageTier::Device)
        })
    };
    let held = worker_blocks(&core, 1);
    assert!(held > 0);

    // Worker 1 is the life the snapshot knew (its events started at 100): kept, no gap.
    core.add_worker(&WorkerSpec::new(1).with_dp_ranks(0, 2), KvMode::Events)
        .unwrap();
    assert_eq!(core.expect_events_from(1, 100), None);
    assert_eq!(worker_blocks(&core, 1), held);
    assert_eq!(core.expected_event_id(1), Some(104));

    // Worker 2 restarted since (a new life from 1,000,000): its old blocks go, and its events
    // are expected from the new base; the old life's stragglers are late.
    core.add_worker(&WorkerSpec::new(2).with_dp_ranks(0, 2), KvMode::Events)
        .unwrap();
    assert_eq!(core.expect_events_from(2, 1_000_000), None);
    assert_eq!(worker_blocks(&core, 2), 0);
    assert_eq!(core.expected_event_id(2), Some(1_000_000));
    let late = core.stats().events_late;
    core.apply_event(&stored(2, 204, &tokens(9, 16), 1, StorageTier::Device));
    assert_eq!(core.stats().events_late, late + 1);
    assert_eq!(
        core.apply_event(&stored(
            2,
            1_000_000,
            &tokens(9, 16),
            1,
            StorageTier::Device
        )),
        None
    );
    assert_eq!(worker_blocks(&core, 2), 4);

    // Worker 4's events before it joined are skipped (not indexed: nobody serves it yet).
    let skipped = core.stats().events_unregistered;
    core.apply_event(&stored(4, 50, &tokens(4, 16), 1, StorageTier::Device));
    assert_eq!(core.stats().events_unregistered, skipped + 1);
    assert_eq!(worker_blocks(&core, 4), 0);
    // Registered, its event 57 is applied before the router learns its life began at 50 (the
    // discovery task adds the worker and states its base under two locks): the ids before 57
    // come back as a gap to repair.
    core.add_worker(&WorkerSpec::new(4), KvMode::Events)
        .unwrap();
    core.apply_event(&stored(4, 57, &tokens(4, 16), 1, StorageTier::Device));
    let gap = core.expect_events_from(4, 50).expect("a gap");
    assert_eq!(gap.missing, 50..57);
    // Asked again (a re-listing), nothing more is missing.
    assert_eq!(core.expect_events_from(4, 50), None);

    // Worker 3 left while the router was down: forgotten after discovery's first listing.
    assert_eq!(core.forget_unregistered(), 1);
    assert_eq!(worker_blocks(&core, 3), 0);
    assert_eq!(core.expected_event_id(3), None);
}

/// The cut is the snapshot: events queued after it (the routing lock let go) are neither in it
/// nor lost, and routing's queries go on while it is read.
#[test]
fn events_queued_after_a_snapshot_cut_wait_for_it_and_are_not_in_it() {
    let mut core = busy_core();
    let expected = core.snapshot(7);
    let cut = core.snapshot_cut(7);
    // After the cut, worker 1 evicts and stores: queued on the shared index, applied by nobody
    // while the cut is held (the event loop's apply returns at once).
    let later = [
        removed(1, 104, &[5_000 + 22]),
        stored(1, 105, &tokens(77, 16), 20_000, StorageTier::Device),
    ];
    for event in &later {
        assert_eq!(core.queue_event(event.clone()), None);
        core.shared_index().apply_queued();
    }
    // A route's query still runs against the index as of the cut.
    let prompt = compute_block_hashes(&tokens(77, 16), BS as usize, &HashSalt::default());
    assert_eq!(core.shared_index().find_matches(&prompt).max_score(), 0);
    let snapshot = cut.finish();
    assert_eq!(snapshot, expected, "the cut moved");
    // Finishing let the queued events in.
    assert_eq!(core.shared_index().find_matches(&prompt).max_score(), 4);
    let mut replayed = busy_core();
    for event in &later {
        replayed.apply_event(event);
    }
    assert!(core.with_index(|a| replayed.with_index(|b| a.same_content(b))));
}
