//! [`SessionCoordinator`]: sticky routing and the engine session lifecycle, with the reference's
//! semantics, as a sans-IO state machine (it returns [`SessionCommand`]s; the transport runs them).
//!
//! Per request the router calls [`SessionCoordinator::route`] before selection (is the session
//! bound to a worker?), then [`SessionCoordinator::on_routed`] with the chosen worker, which
//! returns a [`RoutedPlan`]: a command to run before sending (`open`), commands to run after the
//! response ends (the deferred `close`), and a [`Rollback`] for when the request fails.

use std::time::Duration;

use kvroute_protocols::{
    RequestPhase, RoutingHints, SessionAction, SessionControl, WorkerWithDpRank,
};

use crate::lifecycle::{LifecycleError, SessionCommand, SessionLifecycle};
use crate::store::{AffinityBinding, AffinityKind, AffinityStore, AffinityToken, StoreError};

/// What happens to a session whose bound worker has left.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum WorkerLossMode {
    /// Route the request normally and re-bind the session to the new worker (router-only: the
    /// new worker holds no engine session).
    #[default]
    Soft,
    /// Fail the request with an error naming the session and the worker.
    Hard,
}

/// Stickiness for one request and phase, decided before worker selection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StickyRoute {
    /// No stickiness applies (no session control, the phase is pinned, or the session is not
    /// bound): select a worker normally.
    Free,
    /// The session is bound: route to this worker.
    Bound(WorkerWithDpRank),
    /// The session was bound to a worker that left (soft mode): select normally; `on_routed`
    /// re-binds the session to the chosen worker.
    Rebind {
        /// The worker that left.
        previous: WorkerWithDpRank,
    },
}

/// Undo information for a request that fails after its session was bound.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rollback {
    session_id: String,
    token: AffinityToken,
    close_opened: Option<SessionCommand>,
}

/// What the transport must do around one routed request.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RoutedPlan {
    /// Run before sending the request (an `Open`); report its outcome to
    /// [`SessionCoordinator::open_finished`].
    pub before_send: Option<SessionCommand>,
    /// Run once the response has ended (the deferred `Close`).
    pub after_response: Vec<SessionCommand>,
    /// Pass to [`SessionCoordinator::rollback`] if the request fails.
    pub rollback: Option<Rollback>,
}

/// Why a session operation failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SessionError {
    /// Hard mode: the session's worker has left.
    #[error("session {session_id:?} is bound to worker {worker}, which is no longer available")]
    WorkerGone {
        /// The session.
        session_id: String,
        /// The worker that left.
        worker: WorkerWithDpRank,
    },
    /// The affinity store refused the binding.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The lifecycle command failed.
    #[error(transparent)]
    Lifecycle(#[from] LifecycleError),
}

/// Whether session stickiness applies to `phase`: the request carries session control and the
/// phase's worker is not explicitly pinned (a pin wins over stickiness).
pub fn sticky_allowed(hints: Option<&RoutingHints>, phase: RequestPhase) -> bool {
    hints.is_some_and(|h| h.session_control.is_some() && !h.is_pinned(phase))
}

/// Sticky sessions over an [`AffinityStore`].
#[derive(Debug)]
pub struct SessionCoordinator<S> {
    store: S,
    mode: WorkerLossMode,
}

impl<S: AffinityStore> SessionCoordinator<S> {
    /// A coordinator over `store`.
    pub fn new(store: S, mode: WorkerLossMode) -> Self {
        Self { store, mode }
    }

    /// The underlying store.
    pub fn store(&self) -> &S {
        &self.store
    }

    /// Where the session (if any) sends this request's `phase`. An intermediate turn (no action)
    /// refreshes the binding's TTL; lifecycle actions only peek. `is_live` says whether a worker
    /// is still registered.
    pub fn route(
        &self,
        hints: Option<&RoutingHints>,
        phase: RequestPhase,
        now: Duration,
        is_live: impl Fn(WorkerWithDpRank) -> bool,
    ) -> Result<StickyRoute, SessionError> {
        if !sticky_allowed(hints, phase) {
            return Ok(StickyRoute::Free);
        }
        let Some(sc) = hints.and_then(|h| h.session_control.as_ref()) else {
            return Ok(StickyRoute::Free);
        };
        let found = if sc.action.is_none() {
            self.store.get(&sc.session_id, now)
        } else {
            self.store.peek(&sc.session_id, now)
        };
        let Some(token) = found else {
            return Ok(StickyRoute::Free);
        };
        let worker = token.binding.worker;
        if is_live(worker) {
            tracing::debug!(session = %sc.session_id, %worker, "sticky session hit");
            return Ok(StickyRoute::Bound(worker));
        }
        match self.mode {
            WorkerLossMode::Hard => Err(SessionError::WorkerGone {
                session_id: sc.session_id.clone(),
                worker,
            }),
            WorkerLossMode::Soft => {
                // The worker (and any engine session on it) is gone: nothing to close.
                self.store.remove_if_token(&sc.session_id, token);
                tracing::info!(session = %sc.session_id, %worker, "bound worker left; re-routing session");
                Ok(StickyRoute::Rebind { previous: worker })
            }
        }
    }

    /// The request was routed to `worker`: applies its session action.
    ///
    /// - `open`: the plan asks the worker to open an engine session; the binding is made by
    ///   [`Self::open_finished`] only if the worker accepts.
    /// - `bind`: binds router-only now.
    /// - `close`: unbinds now; the engine close runs after the response, and only when the
    ///   binding was engine-backed or unknown (a router-only binding has nothing to close).
    /// - no action: nothing (the TTL was refreshed by `route`), except re-binding after the
    ///   bound worker left in soft mode.
    pub fn on_routed(
        &self,
        control: Option<&SessionControl>,
        route: StickyRoute,
        worker: WorkerWithDpRank,
        now: Duration,
    ) -> Result<RoutedPlan, SessionError> {
        let Some(sc) = control else {
            return Ok(RoutedPlan::default());
        };
        let ttl = Duration::from_secs(sc.timeout);
        let session_id = &sc.session_id;
        match sc.action {
            Some(SessionAction::Open) => Ok(RoutedPlan {
                before_send: Some(SessionCommand::Open {
                    session_id: session_id.clone(),
                    worker,
                    timeout: ttl,
                }),
                ..RoutedPlan::default()
            }),
            Some(SessionAction::Bind) => {
                // Binding a session the worker already holds open keeps it engine-backed, so
                // that its close still reaches the engine; only a new binding (or one moved to
                // another worker, whose engine never opened it) is router-only.
                let kind = match self.store.peek(session_id, now) {
                    Some(t)
                        if t.binding.worker == worker
                            && t.binding.kind == AffinityKind::EngineBacked =>
                    {
                        AffinityKind::EngineBacked
                    }
                    _ => AffinityKind::RouterOnly,
                };
                let token = self.bind(session_id, worker, kind, ttl, now)?;
                Ok(RoutedPlan {
                    rollback: Some(Rollback {
                        session_id: session_id.clone(),
                        token,
                        close_opened: None,
                    }),
                    ..RoutedPlan::default()
                })
            }
            Some(SessionAction::Close) => {
                let removed = self.store.remove(session_id);
                let engine_close = removed.is_none_or(|b| b.kind == AffinityKind::EngineBacked);
                let after_response = if engine_close {
                    vec![SessionCommand::Close {
                        session_id: session_id.clone(),
                        worker,
                    }]
                } else {
                    Vec::new()
                };
                Ok(RoutedPlan {
                    after_response,
                    ..RoutedPlan::default()
                })
            }
            None => {
                if let StickyRoute::Rebind { .. } = route {
                    self.bind(session_id, worker, AffinityKind::RouterOnly, ttl, now)?;
                }
                Ok(RoutedPlan::default())
            }
        }
    }

    /// The worker answered an `Open`: binds engine-backed if it accepted (and returns the
    /// rollback that unbinds and closes it should the request fail); binds nothing otherwise.
    pub fn open_finished(
        &self,
        command: &SessionCommand,
        accepted: bool,
        now: Duration,
    ) -> Result<Option<Rollback>, SessionError> {
        let SessionCommand::Open {
            session_id,
            worker,
            timeout,
        } = command
        else {
            return Ok(None);
        };
        if !accepted {
            tracing::info!(session = %session_id, %worker, "worker refused to open the session; not binding");
            return Ok(None);
        }
        let token = self.bind(
            session_id,
            *worker,
            AffinityKind::EngineBacked,
            *timeout,
            now,
        )?;
        Ok(Some(Rollback {
            session_id: session_id.clone(),
            token,
            close_opened: Some(SessionCommand::Close {
                session_id: session_id.clone(),
                worker: *worker,
            }),
        }))
    }

    /// Runs the plan's `before_send` with `lifecycle` synchronously (simulation and tests; the
    /// live transport runs the command itself and calls [`Self::open_finished`]).
    pub fn run_before_send(
        &self,
        lifecycle: &impl SessionLifecycle,
        plan: &mut RoutedPlan,
        now: Duration,
    ) -> Result<(), SessionError> {
        let Some(cmd) = plan.before_send.take() else {
            return Ok(());
        };
        let accepted = match &cmd {
            SessionCommand::Open {
                session_id,
                worker,
                timeout,
            } => lifecycle.open(session_id, *worker, *timeout)?,
            SessionCommand::Close { session_id, worker } => {
                lifecycle.close(session_id, *worker)?;
                return Ok(());
            }
        };
        if let Some(rb) = self.open_finished(&cmd, accepted, now)? {
            plan.rollback = Some(rb);
        }
        Ok(())
    }

    /// The request failed: removes the binding it made (unless something rebound the session
    /// since) and returns the close for an engine session it opened.
    pub fn rollback(&self, rollback: Rollback) -> Option<SessionCommand> {
        self.store
            .remove_if_token(&rollback.session_id, rollback.token);
        rollback.close_opened
    }

    /// Reaps bindings expired at `now`; returns a close for each engine-backed one.
    pub fn expire(&self, now: Duration) -> Vec<SessionCommand> {
        self.store
            .expire(now)
            .into_iter()
            .filter(|e| e.binding.kind == AffinityKind::EngineBacked)
            .map(|e| {
                tracing::info!(session = %e.session_id, worker = %e.binding.worker, "engine-backed session expired; closing");
                SessionCommand::Close { session_id: e.session_id, worker: e.binding.worker }
            })
            .collect()
    }

    fn bind(
        &self,
        session_id: &str,
        worker: WorkerWithDpRank,
        kind: AffinityKind,
        ttl: Duration,
        now: Duration,
    ) -> Result<AffinityToken, SessionError> {
        tracing::info!(session = %session_id, %worker, ?kind, ttl_secs = ttl.as_secs(), "binding session");
        Ok(self
            .store
            .put(session_id, AffinityBinding { worker, kind }, ttl, now)?
            .token)
    }
}
