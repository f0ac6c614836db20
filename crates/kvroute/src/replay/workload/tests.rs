use std::time::Duration;

use kvroute_mocker::trace::{TraceRecord, synthesize_prompt_with as synthesize_prompt};

use super::{Synthesis, arrival_time, arrivals};

fn rec(timestamp: f64, input_length: u32, hash_ids: &[u64]) -> TraceRecord {
    TraceRecord {
        timestamp,
        input_length,
        output_length: 0,
        hash_ids: hash_ids.to_vec(),
    }
}

#[test]
fn shared_ids_share_tokens_at_any_block_size() {
    let (mut a, mut b) = (Vec::new(), Vec::new());
    synthesize_prompt(&rec(0.0, 64, &[1, 2]), 0, 32, &mut a);
    synthesize_prompt(&rec(0.0, 64, &[1, 3]), 1, 32, &mut b);
    assert_eq!(a.len(), 64);
    assert_eq!(a[..32], b[..32]);
    assert_ne!(a[32..], b[32..]);
}

#[test]
fn arrivals_are_sorted_by_time_with_file_order_ids() {
    let records = [rec(5.0, 4, &[1]), rec(1.0, 4, &[2]), rec(5.0, 4, &[3])];
    let synthesis = Synthesis {
        trace_block_tokens: 4,
        speed: 1.0,
    };
    let got: Vec<(u64, Duration, u32)> = arrivals(&records, synthesis)
        .map(|a| (a.request.id, a.at, a.request.max_output_tokens))
        .collect();
    let ms = Duration::from_millis;
    assert_eq!(got, vec![(1, ms(1), 1), (0, ms(5), 1), (2, ms(5), 1)]);
}

#[test]
fn speed_divides_arrival_times() {
    assert_eq!(arrival_time(1000.0, 2.0), Duration::from_millis(500));
    assert_eq!(arrival_time(0.0015, 1.0), Duration::from_micros(2));
}
