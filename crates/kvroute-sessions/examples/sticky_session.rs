//! A multi-turn conversation stays on the worker its session opened on: the coordinator decides
//! stickiness before worker selection, asks the transport to open and close the engine session,
//! and closes sessions that sat idle past their timeout, all in virtual time.
//!
//! Run with `cargo run -p kvroute-sessions --example sticky_session`.

use std::time::Duration;

use kvroute_protocols::{
    RequestPhase, RoutingHints, SessionAction, SessionControl, WorkerWithDpRank,
};
use kvroute_sessions::{
    AffinityStore, FakeLifecycle, InMemoryAffinityStore, SessionCommand, SessionCoordinator,
    StickyRoute, WorkerLossMode,
};

fn main() -> Result<(), kvroute_sessions::SessionError> {
    let sessions = SessionCoordinator::new(InMemoryAffinityStore::default(), WorkerLossMode::Soft);
    // Stands in for the transport: every worker accepts `open`, and every command is recorded.
    let workers = FakeLifecycle::accepting();
    let live = |_: WorkerWithDpRank| true;
    let chosen_by_scheduler = WorkerWithDpRank::from_worker_id(3);
    let phase = RequestPhase::Aggregated;

    // Turn 1 opens the session (60 s idle timeout). Nothing is bound yet, so the scheduler picks
    // a worker; the plan asks that worker to open an engine session before the request is sent.
    let open = turn("chat-1", Some(SessionAction::Open), 60);
    let t = Duration::from_secs(0);
    let route = sessions.route(Some(&open), phase, t, live)?;
    assert_eq!(route, StickyRoute::Free);
    let mut plan =
        sessions.on_routed(open.session_control.as_ref(), route, chosen_by_scheduler, t)?;
    sessions.run_before_send(&workers, &mut plan, t)?;
    println!("turn 1: {route:?}, scheduler chose {chosen_by_scheduler}, session opened there");

    // Turn 2 (no action) is routed to the bound worker, whatever the scheduler would say.
    let middle = turn("chat-1", None, 60);
    let t = Duration::from_secs(30);
    let route = sessions.route(Some(&middle), phase, t, live)?;
    println!("turn 2: {route:?}");
    assert_eq!(route, StickyRoute::Bound(chosen_by_scheduler));

    // Turn 3 closes it: unbound now, the engine session closed once the response has ended.
    let close = turn("chat-1", Some(SessionAction::Close), 60);
    let t = Duration::from_secs(50);
    let route = sessions.route(Some(&close), phase, t, live)?;
    let plan = sessions.on_routed(
        close.session_control.as_ref(),
        route,
        chosen_by_scheduler,
        t,
    )?;
    println!(
        "turn 3: {route:?}, after the response: {:?}",
        plan.after_response
    );
    assert_eq!(plan.after_response.len(), 1);
    assert!(sessions.store().is_empty());

    // A session opened and then abandoned is closed on its worker once its timeout has passed.
    let abandoned = turn("chat-2", Some(SessionAction::Open), 60);
    let t = Duration::from_secs(100);
    let route = sessions.route(Some(&abandoned), phase, t, live)?;
    let mut plan = sessions.on_routed(
        abandoned.session_control.as_ref(),
        route,
        chosen_by_scheduler,
        t,
    )?;
    sessions.run_before_send(&workers, &mut plan, t)?;
    assert!(sessions.expire(Duration::from_secs(159)).is_empty());
    let reaped = sessions.expire(Duration::from_secs(161));
    println!("idle past its timeout: {reaped:?}");
    assert!(
        matches!(&reaped[..], [SessionCommand::Close { session_id, .. }] if session_id == "chat-2")
    );
    assert_eq!(
        workers.commands().len(),
        2,
        "the transport ran the two opens"
    );
    Ok(())
}

/// The routing hints of one turn of `session_id`.
fn turn(session_id: &str, action: Option<SessionAction>, timeout_secs: u64) -> RoutingHints {
    let mut control = SessionControl::new(session_id).with_timeout(timeout_secs);
    control.action = action;
    RoutingHints {
        session_control: Some(control),
        ..RoutingHints::default()
    }
}
