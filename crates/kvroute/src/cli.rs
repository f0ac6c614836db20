//! Command-line pieces more than one subcommand uses, so that no subcommand reaches into
//! another's module: the duration syntax of every `DURATION` flag ([`HumanDuration`]), the
//! defaults `serve` and `worker` must agree on, and the NATS connection both open
//! ([`nats::connect`], with its credential flags [`nats::NatsAuth`]), and the engine endpoint
//! a proxy sends to ([`endpoint`]).

mod duration;
pub(crate) mod endpoint;
pub(crate) mod nats;

use std::time::Duration;

pub(crate) use duration::HumanDuration;

/// How long a registered worker stays listed without a heartbeat or renewal (`serve
/// --lease-ttl`, `worker --lease-ttl`).
pub(crate) const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(5);

/// Prefix of the NATS subjects, stream and buckets (`serve --nats-namespace`, `worker
/// --nats-namespace`).
pub(crate) const DEFAULT_NATS_NAMESPACE: &str = "kvroute";

/// On SIGINT/SIGTERM, how long in-flight requests may take to finish (`serve --drain-timeout`,
/// `worker --drain-timeout`).
pub(crate) const DEFAULT_DRAIN_TIMEOUT: Duration = Duration::from_secs(30);
