//! The routing state behind the live router's lock: the core with its RNG, which the router,
//! its guards, load sync and the background loops all take the lock for.

use std::sync::Arc;

use kvroute_sessions::AffinityStore;
use rand_chacha::ChaCha8Rng;

use kvroute_router_core::KvRouterCore;

/// A router's sticky-session store: any [`AffinityStore`], shared.
pub type SharedAffinityStore = Arc<dyn AffinityStore>;

/// The core and the RNG it routes with, under one lock (held only for a decision or an update).
pub(crate) struct State {
    pub(crate) core: KvRouterCore<SharedAffinityStore>,
    pub(crate) rng: ChaCha8Rng,
}

impl std::fmt::Debug for State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("State").finish_non_exhaustive()
    }
}
