//! The seam between the simulated fleet and the live router: a [`Dispatcher`] that routes every
//! arrival with [`KvRouterCore::route`] and feeds the core what a live worker would report (KV
//! events, first token, output tokens, completion), in virtual time.
//!
//! Engine `i` of the simulation is router worker id `i`, registered in event mode with the
//! engine's KV capacity and batch budget, exactly as a live mocker worker registers.

use std::collections::HashMap;
use std::time::Duration;

use indicatif::ProgressBar;
use kvroute_mocker::sim::Dispatcher;
use kvroute_mocker::{Engine, Request, RequestError, StepOutput};
use kvroute_protocols::kv_events::{RouterEvent, StorageTier};
use kvroute_protocols::{RoutingHints, SessionAction, SessionControl};
use kvroute_router_core::{KvRouterCore, RequestId, RouteError, RouteRequest, Routed};
use rand_chacha::ChaCha8Rng;

use crate::replay::metrics::Recorder;

/// How often (virtual time) the core's expiry runs, as the live router's background task would.
const EXPIRE_EVERY: Duration = Duration::from_secs(10);

/// Progress is reported in steps of this many requests, so the bar's lock is rarely taken.
const PROGRESS_STEP: u64 = 64;

/// Drives one [`KvRouterCore`] from a simulation.
pub(crate) struct RouterDispatcher {
    core: KvRouterCore,
    run: RunState,
}

impl RouterDispatcher {
    /// Wraps `core`, whose workers `0..` must be the simulation's engines in order.
    pub(crate) fn new(core: KvRouterCore, run: RunState) -> Self {
        Self { core, run }
    }

    /// The core (named for the drain check) and the run's state, after the run.
    pub(crate) fn into_parts(self) -> (Vec<(&'static str, KvRouterCore)>, RunState) {
        (vec![("", self.core)], self.run)
    }
}

impl Dispatcher for RouterDispatcher {
    fn pick(&mut self, now: Duration, request: &Request, engines: &[Engine]) -> usize {
        if self.run.pacer.arrival(now) {
            self.run.expired += self.core.expire(now).requests.len() as u64;
        }
        match self.run.route_arrival(&mut self.core, request, now) {
            Some(worker) => {
                self.run.recorder.arrived(request.id, worker, now);
                worker
            }
            // An index past the last engine makes the simulation stop with an error; the caller
            // reports the routing error instead.
            None => engines.len(),
        }
    }

    fn observe(&mut self, worker: usize, output: &StepOutput) {
        self.run.gaps += feed(&mut self.core, worker, output, Some(&mut self.run.recorder));
    }

    fn rejected(&mut self, now: Duration, _worker: usize, id: u64, _error: &RequestError) {
        let _ = self.core.on_failed(RequestId(id));
        self.run.recorder.left(id, now, false);
    }
}

/// What every dispatcher keeps besides its router cores: the tie-break RNG, the client-side
/// figures, progress and expiry pacing, and what went wrong.
pub(crate) struct RunState {
    rng: ChaCha8Rng,
    pub(crate) recorder: Recorder,
    pub(crate) pacer: Pacer,
    /// The first routing failure; the run stops there.
    pub(crate) error: Option<RouteError>,
    /// Event-id gaps the cores detected (none expected: the simulation loses no events).
    pub(crate) gaps: u64,
    /// Requests the cores expired before they finished.
    pub(crate) expired: u64,
    /// Sessions of the requests and where their turns ran.
    pub(crate) sessions: SessionTracker,
}

impl RunState {
    pub(crate) fn new(
        rng: ChaCha8Rng,
        recorder: Recorder,
        progress: ProgressBar,
        sessions: SessionTracker,
    ) -> Self {
        Self {
            rng,
            recorder,
            pacer: Pacer::new(progress),
            error: None,
            gaps: 0,
            expired: 0,
            sessions,
        }
    }

    /// Routes a newly arrived request with `core`: with sticky sessions its session's binding
    /// goes with it (`session_control` with `bind` on every turn: the first binds the session
    /// where the policy sends it, later ones follow the binding and refresh it, and a binding
    /// that expired is made again where the policy sends the turn). Counts the turn for session
    /// continuity. Returns the worker's index, or `None` after recording a routing error.
    pub(crate) fn route_arrival(
        &mut self,
        core: &mut KvRouterCore,
        request: &Request,
        now: Duration,
    ) -> Option<usize> {
        let session = self.sessions.of(request.id);
        let hints = session
            .filter(|_| self.sessions.sticky)
            .map(|s| RoutingHints {
                session_control: Some(
                    SessionControl::new(s.to_string()).with_action(SessionAction::Bind),
                ),
                ..RoutingHints::default()
            });
        let mut route = RouteRequest::new(RequestId(request.id), &request.tokens);
        route.hints = hints.as_ref();
        let worker = self.route(core, &route, now)?;
        if let Some(session) = session {
            self.sessions.served(session, worker);
        }
        Some(worker)
    }

    /// Asks `core` where `route` would go, changing nothing but the tie-break RNG; `None` after
    /// recording a routing error.
    pub(crate) fn query(
        &mut self,
        core: &mut KvRouterCore,
        route: &RouteRequest<'_>,
        now: Duration,
    ) -> Option<Routed> {
        match core.query(route, now, &mut self.rng) {
            Ok(routed) => Some(routed),
            Err(e) => {
                self.error.get_or_insert(e);
                None
            }
        }
    }

    /// Routes `route` with `core` and returns the chosen worker's index, or records the first
    /// routing error and returns `None`.
    pub(crate) fn route(
        &mut self,
        core: &mut KvRouterCore,
        route: &RouteRequest<'_>,
        now: Duration,
    ) -> Option<usize> {
        match core.route(route, now, &mut self.rng) {
            Ok(routed) => {
                if let Some(d) = self.recorder.detail(routed.id.0) {
                    d.isl_tokens = routed.isl_tokens;
                    d.overlap_blocks = routed.overlap_blocks;
                    d.best_overlap_blocks = routed
                        .candidates
                        .iter()
                        .map(|c| c.overlap_blocks)
                        .max()
                        .unwrap_or(routed.overlap_blocks);
                    d.prefill_blocks = routed.cost.prefill_blocks;
                    d.decode_blocks = routed.cost.decode_blocks;
                    d.candidates = routed.candidates.len();
                }
                Some(routed.worker.worker_id as usize)
            }
            Err(e) => {
                self.error.get_or_insert(e);
                None
            }
        }
    }
}

/// Which session each request belongs to, whether sessions are sent to the router as sticky,
/// and how many of a session's later turns ran where its previous turn ran.
#[derive(Debug, Clone, Default)]
pub(crate) struct SessionTracker {
    /// `of_request[id]`: the session of request `id`.
    of_request: Vec<Option<u64>>,
    sticky: bool,
    last_worker: HashMap<u64, usize>,
    /// Turns after a session's first (sub-agents' first turns are their own sessions' first).
    pub(crate) later_turns: u64,
    /// Of those, routed to the worker its session's previous turn was routed to.
    pub(crate) continued: u64,
}

impl SessionTracker {
    /// Sessions of request ids `0..`; `sticky` sends them to the router's session machinery.
    pub(crate) fn new(of_request: Vec<Option<u64>>, sticky: bool) -> Self {
        Self {
            of_request,
            sticky,
            ..Self::default()
        }
    }

    fn of(&self, id: u64) -> Option<u64> {
        usize::try_from(id)
            .ok()
            .and_then(|i| self.of_request.get(i).copied().flatten())
    }

    fn served(&mut self, session: u64, worker: usize) {
        if let Some(previous) = self.last_worker.insert(session, worker) {
            self.later_turns += 1;
            if previous == worker {
                self.continued += 1;
            }
        }
    }

    /// The share of later turns that ran where the previous turn ran; `None` when the trace
    /// has no session with two turns.
    pub(crate) fn continuity(&self) -> Option<f64> {
        (self.later_turns > 0).then(|| self.continued as f64 / self.later_turns as f64)
    }
}

/// Progress reporting and the periodic expiry that every dispatcher runs at each arrival.
pub(crate) struct Pacer {
    progress: ProgressBar,
    unreported: u64,
    next_expire: Duration,
}

impl Pacer {
    pub(crate) fn new(progress: ProgressBar) -> Self {
        Self {
            progress,
            unreported: 0,
            next_expire: EXPIRE_EVERY,
        }
    }

    /// Counts one arrival at `now`; true when the cores' expiry is due (every [`EXPIRE_EVERY`]
    /// of virtual time, as the live router's background task runs it).
    pub(crate) fn arrival(&mut self, now: Duration) -> bool {
        self.unreported += 1;
        if self.unreported >= PROGRESS_STEP {
            self.flush();
        }
        if now < self.next_expire {
            return false;
        }
        self.next_expire = now + EXPIRE_EVERY;
        true
    }

    /// Reports progress not yet shown.
    pub(crate) fn flush(&mut self) {
        self.progress.inc(std::mem::take(&mut self.unreported));
    }
}

/// Feeds `core` what engine `worker` produced, as a live worker would report it: KV events,
/// first tokens, output tokens and completions. With a `recorder`, the tokens and completions are
/// also the client's (latency figures). Returns the event-id gaps the core detected.
pub(crate) fn feed(
    core: &mut KvRouterCore,
    worker: usize,
    output: &StepOutput,
    mut recorder: Option<&mut Recorder>,
) -> u64 {
    let gaps = apply_events(core, worker, output);
    for token in &output.tokens {
        let id = RequestId(token.request_id);
        // Unknown ids (expired requests) are fine to ignore: their load is already gone.
        if token.index == 0 {
            let _ = core.on_first_token(id);
        }
        let _ = core.on_output_tokens(id, 1);
        if let Some(recorder) = recorder.as_deref_mut() {
            recorder.token(token);
        }
    }
    for finished in &output.finished {
        // Replay only binds sessions router-side (never opens engine sessions), so there are
        // no deferred session commands to run.
        let _ = core.on_finished(RequestId(finished.request_id));
        if let Some(recorder) = recorder.as_deref_mut() {
            recorder.left(finished.request_id, finished.at, true);
        }
    }
    gaps
}

/// Feeds one engine's KV events to `core` as worker `worker`; returns the gaps detected.
fn apply_events(core: &mut KvRouterCore, worker: usize, output: &StepOutput) -> u64 {
    let mut gaps = 0;
    for event in &output.events {
        let event = RouterEvent {
            worker_id: worker as u64,
            storage_tier: StorageTier::default(),
            event: event.clone(),
        };
        if core.apply_event(&event).is_some() {
            gaps += 1;
        }
    }
    gaps
}
