//! The transport under the kvroute router: the request plane (length-prefixed bincode frames over
//! TCP, many streams multiplexed per connection, cancellation, typed worker-loss errors), the
//! event plane (publish/subscribe by subject), discovery (instances with roles and leases), the
//! push router (round-robin, random, power-of-two-choices, direct), the worker side (serve an
//! [`Engine`], publish numbered KV events, answer gap-recovery and dump calls) and a ZMQ listener
//! that turns a vLLM or SGLang engine's KV event feed into router events.
//!
//! Entry types: [`Engine`] and [`WorkerServer`] on the worker, [`Client`] and [`PushRouter`] on
//! the caller, [`Discovery`] ([`InProcessDiscovery`], [`StaticDiscovery`], and across processes
//! [`RegistryServer`] with [`RemoteDiscovery`]), [`EventPlane`] ([`InProcessEventPlane`]),
//! [`KvEventPublisher`] (whose events a router in another process receives through
//! [`KvEventBridge`], a `subscribe_kv_events` stream per worker), [`LoadReporter`] (the
//! worker's own load, followed the same way), [`ZmqKvListener`] and its engine-side
//! counterpart [`VllmKvPublisher`] (vLLM's ZMQ feed, for simulated engines), and
//! [`WarnThrottle`] (one line per window for a warning that repeats, as every publish does
//! while a broker is down).
//!
//! One machine needs no external service: workers register with the router's
//! [`RegistryServer`] and the router subscribes to each worker's KV events over the request
//! plane. The traits are the seams for a broker (NATS KV for discovery, NATS subjects for
//! events) that replaces both without touching the router.
//!
//! This crate moves bytes and tracks liveness; it must not contain routing policy (no cost model,
//! no KV overlap matching) and depends on no kvroute crate other than `kvroute-protocols`.
//!
//! # Example: serve an engine, call it directly and through the push router
//!
//! ```
//! use std::sync::Arc;
//! use futures::StreamExt;
//! use kvroute_runtime::*;
//!
//! /// Streams the numbers `0..n` for a request `n`.
//! struct Count;
//!
//! impl Engine for Count {
//!     type Request = u32;
//!     type Response = u32;
//!     fn generate(&self, n: u32, _context: RequestContext) -> Result<ResponseStream<u32>, EngineError> {
//!         Ok(Box::pin(futures::stream::iter(0..n)))
//!     }
//! }
//!
//! # tokio::runtime::Runtime::new().unwrap().block_on(async {
//! // The worker: numbered KV events (kept for gap recovery), the server, a discovery record.
//! let discovery = InProcessDiscovery::new(std::time::Duration::from_secs(10));
//! let publisher = KvEventPublisher::new(7, DEFAULT_RING_CAPACITY);
//! let config = WorkerServerConfig::new(7).with_kv_events(publisher);
//! let server = WorkerServer::bind("127.0.0.1:0", Arc::new(Count), config).await.unwrap();
//! let info = InstanceInfo::new(7, server.local_addr().to_string(), 16);
//! let _lease = discovery.register(info).await.unwrap();
//!
//! // A caller with one connection.
//! let client: Client<u32, u32> =
//!     Client::connect(&server.local_addr().to_string(), ClientConfig::default()).await.unwrap();
//! let items: Vec<u32> = client.generate("req-1", &3).await.unwrap().map(Result::unwrap).collect().await;
//! assert_eq!(items, vec![0, 1, 2]);
//!
//! // A router over whatever discovery lists.
//! let router: PushRouter<u32, u32> = PushRouter::new(discovery.watch(), PushRouterConfig::default());
//! let stream = router.generate("req-2", &2, RouteMode::PowerOfTwoChoices).await.unwrap();
//! assert_eq!(stream.worker_id(), 7);
//! assert_eq!(stream.map(Result::unwrap).collect::<Vec<_>>().await, vec![0, 1]);
//! # });
//! ```

mod client;
mod discovery;
mod engine;
mod error;
mod event_plane;
mod fleet_secret;
mod fleet_tls;
mod frame;
mod kv_bridge;
mod kv_publisher;
mod llm;
mod load_reporter;
mod local;
mod push_router;
mod server;
mod vllm_publisher;
mod warn_throttle;
mod zmq_listener;

pub use client::{Client, ClientConfig, ClientStream, EncodedRequest};
pub use discovery::{
    Discovery, DiscoveryError, DiscoveryEvent, ENDPOINT_METADATA, InProcessDiscovery, InstanceInfo,
    InstanceSet, Lease, RegistryChecks, RegistryServer, RemoteDiscovery, RemoteDiscoveryConfig,
    StaticDiscovery, StaticFleetError, WorkerRole, diff_instances, filtered_instances,
    validate as validate_instance,
};
pub use engine::{Engine, EngineError, RequestContext, ResponseStream};
pub use error::RequestError;
pub use event_plane::{
    DEFAULT_SUBSCRIBER_CAPACITY, EventPlane, EventPlaneError, InMemorySnapshotStore,
    InProcessEventPlane, Message, SnapshotStore, Subscription, check_subject, decode_router_event,
    encode_router_event,
};
pub use fleet_secret::{
    FLEET_PROOF_METADATA, FleetSecret, FleetSecretError, MIN_FLEET_SECRET_BYTES,
    membership_filtered,
};
pub use fleet_tls::{FleetTls, FleetTlsError};
pub use frame::{DEFAULT_MAX_FRAME_BYTES, PROTOCOL_VERSION};
pub use kv_bridge::{KV_EVENTS_METADATA, KvEventBridge, KvEventBridgeConfig};
pub use kv_publisher::{
    DEFAULT_RING_CAPACITY, KV_EVENT_BASE_METADATA, KV_EVENT_SUBJECT, KvDump, KvEventPublisher,
    RangeError, incarnation_event_base,
};
pub use llm::{LlmClient, LlmClientStream, LlmEngine, LlmPushRouter, LlmResponse, LlmRoutedStream};
pub use load_reporter::{
    DEFAULT_REPORT_HEARTBEAT, LOAD_REPORT_SUBJECT, LOAD_REPORTS_METADATA, LoadReporter,
    encode_load_report,
};
pub use local::{LocalEngines, LocalRegistration};
pub use push_router::{
    DEFAULT_WORKER_FIRST_RESPONSE_TIMEOUT, PushRouter, PushRouterConfig, RouteError, RouteMode,
    RoutedStream,
};
pub use server::{WorkerServer, WorkerServerConfig};
pub use vllm_publisher::{
    DEFAULT_REPLAY_BUFFER, VllmKvPublisher, VllmPublisherError, encode_vllm_batch,
};
pub use warn_throttle::{DEFAULT_WARN_WINDOW, Suppressed, WarnThrottle};
pub use zmq_listener::{
    BlockHasher, BlockSalt, DEFAULT_MAX_TRACKED_BLOCKS, ZmqKvListener, ZmqKvListenerConfig,
    ZmqListenerError, ZmqListenerStats,
};
