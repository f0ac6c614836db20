//! Behaviour when blocks run out: preemption by recompute, and LRU eviction with `Removed` events.

use std::time::Duration;

use kvroute_indexer::hash::{HashSalt, compute_block_hashes, compute_seq_hashes};
use kvroute_mocker::Engine;
use kvroute_protocols::kv_events::KvCacheEventData;

use crate::support::{EventModel, request, run, small_config};

#[test]
fn decoding_past_capacity_preempts_and_every_request_still_completes() {
    // Four requests whose prompts fit together but whose outputs do not.
    let mut engine = Engine::new(small_config(16, 8, 64), 0).expect("valid config");
    for id in 0..4u32 {
        let tokens = (0..8).map(|i| id * 100 + i).collect();
        engine
            .add_request(Duration::ZERO, request(id.into(), tokens, 12, None))
            .expect("fits alone");
    }
    let mut model = EventModel::default();
    let mut finished = Vec::new();
    run(&mut engine, None, |e, out| {
        let usage = e.kv_usage();
        assert_eq!(usage.used + usage.free, usage.capacity);
        out.events.iter().for_each(|ev| model.apply(ev));
        finished.extend(out.finished.iter().copied());
    });
    assert_eq!(finished.len(), 4);
    assert!(finished.iter().all(|f| f.output_tokens == 12));
    assert!(
        engine.stats().preemptions > 0,
        "the batch cannot decode without preempting"
    );
    assert!(finished.iter().any(|f| f.preemptions > 0));
    // The most recently admitted sequence is preempted first, so request 0 never is.
    assert_eq!(
        finished
            .iter()
            .find(|f| f.request_id == 0)
            .map(|f| f.preemptions),
        Some(0)
    );
    assert_eq!(engine.kv_usage().used, 0);
    assert_eq!(engine.cached_block_hashes(), model.cached());
}

#[test]
fn new_prompts_evict_the_least_recently_used_cached_blocks() {
    let mut engine = Engine::new(small_config(8, 4, 64), 0).expect("valid config");
    let mut model = EventModel::default();
    let mut removed = Vec::new();
    let mut observe = |out: &kvroute_mocker::StepOutput| {
        for ev in &out.events {
            model.apply(ev);
            if let KvCacheEventData::Removed(r) = &ev.data {
                removed.extend(r.block_hashes.iter().map(|h| h.0));
            }
        }
    };
    // A (old) then B (recent) each leave 3 cached blocks; together they fill 6 of 8.
    for (id, base) in [(1u64, 0u32), (2, 500)] {
        let now = engine.clock();
        engine
            .add_request(now, request(id, (base..base + 12).collect(), 1, None))
            .expect("fits");
        run(&mut engine, None, |_, out| observe(out));
    }
    let before = engine.cached_block_hashes();
    assert_eq!(before.len(), 6);
    // C needs 4 blocks: 2 free uncached ones plus 2 evicted from A, the least recently used.
    let now = engine.clock();
    engine
        .add_request(now, request(3, (900..916).collect(), 1, None))
        .expect("fits");
    run(&mut engine, None, |_, out| observe(out));
    // A's blocks go first, its tail before its head (it released its last block first).
    let a_local = compute_block_hashes(&(0..12).collect::<Vec<u32>>(), 4, &HashSalt::default());
    let a_seq = compute_seq_hashes(&a_local);
    assert_eq!(removed, vec![a_seq[2].0, a_seq[1].0]);
    assert!(before.contains(&a_seq[0].0) && engine.cached_block_hashes().contains(&a_seq[0].0));
    // B is intact: 12 prompt tokens hit 8 (the last block is recomputed for logits).
    let now = engine.clock();
    engine
        .add_request(now, request(4, (500..512).collect(), 1, None))
        .expect("fits");
    let mut cached = 0;
    run(&mut engine, None, |_, out| {
        cached += out
            .finished
            .iter()
            .map(|f| f.cached_prompt_tokens)
            .sum::<u32>();
        out.events.iter().for_each(|ev| model.apply(ev));
    });
    assert_eq!(cached, 8);
    assert_eq!(engine.cached_block_hashes(), model.cached());
}
