//! A deterministic simulation of several engines in virtual time: arrivals are dispatched to
//! engines by a [`Dispatcher`] (the seam where `kvroute replay` plugs in the real router), every
//! engine runs its steps at their modelled times, and the report sums what happened.
//!
//! Events at the same instant are processed in a fixed order (engines by index, then arrivals), so
//! the same inputs always give the same report.

use std::collections::HashMap;
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
        let mut arrivals = arrivals.into_iter().peekable();
        let mut report = SimReport::default();
        let mut started: HashMap<RequestId, Duration> = HashMap::new();
        let mut ttft = Vec::new();
        let mut e2e = Vec::new();
        let mut out = StepOutput::default();
        let mut last_arrival = Duration::ZERO;
        let before: Vec<_> = self.engines.iter().map(Engine::stats).collect();
        loop {
            let next_engine = self.engines.iter().filter_map(Engine::next_wakeup).min();
            let next_arrival = arrivals.peek().map(|a| a.at);
            let now = match (next_engine, next_arrival) {
                (None, None) => break,
                (Some(e), Some(a)) => e.min(a),
                (e, a) => e.or(a).unwrap_or_default(),
            };
            for (worker, engine) in self.engines.iter_mut().enumerate() {
                if engine.next_wakeup().is_none_or(|w| w > now) {
                    continue;
                }
                out.clear();
                engine.advance_into(now, &mut out);
                for token in out.tokens.iter().filter(|t| t.index == 0) {
                    if let Some(&arrived) = started.get(&token.request_id) {
                        ttft.push(token.at.saturating_sub(arrived));
                    }
                }
                for finished in &out.finished {
                    if let Some(arrived) = started.remove(&finished.request_id) {
                        e2e.push(finished.at.saturating_sub(arrived));
                        report.completed += 1;
                    }
                }
                report.kv_events += out.events.len() as u64;
                report.simulated = report.simulated.max(engine.clock());
                dispatcher.observe(worker, &out);
            }
            while let Some(arrival) = arrivals.next_if(|a| a.at <= now) {
                if arrival.at < last_arrival {
                    return Err(SimError::OutOfOrder {
                        id: arrival.request.id,
                        at: arrival.at,
                        previous: last_arrival,
                    });
                }
                last_arrival = arrival.at;
                report.arrived += 1;
                let picked = dispatcher.pick(now, &arrival.request, &self.engines);
                let engines = self.engines.len();
                let engine = self
                    .engines
                    .get_mut(picked)
                    .ok_or(SimError::NoSuchEngine { picked, engines })?;
                let id = arrival.request.id;
                match engine.add_request(now, arrival.request) {
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
        // Counters are per engine lifetime; a second run reports only its own work.
        for (engine, before) in self.engines.iter().zip(before) {
            let stats = engine.stats();
            report.prompt_tokens += stats.prompt_tokens - before.prompt_tokens;
            report.cached_prompt_tokens += stats.cached_prompt_tokens - before.cached_prompt_tokens;
            report.output_tokens += stats.output_tokens - before.output_tokens;
            report.preemptions += stats.preemptions - before.preemptions;
            report.steps += stats.steps - before.steps;
        }
        report.ttft = LatencySummary::from_samples(ttft);
        report.e2e = LatencySummary::from_samples(e2e);
        Ok(report)
    }
}
