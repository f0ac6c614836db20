//! The buffers a selection reuses. The [`Scheduler`](crate::Scheduler) owns them so that
//! selecting allocates nothing in the steady state; only the selection (`select.rs`) reads them.

use crate::decision::CandidateCost;

/// Reusable buffers so that a selection allocates nothing in the steady state.
#[derive(Debug, Default)]
pub(crate) struct Scratch {
    pub(crate) eligible: Vec<u32>,
    /// Eligible slots of avoided workers, used only when no other slot is eligible.
    pub(crate) avoided: Vec<u32>,
    pub(crate) candidates: Vec<CandidateCost>,
    /// Per slot: this request's overlap and already-active blocks, valid when stamped with the
    /// current generation (so nothing has to be cleared between selections).
    pub(crate) marks: Vec<Mark>,
    pub(crate) generation: u32,
    pub(crate) weights: Vec<f64>,
    pub(crate) preferred: Vec<(u64, f64)>,
    /// The prefill scale of the last scoring pass.
    pub(crate) prefill_load_scale: f64,
}

#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Mark {
    pub(crate) generation: u32,
    pub(crate) overlap: u32,
    pub(crate) host: u32,
    pub(crate) disk: u32,
    pub(crate) active: u32,
    /// Blocks the worker holds ([`crate::SelectRequest::resident_blocks`]).
    pub(crate) resident: u64,
}

impl Mark {
    #[inline]
    pub(crate) fn current(&mut self, generation: u32) -> &mut Self {
        if self.generation != generation {
            *self = Mark {
                generation,
                ..Mark::default()
            };
        }
        self
    }
}
