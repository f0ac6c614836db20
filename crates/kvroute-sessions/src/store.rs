//! The affinity store seam: where a session's (worker, dp rank) binding lives.

use std::time::Duration;

use kvroute_protocols::WorkerWithDpRank;

/// Whether the worker holds state for the session.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AffinityKind {
    /// A plain routing binding (`bind`): the worker holds no session, nothing to close.
    RouterOnly,
    /// The worker accepted an `open` and holds a session that must be closed.
    EngineBacked,
}

/// A session's target.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AffinityBinding {
    /// Where the session's requests go.
    pub worker: WorkerWithDpRank,
    /// Router-only or engine-backed.
    pub kind: AffinityKind,
}

/// A binding plus the revision that created it, so that undoing a failed attempt removes only
/// the binding that attempt made (a concurrent rebind wins).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AffinityToken {
    /// The binding.
    pub binding: AffinityBinding,
    /// Unique per `put`.
    pub revision: u64,
}

/// What a `put` did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PutOutcome {
    /// The new binding's token.
    pub token: AffinityToken,
    /// The binding it replaced, live or expired but not yet reaped.
    pub replaced: Option<AffinityBinding>,
}

/// A binding removed by expiry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpiredBinding {
    /// The session.
    pub session_id: String,
    /// What it was bound to.
    pub binding: AffinityBinding,
}

/// Why the store refused a write.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The store holds its maximum number of sessions.
    #[error(
        "affinity store is full ({max_sessions} sessions); expire or close sessions, or raise max_sessions"
    )]
    Full {
        /// The configured bound.
        max_sessions: usize,
    },
}

/// Session affinity storage. Times are the caller's clock (time since any fixed epoch), so the
/// same store runs in virtual time under replay.
///
/// A binding expires `ttl` after it was last put or refreshed. Reads treat an expired binding as
/// absent but leave it for [`AffinityStore::expire`], so that every expired engine-backed binding
/// is reported exactly once (its engine session must be closed).
pub trait AffinityStore: Send + Sync {
    /// The live binding of `session_id`, refreshing its sliding TTL (an intermediate turn).
    fn get(&self, session_id: &str, now: Duration) -> Option<AffinityToken>;

    /// The live binding of `session_id` without refreshing it (lifecycle actions, which must not
    /// extend affinity before the worker confirms).
    fn peek(&self, session_id: &str, now: Duration) -> Option<AffinityToken>;

    /// Binds `session_id` to `worker` for `ttl` from `now`, replacing any binding.
    fn put(
        &self,
        session_id: &str,
        binding: AffinityBinding,
        ttl: Duration,
        now: Duration,
    ) -> Result<PutOutcome, StoreError>;

    /// Removes the binding (live or expired) and returns it.
    fn remove(&self, session_id: &str) -> Option<AffinityBinding>;

    /// Removes the binding only if it is still the one `token` names; returns whether it did.
    fn remove_if_token(&self, session_id: &str, token: AffinityToken) -> bool;

    /// Removes and returns every binding expired at `now`.
    fn expire(&self, now: Duration) -> Vec<ExpiredBinding>;

    /// Number of stored bindings (expired ones count until reaped).
    fn len(&self) -> usize;

    /// Whether the store is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A shared store is a store: several owners (a router's core and a replicating task) can hold
/// one, and `Arc<dyn AffinityStore>` lets a router take any implementation.
impl<T: AffinityStore + ?Sized> AffinityStore for std::sync::Arc<T> {
    fn get(&self, session_id: &str, now: Duration) -> Option<AffinityToken> {
        (**self).get(session_id, now)
    }

    fn peek(&self, session_id: &str, now: Duration) -> Option<AffinityToken> {
        (**self).peek(session_id, now)
    }

    fn put(
        &self,
        session_id: &str,
        binding: AffinityBinding,
        ttl: Duration,
        now: Duration,
    ) -> Result<PutOutcome, StoreError> {
        (**self).put(session_id, binding, ttl, now)
    }

    fn remove(&self, session_id: &str) -> Option<AffinityBinding> {
        (**self).remove(session_id)
    }

    fn remove_if_token(&self, session_id: &str, token: AffinityToken) -> bool {
        (**self).remove_if_token(session_id, token)
    }

    fn expire(&self, now: Duration) -> Vec<ExpiredBinding> {
        (**self).expire(now)
    }

    fn len(&self) -> usize {
        (**self).len()
    }
}
