use std::time::Duration;

use super::*;

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

fn health() -> PassiveHealth {
    PassiveHealth::new(HealthConfig {
        failures_to_eject: 3,
        base_ejection: secs(2),
        max_ejection: secs(10),
    })
}

#[test]
fn a_refused_connection_ejects_at_once() {
    let mut h = health();
    assert_eq!(
        h.on_failure(1, HealthFailure::Unreachable, secs(100)),
        Verdict::Ejected {
            until: secs(102),
            after: secs(2)
        }
    );
    assert_eq!(h.ejected(secs(101)), vec![1]);
    assert!(!h.is_ejected(2, secs(101)));
    assert!(h.ejected(secs(102)).is_empty(), "the ejection ends on time");
}

#[test]
fn timeouts_eject_only_after_the_threshold_in_a_row() {
    let mut h = health();
    assert_eq!(
        h.on_failure(7, HealthFailure::Timeout, secs(0)),
        Verdict::Counted { in_a_row: 1 }
    );
    assert_eq!(
        h.on_failure(7, HealthFailure::Lost, secs(1)),
        Verdict::Counted { in_a_row: 2 }
    );
    // A success in between starts the count again.
    assert!(!h.on_success(7));
    assert_eq!(
        h.on_failure(7, HealthFailure::Timeout, secs(2)),
        Verdict::Counted { in_a_row: 1 }
    );
    h.on_failure(7, HealthFailure::Timeout, secs(3));
    assert!(matches!(
        h.on_failure(7, HealthFailure::Timeout, secs(4)),
        Verdict::Ejected { .. }
    ));
    assert!(h.is_ejected(7, secs(5)));
}

#[test]
fn a_failed_probe_doubles_the_ejection_up_to_the_cap_and_a_success_clears_it() {
    let mut h = health();
    let mut now = secs(0);
    let mut lengths = Vec::new();
    for _ in 0..5 {
        match h.on_failure(3, HealthFailure::Unreachable, now) {
            Verdict::Ejected { until, after } => {
                lengths.push(after.as_secs());
                // Failures of requests sent before the ejection change nothing.
                assert_eq!(
                    h.on_failure(3, HealthFailure::Lost, now + Duration::from_millis(1)),
                    Verdict::AlreadyEjected
                );
                now = until;
            }
            other => panic!("expected an ejection, got {other:?}"),
        }
        // On probation: one timeout (below the threshold otherwise) ejects again.
        assert!(!h.is_ejected(3, now));
    }
    assert_eq!(lengths, vec![2, 4, 8, 10, 10]);
    assert!(
        h.on_success(3),
        "the probe's success lets the worker back in"
    );
    assert_eq!(
        h.on_failure(3, HealthFailure::Timeout, now),
        Verdict::Counted { in_a_row: 1 },
        "after a success the worker starts with a clean record"
    );
}

#[test]
fn a_worker_that_left_is_forgotten() {
    let mut h = health();
    h.on_failure(9, HealthFailure::Unreachable, secs(0));
    h.remove(9);
    assert!(h.ejected(secs(1)).is_empty());
}
