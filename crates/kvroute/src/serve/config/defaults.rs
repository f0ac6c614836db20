//! The defaults of `kvroute serve`'s options: the one place validation takes them from. The
//! `--help` texts and `docs/examples/serve.toml` state them too, and tests hold both to these
//! (`defaults_in_help_are_the_constants`, `the_example_config_file_shows_the_defaults`).
//! Defaults the router crate owns (the cost weights, the snapshot interval, migrations) are
//! taken from its configuration types, not repeated here; the ones `kvroute worker` shares are
//! in [`crate::cli`].

use std::time::Duration;

/// `[http] listen`.
pub(crate) const LISTEN: &str = "127.0.0.1:8000";
/// `[http] max_in_flight`.
pub(crate) const MAX_IN_FLIGHT: usize = 4096;
/// `[http] max_queued`.
pub(crate) const MAX_QUEUED: usize = 1024;
/// `[http] queue_timeout`.
pub(crate) const QUEUE_TIMEOUT: Duration = Duration::from_secs(5);
/// `[http] retry_after`.
pub(crate) const RETRY_AFTER: Duration = Duration::from_secs(1);
/// `[http] max_body_bytes`: 16 MiB.
pub(crate) const MAX_BODY_BYTES: usize = 16 << 20;
/// `[http] max_body_memory_bytes`: 256 MiB.
pub(crate) const MAX_BODY_MEMORY_BYTES: usize = 256 << 20;
/// `[http] header_timeout`.
pub(crate) const HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// `[http] body_timeout`.
pub(crate) const BODY_TIMEOUT: Duration = Duration::from_secs(30);
/// `[http] max_prompt_tokens`.
pub(crate) const MAX_PROMPT_TOKENS: usize = 128 * 1024;
/// `[http] keep_alive`.
pub(crate) const KEEP_ALIVE: Duration = Duration::from_secs(15);
/// `[router] block_size`.
pub(crate) const BLOCK_SIZE: u32 = 16;
/// `[discovery] registry_listen`.
pub(crate) const REGISTRY_LISTEN: &str = "127.0.0.1:7100";
/// The model served when none is configured (the built-in mock).
pub(crate) const MOCK_MODEL: &str = "mock";
