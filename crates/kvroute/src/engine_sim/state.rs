//! What one simulated engine's API works with: the engine, its model and text side, its counters
//! and, with `--kv-events`, the tokens of its live blocks. Shared by the routes (`http.rs`) and
//! the completions (`generate.rs`).

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use kvroute_mocker::live::LiveMocker;
use kvroute_router::tokenizer::{ChatTemplate, Tokenizer};

use super::kv_events::BlockTokens;
use super::kv_transfer::{EngineAddress, Transfers};
use super::metrics::{CacheShape, Counters};

/// Turning text into tokens and back, shared by every engine of the process.
pub(super) struct TextSide {
    pub(super) tokenizer: Arc<dyn Tokenizer>,
    pub(super) template: ChatTemplate,
}

/// One simulated engine and what its API needs.
pub(super) struct Sim {
    pub(super) engine: LiveMocker,
    pub(super) model: String,
    pub(super) text: Arc<TextSide>,
    pub(super) cache: CacheShape,
    pub(super) max_model_len: u32,
    pub(super) counters: Counters,
    /// The tokens of live blocks, with `--kv-events`.
    pub(super) blocks: Option<Arc<BlockTokens>>,
    pub(super) next_id: AtomicU64,
    /// When the engine started, seconds since the epoch (`created` of `/v1/models`).
    pub(super) started: u64,
    /// The blocks every engine of the process holds for remote decode.
    pub(super) transfers: Arc<Transfers>,
    /// How other engines reach this one (its `kv_transfer_params`).
    pub(super) address: EngineAddress,
    /// Pulls transferred blocks from other engines.
    pub(super) client: reqwest::Client,
}
