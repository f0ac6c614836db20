//! The multi-engine simulation driver.

use std::time::Duration;

use kvroute_mocker::sim::{Arrival, RoundRobin, SimError, Simulation};
use kvroute_mocker::trace::{self, TraceRecord};

use crate::support::{request, small_config};

fn trace_records() -> Vec<TraceRecord> {
    let text = (0..40)
        .map(|i| {
            format!(
                r#"{{"timestamp": {}, "input_length": {}, "output_length": {}, "hash_ids": [0, {}, {}]}}"#,
                i * 50,
                900 + (i % 7) * 20,
                5 + i % 4,
                1 + i % 5,
                100 + i
            )
        })
        .collect::<Vec<_>>()
        .join("\n");
    trace::parse_jsonl(&text).expect("valid trace")
}

#[test]
fn the_same_trace_gives_the_same_report_and_shares_prefixes() {
    let records = trace_records();
    let config = kvroute_mocker::MockerConfig {
        num_blocks: 2000,
        ..kvroute_mocker::MockerConfig::default()
    };
    let run = || {
        let mut sim = Simulation::new(&config, 3).expect("valid config");
        sim.run(trace::arrivals(&records), &mut RoundRobin::default())
            .expect("sorted arrivals")
    };
    let a = run();
    assert_eq!(a, run());
    assert_eq!((a.arrived, a.completed, a.rejected), (40, 40, 0));
    assert_eq!(a.ttft.count, 40);
    assert!(a.ttft.p50 > Duration::ZERO && a.ttft.p50 <= a.ttft.p99);
    // Hash id 0 (512 tokens = 32 blocks of 16) is shared by every request; each engine computes
    // it once and then hits it.
    assert!(
        a.cached_prompt_tokens >= 37 * 512,
        "cached {}",
        a.cached_prompt_tokens
    );
    assert!(a.simulated >= Duration::from_millis(39 * 50));
}

#[test]
fn synthesized_prompts_share_tokens_exactly_where_hash_ids_do() {
    let records = trace::parse_jsonl(
        "{\"timestamp\": 0, \"input_length\": 600, \"output_length\": 1, \"hash_ids\": [7, 8]}\n\
         \n\
         {\"timestamp\": 1.5, \"input_length\": 1100, \"output_length\": 0, \"hash_ids\": [7, 9]}",
    )
    .expect("valid trace");
    let arrivals: Vec<Arrival> = trace::arrivals(&records).collect();
    let (a, b) = (&arrivals[0].request.tokens, &arrivals[1].request.tokens);
    assert_eq!((a.len(), b.len()), (600, 1100));
    assert_eq!(a[..512], b[..512]);
    assert_ne!(a[512..600], b[512..600]);
    assert_eq!(arrivals[1].at, Duration::from_micros(1500));
    assert_eq!(
        arrivals[1].request.max_output_tokens, 1,
        "zero output is raised to one"
    );
    let err = trace::parse_jsonl("{\"timestamp\": 0}").expect_err("missing fields");
    assert!(err.to_string().contains("trace line 1"), "{err}");
}

#[test]
fn out_of_order_arrivals_are_an_error() {
    let mut sim = Simulation::new(&small_config(64, 4, 64), 2).expect("valid config");
    let arrivals = vec![
        Arrival {
            at: Duration::from_millis(5),
            request: request(1, vec![1, 2, 3], 1, None),
        },
        Arrival {
            at: Duration::from_millis(4),
            request: request(2, vec![1, 2, 3], 1, None),
        },
    ];
    let err = sim
        .run(arrivals, &mut RoundRobin::default())
        .expect_err("unsorted");
    assert!(matches!(err, SimError::OutOfOrder { id: 2, .. }), "{err}");
}

/// Round-robin over prefill engines and, separately, over decode engines.
#[derive(Default)]
struct DisaggRoundRobin {
    prefill: RoundRobin,
    decode: usize,
    decode_picks: Vec<(u64, usize)>,
}

impl kvroute_mocker::sim::Dispatcher for DisaggRoundRobin {
    fn pick(
        &mut self,
        now: Duration,
        request: &kvroute_mocker::Request,
        engines: &[kvroute_mocker::Engine],
    ) -> usize {
        self.prefill.pick(now, request, engines)
    }
}

impl kvroute_mocker::sim::DisaggDispatcher for DisaggRoundRobin {
    fn pick_decode(
        &mut self,
        _now: Duration,
        request: &kvroute_mocker::Request,
        decode: &[kvroute_mocker::Engine],
    ) -> usize {
        let picked = self.decode % decode.len();
        self.decode += 1;
        self.decode_picks.push((request.id, picked));
        picked
    }
}

#[test]
fn disaggregated_runs_prefill_then_decode_and_is_deterministic() {
    use kvroute_mocker::disagg::DecodeConfig;
    use kvroute_mocker::sim::DisaggSimulation;

    let records = trace_records();
    let config = kvroute_mocker::MockerConfig {
        num_blocks: 2000,
        ..kvroute_mocker::MockerConfig::default()
    };
    let run = || {
        let mut sim =
            DisaggSimulation::new(&config, 2, 2, DecodeConfig::default()).expect("valid config");
        let mut dispatcher = DisaggRoundRobin::default();
        let report = sim
            .run(trace::arrivals(&records), &mut dispatcher)
            .expect("sorted arrivals");
        assert!(sim.prefill_engines().iter().all(|e| e.num_requests() == 0));
        assert!(sim.decode_engines().iter().all(|e| e.num_requests() == 0));
        (report, dispatcher.decode_picks)
    };
    let (a, picks) = run();
    assert_eq!((a.clone(), picks.clone()), run());
    assert_eq!((a.arrived, a.completed, a.rejected), (40, 40, 0));
    assert_eq!(picks.len(), 40, "every request reaches decode once");
    // Output tokens are counted on decode only: each request's full budget.
    let expected: u64 = records.iter().map(|r| u64::from(r.output_length)).sum();
    assert_eq!(a.output_tokens, expected);
    assert_eq!(a.ttft.count, 40);
    // Prompt tokens are counted on the prefill engines, which share hash id 0.
    let prompts: u64 = records.iter().map(|r| u64::from(r.input_length)).sum();
    assert_eq!(a.prompt_tokens, prompts);
    assert!(
        a.cached_prompt_tokens >= 38 * 512,
        "{}",
        a.cached_prompt_tokens
    );
}

/// Serves every even request whole on a decode engine (a local prefill) and the rest through a
/// prefill engine.
#[derive(Default)]
struct EvenLocal {
    inner: DisaggRoundRobin,
    local: Vec<u64>,
}

impl kvroute_mocker::sim::Dispatcher for EvenLocal {
    fn pick(
        &mut self,
        now: Duration,
        request: &kvroute_mocker::Request,
        engines: &[kvroute_mocker::Engine],
    ) -> usize {
        self.inner.pick(now, request, engines)
    }
}

impl kvroute_mocker::sim::DisaggDispatcher for EvenLocal {
    fn pick_local(
        &mut self,
        _now: Duration,
        request: &kvroute_mocker::Request,
        decode: &[kvroute_mocker::Engine],
    ) -> Option<usize> {
        request.id.is_multiple_of(2).then(|| {
            self.local.push(request.id);
            request.id as usize / 2 % decode.len()
        })
    }

    fn pick_decode(
        &mut self,
        now: Duration,
        request: &kvroute_mocker::Request,
        decode: &[kvroute_mocker::Engine],
    ) -> usize {
        self.inner.pick_decode(now, request, decode)
    }
}

#[test]
fn a_request_placed_locally_is_served_whole_by_its_decode_engine() {
    use kvroute_mocker::disagg::DecodeConfig;
    use kvroute_mocker::sim::DisaggSimulation;

    let records = trace_records();
    let config = kvroute_mocker::MockerConfig {
        num_blocks: 2000,
        ..kvroute_mocker::MockerConfig::default()
    };
    let mut sim =
        DisaggSimulation::new(&config, 2, 2, DecodeConfig::default()).expect("valid config");
    let mut dispatcher = EvenLocal::default();
    let report = sim
        .run(trace::arrivals(&records), &mut dispatcher)
        .expect("sorted arrivals");
    assert_eq!(
        (report.arrived, report.completed, report.rejected),
        (40, 40, 0)
    );
    assert_eq!(dispatcher.local.len(), 20);
    let remote = &dispatcher.inner.decode_picks;
    assert_eq!(
        remote.len(),
        20,
        "only remote prefills are handed to decode"
    );
    assert!(remote.iter().all(|(id, _)| !id.is_multiple_of(2)));
    // Every prompt is counted once, where it was computed; every output on decode.
    let prompts: u64 = records.iter().map(|r| u64::from(r.input_length)).sum();
    assert_eq!(report.prompt_tokens, prompts);
    let outputs: u64 = records.iter().map(|r| u64::from(r.output_length)).sum();
    assert_eq!(report.output_tokens, outputs);
    assert_eq!(report.ttft.count, 40);
    assert!(sim.decode_engines().iter().all(|e| e.num_requests() == 0));
}
