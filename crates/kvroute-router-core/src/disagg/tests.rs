use super::*;

fn side(uncached_tokens: u64, backlog_tokens: u64) -> PrefillSide {
    PrefillSide {
        uncached_tokens,
        backlog_tokens,
    }
}

/// `(isl, local, remote)` placed with the default thresholds.
fn check(isl: u64, local: PrefillSide, remote: PrefillSide, expect: PrefillPlacement) {
    let placed = ConditionalDisagg::default().place(isl, local, remote);
    assert_eq!(
        placed, expect,
        "isl {isl}, local {local:?}, remote {remote:?}"
    );
}

#[test]
fn a_short_uncached_part_is_prefilled_locally() {
    let short = PrefillPlacement::Local(LocalReason::ShortUncached);
    check(900, side(900, 0), side(900, 0), short);
    // The threshold itself is local; one token more is not (nothing else applies).
    check(5000, side(1000, 0), side(1000, 0), short);
    check(5000, side(1001, 0), side(1001, 0), PrefillPlacement::Remote);
}

#[test]
fn a_mostly_cached_prompt_is_prefilled_locally() {
    let cached = PrefillPlacement::Local(LocalReason::MostlyCached);
    // 8000 of 10000 tokens cached on the decode worker: exactly the default share.
    check(10_000, side(2000, 0), side(10_000, 0), cached);
    check(
        10_000,
        side(2001, 0),
        side(2001, 0),
        PrefillPlacement::Remote,
    );
}

#[test]
fn a_long_prefill_queue_keeps_the_prefill_local() {
    let queued = PrefillPlacement::Local(LocalReason::PrefillQueueLong);
    // Remote work 4000 + 4000 is twice the local 0 + 4000.
    check(4000, side(4000, 0), side(4000, 4000), queued);
    check(
        4000,
        side(4000, 0),
        side(4000, 3999),
        PrefillPlacement::Remote,
    );
    // A busy decode worker raises the bar.
    check(
        4000,
        side(4000, 4000),
        side(4000, 8000),
        PrefillPlacement::Remote,
    );
}

#[test]
fn otherwise_the_prefill_is_remote() {
    check(3000, side(3000, 0), side(3000, 0), PrefillPlacement::Remote);
    check(3000, side(3000, 500), side(0, 0), PrefillPlacement::Remote);
}

#[test]
fn zero_thresholds_always_disaggregate_unless_queued() {
    let always = ConditionalDisagg {
        max_local_prefill_tokens: 0,
        min_local_cached_share: 2.0,
        prefill_queue_ratio: f64::MAX,
    };
    assert_eq!(
        always.place(100, side(100, 0), side(100, 1_000_000)),
        PrefillPlacement::Remote
    );
    // Fully cached on the decode worker: nothing to prefill anywhere.
    assert_eq!(
        always.place(100, side(0, 0), side(100, 0)),
        PrefillPlacement::Local(LocalReason::ShortUncached)
    );
}

#[test]
fn settings_are_checked() {
    let bad_share = ConditionalDisagg {
        min_local_cached_share: f64::NAN,
        ..ConditionalDisagg::default()
    };
    assert_eq!(
        bad_share.validated().unwrap_err().to_string(),
        "min_local_cached_share must be a number >= 0 (above 1 turns the rule off), got NaN"
    );
    let bad_ratio = ConditionalDisagg {
        prefill_queue_ratio: 0.0,
        ..ConditionalDisagg::default()
    };
    assert!(matches!(
        bad_ratio.validated(),
        Err(ConditionalDisaggError::QueueRatio(_))
    ));
    assert!(ConditionalDisagg::default().validated().is_ok());
}

#[test]
fn placements_have_names() {
    assert_eq!(PrefillPlacement::Remote.name(), "remote");
    assert!(PrefillPlacement::Local(LocalReason::MostlyCached).is_local());
    assert_eq!(
        PrefillPlacement::Local(LocalReason::PrefillQueueLong).name(),
        "prefill_queue_long"
    );
}

#[test]
fn a_busy_decode_worker_still_prefills_a_short_or_cached_prompt() {
    // Holding these rules to the decode worker's own queue was measured and dropped (see
    // `place`): 20,000 tokens waiting there do not send a short prompt away.
    check(
        5000,
        side(500, 20_000),
        side(5000, 0),
        PrefillPlacement::Local(LocalReason::ShortUncached),
    );
}
