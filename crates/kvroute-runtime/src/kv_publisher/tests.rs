use kvroute_protocols::kv_events::KvCacheEventData;

use super::*;

fn ids(events: &[RouterEvent]) -> Vec<u64> {
    events.iter().map(|e| e.event.event_id).collect()
}

/// Publishes `published` events into a ring of `capacity`, then asks for `from..=to`.
fn check(capacity: usize, published: u64, (from, to): (u64, u64), expect: Result<Vec<u64>, &str>) {
    let publisher = KvEventPublisher::new(1, capacity);
    for _ in 0..published {
        publisher.publish(0, KvCacheEventData::Cleared);
    }
    let got = publisher
        .range(from, to)
        .map(|e| ids(&e))
        .map_err(|e| e.to_string());
    match expect {
        Ok(expect) => assert_eq!(got, Ok(expect)),
        Err(fragment) => {
            let error = got.unwrap_err();
            assert!(
                error.contains(fragment),
                "{error:?} should mention {fragment:?}"
            );
        }
    }
}

#[test]
fn ranges_come_from_the_ring() {
    check(4, 0, (0, 5), Ok(vec![]));
    check(4, 3, (0, 2), Ok(vec![0, 1, 2]));
    check(4, 3, (1, 1), Ok(vec![1]));
    check(4, 3, (2, 99), Ok(vec![2]));
    check(4, 3, (3, 99), Ok(vec![]));
    check(4, 10, (6, 9), Ok(vec![6, 7, 8, 9]));
    check(4, 10, (5, 9), Err("holds events 6..=9"));
    check(4, 10, (9, 8), Err("expected from <= to"));
    check(1, 10, (9, 9), Ok(vec![9]));
}

#[test]
fn ids_increase_by_one_and_the_last_is_reported() {
    let publisher = KvEventPublisher::new(7, 2);
    assert_eq!(publisher.last_event_id(), None);
    let a = publisher.publish(2, KvCacheEventData::Cleared);
    let b = publisher.clone().publish(3, KvCacheEventData::Cleared);
    assert_eq!(
        (a.event.event_id, b.event.event_id),
        (0, 1),
        "clones share one counter"
    );
    assert_eq!((a.worker_id, b.event.dp_rank), (7, 3));
    assert_eq!(publisher.last_event_id(), Some(1));
}

#[test]
fn a_dump_carries_the_id_read_before_the_engine_was_asked() {
    let publisher = KvEventPublisher::new(7, 8);
    publisher.publish(0, KvCacheEventData::Cleared);
    let dump = publisher.dump_with(|| {
        // An event published while the engine builds its dump is after the dump's id.
        publisher.publish(0, KvCacheEventData::Cleared);
        vec![KvCacheEvent {
            event_id: 999,
            data: KvCacheEventData::Cleared,
            dp_rank: 1,
        }]
    });
    assert_eq!(dump.last_event_id, Some(0));
    assert_eq!(ids(&dump.events), vec![0]);
    assert_eq!(
        (dump.events[0].worker_id, dump.events[0].event.dp_rank),
        (7, 1)
    );
}

/// Publishes `published` events into a ring of `capacity`, subscribes from `from`, publishes two
/// more, and returns the backlog's ids then the live ids (or the error's message).
fn check_subscribe(
    capacity: usize,
    published: u64,
    from: Option<u64>,
    expect: Result<(Vec<u64>, Vec<u64>), &str>,
) {
    let publisher = KvEventPublisher::new(1, capacity);
    for _ in 0..published {
        publisher.publish(0, KvCacheEventData::Cleared);
    }
    let got = publisher.subscribe(from).map_err(|e| e.to_string());
    match (got, expect) {
        (Ok((backlog, mut live)), Ok((expect_backlog, expect_live))) => {
            publisher.publish(0, KvCacheEventData::Cleared);
            publisher.publish(0, KvCacheEventData::Cleared);
            let live_ids: Vec<u64> = std::iter::from_fn(|| live.try_recv().ok())
                .map(|e| e.event.event_id)
                .collect();
            assert_eq!((ids(&backlog), live_ids), (expect_backlog, expect_live));
        }
        (Err(error), Err(fragment)) => {
            assert!(
                error.contains(fragment),
                "{error:?} should mention {fragment:?}"
            );
        }
        (got, expect) => panic!("got {got:?}, expected {expect:?}"),
    }
}

#[test]
fn subscribers_get_the_backlog_then_every_later_event() {
    check_subscribe(4, 0, None, Ok((vec![], vec![0, 1])));
    check_subscribe(4, 0, Some(0), Ok((vec![], vec![0, 1])));
    check_subscribe(4, 3, None, Ok((vec![], vec![3, 4])));
    check_subscribe(4, 3, Some(1), Ok((vec![1, 2], vec![3, 4])));
    check_subscribe(4, 3, Some(3), Ok((vec![], vec![3, 4])));
    check_subscribe(4, 3, Some(7), Ok((vec![], vec![3, 4])));
    check_subscribe(4, 10, Some(6), Ok((vec![6, 7, 8, 9], vec![10, 11])));
    check_subscribe(4, 10, Some(5), Err("holds events 6..=9"));
}

mod tracking {
    use kvroute_protocols::kv_events::{
        ExternalSequenceBlockHash as H, KvCacheRemoveData, KvCacheStoreData,
        KvCacheStoredBlockData, LocalBlockHash, StorageTier,
    };

    use super::*;

    fn stored(parent: Option<u64>, blocks: &[u64]) -> KvCacheEventData {
        KvCacheEventData::Stored(KvCacheStoreData {
            parent_hash: parent.map(H),
            blocks: blocks
                .iter()
                .map(|&b| KvCacheStoredBlockData {
                    block_hash: H(b),
                    tokens_hash: LocalBlockHash(b * 10),
                })
                .collect(),
        })
    }

    /// (tier, dp rank, block, parent) of every dumped block, in dump order.
    fn dumped(publisher: &KvEventPublisher) -> Vec<(StorageTier, u32, u64, Option<u64>)> {
        publisher
            .dump_with(|| panic!("a tracking publisher never asks the engine"))
            .events
            .iter()
            .map(|e| match &e.event.data {
                KvCacheEventData::Stored(s) => {
                    assert_eq!(s.blocks.len(), 1);
                    assert_eq!(s.blocks[0].tokens_hash.0, s.blocks[0].block_hash.0 * 10);
                    (
                        e.storage_tier,
                        e.event.dp_rank,
                        s.blocks[0].block_hash.0,
                        s.parent_hash.map(|h| h.0),
                    )
                }
                other => panic!("a dump holds only stored blocks, got {other:?}"),
            })
            .collect()
    }

    #[test]
    fn a_tracking_publisher_dumps_what_its_events_left_held_parents_first() {
        let publisher = KvEventPublisher::tracking_blocks(3, 2);
        publisher.publish(0, stored(None, &[1, 2, 3]));
        publisher.publish(1, stored(None, &[7]));
        publisher.publish_tier(0, StorageTier::HostPinned, stored(None, &[1]));
        publisher.publish(0, stored(Some(2), &[4]));
        publisher.publish(
            0,
            KvCacheEventData::Removed(KvCacheRemoveData {
                block_hashes: vec![H(3)],
            }),
        );
        // The ring keeps only two events; the dump still has everything.
        let dump = publisher.dump_with(Vec::new);
        assert_eq!(dump.last_event_id, Some(4));
        assert!(dump.events.iter().all(|e| e.event.event_id == 4));
        assert_eq!(
            dumped(&publisher),
            vec![
                (StorageTier::Device, 0, 1, None),
                (StorageTier::Device, 0, 2, Some(1)),
                (StorageTier::Device, 1, 7, None),
                (StorageTier::HostPinned, 0, 1, None),
                (StorageTier::Device, 0, 4, Some(2)),
            ]
        );
        assert_eq!(publisher.tracked_blocks(), Some(5));
        // Clearing a lane drops only that lane.
        publisher.publish(0, KvCacheEventData::Cleared);
        assert_eq!(
            dumped(&publisher),
            vec![
                (StorageTier::Device, 1, 7, None),
                (StorageTier::HostPinned, 0, 1, None)
            ]
        );
        assert_eq!(publisher.tracked_blocks(), Some(2));
    }

    #[test]
    fn a_plain_publisher_dumps_the_engine_and_tracks_nothing() {
        let publisher = KvEventPublisher::new(3, 8);
        publisher.publish(0, stored(None, &[1]));
        assert_eq!(publisher.tracked_blocks(), None);
        assert!(publisher.dump_with(Vec::new).events.is_empty());
    }
}
