//! The translator (engine events in, router events out) and the replay frames, without sockets.

use std::sync::Arc;

use bytes::Bytes;
use kvroute_protocols::kv_events::{
    ExternalSequenceBlockHash as H, KvCacheEventData, KvCacheRemoveData, KvCacheStoreData,
    KvCacheStoredBlockData, LocalBlockHash, StorageTier,
};
use kvroute_protocols::zmq_events::{
    BlockExtraKeys, BlockRemoved, BlockStored, EngineEventBatch, EngineKvEvent, MmExtraKey,
};

use super::translate::{Output, Translator, tier};
use super::{BlockHasher, BlockSalt, Counters, ReplayReply, parse_replay_reply};

/// A readable content hash: the token sum, plus 1000 for a LoRA, plus 100 per salt byte.
fn content(tokens: &[u32], lora: Option<&str>, salt: Option<&str>) -> LocalBlockHash {
    LocalBlockHash(
        tokens.iter().map(|&t| u64::from(t)).sum::<u64>()
            + lora.map_or(0, |_| 1000)
            + salt.map_or(0, |s| 100 * s.len() as u64),
    )
}

fn hasher() -> BlockHasher {
    Arc::new(|tokens: &[u32], salt: BlockSalt<'_>| content(tokens, salt.lora_name, salt.cache_salt))
}

fn translator(block_size: Option<u32>, capacity: usize) -> (Translator, Arc<Counters>) {
    let counters = Arc::new(Counters::default());
    let t = Translator::new(hasher(), block_size, capacity, counters.clone());
    (t, counters)
}

/// A two-token-block chain with these engine hashes, continuing `parent`.
fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[u32]) -> BlockStored {
    BlockStored {
        block_hashes: hashes.iter().map(|&h| H(h)).collect(),
        parent_block_hash: parent.map(H),
        token_ids: tokens.to_vec(),
        block_size: 2,
        ..BlockStored::default()
    }
}

fn removed(hashes: &[u64]) -> BlockRemoved {
    BlockRemoved {
        block_hashes: hashes.iter().map(|&h| H(h)).collect(),
        ..BlockRemoved::default()
    }
}

fn salt_keys(salt: &str) -> BlockExtraKeys {
    BlockExtraKeys {
        cache_salt: Some(salt.into()),
        ..BlockExtraKeys::default()
    }
}

fn batch(events: Vec<EngineKvEvent>) -> EngineEventBatch {
    EngineEventBatch {
        ts: 0.0,
        events,
        dp_rank: None,
        errors: Vec::new(),
    }
}

/// `Stored` on dp rank 0, device tier, from `(engine hash, content hash)` pairs.
fn out_stored(parent: Option<u64>, blocks: &[(u64, LocalBlockHash)]) -> Output {
    (
        0,
        StorageTier::Device,
        KvCacheEventData::Stored(KvCacheStoreData {
            parent_hash: parent.map(H),
            blocks: blocks
                .iter()
                .map(|&(h, tokens_hash)| KvCacheStoredBlockData {
                    block_hash: H(h),
                    tokens_hash,
                })
                .collect(),
        }),
    )
}

fn out_removed(hashes: &[u64]) -> Output {
    (
        0,
        StorageTier::Device,
        KvCacheEventData::Removed(KvCacheRemoveData {
            block_hashes: hashes.iter().map(|&h| H(h)).collect(),
        }),
    )
}

/// Feeds each batch in turn and compares everything published with `expect`.
#[track_caller]
fn check(t: &mut Translator, batches: Vec<Vec<EngineKvEvent>>, expect: Vec<Output>) {
    let got: Vec<Output> = batches
        .into_iter()
        .flat_map(|b| t.batch(batch(b)))
        .collect();
    assert_eq!(got, expect);
}

#[test]
fn vllm_cache_salt_on_the_first_block_salts_the_whole_chain() {
    let (mut t, _) = translator(Some(2), 100);
    // vLLM names the salt in the first block's extra keys only.
    let mut first = stored(&[1, 2], None, &[1, 2, 3, 4]);
    first.extra_keys = vec![salt_keys("tenant"), BlockExtraKeys::default()];
    // A later event continues the chain without any salt of its own.
    let continuation = stored(&[3], Some(2), &[5, 6]);
    // The same tokens unsalted are another chain.
    let plain = stored(&[11, 12], None, &[1, 2, 3, 4]);
    let salted = |tokens: &[u32]| content(tokens, None, Some("tenant"));
    check(
        &mut t,
        vec![
            vec![EngineKvEvent::BlockStored(first)],
            vec![EngineKvEvent::BlockStored(continuation)],
            vec![EngineKvEvent::BlockStored(plain)],
        ],
        vec![
            out_stored(None, &[(1, salted(&[1, 2])), (2, salted(&[3, 4]))]),
            out_stored(Some(2), &[(3, salted(&[5, 6]))]),
            out_stored(
                None,
                &[
                    (11, content(&[1, 2], None, None)),
                    (12, content(&[3, 4], None, None)),
                ],
            ),
        ],
    );
}

#[test]
fn an_offloaded_copy_without_extra_keys_takes_the_salt_of_its_device_copy() {
    let (mut t, _) = translator(Some(2), 100);
    let mut gpu = stored(&[1, 2], None, &[1, 2, 3, 4]);
    gpu.extra_keys = vec![salt_keys("tenant"), BlockExtraKeys::default()];
    // vLLM's offloading connector publishes the CPU copy without extra keys.
    let mut cpu = stored(&[1, 2], None, &[1, 2, 3, 4]);
    cpu.medium = Some("CPU".into());
    let salted = |tokens: &[u32]| content(tokens, None, Some("tenant"));
    let got = t.batch(batch(vec![
        EngineKvEvent::BlockStored(gpu),
        EngineKvEvent::BlockStored(cpu),
    ]));
    let (_, tier, data) = &got[1];
    assert_eq!(*tier, StorageTier::HostPinned);
    assert_eq!(
        *data,
        out_stored(None, &[(1, salted(&[1, 2])), (2, salted(&[3, 4]))]).2
    );
}

#[test]
fn sglang_cache_salt_and_lora_name_apply_to_every_block() {
    let (mut t, _) = translator(Some(2), 100);
    let mut first = stored(&[1], None, &[1, 2]);
    first.cache_salt = Some("s".into());
    first.lora_name = Some("adapter".into());
    let mut next = stored(&[2], Some(1), &[3, 4]);
    next.cache_salt = Some("s".into());
    next.lora_name = Some("adapter".into());
    check(
        &mut t,
        vec![vec![
            EngineKvEvent::BlockStored(first),
            EngineKvEvent::BlockStored(next),
        ]],
        vec![
            out_stored(None, &[(1, content(&[1, 2], Some("adapter"), Some("s")))]),
            out_stored(
                Some(1),
                &[(2, content(&[3, 4], Some("adapter"), Some("s")))],
            ),
        ],
    );
}

#[test]
fn salt_is_forgotten_with_its_block() {
    let (mut t, counters) = translator(Some(2), 100);
    let mut first = stored(&[1], None, &[1, 2]);
    first.extra_keys = vec![salt_keys("tenant")];
    t.batch(batch(vec![
        EngineKvEvent::BlockStored(first),
        EngineKvEvent::BlockRemoved(removed(&[1])),
    ]));
    // The parent is gone: a continuation of it would be rejected by the index, so it is skipped.
    check(
        &mut t,
        vec![vec![EngineKvEvent::BlockStored(stored(
            &[2],
            Some(1),
            &[3, 4],
        ))]],
        vec![],
    );
    assert_eq!(counters.orphan_blocks.load(super::Ordering::Relaxed), 1);
    assert_eq!(counters.tracked_blocks.load(super::Ordering::Relaxed), 0);
}

#[test]
fn blocks_with_media_or_unknown_extra_keys_end_the_published_chain() {
    let (mut t, counters) = translator(Some(2), 100);
    let mut event = stored(&[1, 2, 3], None, &[1, 2, 3, 4, 5, 6]);
    event.extra_keys = vec![
        BlockExtraKeys::default(),
        BlockExtraKeys {
            mm: vec![MmExtraKey {
                identifier: "img".into(),
                offset: 0,
            }],
            ..BlockExtraKeys::default()
        },
        BlockExtraKeys::default(),
    ];
    // A continuation of the skipped part is skipped too.
    let continuation = stored(&[4], Some(3), &[7, 8]);
    let mut embeds = stored(&[5], None, &[9, 9]);
    embeds.extra_keys = vec![BlockExtraKeys {
        prompt_embeds: vec![vec![1, 2]],
        ..BlockExtraKeys::default()
    }];
    check(
        &mut t,
        vec![vec![
            EngineKvEvent::BlockStored(event),
            EngineKvEvent::BlockStored(continuation),
            EngineKvEvent::BlockStored(embeds),
        ]],
        vec![out_stored(None, &[(1, content(&[1, 2], None, None))])],
    );
    let load = |c: &super::AtomicU64| c.load(super::Ordering::Relaxed);
    assert_eq!(load(&counters.unhashable_blocks), 3);
    assert_eq!(load(&counters.orphan_blocks), 1);
}

#[test]
fn placeholders_and_numbered_loras_are_unhashable() {
    let (mut t, counters) = translator(Some(2), 100);
    // vLLM's offloading placeholder: no tokens, block size 0.
    let mut placeholder = stored(&[1], None, &[]);
    placeholder.block_size = 0;
    placeholder.medium = Some("CPU".into());
    // vLLM 0.10 names a LoRA by number only.
    let mut numbered = stored(&[2], None, &[1, 2]);
    numbered.lora_id = Some(3);
    check(
        &mut t,
        vec![vec![
            EngineKvEvent::BlockStored(placeholder),
            EngineKvEvent::BlockStored(numbered),
        ]],
        vec![],
    );
    assert_eq!(counters.unhashable_blocks.load(super::Ordering::Relaxed), 2);
    assert_eq!(
        counters
            .block_size_mismatches
            .load(super::Ordering::Relaxed),
        0
    );
}

#[test]
fn only_the_first_whole_prefix_group_feeds_the_index() {
    let (mut t, counters) = translator(Some(2), 100);
    let in_group = |mut s: BlockStored, group: u32, kind: &str| {
        s.group_idx = Some(group);
        s.kv_cache_spec_kind = Some(kind.into());
        EngineKvEvent::BlockStored(s)
    };
    let removed_from = |hashes: &[u64], group: u32| {
        let mut r = removed(hashes);
        r.group_idx = Some(group);
        EngineKvEvent::BlockRemoved(r)
    };
    // Gemma-like: group 0 is sliding window, group 1 full attention; both store the same hashes.
    check(
        &mut t,
        vec![
            vec![
                removed_from(&[1], 1), // before any store: no group feeds yet
                in_group(stored(&[1], None, &[1, 2]), 0, "sliding_window"),
                in_group(stored(&[1], None, &[1, 2]), 1, "full_attention"),
                in_group(stored(&[1], None, &[1, 2]), 2, "full_attention"),
            ],
            // The sliding window drops the block; the full-attention group still holds it.
            vec![removed_from(&[1], 0), removed_from(&[1], 2)],
            vec![removed_from(&[1], 1)],
        ],
        vec![
            out_stored(None, &[(1, content(&[1, 2], None, None))]),
            out_removed(&[1]),
        ],
    );
    assert_eq!(
        counters.other_group_events.load(super::Ordering::Relaxed),
        5
    );
}

#[test]
fn a_block_size_mismatch_is_skipped_and_counted() {
    let (mut t, counters) = translator(Some(16), 100);
    let mut page = stored(&[1], None, &[7]);
    page.block_size = 1;
    check(
        &mut t,
        vec![vec![
            EngineKvEvent::BlockStored(page.clone()),
            EngineKvEvent::BlockStored(page),
        ]],
        vec![],
    );
    let load = |c: &super::AtomicU64| c.load(super::Ordering::Relaxed);
    assert_eq!(load(&counters.block_size_mismatches), 2);
    assert_eq!(load(&counters.first_mismatched_block_size), 2, "1 + 1");
}

#[test]
fn a_re_announced_block_is_not_stored_twice_and_removals_name_only_known_blocks() {
    let (mut t, _) = translator(None, 100);
    check(
        &mut t,
        vec![
            vec![EngineKvEvent::BlockStored(stored(
                &[1, 2],
                None,
                &[1, 2, 3, 4],
            ))],
            // vLLM re-announces a reused prefix, extended by a new block.
            vec![EngineKvEvent::BlockStored(stored(
                &[1, 2, 3],
                None,
                &[1, 2, 3, 4, 5, 6],
            ))],
            vec![EngineKvEvent::BlockRemoved(removed(&[3, 99, 1]))],
        ],
        vec![
            out_stored(
                None,
                &[
                    (1, content(&[1, 2], None, None)),
                    (2, content(&[3, 4], None, None)),
                ],
            ),
            out_stored(Some(2), &[(3, content(&[5, 6], None, None))]),
            out_removed(&[3, 1]),
        ],
    );
}

#[test]
fn a_restart_clears_every_lane_written_and_forgets_the_blocks() {
    let (mut t, counters) = translator(None, 100);
    let mut cpu = stored(&[2], None, &[1, 2]);
    cpu.medium = Some("CPU".into());
    let mut b = batch(vec![
        EngineKvEvent::BlockStored(stored(&[1], None, &[1, 2])),
        EngineKvEvent::BlockStored(cpu),
    ]);
    b.dp_rank = Some(3);
    t.batch(b);
    t.batch(batch(vec![EngineKvEvent::AllBlocksCleared]));
    let cleared = |dp, tier| (dp, tier, KvCacheEventData::Cleared);
    assert_eq!(
        t.restart(),
        vec![
            cleared(0, StorageTier::Device),
            cleared(3, StorageTier::Device),
            cleared(3, StorageTier::HostPinned),
        ]
    );
    assert_eq!(counters.tracked_blocks.load(super::Ordering::Relaxed), 0);
    assert_eq!(t.restart(), vec![], "nothing written since");
}

#[test]
fn a_full_table_stops_republishing_and_counts() {
    let (mut t, counters) = translator(None, 2);
    check(
        &mut t,
        vec![vec![EngineKvEvent::BlockStored(stored(
            &[1, 2, 3],
            None,
            &[1, 2, 3, 4, 5, 6],
        ))]],
        vec![out_stored(
            None,
            &[
                (1, content(&[1, 2], None, None)),
                (2, content(&[3, 4], None, None)),
            ],
        )],
    );
    assert_eq!(counters.untracked_blocks.load(super::Ordering::Relaxed), 1);
    // Removing frees room.
    t.batch(batch(vec![EngineKvEvent::BlockRemoved(removed(&[2]))]));
    check(
        &mut t,
        vec![vec![EngineKvEvent::BlockStored(stored(
            &[7],
            Some(1),
            &[9, 9],
        ))]],
        vec![out_stored(Some(1), &[(7, content(&[9, 9], None, None))])],
    );
}

#[test]
fn engine_mediums_map_to_tiers() {
    let table = [
        (None, None, StorageTier::Device),
        (Some("GPU"), None, StorageTier::Device),
        (Some("CPU"), Some("LOCAL"), StorageTier::HostPinned),
        (Some("CPU_PINNED"), None, StorageTier::HostPinned),
        (Some("cpu_tier"), None, StorageTier::HostPinned),
        (Some("STORAGE"), None, StorageTier::Disk),
        (Some("STORAGE"), Some("REMOTE"), StorageTier::External),
        (Some("DISK"), None, StorageTier::Disk),
        (Some("LOCAL_DISK"), None, StorageTier::Disk),
        (Some("EXTERNAL"), None, StorageTier::External),
        (Some("SOMETHING_NEW"), None, StorageTier::External),
    ];
    for (medium, locality, expect) in table {
        assert_eq!(tier(medium, locality), expect, "{medium:?} {locality:?}");
    }
}

#[test]
fn replay_replies_of_current_engines_and_of_vllm_0_10() {
    let seq = Bytes::copy_from_slice(&7u64.to_be_bytes());
    let payload = Bytes::from_static(b"batch");
    let end = Bytes::from_static(&[0xff; 8]);
    let empty = Bytes::new();
    let topic = Bytes::from_static(b"kv");
    let table: Vec<(Vec<Bytes>, Result<ReplayReply<'_>, &str>)> = vec![
        (
            vec![empty.clone(), topic.clone(), seq.clone(), payload.clone()],
            Ok(ReplayReply::Batch {
                seq: 7,
                payload: &payload,
            }),
        ),
        (
            vec![empty.clone(), seq.clone(), payload.clone()],
            Ok(ReplayReply::Batch {
                seq: 7,
                payload: &payload,
            }),
        ),
        (
            vec![empty.clone(), empty.clone(), end.clone(), empty.clone()],
            Ok(ReplayReply::End),
        ),
        (
            vec![empty.clone(), end.clone(), empty.clone()],
            Ok(ReplayReply::End),
        ),
        (
            vec![topic.clone(), seq.clone(), payload.clone()],
            Err("expected [b\"\", topic, seq, payload] or [b\"\", seq, payload], got 3 frames"),
        ),
        (
            vec![empty.clone(), Bytes::from_static(&[1, 2]), payload.clone()],
            Err("expected an 8-byte sequence frame, got 2 bytes"),
        ),
    ];
    for (frames, expect) in &table {
        assert_eq!(
            parse_replay_reply(frames),
            expect.clone().map_err(str::to_owned),
            "{frames:?}"
        );
    }
}
