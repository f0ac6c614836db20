//! Integration tests of the scheduler: the load invariant against a naive model, hand-computed
//! costs and selections, eligibility errors, reconciliation with reported load, and the
//! admission queue.

mod eligibility;
mod invariant;
mod reconcile;
mod selection;
mod support;
