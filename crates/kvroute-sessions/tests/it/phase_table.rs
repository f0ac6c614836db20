//! The reference's sticky-phase table: stickiness is skipped for a phase whose worker is
//! explicitly pinned (prefill: prefill worker, prefill dp rank or backend instance; decode:
//! decode worker, dp rank or backend instance; aggregated: backend instance or dp rank).

use kvroute_protocols::{RequestPhase, RoutingHints, SessionControl};
use kvroute_sessions::sticky_allowed;

/// A pin set on top of a request that carries session control.
#[derive(Debug, Clone, Copy)]
enum Pin {
    None,
    Backend,
    PrefillWorker,
    PrefillDpRank,
    DecodeWorker,
    DpRank,
}

fn hints(pin: Pin) -> RoutingHints {
    let mut h = RoutingHints {
        session_control: Some(SessionControl::new("sess-1")),
        ..RoutingHints::default()
    };
    match pin {
        Pin::None => {}
        Pin::Backend => h.backend_instance_id = Some(5),
        Pin::PrefillWorker => h.prefill_worker_id = Some(1),
        Pin::PrefillDpRank => h.prefill_dp_rank = Some(2),
        Pin::DecodeWorker => h.decode_worker_id = Some(3),
        Pin::DpRank => h.dp_rank = Some(4),
    }
    h
}

/// `expect` is (prefill, decode, aggregated) stickiness.
fn check(pin: Pin, expect: (bool, bool, bool)) {
    let h = hints(pin);
    let got = (
        sticky_allowed(Some(&h), RequestPhase::Prefill),
        sticky_allowed(Some(&h), RequestPhase::Decode),
        sticky_allowed(Some(&h), RequestPhase::Aggregated),
    );
    assert_eq!(got, expect, "pin {pin:?}");
}

#[test]
fn sticky_phase_table() {
    check(Pin::None, (true, true, true));
    check(Pin::Backend, (false, false, false));
    check(Pin::PrefillWorker, (false, true, true));
    check(Pin::PrefillDpRank, (false, true, true));
    check(Pin::DecodeWorker, (true, false, true));
    check(Pin::DpRank, (true, false, false));
}

#[test]
fn no_session_control_means_no_stickiness() {
    let h = RoutingHints::default();
    for phase in [
        RequestPhase::Prefill,
        RequestPhase::Decode,
        RequestPhase::Aggregated,
    ] {
        assert!(!sticky_allowed(Some(&h), phase));
        assert!(!sticky_allowed(None, phase));
    }
}
