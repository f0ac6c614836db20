//! A deterministic simulation of several engines in virtual time: arrivals are dispatched to
//! engines by a [`Dispatcher`] (the seam where `kvroute replay` plugs in the real router), every
//! engine runs its steps at their modelled times, and the report sums what happened.
//!
//! Events at the same instant are processed in a fixed order (engines by index, then arrivals), so
//! the same inputs always give the same report.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::time::Duration;

use crate::config::{ConfigError, MockerConfig};
use crate::engine::Engine;
use crate::request::{Request, RequestError, RequestId, StepOutput};

/// A request and when it arrives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Arrival {
    /// Arrival time since the start of the simulation.
    pub at: Duration,
    /// The request.
    pub request: Request,
}

/// Chooses the engine of each arriving request and watches what engines produce.
pub trait Dispatcher {
    /// The index (into `engines`) of the engine that serves `request`, arriving at `now`.
    fn pick(&mut self, now: Duration, request: &Request, engines: &[Engine]) -> usize;

    /// Called with everything engine `worker` produced (tokens, finishes, KV events) at each of
    /// its wake-ups.
    fn observe(&mut self, worker: usize, output: &StepOutput) {
        let _ = (worker, output);
    }

    /// Called when engine `worker` refused request `id` at `now` (it was counted in
    /// [`SimReport::rejected`] and produces nothing), so a dispatcher can free what it tracked.
    fn rejected(&mut self, now: Duration, worker: usize, id: RequestId, error: &RequestError) {
        let _ = (now, worker, id, error);
    }
}

/// Sends request `i` to engine `i % n`.
#[derive(Debug, Clone, Default)]
pub struct RoundRobin {
    next: usize,
}

impl Dispatcher for RoundRobin {
    fn pick(&mut self, _now: Duration, _request: &Request, engines: &[Engine]) -> usize {
        let picked = self.next % engines.len().max(1);
        self.next = picked + 1;
        picked
    }
}

/// A simulation that cannot go on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SimError {
    /// Arrivals must come in time order.
    #[error(
        "arrival of request {id} at {at:?} comes before the previous arrival at {previous:?}; arrivals must be sorted by time"
    )]
    OutOfOrder {
        /// The offending request.
        id: RequestId,
        /// Its time.
        at: Duration,
        /// The previous arrival's time.
        previous: Duration,
    },
    /// The dispatcher picked an engine that does not exist.
    #[error("dispatcher picked engine {picked}, expected an index below {engines}")]
    NoSuchEngine {
        /// The index picked.
        picked: usize,
        /// Engines in the simulation.
        engines: usize,
    },
}

/// Mean and percentiles of a latency distribution.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LatencySummary {
    /// Samples.
    pub count: usize,
    /// Mean.
    pub mean: Duration,
    /// Median.
    pub p50: Duration,
    /// 99th percentile.
    pub p99: Duration,
    /// Maximum.
    pub max: Duration,
}

impl LatencySummary {
    fn from_samples(mut samples: Vec<Duration>) -> Self {
        if samples.is_empty() {
            return Self::default();
        }
        samples.sort_unstable();
        let n = samples.len();
        let total: Duration = samples.iter().sum();
        let pick = |q: f64| samples[((n as f64 * q).ceil() as usize).clamp(1, n) - 1];
        Self {
            count: n,
            mean: total / n as u32,
            p50: pick(0.50),
            p99: pick(0.99),
            max: samples[n - 1],
        }
    }
}

/// What a simulation run did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SimReport {
    /// Requests that arrived.
    pub arrived: u64,
    /// Requests an engine refused (see [`crate::RequestError`]).
    pub rejected: u64,
    /// Requests that generated all their tokens.
    pub completed: u64,
    /// Prompt tokens admitted.
    pub prompt_tokens: u64,
    /// Prompt tokens served from the prefix cache.
    pub cached_prompt_tokens: u64,
    /// Tokens generated.
    pub output_tokens: u64,
    /// Preemptions over all engines.
    pub preemptions: u64,
    /// Engine steps over all engines.
    pub steps: u64,
    /// KV events emitted over all engines.
    pub kv_events: u64,
    /// When the last engine went idle.
    pub simulated: Duration,
    /// Time to first token.
    pub ttft: LatencySummary,
    /// Arrival to last token.
    pub e2e: LatencySummary,
}

/// Several engines sharing one virtual clock.
#[derive(Debug)]
pub struct Simulation {
    engines: Vec<Engine>,
}

impl Simulation {
    /// `workers` identical engines (data-parallel rank 0 each).
    pub fn new(config: &MockerConfig, workers: usize) -> Result<Self, ConfigError> {
        let engines = (0..workers)
            .map(|_| Engine::new(config.clone(), 0))
            .collect::<Result<_, _>>()?;
        Ok(Self { engines })
    }

    /// The engines, in worker index order.
    pub fn engines(&self) -> &[Engine] {
        &self.engines
    }

    /// Feeds every arrival and runs until all engines are idle.
    pub fn run<I, D>(&mut self, arrivals: I, dispatcher: &mut D) -> Result<SimReport, SimError>
    where
        I: IntoIterator<Item = Arrival>,
        D: Dispatcher + ?Sized,
    {
        let mut arrivals = ArrivalFeed::new(arrivals);
        let mut report = SimReport::default();
        let mut started: HashMap<RequestId, Duration> = HashMap::new();
        let mut ttft = Vec::new();
        let mut e2e = Vec::new();
        let mut out = StepOutput::default();
        let before: Vec<_> = self.engines.iter().map(Engine::stats).collect();
        loop {
            let next_engine = self.engines.iter().filter_map(Engine::next_wakeup).min();
            let Some(now) = next_engine.into_iter().chain(arrivals.next_at()).min() else {
                break;
            };
            advance_due(
                &mut self.engines,
                now,
                &mut out,
                &mut report,
                |worker, out| {
                    for token in out.tokens.iter().filter(|t| t.index == 0) {
                        if let Some(&arrived) = started.get(&token.request_id) {
                            ttft.push(token.at.saturating_sub(arrived));
                        }
                    }
                    for finished in &out.finished {
                        if let Some(arrived) = started.remove(&finished.request_id) {
                            e2e.push(finished.at.saturating_sub(arrived));
                        }
                    }
                    dispatcher.observe(worker, out);
                },
            );
            while let Some(arrival) = arrivals.next_due(now)? {
                report.arrived += 1;
                let picked = dispatcher.pick(now, &arrival.request, &self.engines);
                let id = arrival.request.id;
                match engine_at(&mut self.engines, picked)?.add_request(now, arrival.request) {
                    Ok(()) => {
                        started.insert(id, now);
                    }
                    Err(error) => {
                        report.rejected += 1;
                        dispatcher.rejected(now, picked, id, &error);
                    }
                }
            }
        }
        report.completed = e2e.len() as u64;
        // Counters are per engine lifetime; a second run reports only its own work.
        add_stats(&mut report, &self.engines, &before, Counted::All);
        report.ttft = LatencySummary::from_samples(ttft);
        report.e2e = LatencySummary::from_samples(e2e);
        Ok(report)
    }
}

/// The dispatcher of a [`DisaggSimulation`]: [`Dispatcher::pick`] chooses the prefill engine of
/// each arrival (and [`Dispatcher::observe`] / [`Dispatcher::rejected`] see the prefill engines),
/// the methods here the decode engine once the prefill finished.
pub trait DisaggDispatcher: Dispatcher {
    /// The index (into `decode`) of the decode engine that serves `request` aggregated, prefill
    /// included, instead of a prefill engine (conditional disaggregation); `None` (the default)
    /// sends it to the prefill engine [`Dispatcher::pick`] chooses. Asked first for every
    /// arrival; a request served locally is seen by the decode methods only.
    fn pick_local(&mut self, now: Duration, request: &Request, decode: &[Engine]) -> Option<usize> {
        let _ = (now, request, decode);
        None
    }

    /// The index (into `decode`) of the decode engine that continues `request` (the client's
    /// request, with its full output budget), whose prefill finished at `now`.
    fn pick_decode(&mut self, now: Duration, request: &Request, decode: &[Engine]) -> usize;

    /// Called with everything decode engine `worker` produced at each of its wake-ups.
    fn observe_decode(&mut self, worker: usize, output: &StepOutput) {
        let _ = (worker, output);
    }

    /// Called when decode engine `worker` refused request `id` at `now`.
    fn rejected_decode(
        &mut self,
        now: Duration,
        worker: usize,
        id: RequestId,
        error: &RequestError,
    ) {
        let _ = (now, worker, id, error);
    }
}

/// Disaggregated serving in virtual time: every arrival is prefilled on a prefill engine with an
/// output budget of one token; when that finishes, the request goes to a decode engine, which
/// receives the prompt's KV after the modelled transfer time
/// ([`crate::disagg::DecodeConfig::transfer_per_block`]) and generates the full output. An
/// arrival for which [`DisaggDispatcher::pick_local`] names a decode engine is served there
/// whole instead, as aggregated serving does.
///
/// The report counts prompt tokens (and cached ones) where they were computed (prefill engines,
/// and decode engines for local prefills), output tokens on the decode engines, and measures TTFT and end-to-end latency from arrival to the decode engine's
/// first and last token, as a client of the disaggregated router sees them.
#[derive(Debug)]
pub struct DisaggSimulation {
    prefill: Vec<Engine>,
    decode: Vec<Engine>,
    transfer: crate::disagg::DecodeConfig,
}

impl DisaggSimulation {
    /// `prefill` prefill engines and `decode` decode engines, all with `config`.
    pub fn new(
        config: &MockerConfig,
        prefill: usize,
        decode: usize,
        transfer: crate::disagg::DecodeConfig,
    ) -> Result<Self, ConfigError> {
        let engines = |n: usize| {
            (0..n)
                .map(|_| Engine::new(config.clone(), 0))
                .collect::<Result<Vec<_>, _>>()
        };
        Ok(Self {
            prefill: engines(prefill)?,
            decode: engines(decode)?,
            transfer,
        })
    }

    /// The prefill engines, in index order.
    pub fn prefill_engines(&self) -> &[Engine] {
        &self.prefill
    }

    /// The decode engines, in index order.
    pub fn decode_engines(&self) -> &[Engine] {
        &self.decode
    }

    /// Feeds every arrival through prefill, transfer and decode, and runs until all engines are
    /// idle. Same-instant events run in a fixed order: prefill engines, decode engines (each by
    /// index), finished transfers (by the order their prefills finished), then arrivals.
    pub fn run<I, D>(&mut self, arrivals: I, dispatcher: &mut D) -> Result<SimReport, SimError>
    where
        I: IntoIterator<Item = Arrival>,
        D: DisaggDispatcher + ?Sized,
    {
        let mut arrivals = ArrivalFeed::new(arrivals);
        let mut run = DisaggRun::default();
        let mut out = StepOutput::default();
        let before_prefill: Vec<_> = self.prefill.iter().map(Engine::stats).collect();
        let before_decode: Vec<_> = self.decode.iter().map(Engine::stats).collect();
        loop {
            let next_engine = self
                .prefill
                .iter()
                .chain(&self.decode)
                .filter_map(Engine::next_wakeup)
                .min();
            let next_transfer_at = run.transfers.peek().map(|Reverse((at, ..))| *at);
            let Some(now) = [next_engine, next_transfer_at, arrivals.next_at()]
                .into_iter()
                .flatten()
                .min()
            else {
                break;
            };
            // A prefill that picked a decode engine out of range; reported after the wake-ups.
            let mut bad_pick = None;
            let decode = &self.decode;
            let transfer_config = &self.transfer;
            advance_due(
                &mut self.prefill,
                now,
                &mut out,
                &mut run.report,
                |worker, out| {
                    dispatcher.observe(worker, out);
                    for finished in &out.finished {
                        let Some((request, _)) = run.pending.get(&finished.request_id) else {
                            continue;
                        };
                        if finished.reason != crate::request::FinishReason::Length {
                            run.pending.remove(&finished.request_id);
                            continue;
                        }
                        let picked = dispatcher.pick_decode(now, request, decode);
                        let Some(engine) = decode.get(picked) else {
                            bad_pick.get_or_insert(picked);
                            continue;
                        };
                        let config = engine.config();
                        let transfer = crate::disagg::transfer_time(
                            transfer_config,
                            request.tokens.len(),
                            config.block_size,
                            config.speedup,
                        );
                        let ready = finished.at.max(now) + transfer;
                        run.transfers.push(Reverse((
                            ready,
                            run.next_transfer,
                            picked,
                            finished.request_id,
                        )));
                        run.next_transfer += 1;
                    }
                },
            );
            if let Some(picked) = bad_pick {
                return Err(SimError::NoSuchEngine {
                    picked,
                    engines: self.decode.len(),
                });
            }
            advance_due(
                &mut self.decode,
                now,
                &mut out,
                &mut run.report,
                |worker, out| {
                    for token in out.tokens.iter().filter(|t| t.index == 0) {
                        if let Some((_, arrived)) = run.pending.get(&token.request_id) {
                            run.ttft.push(token.at.saturating_sub(*arrived));
                        }
                    }
                    for finished in &out.finished {
                        if let Some((_, arrived)) = run.pending.remove(&finished.request_id) {
                            run.e2e.push(finished.at.saturating_sub(arrived));
                        }
                    }
                    dispatcher.observe_decode(worker, out);
                },
            );
            run.finish_transfers(now, &mut self.decode, dispatcher);
            let mut engines = Engines {
                prefill: &mut self.prefill,
                decode: &mut self.decode,
            };
            run.admit_due(now, &mut arrivals, &mut engines, dispatcher)?;
        }
        let DisaggRun {
            mut report,
            ttft,
            e2e,
            ..
        } = run;
        report.completed = e2e.len() as u64;
        add_stats(
            &mut report,
            &self.prefill,
            &before_prefill,
            Counted::Prompts,
        );
        add_stats(&mut report, &self.decode, &before_decode, Counted::Decode);
        report.ttft = LatencySummary::from_samples(ttft);
        report.e2e = LatencySummary::from_samples(e2e);
        Ok(report)
    }
}

/// The state of one [`DisaggSimulation::run`].
#[derive(Default)]
struct DisaggRun {
    report: SimReport,
    /// The client's request (full output budget) and its arrival, until it leaves decode.
    pending: HashMap<RequestId, (Request, Duration)>,
    /// Transfers in flight: (ready at, sequence number, decode engine, request id).
    transfers: BinaryHeap<Reverse<(Duration, u64, usize, RequestId)>>,
    next_transfer: u64,
    ttft: Vec<Duration>,
    e2e: Vec<Duration>,
}

impl DisaggRun {
    /// Hands each transfer finished by `now` to its decode engine.
    fn finish_transfers<D: DisaggDispatcher + ?Sized>(
        &mut self,
        now: Duration,
        decode: &mut [Engine],
        dispatcher: &mut D,
    ) {
        while let Some(Reverse((_, _, worker, id))) = self
            .transfers
            .peek()
            .copied()
            .filter(|Reverse((at, ..))| *at <= now)
        {
            self.transfers.pop();
            let Some((request, _)) = self.pending.get(&id) else {
                continue;
            };
            if let Err(error) = decode[worker].add_prefilled_request(now, request.clone()) {
                self.pending.remove(&id);
                self.report.rejected += 1;
                dispatcher.rejected_decode(now, worker, id, &error);
            }
        }
    }

    /// Sends each arrival due by `now` to the decode engine the dispatcher picks for a local
    /// prefill (whole), or else to the prefill engine it picks, with an output budget of one
    /// token.
    fn admit_due<I, D>(
        &mut self,
        now: Duration,
        arrivals: &mut ArrivalFeed<I>,
        engines: &mut Engines<'_>,
        dispatcher: &mut D,
    ) -> Result<(), SimError>
    where
        I: Iterator<Item = Arrival>,
        D: DisaggDispatcher + ?Sized,
    {
        while let Some(arrival) = arrivals.next_due(now)? {
            self.report.arrived += 1;
            let id = arrival.request.id;
            if let Some(local) = dispatcher.pick_local(now, &arrival.request, engines.decode) {
                let request = arrival.request.clone();
                match engine_at(engines.decode, local)?.add_request(now, request) {
                    Ok(()) => {
                        self.pending.insert(id, (arrival.request, now));
                    }
                    Err(error) => {
                        self.report.rejected += 1;
                        dispatcher.rejected_decode(now, local, id, &error);
                    }
                }
                continue;
            }
            let picked = dispatcher.pick(now, &arrival.request, engines.prefill);
            let request = Request {
                max_output_tokens: 1,
                ..arrival.request.clone()
            };
            match engine_at(engines.prefill, picked)?.add_request(now, request) {
                Ok(()) => {
                    self.pending.insert(id, (arrival.request, now));
                }
                Err(error) => {
                    self.report.rejected += 1;
                    dispatcher.rejected(now, picked, id, &error);
                }
            }
        }
        Ok(())
    }
}

/// Both pools of a [`DisaggSimulation`], borrowed for admitting arrivals.
struct Engines<'a> {
    prefill: &'a mut [Engine],
    decode: &'a mut [Engine],
}

/// The arrivals of one run, checked to come in time order.
struct ArrivalFeed<I: Iterator<Item = Arrival>> {
    arrivals: std::iter::Peekable<I>,
    last: Duration,
}

impl<I: Iterator<Item = Arrival>> ArrivalFeed<I> {
    fn new(arrivals: impl IntoIterator<IntoIter = I>) -> Self {
        Self {
            arrivals: arrivals.into_iter().peekable(),
            last: Duration::ZERO,
        }
    }

    /// When the next arrival is due, if any is left.
    fn next_at(&mut self) -> Option<Duration> {
        self.arrivals.peek().map(|a| a.at)
    }

    /// The next arrival due by `now`, or an error if it arrives before the one before it.
    fn next_due(&mut self, now: Duration) -> Result<Option<Arrival>, SimError> {
        let Some(arrival) = self.arrivals.next_if(|a| a.at <= now) else {
            return Ok(None);
        };
        if arrival.at < self.last {
            return Err(SimError::OutOfOrder {
                id: arrival.request.id,
                at: arrival.at,
                previous: self.last,
            });
        }
        self.last = arrival.at;
        Ok(Some(arrival))
    }
}

/// The engine a dispatcher picked, or an error naming the index out of range.
fn engine_at(engines: &mut [Engine], picked: usize) -> Result<&mut Engine, SimError> {
    let engines_len = engines.len();
    engines.get_mut(picked).ok_or(SimError::NoSuchEngine {
        picked,
        engines: engines_len,
    })
}

/// Runs every engine whose wake-up is due by `now`, in index order, counting its KV events and
/// clock in `report` and handing its output to `each` with the engine's index.
fn advance_due(
    engines: &mut [Engine],
    now: Duration,
    out: &mut StepOutput,
    report: &mut SimReport,
    mut each: impl FnMut(usize, &StepOutput),
) {
    for (worker, engine) in engines.iter_mut().enumerate() {
        if engine.next_wakeup().is_none_or(|w| w > now) {
            continue;
        }
        out.clear();
        engine.advance_into(now, out);
        report.kv_events += out.events.len() as u64;
        report.simulated = report.simulated.max(engine.clock());
        each(worker, out);
    }
}

/// Which engine counters a group of engines contributes to the report.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Counted {
    /// Aggregated engines: prompts and outputs.
    All,
    /// Prefill engines: prompts (their one output token each is not the client's).
    Prompts,
    /// Decode engines: outputs, and the prompts they prefilled themselves (not those whose KV
    /// arrived from a prefill engine).
    Decode,
}

/// Adds what `engines` did since `before` (counters are per engine lifetime, so a second run
/// reports only its own work).
fn add_stats(
    report: &mut SimReport,
    engines: &[Engine],
    before: &[crate::request::EngineStats],
    counted: Counted,
) {
    for (engine, before) in engines.iter().zip(before) {
        let stats = engine.stats();
        let (prompt, cached) = computed_prompts(&stats, counted);
        let (prompt_before, cached_before) = computed_prompts(before, counted);
        report.prompt_tokens += prompt - prompt_before;
        report.cached_prompt_tokens += cached - cached_before;
        if counted != Counted::Prompts {
            report.output_tokens += stats.output_tokens - before.output_tokens;
        }
        report.preemptions += stats.preemptions - before.preemptions;
        report.steps += stats.steps - before.steps;
    }
}

/// The prompt tokens (and cached ones) `stats` counts as computed on an engine of `counted`'s
/// kind: a decode engine's transferred prompts were computed on a prefill engine.
fn computed_prompts(stats: &crate::request::EngineStats, counted: Counted) -> (u64, u64) {
    match counted {
        Counted::Decode => (
            stats.prompt_tokens - stats.transferred_prompt_tokens,
            stats.cached_prompt_tokens - stats.transferred_cached_tokens,
        ),
        Counted::All | Counted::Prompts => (stats.prompt_tokens, stats.cached_prompt_tokens),
    }
}
