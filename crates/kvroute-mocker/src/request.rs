//! The engine's vocabulary: requests in, generated tokens, finishes and errors out, and the
//! counters it keeps.

use std::time::Duration;

use kvroute_protocols::kv_events::KvCacheEvent;

/// The engine's id of a request; unique among the requests it currently holds.
pub type RequestId = u64;

/// A request to generate: a prompt, an output budget and an optional engine session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// The caller's id for this request.
    pub id: RequestId,
    /// The prompt's token ids.
    pub tokens: Vec<u32>,
    /// How many tokens to generate (the request finishes after exactly this many).
    pub max_output_tokens: u32,
    /// An open session whose blocks the request's blocks join when it finishes.
    pub session: Option<String>,
}

/// One generated token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenOutput {
    /// The request it belongs to.
    pub request_id: RequestId,
    /// The token id.
    pub token: u32,
    /// Its position in the output (0 for the first token).
    pub index: u32,
    /// When the step that produced it ended.
    pub at: Duration,
}

/// Why a request left the engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum FinishReason {
    /// It generated `max_output_tokens` tokens.
    Length,
    /// The caller cancelled it.
    Cancelled,
}

/// A request that left the engine, with its accounting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Finished {
    /// The request.
    pub request_id: RequestId,
    /// Why it finished.
    pub reason: FinishReason,
    /// When.
    pub at: Duration,
    /// Prompt tokens found in the prefix cache at its first admission.
    pub cached_prompt_tokens: u32,
    /// Tokens generated.
    pub output_tokens: u32,
    /// How many times it was preempted.
    pub preemptions: u32,
}

/// Everything the engine produced since the last drain.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepOutput {
    /// Generated tokens, in time order.
    pub tokens: Vec<TokenOutput>,
    /// Finished and cancelled requests.
    pub finished: Vec<Finished>,
    /// KV events, in event-id order.
    pub events: Vec<KvCacheEvent>,
}

impl StepOutput {
    /// Empties every list, keeping their allocations.
    pub fn clear(&mut self) {
        self.tokens.clear();
        self.finished.clear();
        self.events.clear();
    }

    /// Whether nothing was produced.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty() && self.finished.is_empty() && self.events.is_empty()
    }
}

/// A request the engine refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RequestError {
    /// The prompt has no tokens.
    #[error("request {0}: the prompt is empty, expected at least one token")]
    EmptyPrompt(RequestId),
    /// `max_output_tokens` is zero.
    #[error("request {0}: max_output_tokens is 0, expected at least 1")]
    NoOutput(RequestId),
    /// The id is already in use.
    #[error("request {0}: id already in use by a running or waiting request")]
    DuplicateId(RequestId),
    /// Prompt plus output could never fit in the cache.
    #[error("request {id}: prompt plus output need {needed} blocks, the cache holds {capacity}")]
    TooLong {
        /// The request.
        id: RequestId,
        /// Blocks needed.
        needed: u64,
        /// Blocks in the cache.
        capacity: u64,
    },
    /// The request names a session that is not open.
    #[error("request {id}: session {session:?} is not open, expected an open session or none")]
    UnknownSession {
        /// The request.
        id: RequestId,
        /// The session named.
        session: String,
    },
}

/// Counters over the engine's lifetime.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// Steps run.
    pub steps: u64,
    /// Requests admitted for the first time.
    pub admitted: u64,
    /// Prompt tokens of admitted requests.
    pub prompt_tokens: u64,
    /// Of those, found in the prefix cache at first admission.
    pub cached_prompt_tokens: u64,
    /// Of `prompt_tokens`, those of requests whose KV arrived from a prefill engine
    /// ([`crate::Engine::add_prefilled_request`]): computed elsewhere, not here.
    pub transferred_prompt_tokens: u64,
    /// Of `cached_prompt_tokens`, those of requests whose KV arrived from a prefill engine.
    pub transferred_cached_tokens: u64,
    /// Tokens generated.
    pub output_tokens: u64,
    /// Preemptions.
    pub preemptions: u64,
}

/// Block accounting at one instant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvUsage {
    /// Blocks in the pool.
    pub capacity: usize,
    /// Blocks referenced by sequences or sessions.
    pub used: usize,
    /// Blocks referenced by nobody.
    pub free: usize,
    /// Blocks in the prefix cache (used or free).
    pub cached: usize,
}
