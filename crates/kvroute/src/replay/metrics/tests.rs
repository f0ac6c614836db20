use std::time::Duration;

use kvroute_mocker::TokenOutput;

use super::{LoadTimeline, Recorder, max_over_mean, quantile};

fn ms(v: u64) -> Duration {
    Duration::from_millis(v)
}

fn token(request_id: u64, index: u32, at: Duration) -> TokenOutput {
    TokenOutput {
        request_id,
        token: 0,
        index,
        at,
    }
}

#[test]
fn ttft_itl_and_e2e_come_from_token_times() {
    let mut r = Recorder::new(2, ms(100));
    r.arrived(7, 1, ms(10));
    r.token(&token(7, 0, ms(60)));
    r.token(&token(7, 1, ms(70)));
    r.token(&token(7, 2, ms(90)));
    r.left(7, ms(90), true);
    assert_eq!(r.ttft, vec![ms(50)]);
    assert_eq!(r.itl, vec![ms(15)]);
    assert_eq!(r.e2e, vec![ms(80)]);
    assert_eq!(r.in_flight(), 0);
}

#[test]
fn refused_requests_leave_no_latency_and_no_load() {
    let mut r = Recorder::new(1, ms(100));
    r.arrived(1, 0, ms(0));
    r.left(1, ms(0), false);
    r.load.finish(ms(100));
    assert!(r.e2e.is_empty() && r.ttft.is_empty());
    assert_eq!(r.load.mean_per_worker(ms(100)), vec![0.0]);
}

#[test]
fn load_integrates_over_buckets() {
    let mut l = LoadTimeline::new(2, ms(100));
    l.change(0, ms(50), 1);
    l.change(0, ms(150), 1);
    l.change(0, ms(250), -2);
    l.change(1, ms(0), 1);
    l.finish(ms(300));
    // Worker 0: one request over [50, 150), two over [150, 250).
    let series = l.series();
    let round = |v: &[f64]| {
        v.iter()
            .map(|x| (x * 1000.0).round() / 1000.0)
            .collect::<Vec<_>>()
    };
    assert_eq!(round(&series[0]), vec![0.5, 1.5, 1.0]);
    assert_eq!(round(&series[1]), vec![1.0, 1.0, 1.0]);
    let means = round(&l.mean_per_worker(ms(300)));
    assert_eq!(means, vec![1.0, 1.0]);
}

#[test]
fn quantiles_use_nearest_rank() {
    let sorted: Vec<Duration> = (1..=100).map(ms).collect();
    assert_eq!(quantile(&sorted, 0.5), ms(50));
    assert_eq!(quantile(&sorted, 0.99), ms(99));
    assert_eq!(quantile(&[], 0.5), Duration::ZERO);
}

#[test]
fn max_over_mean_is_one_when_balanced() {
    assert_eq!(max_over_mean(&[2.0, 2.0]), 1.0);
    assert_eq!(max_over_mean(&[3.0, 1.0]), 1.5);
    assert_eq!(max_over_mean(&[0.0, 0.0]), 0.0);
    assert_eq!(max_over_mean(&[]), 0.0);
}
