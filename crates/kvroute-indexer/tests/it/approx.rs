//! Approximate mode: predictions with a TTL and a size cap, on the caller's clock.

use std::time::Duration;

use kvroute_indexer::{ApproxConfig, ApproxIndex, Learnt, Retention};
use kvroute_protocols::WorkerWithDpRank;
use kvroute_protocols::kv_events::LocalBlockHash;

fn blocks(ids: &[u64]) -> Vec<LocalBlockHash> {
    ids.iter().map(|&i| LocalBlockHash(i)).collect()
}

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

#[test]
fn predictions_match_until_they_expire() {
    let w = WorkerWithDpRank::from_worker_id(7);
    let mut approx = ApproxIndex::new(ApproxConfig {
        ttl: secs(10),
        ..ApproxConfig::default()
    });
    approx.record(w, &blocks(&[1, 2, 3]), secs(0));
    assert_eq!(approx.find_matches(&blocks(&[1, 2, 9])).score(w), 2);
    approx.expire(secs(9));
    assert_eq!(approx.live_blocks(), 3);
    approx.expire(secs(10));
    assert_eq!(approx.live_blocks(), 0);
    assert_eq!(approx.find_matches(&blocks(&[1])).score(w), 0);
    assert_eq!(approx.memory().live_nodes, 0);
}

#[test]
fn a_new_decision_refreshes_the_shared_prefix() {
    let w = WorkerWithDpRank::from_worker_id(1);
    let mut approx = ApproxIndex::new(ApproxConfig {
        ttl: secs(10),
        ..ApproxConfig::default()
    });
    approx.record(w, &blocks(&[1, 2]), secs(0));
    approx.record(w, &blocks(&[1, 3]), secs(5));
    approx.expire(secs(12));
    // [1] was refreshed at 5 and lives to 15; [1, 2] expired at 10.
    let scores = approx.find_matches(&blocks(&[1, 3]));
    assert_eq!(scores.score(w), 2);
    assert_eq!(approx.find_matches(&blocks(&[1, 2])).score(w), 1);
    assert_eq!(approx.live_blocks(), 2);
}

#[test]
fn the_size_cap_prunes_oldest_to_the_target_ratio() {
    let mut approx = ApproxIndex::new(ApproxConfig {
        ttl: secs(1000),
        max_blocks: 10,
        prune_target_ratio: 0.5,
    });
    for i in 0..4u64 {
        let w = WorkerWithDpRank::from_worker_id(i);
        approx.record(w, &blocks(&[i * 10, i * 10 + 1, i * 10 + 2]), secs(i));
    }
    // 12 > 10 blocks: the oldest are pruned until 5 remain.
    assert_eq!(approx.live_blocks(), 5);
    let newest = WorkerWithDpRank::from_worker_id(3);
    assert_eq!(approx.find_matches(&blocks(&[30, 31, 32])).score(newest), 3);
    let oldest = WorkerWithDpRank::from_worker_id(0);
    assert_eq!(approx.find_matches(&blocks(&[0])).score(oldest), 0);
}

#[test]
fn removing_a_worker_drops_its_predictions() {
    let mut approx = ApproxIndex::new(ApproxConfig::default());
    approx.record(
        WorkerWithDpRank::from_worker_id(1),
        &blocks(&[1, 2]),
        secs(0),
    );
    approx.record(WorkerWithDpRank::from_worker_id(2), &blocks(&[1]), secs(0));
    approx.remove_worker(1);
    assert_eq!(approx.live_blocks(), 1);
    assert_eq!(approx.find_matches(&blocks(&[1, 2])).scores.len(), 1);
}

/// Three conversations of `len` blocks each recorded on `w` one after another, under ids 1..=3.
fn three_conversations(approx: &mut ApproxIndex, w: WorkerWithDpRank, len: u64) {
    for c in 0..3u64 {
        let ids: Vec<u64> = (c * 100..c * 100 + len).collect();
        approx.record_request(w, &blocks(&ids), secs(c), Some(c + 1));
        approx.forget(c + 1);
    }
}

#[test]
fn a_report_of_fewer_blocks_teaches_the_capacity_and_cuts_older_predictions() {
    let w = WorkerWithDpRank::from_worker_id(1);
    let mut approx = ApproxIndex::new(ApproxConfig::default());
    three_conversations(&mut approx, w, 4);
    // Conversation 0 is 8 blocks old, 1 is 4, 2 is 0: all predicted while nothing is learnt.
    for c in 0..3u64 {
        assert_eq!(approx.find_matches(&blocks(&[c * 100])).score(w), 1);
    }
    assert_eq!(approx.capacity(w), None);

    // Conversation 0 again: predicted 4 blocks, the engine had none (evicted at age 8). The
    // first shortfall cannot tell an eviction from a lost cache: it sets the capacity, whose
    // cut drops the older predictions either way.
    approx.record_request(w, &blocks(&[0, 1, 2, 3, 50]), secs(4), Some(10));
    assert_eq!(approx.on_report(10, 0), Learnt::Lowered(8.0));
    assert_eq!(approx.capacity(w), Some(8.0));
    // A second report of the same request teaches nothing.
    assert_eq!(approx.on_report(10, 0), Learnt::Nothing);

    // Now conversation 0 (with its new block) is age 0, 2 is age 1, 1 is age 5: all under 8.
    assert_eq!(approx.find_matches(&blocks(&[100, 101])).score(w), 2);
    // Conversation 2 again, held: reported as predicted, nothing learnt.
    approx.record_request(w, &blocks(&[200, 201, 202, 203]), secs(5), Some(11));
    assert_eq!(approx.on_report(11, 4), Learnt::Nothing);
    // Conversation 1 (age 5) reported missing: an eviction, the capacity moves halfway to 5.
    approx.record_request(w, &blocks(&[100, 101, 102, 103]), secs(6), Some(12));
    assert_eq!(approx.on_report(12, 0), Learnt::Lowered(6.5));
    assert_eq!(approx.capacity(w), Some(6.5));
}

#[test]
fn matches_stop_at_the_first_block_older_than_the_capacity() {
    let w = WorkerWithDpRank::from_worker_id(1);
    let mut approx = ApproxIndex::new(ApproxConfig::default());
    let long: Vec<u64> = (0..10).collect();
    approx.record(w, &blocks(&long), secs(0));
    approx.record(w, &blocks(&[700, 701, 702, 703, 704]), secs(1));
    approx.record(w, &blocks(&[800, 801, 802, 803, 804]), secs(2));
    // `long` is 10 blocks old, the 700s 5.
    assert_eq!(approx.find_matches(&blocks(&long)).score(w), 10);
    approx.record_request(w, &blocks(&[700, 701, 702, 703, 704]), secs(3), Some(5));
    assert_eq!(approx.on_report(5, 0), Learnt::Lowered(5.0));
    assert_eq!(approx.capacity(w), Some(5.0));
    assert_eq!(approx.find_matches(&blocks(&long)).score(w), 0);
    // The first half of `long` used again (with one new block): young again, the rest old.
    approx.record(w, &blocks(&[0, 1, 2, 3, 4, 77]), secs(4));
    assert_eq!(approx.find_matches(&blocks(&long)).score(w), 5);
    assert_eq!(approx.find_matches(&blocks(&long[..3])).score(w), 3);
}

#[test]
fn block_counts_are_the_live_predictions_whatever_capacity_is_learnt() {
    let (a, b) = (
        WorkerWithDpRank::from_worker_id(1),
        WorkerWithDpRank::from_worker_id(2),
    );
    let mut approx = ApproxIndex::new(ApproxConfig {
        ttl: secs(10),
        ..ApproxConfig::default()
    });
    let long: Vec<u64> = (0..10).collect();
    approx.record(a, &blocks(&long), secs(0));
    approx.record(a, &blocks(&[700, 701, 702, 703, 704]), secs(1));
    approx.record(a, &blocks(&[800, 801, 802, 803, 804]), secs(1));
    approx.record(b, &blocks(&[1, 2, 3]), secs(1));
    let counts = |approx: &ApproxIndex| {
        let mut out = vec![(WorkerWithDpRank::from_worker_id(9), 99)];
        approx.block_counts(&mut out);
        out.sort();
        out
    };
    // Appended after what `out` held, one entry a worker.
    let stray = (WorkerWithDpRank::from_worker_id(9), 99);
    assert_eq!(counts(&approx), [(a, 20), (b, 3), stray]);
    // The 700s are 5 blocks old and gone: a learnt capacity of 5 blocks, which cuts the
    // matches (the 10-block prompt matches none of its blocks now) but not the count. The engine
    // evicts, so its cache is full: it holds as many blocks as it was sent, up to its KV
    // capacity, even if not the predicted ones.
    approx.record_request(a, &blocks(&[700, 701, 702, 703, 704]), secs(2), Some(5));
    assert_eq!(approx.on_report(5, 0), Learnt::Lowered(5.0));
    assert_eq!(approx.find_matches(&blocks(&long)).score(a), 0);
    assert_eq!(counts(&approx), [(a, 20), (b, 3), stray]);
    // Expired predictions count no more (within the expiry queue's bucket, a 64th of the TTL,
    // of their deadline); a worker once predicted stays, at 0.
    let bucket = secs(10) / 64;
    approx.expire(secs(11) + bucket);
    // Only the 700s, refreshed at 2 s, live on.
    assert_eq!(counts(&approx), [(a, 5), (b, 0), stray]);
    approx.expire(secs(12) + bucket);
    assert_eq!(counts(&approx), [(a, 0), (b, 0), stray]);
}

#[test]
fn a_report_above_the_cut_raises_the_capacity() {
    let w = WorkerWithDpRank::from_worker_id(1);
    let mut approx = ApproxIndex::new(ApproxConfig::default());
    three_conversations(&mut approx, w, 4);
    // Learn a small capacity from a miss of conversation 0 (age 8 in blocks, 2 in requests).
    approx.record_request(w, &blocks(&[0, 1, 2, 3]), secs(4), Some(10));
    assert_eq!(approx.on_report(10, 0), Learnt::Lowered(8.0));
    assert_eq!(approx.capacity(w), Some(8.0));
    // In requests the first miss teaches the least the report allows (nothing was held: 1);
    // both models missed by as much, so blocks stay in force.
    assert_eq!(approx.request_capacity(w), Some(1.0));
    assert_eq!(approx.retention(w), Some(Retention::Blocks(8.0)));
    // 8 fresh blocks elsewhere: conversation 1 is age 12 now, cut to nothing...
    approx.record_request(w, &blocks(&(300..308).collect::<Vec<_>>()), secs(5), None);
    assert_eq!(
        approx.find_matches(&blocks(&[100, 101, 102, 103])).score(w),
        0
    );
    // ...but the engine had all 4 blocks: the capacity moves halfway past age 12.
    approx.record_request(w, &blocks(&[100, 101, 102, 103]), secs(6), Some(11));
    assert_eq!(approx.on_report(11, 4), Learnt::Raised(10.5));
    // A young block lost (age 0 against a capacity of 10.5): the cache was lost.
    approx.record_request(w, &blocks(&[100, 101, 102, 103]), secs(7), Some(12));
    assert_eq!(approx.on_report(12, 0), Learnt::Lost);
    assert_eq!(approx.capacity(w), Some(10.5));
    // A young block missing while the prompt's first blocks were held: not a restart (LRU
    // loses a prompt's tail first) but an engine short of memory; the capacity moves halfway
    // down.
    approx.record_request(w, &blocks(&[100, 101, 102, 103]), secs(8), Some(13));
    assert_eq!(approx.on_report(13, 2), Learnt::Lowered(5.25));
    assert_eq!(approx.capacity(w), Some(5.25));
    // Removing the worker forgets what was learnt.
    approx.remove_worker(1);
    assert_eq!(approx.capacity(w), None);
}

/// A simulated engine's cache, answering how many leading blocks of a prompt it holds.
trait Engine {
    /// Serves `prompt`: returns how many of its leading blocks were cached, then caches it.
    fn serve(&mut self, prompt: &[u64]) -> u32;
}

/// One slot and no prompt memory (llama.cpp with `--cache-ram 0`): holds the last prompt only.
#[derive(Default)]
struct OneSlot {
    last: Vec<u64>,
}

impl Engine for OneSlot {
    fn serve(&mut self, prompt: &[u64]) -> u32 {
        let held = prompt
            .iter()
            .zip(&self.last)
            .take_while(|(a, b)| a == b)
            .count();
        self.last = prompt.to_vec();
        held as u32
    }
}

/// A paged cache of `capacity` blocks that evicts the least recently used (vLLM, SGLang).
struct LruBlocks {
    capacity: usize,
    tick: u64,
    /// A block is its whole prefix; its value the tick of its last use.
    used: std::collections::HashMap<Vec<u64>, u64>,
}

impl Engine for LruBlocks {
    fn serve(&mut self, prompt: &[u64]) -> u32 {
        let held = (1..=prompt.len())
            .take_while(|&n| self.used.contains_key(&prompt[..n]))
            .count();
        self.tick += 1;
        for n in 1..=prompt.len() {
            self.used.insert(prompt[..n].to_vec(), self.tick);
        }
        while self.used.len() > self.capacity {
            // Oldest first; within one request, the longest prefix (its tail) first.
            let victim = self
                .used
                .iter()
                .min_by_key(|(k, t)| (**t, std::cmp::Reverse(k.len())))
                .map(|(k, _)| k.clone())
                .expect("not empty");
            self.used.remove(&victim);
        }
        held as u32
    }
}

/// Conversations over two shared system prompts and one-off documents of any length, picked in
/// a fixed pseudo-random order and all sent to `w` of `approx` and to `engine`. Returns the summed |predicted - reported| over
/// the requests after the first `warm_up`.
fn converse(
    approx: &mut ApproxIndex,
    engine: &mut dyn Engine,
    warm_up: usize,
    learn: bool,
) -> (u64, usize) {
    let w = WorkerWithDpRank::from_worker_id(1);
    // 6 conversations, 3 per family; each turn adds 3 blocks.
    let mut history: Vec<Vec<u64>> = (0..6u64)
        .map(|c| (0..8).map(|i| (c % 2) * 1_000 + i).collect())
        .collect();
    let mut state = 7u64;
    let mut miss = 0u64;
    let mut counted = 0usize;
    for n in 0..200usize {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1);
        let pick = (state >> 33) % 8;
        let prompt = if pick < 6 {
            let c = pick as usize;
            let turn = history[c].len() as u64;
            history[c].extend((0..3).map(|i| 10_000 * (c as u64 + 1) + turn + i));
            if history[c].len() > 40 {
                history[c].truncate(8); // a new conversation of the same family
            }
            history[c].clone()
        } else {
            // A one-off document of 2 to 49 blocks.
            let len = 2 + (state >> 40) % 48;
            (0..len).map(|i| 1_000_000 * (n as u64 + 1) + i).collect()
        };
        let predicted = approx.find_matches(&blocks(&prompt)).score(w);
        let id = n as u64 + 1;
        approx.record_request(w, &blocks(&prompt), secs(n as u64), Some(id));
        let reported = engine.serve(&prompt);
        if learn {
            approx.on_report(id, reported);
        } else {
            approx.forget(id);
        }
        if n >= warm_up {
            miss += u64::from(predicted.abs_diff(reported));
            counted += 1;
        }
    }
    (miss, counted)
}

#[test]
fn an_engine_that_keeps_one_prompt_a_slot_is_learnt_in_requests() {
    let w = WorkerWithDpRank::from_worker_id(1);
    let mut approx = ApproxIndex::new(ApproxConfig::default());
    let (miss, counted) = converse(&mut approx, &mut OneSlot::default(), 40, true);
    // Held only while no other request took the slot: a capacity of one request.
    assert_eq!(approx.retention(w), Some(Retention::Requests(1.0)));
    // After warm-up every prediction is exact: the system prompt when another conversation
    // came between, the whole history when the same one came back at once.
    assert_eq!(miss, 0, "{counted} requests");
}

#[test]
fn an_engine_that_evicts_blocks_is_learnt_in_blocks() {
    let w = WorkerWithDpRank::from_worker_id(1);
    let mut approx = ApproxIndex::new(ApproxConfig::default());
    let engine = || LruBlocks {
        capacity: 120,
        tick: 0,
        used: Default::default(),
    };
    let (miss, counted) = converse(&mut approx, &mut engine(), 40, true);
    assert!(
        matches!(approx.retention(w), Some(Retention::Blocks(_))),
        "{:?}",
        approx.retention(w)
    );
    // An LRU's boundary moves with the traffic, so the learnt capacity is off by a few blocks
    // now and then: within 1.5 blocks a request on average, a fraction of what predicting
    // everything held misses.
    let mut blind = ApproxIndex::new(ApproxConfig::default());
    let (blind_miss, _) = converse(&mut blind, &mut engine(), 40, false);
    assert!(
        miss * 2 <= counted as u64 * 3 && miss * 4 < blind_miss,
        "{miss} blocks missed over {counted} requests, {blind_miss} without learning"
    );
}

#[test]
fn in_requests_a_first_miss_starts_at_the_least_the_report_allows_and_only_the_last_prompt_is_lost()
{
    let w = WorkerWithDpRank::from_worker_id(1);
    let mut approx = ApproxIndex::new(ApproxConfig::default());
    // Two prompts sharing 2 blocks, then 3 others: the shared blocks are 3 requests old, the
    // first prompt's own tail 4.
    approx.record(w, &blocks(&[1, 2, 3, 4]), secs(0));
    approx.record(w, &blocks(&[1, 2, 5, 6]), secs(1));
    for c in 0..3u64 {
        approx.record(w, &blocks(&[100 + c]), secs(2));
    }
    // The engine held the 2 shared blocks (age 3), not the tail (age 4): at least 4 requests.
    // (In blocks the capacity starts at the missing block's age, 5 new blocks.)
    approx.record_request(w, &blocks(&[1, 2, 3, 4]), secs(3), Some(1));
    approx.on_report(1, 2);
    assert_eq!(approx.request_capacity(w), Some(4.0));
    assert_eq!(approx.capacity(w), Some(5.0));
    // A prompt one request old missing entirely: evicted (the capacity falls to 1), not lost.
    approx.record(w, &blocks(&[200, 201, 202]), secs(4));
    approx.record(w, &blocks(&[300]), secs(5));
    approx.record_request(w, &blocks(&[200, 201, 202]), secs(6), Some(2));
    approx.on_report(2, 0);
    assert_eq!(approx.request_capacity(w), Some(1.0));
    // The prompt the worker served last missing entirely: lost, the capacity stands.
    approx.record(w, &blocks(&[400, 401, 402]), secs(7));
    approx.record_request(w, &blocks(&[400, 401, 402]), secs(8), Some(3));
    approx.on_report(3, 0);
    assert_eq!(approx.request_capacity(w), Some(1.0));
    // A surplus raises it at once to one past the oldest block held.
    approx.record(w, &blocks(&[500, 501]), secs(9));
    approx.record(w, &blocks(&[600]), secs(10));
    approx.record(w, &blocks(&[700]), secs(11));
    approx.record_request(w, &blocks(&[500, 501]), secs(12), Some(4));
    approx.on_report(4, 2);
    assert_eq!(approx.request_capacity(w), Some(3.0));
}

#[test]
fn refreshing_a_prompt_does_not_grow_the_tables() {
    // A long conversation's prompt re-recorded by every turn, well within the TTL: its blocks
    // are refreshed, never new, so the tables (the expiry queue included) stay the size one
    // recording made them, and each block still expires at its last refresh plus the TTL.
    let w = WorkerWithDpRank::from_worker_id(3);
    let mut approx = ApproxIndex::new(ApproxConfig {
        ttl: secs(100),
        ..ApproxConfig::default()
    });
    let prompt: Vec<u64> = (0..500).collect();
    approx.record(w, &blocks(&prompt), Duration::ZERO);
    let once = approx.memory().table_bytes;
    for turn in 1..=2_000u64 {
        approx.record(w, &blocks(&prompt), Duration::from_millis(turn * 10));
    }
    assert_eq!(approx.live_blocks(), 500);
    assert!(
        approx.memory().table_bytes <= once * 2,
        "{} bytes after 2,000 refreshes, {once} after one recording",
        approx.memory().table_bytes
    );
    // The last refresh was at 20 s: the blocks outlive their first deadline (100 s) and go
    // after 120 s, within the expiry queue's bucket of it (a 64th of the TTL).
    approx.expire(secs(119));
    assert_eq!(approx.find_matches(&blocks(&prompt)).score(w), 500);
    approx.expire(secs(120) + secs(100) / 64);
    assert_eq!(approx.live_blocks(), 0);
    assert_eq!(approx.memory().live_nodes, 0);
}

#[test]
fn a_prediction_dropped_and_made_again_expires_once_at_its_new_deadline() {
    let w = WorkerWithDpRank::from_worker_id(4);
    let mut approx = ApproxIndex::new(ApproxConfig {
        ttl: secs(10),
        ..ApproxConfig::default()
    });
    approx.record(w, &blocks(&[1, 2, 3]), secs(0));
    // The engine lost everything but nothing is kept; then the prompt is routed there again.
    assert_eq!(approx.retain_worker(w, &[]), 3);
    approx.record(w, &blocks(&[1, 2, 3]), secs(5));
    approx.expire(secs(10));
    assert_eq!(approx.find_matches(&blocks(&[1, 2, 3])).score(w), 3);
    approx.expire(secs(15));
    assert_eq!(approx.live_blocks(), 0);
}
