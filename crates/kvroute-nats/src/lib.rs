//! kvroute on NATS: the runtime's seams backed by a NATS server, so that several routers serve
//! one fleet and a restarted router catches up.
//!
//! - [`NatsEventPlane`] implements the runtime's [`EventPlane`](kvroute_runtime::EventPlane).
//!   KV events (the [`KV_EVENT_SUBJECT`](kvroute_runtime::KV_EVENT_SUBJECT) subject) go to a
//!   JetStream stream, one subject per worker, de-duplicated by worker and event id, bounded in
//!   age and bytes; a subscriber reads the stream from its oldest retained event, so a router
//!   that starts late or restarts replays what it missed (events it already reflects are skipped
//!   by id, and the worker's ring and dump stay the fallback for what the stream no longer
//!   holds). Every other subject is plain NATS publish/subscribe (at most once).
//! - [`NatsDiscovery`] implements [`Discovery`](kvroute_runtime::Discovery) on a KV bucket: a
//!   worker's registration is a key renewed every third of the lease's time to live; every
//!   watcher drops an entry not renewed within it, so a killed worker disappears within the TTL.
//!   A worker needs the NATS URL only, no router address.
//!
//! - [`NatsAffinityStore`] implements kvroute-sessions' `AffinityStore` on a KV bucket: each
//!   router keeps a local mirror and writes every change through, so a session bound through
//!   one router is honoured by all of them.
//!
//! - [`NatsSnapshotStore`] implements the runtime's
//!   [`SnapshotStore`](kvroute_runtime::SnapshotStore) on a JetStream object store: the routers'
//!   periodic index snapshot, with the stream position it reflects, so a router that starts or
//!   restarts loads it and replays only the events after it.
//!
//! [`Nats::connect`] opens the connection both share and keeps its state (connected or not,
//! reconnects) for the caller's logs and metrics. Names are scoped by a namespace
//! ([`NatsConfig::namespace`]), so several fleets can share one server.
//!
//! This crate holds no routing policy; it depends on kvroute-protocols, kvroute-runtime and
//! kvroute-sessions only.

mod client;
mod discovery;
mod event_plane;
mod sessions;
mod snapshots;

pub use client::{ConnectError, DEFAULT_NAMESPACE, Nats, NatsConfig, NatsStatus, redact_url};
pub use discovery::{LEASE_TTL_METADATA, NatsDiscovery, NatsDiscoveryConfig};
pub use event_plane::{EventStreamConfig, NatsEventPlane};
/// The session types [`NatsAffinityStore`] speaks, from kvroute-sessions.
pub use kvroute_sessions::{AffinityBinding, AffinityKind, AffinityStore};
pub use sessions::{NatsAffinityStore, NatsAffinityStoreConfig};
pub use snapshots::NatsSnapshotStore;
pub mod testing;
