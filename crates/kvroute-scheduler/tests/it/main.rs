//! Integration tests of the scheduler: the load invariant against a naive model, hand-computed
//! costs and selections, eligibility errors, and the admission queue.

mod eligibility;
mod invariant;
mod selection;
mod support;
