//! Disaggregated replay: the [`DisaggDispatcher`] seam driven by two live router cores, one over
//! the prefill engines (the policy's normal cost) and one over the decode engines with the decode
//! overrides the prefill router applies (see [`decode_override`]).
//!
//! Prefill engine `i` is prefill-core worker `i`; decode engine `j` is decode-core worker `j` and
//! recorder worker `prefill + j`, so the load timeline shows both pools side by side.

use std::time::Duration;

use kvroute_mocker::sim::{DisaggDispatcher, Dispatcher};
use kvroute_mocker::{Engine, Request, RequestError, StepOutput};
use kvroute_protocols::RouterConfigOverride;
use kvroute_router_core::{KvRouterCore, RequestId, RouteRequest};

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
            run,
        }
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
    fn pick(&mut self, now: Duration, request: &Request, engines: &[Engine]) -> usize {
        if self.run.pacer.arrival(now) {
            self.run.expired += self.prefill.expire(now).requests.len() as u64;
            self.run.expired += self.decode.expire(now).requests.len() as u64;
        }
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

#[cfg(test)]
mod tests;
