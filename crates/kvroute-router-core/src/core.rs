//! [`KvRouterCore`]: the synchronous routing core (KV indexes + scheduler + sessions).

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_indexer::{
    ApproxIndex, ConcurrentIndex, FastMap, GapTracker, KvIndex, Learnt, OverlapScores,
};
use kvroute_protocols::kv_events::LocalBlockHash;
use kvroute_protocols::{WorkerId, WorkerLoadReport, WorkerWithDpRank};
use kvroute_scheduler::{
    ConfigError, LoadError, NewRequest, RequestId, Scheduler, SelectRequest, TierOverlap,
    WorkerError, WorkerLoad, WorkerSpec,
};
use kvroute_sessions::{
    AffinityStore, InMemoryAffinityStore, Rollback, SessionCommand, SessionCoordinator,
    StickyRoute, sticky_allowed,
};
use rand::Rng;

use crate::config::{KvMode, RouterConfig};
use crate::error::RouteError;
use crate::policy::Policy;
use crate::request::{
    PhaseTimings, PreparedRoute, RoutePreparer, RouteRequest, RouteSource, Routed, hash_prompt,
};
use inflight::Inflight;

/// The KV router as a sans-IO state machine: apply KV events, route requests, track their load
/// until they end, keep sessions sticky.
///
/// Synchronous and deterministic: `now` (time since any fixed epoch, never going backwards) and
/// the RNG come in as arguments, so the live router (behind a mutex) and trace replay (in virtual
/// time) run this same code. The only clock it reads is for [`PhaseTimings`], which no decision
/// depends on.
///
/// The exact index is shared ([`Self::shared_index`]), so that a live router hashes prompts and
/// matches them ([`Self::preparer`]) and applies queued events ([`Self::queue_event`]) without
/// holding the lock its core sits behind: that lock then covers only the decisions.
#[derive(Debug)]
pub struct KvRouterCore<S: AffinityStore = InMemoryAffinityStore> {
    config: RouterConfig,
    /// Blocks of workers that publish events (one shard: a router's events come from one event
    /// loop, and queries are cheapest on one shard).
    index: Arc<ConcurrentIndex>,
    /// Predicted blocks of workers that publish none.
    approx: ApproxIndex,
    /// Prompts routed to event workers whose events have not come yet
    /// ([`RouterConfig::inflight_ttl`]).
    inflight: Inflight,
    modes: FastMap<WorkerId, KvMode>,
    /// Event ids per worker: the runtime's publisher numbers one sequence per worker, over all
    /// of its dp ranks, so gaps are detected per worker rather than per rank.
    gaps: GapTracker,
    /// Per worker, the first event id from which its blocks are known completely (0 after a
    /// dump or a snapshot; the first id seen when its events arrived before anything else).
    origin: FastMap<WorkerId, u64>,
    scheduler: Scheduler,
    sessions: SessionCoordinator<S>,
    active: FastMap<RequestId, Active>,
    /// The last load each (worker, dp rank) reported of itself.
    /// Each rank's last load report and when it came.
    reports: FastMap<WorkerWithDpRank, (WorkerLoadReport, Duration)>,
    rr_next: u64,
    stats: CoreStats,
    scratch: Scratch,
    /// The request the last [`Self::route`] recorded a prediction for (its blocks are still in
    /// `scratch.local` until the next decision), for [`Self::predicted_blocks`].
    last_prediction: Option<RequestId>,
}

/// Counters of the core's event handling.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CoreStats {
    /// Live events applied to the exact index.
    pub events_applied: u64,
    /// Events whose id was at or below one already seen (duplicates, or already recovered);
    /// skipped.
    pub events_late: u64,
    /// Gaps in a worker's event ids.
    pub gaps_detected: u64,
    /// Events from workers in approximate mode; skipped.
    pub events_ignored: u64,
    /// Events from workers this core does not serve (not registered, or not yet): skipped. A
    /// worker's blocks are learnt when it joins (a dump, or the event stream from its first
    /// event id), so nothing is lost; indexing them instead would keep, forever, the blocks of
    /// every worker another router serves (a role-filtered phase router) and of every past
    /// life of a restarted one.
    pub events_unregistered: u64,
    /// Events applied from gap recovery or dumps.
    pub events_recovered: u64,
    /// Load reports recorded (and held against the tracked load).
    pub load_reports_applied: u64,
    /// Load reports from (worker, dp rank)s this core does not serve: skipped, like their
    /// events.
    pub load_reports_unregistered: u64,
}

/// What [`KvRouterCore::expire`] dropped.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Expired {
    /// Requests nobody finished within the scheduler's expiry; their load is gone.
    pub requests: Vec<RequestId>,
    /// Engine sessions to close (expired engine-backed bindings, and the deferred closes of the
    /// expired requests).
    pub session_closes: Vec<SessionCommand>,
}

/// A request in flight: what to do with its session when it ends.
#[derive(Debug)]
struct Active {
    worker: WorkerWithDpRank,
    /// Its prompt's blocks from this one on are credited in flight on `worker` until its prefill
    /// is done ([`Inflight::release`]).
    inflight_from: Option<usize>,
    pending_open: Option<SessionCommand>,
    after_response: Vec<SessionCommand>,
    rollback: Option<Rollback>,
}

#[derive(Debug, Default)]
struct Scratch {
    local: Vec<LocalBlockHash>,
    seq: Vec<u64>,
    overlaps: Vec<(WorkerWithDpRank, u32)>,
    /// The event workers' overlaps as the exact index alone shows them (`overlaps` before the
    /// in-flight blocks extend them).
    exact: Vec<(WorkerWithDpRank, u32)>,
    /// Runs of prompt blocks in slower tiers continuing each worker's device prefix.
    lower: Vec<TierOverlap>,
    /// Blocks each worker holds, from the exact index for event workers and from predictions
    /// for the others; filled only when the policy charges for evictions.
    resident: Vec<(WorkerWithDpRank, u64)>,
}

/// A decision before it is committed.
struct Decided {
    routed: Routed,
    sticky: StickyRoute,
    /// The round-robin turn was used (advance it on commit).
    round_robin: bool,
}

impl KvRouterCore<InMemoryAffinityStore> {
    /// A core with no workers and an in-memory affinity store; fails if the scheduler
    /// configuration does not validate.
    pub fn new(config: RouterConfig) -> Result<Self, ConfigError> {
        let store = InMemoryAffinityStore::new(config.max_sessions);
        Self::with_store(config, store)
    }
}

impl<S: AffinityStore> KvRouterCore<S> {
    /// A core with no workers whose sticky sessions live in `store`.
    pub fn with_store(config: RouterConfig, store: S) -> Result<Self, ConfigError> {
        let scheduler = Scheduler::new(config.scheduler.clone())?;
        Ok(Self {
            index: Arc::new(ConcurrentIndex::new()),
            approx: ApproxIndex::new(config.approx),
            inflight: Inflight::new(config.inflight_ttl, config.approx.max_blocks),
            modes: FastMap::default(),
            gaps: GapTracker::new(),
            origin: FastMap::default(),
            scheduler,
            sessions: SessionCoordinator::new(store, config.session_loss),
            active: FastMap::default(),
            reports: FastMap::default(),
            rr_next: 0,
            last_prediction: None,
            stats: CoreStats::default(),
            scratch: Scratch::default(),
            config,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &RouterConfig {
        &self.config
    }

    /// Tokens per KV block.
    pub fn block_size(&self) -> u32 {
        self.config.block_size()
    }

    /// The selection policy.
    pub fn policy(&self) -> Policy {
        self.config.policy
    }

    /// Changes the selection policy (load and caches are kept).
    pub fn set_policy(&mut self, policy: Policy) {
        self.config.policy = policy;
    }

    // ----- workers and events -----

    /// Registers a worker (all of its dp ranks) with zero load; `mode` says whether its cache is
    /// known from its events or predicted from routing decisions.
    pub fn add_worker(&mut self, spec: &WorkerSpec, mode: KvMode) -> Result<(), WorkerError> {
        self.scheduler.add_worker(spec)?;
        self.modes.insert(spec.worker_id, mode);
        tracing::info!(
            worker = spec.worker_id,
            ?mode,
            dp_size = spec.dp_size,
            "worker added"
        );
        Ok(())
    }

    /// Unregisters a worker: forgets its blocks, predictions and event ids, and drops the load
    /// of its requests in flight, which are returned (their guards still call `on_finished` or
    /// `on_failed`, which then only settle sessions). Unknown workers return an empty list.
    pub fn remove_worker(&mut self, worker_id: WorkerId) -> Vec<RequestId> {
        self.modes.remove(&worker_id);
        self.index_mut(|index| index.remove_worker(worker_id));
        self.approx.remove_worker(worker_id);
        self.inflight.remove_worker(worker_id);
        self.gaps.forget_worker(worker_id);
        self.origin.remove(&worker_id);
        self.reports.retain(|w, _| w.worker_id != worker_id);
        let dropped = self.scheduler.remove_worker(worker_id);
        tracing::info!(
            worker = worker_id,
            dropped = dropped.len(),
            "worker removed"
        );
        dropped
    }

    /// Whether the worker is registered.
    pub fn has_worker(&self, worker_id: WorkerId) -> bool {
        self.modes.contains_key(&worker_id)
    }

    /// The worker's KV mode, if registered.
    pub fn kv_mode(&self, worker_id: WorkerId) -> Option<KvMode> {
        self.modes.get(&worker_id).copied()
    }

    /// Runs `f` on the exact index once every queued event is applied (see
    /// [`ConcurrentIndex::with_shard_mut`]).
    fn index_mut<R>(&self, f: impl FnOnce(&mut KvIndex) -> R) -> R {
        self.index.with_shard_mut(0, f)
    }

    // ----- routing -----

    /// Routes a request: hashes its tokens into blocks, resolves a pinned worker or a sticky
    /// session (before any scoring), otherwise finds cached prefixes and selects a worker with
    /// the policy; then records the request's load (and, for a worker in approximate mode, the
    /// predicted blocks) and applies its session action.
    ///
    /// Run `session_open` (if any) before sending and report it with [`Self::session_opened`];
    /// report progress with [`Self::on_first_token`] / [`Self::on_output_tokens`]; end with
    /// [`Self::on_finished`] or [`Self::on_failed`]. On error no load was recorded.
    pub fn route<R: Rng + ?Sized>(
        &mut self,
        req: &RouteRequest<'_>,
        now: Duration,
        rng: &mut R,
    ) -> Result<Routed, RouteError> {
        self.route_with(req, None, now, rng)
    }

    /// [`Self::route`] for a request whose prompt was hashed and matched beforehand by
    /// [`RoutePreparer::prepare`] (outside the lock this core sits behind). The decision is the
    /// one `route` makes on an index holding what the preparation saw. A preparation of
    /// another request (id or prompt length) is ignored: the request is hashed and matched here.
    pub fn route_prepared<R: Rng + ?Sized>(
        &mut self,
        req: &RouteRequest<'_>,
        prepared: PreparedRoute,
        now: Duration,
        rng: &mut R,
    ) -> Result<Routed, RouteError> {
        self.route_with(req, Some(prepared), now, rng)
    }

    fn route_with<R: Rng + ?Sized>(
        &mut self,
        req: &RouteRequest<'_>,
        prepared: Option<PreparedRoute>,
        now: Duration,
        rng: &mut R,
    ) -> Result<Routed, RouteError> {
        if self.active.contains_key(&req.id) {
            return Err(LoadError::DuplicateRequest(req.id).into());
        }
        let Decided {
            mut routed,
            sticky,
            round_robin,
        } = self.decide(req, prepared, now, rng, false)?;
        let t = Instant::now();
        let control = req.hints.and_then(|h| h.session_control.as_ref());
        let plan = self
            .sessions
            .on_routed(control, sticky, routed.worker, now)?;
        // Slower tiers' blocks count at their weights, as the reference estimates cached tokens.
        let cached_tokens = routed.cost.cached_tokens(self.config.block_size());
        let added = self.scheduler.add_request_with_cached_tokens(
            &NewRequest {
                id: req.id,
                worker: routed.worker,
                isl_tokens: routed.isl_tokens,
                block_hashes: &self.scratch.seq,
                overlap_blocks: routed.overlap_blocks,
                expected_output_tokens: req.expected_output_tokens,
            },
            cached_tokens,
            now,
        );
        if let Err(e) = added {
            if let Some(rb) = plan.rollback {
                let _ = self.sessions.rollback(rb);
            }
            return Err(e.into());
        }
        let mut inflight_from = None;
        if self.modes.get(&routed.worker.worker_id) == Some(&KvMode::Approximate) {
            self.approx
                .record_request(routed.worker, &self.scratch.local, now, Some(req.id.0));
            self.last_prediction = Some(req.id);
        } else {
            // What the exact index already shows there needs no prediction.
            let from = self
                .scratch
                .exact
                .iter()
                .find(|(w, _)| *w == routed.worker)
                .map_or(0, |&(_, blocks)| blocks as usize);
            inflight_from = self
                .inflight
                .record(routed.worker, &self.scratch.seq, from, now)
                .then_some(from);
        }
        if round_robin {
            self.rr_next = self.rr_next.wrapping_add(1);
        }
        routed.session_open = plan.before_send.clone();
        self.active.insert(
            req.id,
            Active {
                worker: routed.worker,
                inflight_from,
                pending_open: plan.before_send,
                after_response: plan.after_response,
                rollback: plan.rollback,
            },
        );
        routed.timings.scheduling += t.elapsed();
        Ok(routed)
    }

    /// The decision [`Self::route`] would make now, without making it: no load, prediction,
    /// session binding or TTL refresh, round-robin turn or request id is touched (the
    /// scheduler's decision counters do count it). With the same RNG state, `route` right after
    /// chooses the same worker.
    pub fn query<R: Rng + ?Sized>(
        &mut self,
        req: &RouteRequest<'_>,
        now: Duration,
        rng: &mut R,
    ) -> Result<Routed, RouteError> {
        Ok(self.decide(req, None, now, rng, true)?.routed)
    }

    /// [`Self::query`] for a prepared request (see [`Self::route_prepared`]).
    pub fn query_prepared<R: Rng + ?Sized>(
        &mut self,
        req: &RouteRequest<'_>,
        prepared: PreparedRoute,
        now: Duration,
        rng: &mut R,
    ) -> Result<Routed, RouteError> {
        Ok(self.decide(req, Some(prepared), now, rng, true)?.routed)
    }

    /// Hashes prompts and matches them against this core's exact index, from any thread and
    /// without the core (see [`Self::route_prepared`]).
    pub fn preparer(&self) -> RoutePreparer {
        RoutePreparer::new(
            Arc::clone(&self.index),
            self.config.block_size(),
            self.charges_evictions(),
        )
    }

    fn decide<R: Rng + ?Sized>(
        &mut self,
        req: &RouteRequest<'_>,
        prepared: Option<PreparedRoute>,
        now: Duration,
        rng: &mut R,
        query: bool,
    ) -> Result<Decided, RouteError> {
        self.last_prediction = None;
        let mut timings = PhaseTimings::default();
        let prepared = prepared.filter(|p| p.fits(req));
        let (exact, resident) = match prepared {
            Some(p) => {
                self.scratch.local = p.local;
                self.scratch.seq = p.seq;
                timings.hashing = p.hashing;
                timings.find_matches = p.find_matches;
                (Some(p.exact), p.resident)
            }
            None => {
                let t = Instant::now();
                self.hash(req);
                timings.hashing = t.elapsed();
                (None, None)
            }
        };

        let t = Instant::now();
        let pinned = req.hints.and_then(|h| h.pinned_worker(req.phase));
        let (source, sticky) = match pinned {
            Some(_) => (RouteSource::Pinned, StickyRoute::Free),
            None if self.config.policy == Policy::Direct => {
                return Err(RouteError::NoWorkerId { phase: req.phase });
            }
            None => match self.sticky(req, now, query)? {
                StickyRoute::Bound(w) => (RouteSource::Sticky, StickyRoute::Bound(w)),
                other => (RouteSource::Selected, other),
            },
        };
        let sticky_time = t.elapsed();

        let t = Instant::now();
        self.find_matches(exact);
        self.count_resident(resident);
        timings.find_matches += t.elapsed();

        let t = Instant::now();
        let isl_tokens = req.tokens.len() as u64;
        let mut select = SelectRequest::new(isl_tokens, &self.scratch.seq, &self.scratch.overlaps);
        select.lower_tiers = &self.scratch.lower;
        select.resident_blocks = &self.scratch.resident;
        select.request_id = Some(req.id);
        select.avoided_worker_ids = req.avoided;
        if let Some(h) = req.hints {
            select = select.with_hints(h, req.phase);
        }
        // A policy with its own weights (kv-locality, kv-adaptive) replaces the configured ones.
        select.weights = self.config.policy.cost_weights();
        select.overrides = req.overrides;
        if let StickyRoute::Bound(w) = sticky {
            select.pinned_worker = Some(w.worker_id);
            select.pinned_dp_rank = Some(w.dp_rank);
        }
        let policy = self.config.policy;
        let rr_next = self.rr_next;
        let decision = self.scheduler.select(&select, rng)?;
        let candidates = decision.candidates.to_vec();
        let temperature = decision.temperature;
        let (cost, round_robin) = match (source, policy) {
            (RouteSource::Selected, Policy::RoundRobin) if !candidates.is_empty() => {
                let i = (rr_next % candidates.len() as u64) as usize;
                (candidates[i], true)
            }
            (RouteSource::Selected, Policy::Random) if !candidates.is_empty() => {
                (candidates[rng.gen_range(0..candidates.len())], false)
            }
            _ => (decision.chosen, false),
        };
        timings.scheduling = t.elapsed() + sticky_time;
        Ok(Decided {
            routed: Routed {
                id: req.id,
                worker: cost.worker,
                source,
                overlap_blocks: cost.overlap_blocks,
                prompt_blocks: self.scratch.local.len() as u32,
                isl_tokens,
                cost,
                candidates,
                temperature,
                session_open: None,
                timings,
            },
            sticky,
            round_robin,
        })
    }

    /// Block hashes (local, for the indexes) and sequence hashes (for the scheduler).
    fn hash(&mut self, req: &RouteRequest<'_>) {
        hash_prompt(
            req,
            self.config.block_size(),
            &mut self.scratch.local,
            &mut self.scratch.seq,
        );
    }

    /// Overlaps from the exact index (`exact` when the request was prepared) for event workers
    /// (device prefixes, and their runs in slower tiers) and from predictions for the others.
    fn find_matches(&mut self, exact: Option<OverlapScores>) {
        self.scratch.overlaps.clear();
        self.scratch.exact.clear();
        self.scratch.lower.clear();
        if self.scratch.local.is_empty() {
            return;
        }
        let exact = exact.unwrap_or_else(|| self.index.find_matches(&self.scratch.local));
        let modes = &self.modes;
        self.scratch.overlaps.extend(
            exact
                .scores
                .iter()
                .filter(|(w, _)| modes.get(&w.worker_id) != Some(&KvMode::Approximate))
                .map(|(&w, &s)| (w, s)),
        );
        self.scratch.lower.extend(
            exact
                .lower_tiers
                .iter()
                .filter(|t| modes.get(&t.worker.worker_id) != Some(&KvMode::Approximate))
                .map(|t| TierOverlap {
                    worker: t.worker,
                    tier: t.tier,
                    blocks: t.blocks,
                }),
        );
        self.scratch.exact.clone_from(&self.scratch.overlaps);
        if !self.inflight.is_empty() {
            // A prompt still in flight on an event worker: its blocks count as cached there
            // until its events arrive, continuing what the index shows.
            self.inflight
                .extend(&self.scratch.seq, &mut self.scratch.overlaps, |w| {
                    modes.get(&w.worker_id) == Some(&KvMode::Approximate)
                });
        }
        if self.approx.live_blocks() > 0 {
            let predicted = self.approx.find_matches(&self.scratch.local);
            self.scratch.overlaps.extend(
                predicted
                    .scores
                    .iter()
                    .filter(|(w, _)| modes.get(&w.worker_id) == Some(&KvMode::Approximate))
                    .map(|(&w, &s)| (w, s)),
            );
        }
    }

    /// The session's stickiness for this request; a query only peeks (no TTL refresh, no
    /// unbinding of a session whose worker left).
    fn sticky(
        &self,
        req: &RouteRequest<'_>,
        now: Duration,
        query: bool,
    ) -> Result<StickyRoute, RouteError> {
        let is_live = |w: WorkerWithDpRank| self.scheduler.worker_load(w).is_some();
        if !query {
            return Ok(self.sessions.route(req.hints, req.phase, now, is_live)?);
        }
        if !sticky_allowed(req.hints, req.phase) {
            return Ok(StickyRoute::Free);
        }
        let bound = req
            .hints
            .and_then(|h| h.session_control.as_ref())
            .and_then(|sc| self.sessions.store().peek(&sc.session_id, now))
            .map(|token| token.binding.worker);
        Ok(match bound {
            Some(w) if is_live(w) => StickyRoute::Bound(w),
            Some(previous) => StickyRoute::Rebind { previous },
            None => StickyRoute::Free,
        })
    }

    // ----- request lifecycle -----

    /// The worker answered the request's `session_open` command (`accepted` false when it
    /// refused or failed): binds the session engine-backed if accepted.
    pub fn session_opened(
        &mut self,
        id: RequestId,
        accepted: bool,
        now: Duration,
    ) -> Result<(), RouteError> {
        let Some(active) = self.active.get_mut(&id) else {
            return Err(LoadError::UnknownRequest(id).into());
        };
        let Some(cmd) = active.pending_open.take() else {
            return Ok(());
        };
        if let Some(rb) = self.sessions.open_finished(&cmd, accepted, now)? {
            active.rollback = Some(rb);
        }
        Ok(())
    }

    /// The request's first token arrived: its prompt no longer counts as prefill load, nor as
    /// cached in flight on its worker (its events say that now).
    pub fn on_first_token(&mut self, id: RequestId) -> Result<(), LoadError> {
        self.release_inflight(id);
        self.scheduler.mark_prefill_completed(id)
    }

    /// The request generated `tokens` more output tokens (implies its prefill completed).
    pub fn on_output_tokens(&mut self, id: RequestId, tokens: u64) -> Result<(), LoadError> {
        self.release_inflight(id);
        self.scheduler.add_output_tokens(id, tokens)
    }

    /// The request's prefill is done or will not be: its engine has published its prompt's
    /// blocks (or never will), so they are no longer credited in flight and the events alone
    /// say what its worker holds.
    fn release_inflight(&mut self, id: RequestId) {
        let Some(from) = self
            .active
            .get_mut(&id)
            .and_then(|a| a.inflight_from.take())
        else {
            return;
        };
        if let Some((worker, prompt)) = self.scheduler.request_prompt(id) {
            self.inflight
                .release(worker, prompt.get(from..).unwrap_or_default());
        }
    }

    /// The engine serving request `id` reported `reported` of its prompt's tokens found in its
    /// cache. For a worker in approximate mode the report teaches the prediction: the worker's
    /// effective capacity (in blocks or in requests of age, whichever has lately predicted its
    /// reports better) is learnt from it ([`kvroute_indexer::ApproxIndex::on_report`]), so later
    /// matches stop where the engine's cache evidently ends. A report of none of a prompt whose
    /// blocks were far too young to be evicted ([`kvroute_indexer::Learnt::Lost`]) means the
    /// engine lost what it held (a restart): every prediction for that worker is dropped but
    /// this request's prompt, which the engine holds now. Returns how many predicted blocks
    /// were dropped (0 when nothing was wrong, or the worker publishes events, or the request
    /// is unknown).
    pub fn on_cache_report(&mut self, id: RequestId, reported: u64) -> usize {
        // Borrowed, not copied: every response of an approximate worker reports.
        let Some((worker, prompt)) = self.scheduler.request_prompt(id) else {
            return 0;
        };
        if self.modes.get(&worker.worker_id) != Some(&KvMode::Approximate) {
            return 0;
        }
        let block = u64::from(self.config.block_size());
        let blocks = |tokens: u64| u32::try_from(tokens / block).unwrap_or(u32::MAX);
        let learnt = self.approx.on_report(id.0, blocks(reported));
        // An eviction or a survival is learnt as capacity and the predictions stand; only a
        // lost cache drops them.
        if learnt != Learnt::Lost {
            return 0;
        }
        self.approx.retain_worker(worker, prompt)
    }

    /// The request's response ended normally: frees its load and returns the deferred session
    /// commands (the engine-session `close`) to run now. Unknown ids return nothing.
    pub fn on_finished(&mut self, id: RequestId) -> Vec<SessionCommand> {
        self.release_inflight(id);
        let _ = self.scheduler.free(id);
        self.approx.forget(id.0);
        self.active
            .remove(&id)
            .map(|a| a.after_response)
            .unwrap_or_default()
    }

    /// The request failed (worker error, cancellation, worker death): frees its load, undoes the
    /// session binding it made, and returns the session commands to run (closing an engine
    /// session it opened, and its deferred close). Unknown ids return nothing.
    pub fn on_failed(&mut self, id: RequestId) -> Vec<SessionCommand> {
        self.release_inflight(id);
        let _ = self.scheduler.free(id);
        self.approx.forget(id.0);
        let Some(active) = self.active.remove(&id) else {
            return Vec::new();
        };
        let mut commands = Vec::new();
        if let Some(close) = active.rollback.and_then(|rb| self.sessions.rollback(rb)) {
            commands.push(close);
        }
        for cmd in active.after_response {
            if !commands.contains(&cmd) {
                commands.push(cmd);
            }
        }
        commands
    }

    /// Drops the load nobody owns any more after the scheduler's expiry (another replica's
    /// request its replica never ended), predictions past their TTL and sessions past theirs.
    /// Call it periodically with a clock that never goes backwards.
    ///
    /// A request this core routed is never dropped by age: its caller owns it until
    /// [`Self::on_finished`] or [`Self::on_failed`] (the live router's guard calls one of them on
    /// every path, replay's simulator when the engine ends it), so a request waiting long in a
    /// saturated engine's queue stays load, as it is.
    pub fn expire(&mut self, now: Duration) -> Expired {
        let active = &self.active;
        let requests = self
            .scheduler
            .expire_unowned(now, |id| active.contains_key(&id));
        let mut session_closes = Vec::new();
        for id in &requests {
            if let Some(active) = self.active.remove(id) {
                session_closes.extend(active.after_response);
            }
        }
        self.approx.expire(now);
        self.inflight.expire(now);
        session_closes.extend(self.sessions.expire(now));
        let ttl = self.config.report_ttl;
        self.reports
            .retain(|_, (_, at)| now.saturating_sub(*at) <= ttl);
        Expired {
            requests,
            session_closes,
        }
    }

    // ----- observation -----

    /// Requests routed and not yet ended.
    pub fn active_requests(&self) -> usize {
        self.active.len()
    }

    /// The worker a request in flight was routed to.
    pub fn request_worker(&self, id: RequestId) -> Option<WorkerWithDpRank> {
        self.active.get(&id).map(|a| a.worker)
    }

    /// Every registered (worker, dp rank).
    pub fn workers(&self) -> impl Iterator<Item = WorkerWithDpRank> + '_ {
        self.scheduler.workers()
    }

    /// The load of one (worker, dp rank), if registered.
    pub fn worker_load(&self, worker: WorkerWithDpRank) -> Option<WorkerLoad> {
        self.scheduler.worker_load(worker)
    }

    /// Event handling counters.
    pub fn stats(&self) -> CoreStats {
        self.stats
    }

    /// The scheduler (load, metrics counters).
    pub fn scheduler(&self) -> &Scheduler {
        &self.scheduler
    }

    /// Runs `f` on the exact index, fed by events, once every queued event is applied.
    pub fn with_index<R>(&self, f: impl FnOnce(&KvIndex) -> R) -> R {
        self.index_mut(|index| f(index))
    }

    /// The exact index, shared: query it, or apply the events [`Self::queue_event`] queued, from
    /// any thread.
    pub fn shared_index(&self) -> &Arc<ConcurrentIndex> {
        &self.index
    }

    /// The approximate index, fed by routing decisions.
    pub fn approx_index(&self) -> &ApproxIndex {
        &self.approx
    }

    /// The session coordinator (its store holds the bindings).
    pub fn sessions(&self) -> &SessionCoordinator<S> {
        &self.sessions
    }

    /// The next event id expected from `worker_id`, if any event was seen.
    pub fn expected_event_id(&self, worker_id: WorkerId) -> Option<u64> {
        self.gaps
            .expected(WorkerWithDpRank::from_worker_id(worker_id))
    }
}

mod events;
mod inflight;
mod load;
mod resident;
pub(crate) mod snapshot;

#[cfg(test)]
mod tests;
