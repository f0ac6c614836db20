use std::time::{Duration, Instant};

use super::WarnThrottle;

/// What happened at a millisecond offset: an occurrence (`check`) or a flush.
enum Op {
    Check(u64),
    Flush(u64),
}

/// Runs `ops` through a 10 s throttle and returns one line per call that logged: the offset and
/// the suffix the line would carry.
fn check(ops: &[Op], expect: &[&str]) {
    let throttle = WarnThrottle::new(Duration::from_secs(10));
    let t0 = Instant::now();
    let mut logged = Vec::new();
    for op in ops {
        let (at, out) = match *op {
            Op::Check(ms) => (ms, throttle.check(t0 + Duration::from_millis(ms))),
            Op::Flush(ms) => (ms, throttle.flush(t0 + Duration::from_millis(ms))),
        };
        if let Some(more) = out {
            logged.push(format!("{at}:{more}"));
        }
    }
    assert_eq!(logged, expect);
}

fn burst(from_ms: u64, to_ms: u64, every_ms: u64) -> Vec<Op> {
    (from_ms..to_ms)
        .step_by(every_ms as usize)
        .map(Op::Check)
        .collect()
}

#[test]
fn the_first_occurrence_is_logged_at_once_and_alone() {
    check(&[Op::Check(0)], &["0:"]);
    check(&[Op::Check(5_000)], &["5000:"]);
}

#[test]
fn a_burst_within_the_window_is_one_line() {
    // 1,000 failures in 10 s, as while NATS is down.
    check(&burst(0, 10_000, 10), &["0:"]);
}

#[test]
fn the_first_occurrence_after_the_window_carries_the_count() {
    let mut ops = burst(0, 10_000, 10);
    ops.push(Op::Check(10_000));
    check(
        &ops,
        &["0:", "10000: (999 more like this in the last 10 s)"],
    );
    // A long quiet spell: the count covers all of it.
    check(
        &[Op::Check(0), Op::Check(1), Op::Check(60_000)],
        &["0:", "60000: (1 more like this in the last 60 s)"],
    );
}

#[test]
fn a_steady_stream_logs_once_per_window() {
    let ops = burst(0, 30_001, 100);
    check(
        &ops,
        &[
            "0:",
            "10000: (99 more like this in the last 10 s)",
            "20000: (99 more like this in the last 10 s)",
            "30000: (99 more like this in the last 10 s)",
        ],
    );
}

#[test]
fn flush_reports_the_last_burst_once_the_window_has_passed() {
    check(
        &[
            Op::Check(0),
            Op::Check(100),
            Op::Check(200),
            // Too early: the window is still open.
            Op::Flush(5_000),
            Op::Flush(10_500),
            // Nothing left to report.
            Op::Flush(30_000),
        ],
        &["0:", "10500: (2 more like this in the last 11 s)"],
    );
    // Nothing suppressed, nothing to flush; before any occurrence, nothing either.
    check(&[Op::Flush(0), Op::Check(0), Op::Flush(20_000)], &["0:"]);
}

#[test]
fn a_flush_restarts_the_window() {
    check(
        &[
            Op::Check(0),
            Op::Check(1),
            Op::Flush(10_000),
            Op::Check(15_000),
            Op::Check(20_000),
        ],
        &[
            "0:",
            "10000: (1 more like this in the last 10 s)",
            "20000: (1 more like this in the last 10 s)",
        ],
    );
}
