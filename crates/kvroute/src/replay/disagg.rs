//! Disaggregated replay: the [`DisaggDispatcher`] seam driven by two live router cores, one over
//! the prefill engines (the policy's normal cost) and one over the decode engines with the decode
//! overrides the prefill router applies (see [`decode_override`]).
//!
//! Prefill engine `i` is prefill-core worker `i`; decode engine `j` is decode-core worker `j` and
//! recorder worker `prefill + j`, so the load timeline shows both pools side by side.
//!
//! With conditional disaggregation each arrival is first placed by the router core's
//! [`ConditionalDisagg`] rule, from a query of each core: a prompt prefilled locally is routed
//! by the decode core as an aggregated request (overlap credit, prefill tracked) and served whole
//! by its decode engine.

use std::time::Duration;

use kvroute_mocker::sim::{DisaggDispatcher, Dispatcher};
use kvroute_mocker::{Engine, Request, RequestError, StepOutput};
use kvroute_protocols::RouterConfigOverride;
use kvroute_router_core::{
    ConditionalDisagg, KvRouterCore, PrefillPlacement, RequestId, RouteRequest,
};

use crate::replay::dispatch::{RunState, feed};

/// The decode-phase overrides of `kvroute-prefill` (`request::decode_override(None)`): the
/// prompt's KV arrives from the prefill worker, so cached overlap earns no credit, no reuse is
/// assumed and the prompt is not counted as prefill load. Restated here because the binary may
/// not depend on `kvroute-prefill` (see the layering table); a test keeps the two equal.
pub(crate) fn decode_override() -> RouterConfigOverride {
    RouterConfigOverride {
        overlap_score_credit: Some(0.0),
        assume_kv_reuse: Some(false),
        track_prefill_tokens: Some(false),
        ..RouterConfigOverride::default()
    }
}

/// Drives a prefill core and a decode core from a [`kvroute_mocker::sim::DisaggSimulation`].
pub(crate) struct DisaggRouterDispatcher {
    prefill: KvRouterCore,
    decode: KvRouterCore,
    prefill_workers: usize,
    overrides: RouterConfigOverride,
    /// Conditional disaggregation's rule, or `None` to prefill every request remotely.
    conditional: Option<ConditionalDisagg>,
    /// Requests placed by the rule, by placement name (for the report).
    pub(crate) placements: std::collections::BTreeMap<&'static str, u64>,
    run: RunState,
}

impl DisaggRouterDispatcher {
    /// Wraps the two cores, whose workers `0..` are the prefill and decode engines in order.
    pub(crate) fn new(
        prefill: KvRouterCore,
        decode: KvRouterCore,
        prefill_workers: usize,
        run: RunState,
    ) -> Self {
        Self {
            prefill,
            decode,
            prefill_workers,
            overrides: decode_override(),
            conditional: None,
            placements: std::collections::BTreeMap::new(),
            run,
        }
    }

    /// The same dispatcher deciding per request, with `rule`, whether to prefill remotely.
    pub(crate) fn with_conditional(mut self, rule: ConditionalDisagg) -> Self {
        self.conditional = Some(rule);
        self
    }

    /// Where `rule` places `request`'s prefill now, from a query of each core; `None` after a
    /// routing error (recorded).
    fn place(
        &mut self,
        rule: ConditionalDisagg,
        now: Duration,
        request: &Request,
    ) -> Option<PrefillPlacement> {
        let route = RouteRequest::new(RequestId(request.id), &request.tokens);
        let local = self.run.query(&mut self.decode, &route, now)?;
        let remote = self.run.query(&mut self.prefill, &route, now)?;
        let block_size = self.decode.config().block_size();
        Some(rule.place_routed(&local, &remote, block_size))
    }

    /// Both cores, named by role for the drain check, and the run's state, after the run.
    pub(crate) fn into_parts(self) -> (Vec<(&'static str, KvRouterCore)>, RunState) {
        (
            vec![("prefill", self.prefill), ("decode", self.decode)],
            self.run,
        )
    }
}

impl Dispatcher for DisaggRouterDispatcher {
    // Expiry and progress run in `pick_local`, which sees every arrival first.
    fn pick(&mut self, now: Duration, request: &Request, engines: &[Engine]) -> usize {
        match self.run.route_arrival(&mut self.prefill, request, now) {
            Some(worker) => {
                self.run.recorder.arrived(request.id, worker, now);
                worker
            }
            // An index past the last engine stops the simulation; the caller reports the error.
            None => engines.len(),
        }
    }

    fn observe(&mut self, worker: usize, output: &StepOutput) {
        // The prefill's single token is not the client's: only the core's load follows it.
        self.run.gaps += feed(&mut self.prefill, worker, output, None);
    }

    fn rejected(&mut self, now: Duration, _worker: usize, id: u64, _error: &RequestError) {
        let _ = self.prefill.on_failed(RequestId(id));
        self.run.recorder.left(id, now, false);
    }
}

impl DisaggDispatcher for DisaggRouterDispatcher {
    fn pick_local(&mut self, now: Duration, request: &Request, decode: &[Engine]) -> Option<usize> {
        if self.run.pacer.arrival(now) {
            self.run.expired += self.prefill.expire(now).requests.len() as u64;
            self.run.expired += self.decode.expire(now).requests.len() as u64;
        }
        let rule = self.conditional?;
        // A routing error stops the run: an index past the last engine, reported by the caller.
        let Some(placement) = self.place(rule, now, request) else {
            return Some(decode.len());
        };
        *self.placements.entry(placement.name()).or_default() += 1;
        if !placement.is_local() {
            return None;
        }
        match self.run.route_arrival(&mut self.decode, request, now) {
            Some(worker) => {
                self.run
                    .recorder
                    .arrived(request.id, self.prefill_workers + worker, now);
                Some(worker)
            }
            None => Some(decode.len()),
        }
    }

    fn pick_decode(&mut self, now: Duration, request: &Request, decode: &[Engine]) -> usize {
        let route = RouteRequest::new(RequestId(request.id), &request.tokens)
            .with_overrides(&self.overrides);
        match self.run.route(&mut self.decode, &route, now) {
            Some(worker) => {
                self.run
                    .recorder
                    .moved(request.id, self.prefill_workers + worker, now);
                worker
            }
            None => decode.len(),
        }
    }

    fn observe_decode(&mut self, worker: usize, output: &StepOutput) {
        self.run.gaps += feed(
            &mut self.decode,
            worker,
            output,
            Some(&mut self.run.recorder),
        );
    }

    fn rejected_decode(&mut self, now: Duration, _worker: usize, id: u64, _error: &RequestError) {
        let _ = self.decode.on_failed(RequestId(id));
        self.run.recorder.left(id, now, false);
    }
}

pub(crate) mod args;

#[cfg(test)]
mod tests;
