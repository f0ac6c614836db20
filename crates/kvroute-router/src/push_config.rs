//! [`KvPushRouterConfig`]: how the live router behaves (the core's configuration, the transport,
//! load sync, snapshots, passive health).

use std::time::Duration;

use kvroute_runtime::PushRouterConfig;

use crate::health::HealthConfig;
use crate::load_sync::LoadSyncConfig;
use kvroute_router_core::{KvMode, RouterConfig};

/// The instance metadata key a worker sets to `"false"` when it publishes no KV events (the
/// router then predicts its cache from routing decisions).
pub const KV_EVENTS_METADATA_KEY: &str = "kv_events";

/// How a [`KvPushRouter`](crate::KvPushRouter) behaves.
#[derive(Debug, Clone)]
pub struct KvPushRouterConfig {
    /// The routing core (block size, policy, cost, sessions).
    pub core: RouterConfig,
    /// The transport (connections, role filter, backoff).
    pub push: PushRouterConfig,
    /// The KV mode of workers that do not say (see [`KV_EVENTS_METADATA_KEY`]).
    pub default_kv_mode: KvMode,
    /// Seed of the routing RNG (tie-breaking, temperature, the random policy).
    pub seed: u64,
    /// How often requests, predictions and sessions are expired.
    pub expire_interval: Duration,
    /// Share active load with other router replicas over the event plane (see
    /// [`LoadSyncConfig`]); `None` for a router that serves its fleet alone.
    pub load_sync: Option<LoadSyncConfig>,
    /// How often the index snapshot is saved, when the router has a
    /// [`SnapshotStore`](kvroute_runtime::SnapshotStore) (see
    /// [`KvPushRouter::start_shared`](crate::KvPushRouter::start_shared)); a replica skips its
    /// turn while another's snapshot is younger than 80% of this.
    pub snapshot_interval: Duration,
    /// When a worker whose requests keep failing is routed around (see [`crate::health`]).
    pub health: HealthConfig,
}

impl KvPushRouterConfig {
    /// Defaults for engines with `block_size` tokens per KV block.
    pub fn new(block_size: u32) -> Self {
        Self {
            core: RouterConfig::new(block_size),
            push: PushRouterConfig::default(),
            default_kv_mode: KvMode::Events,
            seed: 0x6b76_726f_7574_6572,
            expire_interval: Duration::from_secs(1),
            load_sync: None,
            snapshot_interval: Duration::from_secs(30),
            health: HealthConfig::default(),
        }
    }
}
