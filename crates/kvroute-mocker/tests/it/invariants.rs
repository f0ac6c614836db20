//! Random workloads: block accounting holds after every wake-up, nothing leaks once all work and
//! sessions end, and replaying the emitted events (into a naive model and into kvroute-indexer's
//! index) reproduces exactly the blocks the engine holds in its prefix cache.

use std::time::Duration;

use kvroute_indexer::KvIndex;
use kvroute_indexer::hash::{HashSalt, compute_block_hashes};
use kvroute_mocker::{Engine, StepOutput};
use kvroute_protocols::WorkerWithDpRank;
use proptest::prelude::*;

use crate::support::{EventModel, apply_to_index, index_blocks, request, run, small_config};

#[derive(Debug, Clone)]
enum Op {
    Add {
        prefix: u32,
        shared: usize,
        own: usize,
        out: u32,
        session: Option<u8>,
    },
    Advance(u64),
    Cancel(usize),
    Open(u8),
    Close(u8),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..3u32, 0..24usize, 1..12usize, 1..12u32, proptest::option::of(0..3u8)).prop_map(
            |(prefix, shared, own, out, session)| Op::Add { prefix, shared, own, out, session }
        ),
        4 => (0..60u64).prop_map(Op::Advance),
        1 => (0..16usize).prop_map(Op::Cancel),
        1 => (0..3u8).prop_map(Op::Open),
        1 => (0..3u8).prop_map(Op::Close),
    ]
}

struct Harness {
    engine: Engine,
    model: EventModel,
    index: KvIndex,
    now: Duration,
    next_id: u64,
    live: Vec<u64>,
}

impl Harness {
    fn observe(&mut self, out: &StepOutput) {
        let usage = self.engine.kv_usage();
        assert_eq!(
            usage.used + usage.free,
            usage.capacity,
            "used + free = capacity"
        );
        for event in &out.events {
            self.model.apply(event);
        }
        apply_to_index(&mut self.index, 1, &out.events);
        for f in &out.finished {
            self.live.retain(|&id| id != f.request_id);
        }
    }

    fn advance(&mut self, until: Option<Duration>) {
        let mut outs = Vec::new();
        run(&mut self.engine, until, |_, out| outs.push(out.clone()));
        for out in &outs {
            self.observe(out);
        }
        self.now = self.engine.clock();
    }

    fn apply(&mut self, op: Op) {
        match op {
            Op::Add {
                prefix,
                shared,
                own,
                out,
                session,
            } => {
                let id = self.next_id;
                self.next_id += 1;
                let mut tokens: Vec<u32> = (0..shared as u32).map(|i| prefix * 1000 + i).collect();
                tokens.extend((0..own as u32).map(|i| 100_000 + (id as u32) * 100 + i));
                let overlap = self.index.find_matches(&compute_block_hashes(
                    &tokens,
                    4,
                    &HashSalt::default(),
                ));
                assert_eq!(
                    overlap.score(WorkerWithDpRank::from_worker_id(1)) as usize,
                    self.engine.cached_prefix_blocks(&tokens),
                    "the index's overlap is the engine's cached prefix"
                );
                let name = session.map(|s| format!("s{s}"));
                let req = request(id, tokens, out, name.as_deref());
                // Requests naming a closed session are refused; that is part of the workload.
                if self.engine.add_request(self.now, req).is_ok() {
                    self.live.push(id);
                }
            }
            Op::Advance(ms) => self.advance(Some(self.now + Duration::from_millis(ms))),
            Op::Cancel(i) => {
                if let Some(&id) = self.live.get(i % self.live.len().max(1)) {
                    let mut out = StepOutput::default();
                    assert!(self.engine.cancel(self.now, id, &mut out));
                    self.observe(&out);
                }
            }
            Op::Open(s) => {
                self.engine.open_session(
                    self.now,
                    &format!("s{s}"),
                    Some(Duration::from_millis(300)),
                );
            }
            Op::Close(s) => {
                self.engine.close_session(self.now, &format!("s{s}"));
            }
        }
        let cached = self.engine.cached_block_hashes();
        assert_eq!(cached, self.model.cached(), "event replay == cache");
        assert_eq!(
            cached,
            index_blocks(&self.index, 1),
            "kvroute-indexer replay == cache"
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn accounting_and_event_replay_hold_under_random_workloads(
        ops in proptest::collection::vec(op(), 1..80),
        num_blocks in 12..40u32,
        max_seqs in 1..5u32,
        max_batched in 4..24u32,
    ) {
        let engine = Engine::new(small_config(num_blocks, max_seqs, max_batched), 0)
            .expect("valid config");
        let mut h = Harness {
            engine,
            model: EventModel::default(),
            index: KvIndex::new(),
            now: Duration::ZERO,
            next_id: 0,
            live: Vec::new(),
        };
        for op in ops {
            h.apply(op);
        }
        for s in 0..3 {
            h.engine.close_session(h.now, &format!("s{s}"));
        }
        h.advance(None);
        prop_assert_eq!(h.engine.num_requests(), 0, "every request finishes");
        prop_assert_eq!(h.engine.kv_usage().used, 0, "no block leaks once all work is done");
        let cached = h.engine.cached_block_hashes();
        prop_assert_eq!(&cached, &h.model.cached());
        prop_assert_eq!(&cached, &index_blocks(&h.index, 1), "kvroute-indexer replay == cache");
    }
}
