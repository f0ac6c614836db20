//! Command-line pieces more than one subcommand uses, so that no subcommand reaches into
//! another's module: the duration syntax of every `DURATION` flag ([`HumanDuration`]) and the
//! NATS connection `serve` and `worker` both open ([`nats::connect`], with its credential flags
//! [`nats::NatsAuth`]).

mod duration;
pub(crate) mod nats;

pub(crate) use duration::HumanDuration;
