//! Sticky sessions for kvroute: which (worker, dp rank) a multi-turn session is bound to, for
//! how long, and whether the worker holds an engine session that must be closed.
//!
//! Entry types: the [`AffinityStore`] trait and its default [`InMemoryAffinityStore`] (sliding
//! TTL, bounded size, safe across threads); the [`SessionLifecycle`] trait a transport implements
//! to open and close engine sessions, with [`FakeLifecycle`] for tests; and the
//! [`SessionCoordinator`], a sans-IO state machine with the reference's semantics that returns
//! [`SessionCommand`]s for the transport to run.
//!
//! Time comes in as `now` (a [`std::time::Duration`] since any fixed epoch) so sessions expire in
//! virtual time under replay. This crate must not depend on tokio or the transport's concrete
//! types; it depends on `kvroute-protocols` only for the wire types.

mod coordinator;
mod lifecycle;
mod memory;
mod store;

pub use coordinator::{
    Rollback, RoutedPlan, SessionCoordinator, SessionError, StickyRoute, WorkerLossMode,
    sticky_allowed,
};
pub use lifecycle::{FakeLifecycle, LifecycleError, SessionCommand, SessionLifecycle};
pub use memory::{DEFAULT_MAX_SESSIONS, InMemoryAffinityStore};
pub use store::{
    AffinityBinding, AffinityKind, AffinityStore, AffinityToken, ExpiredBinding, PutOutcome,
    StoreError,
};

#[cfg(test)]
mod tests;
