//! The coordinator's lifecycle semantics, driven in virtual time with the fake lifecycle.

use std::time::Duration;

use kvroute_protocols::{
    RequestPhase, RoutingHints, SessionAction, SessionControl, WorkerWithDpRank,
};
use kvroute_sessions::{
    AffinityKind, AffinityStore, FakeLifecycle, InMemoryAffinityStore, RoutedPlan, SessionCommand,
    SessionCoordinator, SessionError, StickyRoute, WorkerLossMode,
};

const AGG: RequestPhase = RequestPhase::Aggregated;

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

fn w(id: u64) -> WorkerWithDpRank {
    WorkerWithDpRank::new(id, 0)
}

fn coordinator(mode: WorkerLossMode) -> SessionCoordinator<InMemoryAffinityStore> {
    SessionCoordinator::new(InMemoryAffinityStore::new(100), mode)
}

fn hints(action: Option<SessionAction>, timeout: u64) -> RoutingHints {
    let mut sc = SessionControl::new("s1").with_timeout(timeout);
    sc.action = action;
    RoutingHints {
        session_control: Some(sc),
        ..RoutingHints::default()
    }
}

/// One turn: route, pretend selection picked `selected` when free, apply the action, run the
/// `open` through `life`. Returns where it went and the plan.
fn turn(
    c: &SessionCoordinator<InMemoryAffinityStore>,
    life: &FakeLifecycle,
    h: &RoutingHints,
    selected: WorkerWithDpRank,
    now: Duration,
) -> Result<(WorkerWithDpRank, RoutedPlan), SessionError> {
    let route = c.route(Some(h), AGG, now, |_| true)?;
    let worker = match route {
        StickyRoute::Bound(w) => w,
        _ => selected,
    };
    let mut plan = c.on_routed(h.session_control.as_ref(), route, worker, now)?;
    c.run_before_send(life, &mut plan, now)?;
    Ok((worker, plan))
}

#[test]
fn open_binds_engine_backed_and_close_defers_the_engine_close() {
    let c = coordinator(WorkerLossMode::Soft);
    let life = FakeLifecycle::accepting();
    let (_, plan) = turn(
        &c,
        &life,
        &hints(Some(SessionAction::Open), 60),
        w(3),
        secs(0),
    )
    .expect("ok");
    assert!(plan.rollback.is_some());
    assert_eq!(
        c.store().peek("s1", secs(1)).map(|t| t.binding.kind),
        Some(AffinityKind::EngineBacked)
    );
    // Intermediate turn: sticks to worker 3 whatever selection would say.
    let (worker, plan) = turn(&c, &life, &hints(None, 60), w(9), secs(30)).expect("ok");
    assert_eq!((worker, plan), (w(3), RoutedPlan::default()));
    // Closing turn: unbound now, engine close only after the response.
    let (worker, plan) = turn(
        &c,
        &life,
        &hints(Some(SessionAction::Close), 60),
        w(9),
        secs(40),
    )
    .expect("ok");
    assert_eq!(worker, w(3));
    assert!(c.store().is_empty());
    assert_eq!(
        plan.after_response,
        vec![SessionCommand::Close {
            session_id: "s1".into(),
            worker: w(3)
        }]
    );
    assert_eq!(
        life.commands(),
        vec![SessionCommand::Open {
            session_id: "s1".into(),
            worker: w(3),
            timeout: secs(60)
        }],
        "the close is deferred, not sent during routing"
    );
}

#[test]
fn open_refused_by_the_worker_leaves_no_binding() {
    let c = coordinator(WorkerLossMode::Soft);
    let life = FakeLifecycle::refusing();
    let (_, plan) = turn(
        &c,
        &life,
        &hints(Some(SessionAction::Open), 60),
        w(3),
        secs(0),
    )
    .expect("ok");
    assert_eq!(plan.rollback, None);
    assert!(c.store().is_empty());
    assert_eq!(
        c.route(Some(&hints(None, 60)), AGG, secs(1), |_| true),
        Ok(StickyRoute::Free)
    );
}

#[test]
fn close_of_a_router_only_binding_sends_no_engine_close() {
    let c = coordinator(WorkerLossMode::Soft);
    let life = FakeLifecycle::accepting();
    turn(
        &c,
        &life,
        &hints(Some(SessionAction::Bind), 60),
        w(2),
        secs(0),
    )
    .expect("ok");
    assert_eq!(
        c.store().peek("s1", secs(1)).map(|t| t.binding.kind),
        Some(AffinityKind::RouterOnly)
    );
    let (_, plan) = turn(
        &c,
        &life,
        &hints(Some(SessionAction::Close), 60),
        w(9),
        secs(1),
    )
    .expect("ok");
    assert_eq!(plan.after_response, vec![]);
    assert!(
        life.commands().is_empty(),
        "bind and close of a router-only session reach no engine"
    );
}

#[test]
fn close_of_an_unknown_session_still_closes_the_engine() {
    let c = coordinator(WorkerLossMode::Soft);
    let (_, plan) = turn(
        &c,
        &FakeLifecycle::accepting(),
        &hints(Some(SessionAction::Close), 60),
        w(4),
        secs(0),
    )
    .expect("ok");
    assert_eq!(
        plan.after_response,
        vec![SessionCommand::Close {
            session_id: "s1".into(),
            worker: w(4)
        }]
    );
}

#[test]
fn intermediate_turns_refresh_and_expiry_closes_engine_sessions() {
    let c = coordinator(WorkerLossMode::Soft);
    let life = FakeLifecycle::accepting();
    turn(
        &c,
        &life,
        &hints(Some(SessionAction::Open), 10),
        w(1),
        secs(0),
    )
    .expect("ok");
    // Turns at 8 and 16 keep it alive past its original deadline of 10.
    for t in [8, 16] {
        assert_eq!(
            turn(&c, &life, &hints(None, 10), w(9), secs(t))
                .expect("ok")
                .0,
            w(1)
        );
        assert_eq!(c.expire(secs(t)), vec![]);
    }
    // A lifecycle action only peeks: a `bind` routed at 20 does not extend the deadline (26).
    assert_eq!(
        c.route(
            Some(&hints(Some(SessionAction::Bind), 10)),
            AGG,
            secs(20),
            |_| true
        ),
        Ok(StickyRoute::Bound(w(1)))
    );
    assert_eq!(c.expire(secs(25)), vec![]);
    assert_eq!(
        c.expire(secs(26)),
        vec![SessionCommand::Close {
            session_id: "s1".into(),
            worker: w(1)
        }]
    );
    assert_eq!(
        c.route(Some(&hints(None, 10)), AGG, secs(27), |_| true),
        Ok(StickyRoute::Free)
    );
}

#[test]
fn expired_router_only_bindings_close_nothing() {
    let c = coordinator(WorkerLossMode::Soft);
    turn(
        &c,
        &FakeLifecycle::accepting(),
        &hints(Some(SessionAction::Bind), 5),
        w(1),
        secs(0),
    )
    .expect("ok");
    assert_eq!(c.expire(secs(5)), vec![]);
    assert!(c.store().is_empty());
}

#[test]
fn rollback_unbinds_and_closes_what_the_failed_request_opened() {
    let c = coordinator(WorkerLossMode::Soft);
    let (_, plan) = turn(
        &c,
        &FakeLifecycle::accepting(),
        &hints(Some(SessionAction::Open), 60),
        w(3),
        secs(0),
    )
    .expect("ok");
    let close = c.rollback(plan.rollback.expect("opened"));
    assert_eq!(
        close,
        Some(SessionCommand::Close {
            session_id: "s1".into(),
            worker: w(3)
        })
    );
    assert!(c.store().is_empty());
}

#[test]
fn soft_mode_rebinds_when_the_bound_worker_leaves() {
    let c = coordinator(WorkerLossMode::Soft);
    turn(
        &c,
        &FakeLifecycle::accepting(),
        &hints(Some(SessionAction::Open), 60),
        w(3),
        secs(0),
    )
    .expect("ok");
    let h = hints(None, 60);
    let route = c
        .route(Some(&h), AGG, secs(1), |wk| wk != w(3))
        .expect("soft");
    assert_eq!(route, StickyRoute::Rebind { previous: w(3) });
    c.on_routed(h.session_control.as_ref(), route, w(5), secs(1))
        .expect("rebound");
    let token = c.store().peek("s1", secs(2)).expect("bound again");
    assert_eq!(
        (token.binding.worker, token.binding.kind),
        (w(5), AffinityKind::RouterOnly)
    );
}

#[test]
fn hard_mode_fails_naming_the_session_and_worker() {
    let c = coordinator(WorkerLossMode::Hard);
    turn(
        &c,
        &FakeLifecycle::accepting(),
        &hints(Some(SessionAction::Bind), 60),
        w(3),
        secs(0),
    )
    .expect("ok");
    let err = c
        .route(Some(&hints(None, 60)), AGG, secs(1), |_| false)
        .expect_err("hard");
    assert_eq!(
        err.to_string(),
        "session \"s1\" is bound to worker 3/dp0, which is no longer available"
    );
}

#[test]
fn a_pinned_phase_ignores_the_binding() {
    let c = coordinator(WorkerLossMode::Soft);
    turn(
        &c,
        &FakeLifecycle::accepting(),
        &hints(Some(SessionAction::Bind), 60),
        w(3),
        secs(0),
    )
    .expect("ok");
    let mut h = hints(None, 60);
    h.backend_instance_id = Some(7);
    assert_eq!(
        c.route(Some(&h), AGG, secs(1), |_| true),
        Ok(StickyRoute::Free)
    );
}

#[test]
fn a_full_store_refuses_the_bind_with_a_clear_error() {
    let c = SessionCoordinator::new(InMemoryAffinityStore::new(0), WorkerLossMode::Soft);
    let err = turn(
        &c,
        &FakeLifecycle::accepting(),
        &hints(Some(SessionAction::Bind), 60),
        w(3),
        secs(0),
    )
    .expect_err("full");
    assert_eq!(
        err.to_string(),
        "affinity store is full (0 sessions); expire or close sessions, or raise max_sessions"
    );
}

#[test]
fn a_bind_after_an_open_keeps_the_session_engine_backed_so_its_close_reaches_the_engine() {
    let c = coordinator(WorkerLossMode::Soft);
    let life = FakeLifecycle::accepting();
    turn(
        &c,
        &life,
        &hints(Some(SessionAction::Open), 60),
        w(3),
        secs(0),
    )
    .expect("open");
    let (worker, _) = turn(
        &c,
        &life,
        &hints(Some(SessionAction::Bind), 60),
        w(9),
        secs(10),
    )
    .expect("bind");
    assert_eq!(worker, w(3), "the bind sticks to the open session's worker");
    assert_eq!(
        c.store().peek("s1", secs(11)).map(|t| t.binding.kind),
        Some(AffinityKind::EngineBacked)
    );
    let (_, plan) = turn(
        &c,
        &life,
        &hints(Some(SessionAction::Close), 60),
        w(9),
        secs(20),
    )
    .expect("close");
    assert_eq!(
        plan.after_response,
        vec![SessionCommand::Close {
            session_id: "s1".into(),
            worker: w(3)
        }],
        "the engine that opened the session is told to close it"
    );
}
