//! [`InMemoryAffinityStore`]: the single-router default, on a sharded concurrent map.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use dashmap::DashMap;
use dashmap::mapref::entry::Entry as MapEntry;

use crate::store::{
    AffinityBinding, AffinityStore, AffinityToken, ExpiredBinding, PutOutcome, StoreError,
};

/// Default bound on stored sessions: enough for a large fleet's conversations, small enough
/// (~100 bytes each) that a client inventing session ids cannot exhaust memory.
pub const DEFAULT_MAX_SESSIONS: usize = 1_000_000;

#[derive(Debug, Clone, Copy)]
struct Entry {
    binding: AffinityBinding,
    ttl: Duration,
    expires_at: Duration,
    revision: u64,
}

impl Entry {
    fn token(&self) -> AffinityToken {
        AffinityToken {
            binding: self.binding,
            revision: self.revision,
        }
    }
}

/// Affinity bindings in a `DashMap`, safe to share between router threads, bounded in size.
#[derive(Debug)]
pub struct InMemoryAffinityStore {
    map: DashMap<String, Entry>,
    /// Stored entries; reserved before a vacant insert so the bound holds under concurrency.
    count: AtomicUsize,
    max_sessions: usize,
    next_revision: AtomicU64,
}

impl Default for InMemoryAffinityStore {
    fn default() -> Self {
        Self::new(DEFAULT_MAX_SESSIONS)
    }
}

impl InMemoryAffinityStore {
    /// An empty store holding at most `max_sessions` bindings.
    pub fn new(max_sessions: usize) -> Self {
        Self {
            map: DashMap::new(),
            count: AtomicUsize::new(0),
            max_sessions,
            next_revision: AtomicU64::new(1),
        }
    }

    /// The configured bound.
    pub fn max_sessions(&self) -> usize {
        self.max_sessions
    }

    fn lookup(&self, session_id: &str, now: Duration, refresh: bool) -> Option<AffinityToken> {
        if refresh {
            let mut e = self.map.get_mut(session_id)?;
            if e.expires_at <= now {
                return None;
            }
            e.expires_at = now.saturating_add(e.ttl);
            Some(e.token())
        } else {
            let e = self.map.get(session_id)?;
            (e.expires_at > now).then(|| e.token())
        }
    }
}

impl AffinityStore for InMemoryAffinityStore {
    fn get(&self, session_id: &str, now: Duration) -> Option<AffinityToken> {
        self.lookup(session_id, now, true)
    }

    fn peek(&self, session_id: &str, now: Duration) -> Option<AffinityToken> {
        self.lookup(session_id, now, false)
    }

    fn put(
        &self,
        session_id: &str,
        binding: AffinityBinding,
        ttl: Duration,
        now: Duration,
    ) -> Result<PutOutcome, StoreError> {
        let revision = self.next_revision.fetch_add(1, Ordering::Relaxed);
        let entry = Entry {
            binding,
            ttl,
            expires_at: now.saturating_add(ttl),
            revision,
        };
        let replaced = match self.map.entry(session_id.to_owned()) {
            MapEntry::Occupied(mut o) => Some(o.insert(entry).binding),
            MapEntry::Vacant(v) => {
                let max = self.max_sessions;
                self.count
                    .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                        (n < max).then_some(n + 1)
                    })
                    .map_err(|_| StoreError::Full { max_sessions: max })?;
                v.insert(entry);
                None
            }
        };
        Ok(PutOutcome {
            token: entry.token(),
            replaced,
        })
    }

    fn remove(&self, session_id: &str) -> Option<AffinityBinding> {
        let (_, e) = self.map.remove(session_id)?;
        self.count.fetch_sub(1, Ordering::AcqRel);
        Some(e.binding)
    }

    fn remove_if_token(&self, session_id: &str, token: AffinityToken) -> bool {
        let removed = self
            .map
            .remove_if(session_id, |_, e| e.token() == token)
            .is_some();
        if removed {
            self.count.fetch_sub(1, Ordering::AcqRel);
        }
        removed
    }

    fn expire(&self, now: Duration) -> Vec<ExpiredBinding> {
        let mut expired = Vec::new();
        self.map.retain(|session_id, e| {
            let alive = e.expires_at > now;
            if !alive {
                expired.push(ExpiredBinding {
                    session_id: session_id.clone(),
                    binding: e.binding,
                });
            }
            alive
        });
        self.count.fetch_sub(expired.len(), Ordering::AcqRel);
        expired
    }

    fn len(&self) -> usize {
        self.count.load(Ordering::Acquire)
    }
}
