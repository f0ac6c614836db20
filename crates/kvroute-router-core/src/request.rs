//! What the core is asked to route, and what it answers.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_indexer::hash::{HashSalt, compute_block_hashes, next_seq_hash};
use kvroute_indexer::{ConcurrentIndex, OverlapScores};
use kvroute_protocols::kv_events::LocalBlockHash;
use kvroute_protocols::{
    PreprocessedRequest, RequestPhase, RouterConfigOverride, RoutingHints, WorkerWithDpRank,
};
use kvroute_scheduler::{CandidateCost, RequestId};
use kvroute_sessions::SessionCommand;

/// One request to route: its tokens plus whatever steers the choice. Borrows everything, so
/// building one per request costs nothing.
#[derive(Debug, Clone, Copy)]
pub struct RouteRequest<'a> {
    /// The caller's id, unique among requests in flight (freed by `on_finished`).
    pub id: RequestId,
    /// The tokens matched against the KV index (the multimodal routing tokens when present).
    pub tokens: &'a [u32],
    /// The phase being routed (aggregated unless disaggregated serving).
    pub phase: RequestPhase,
    /// Pins, allowed workers, session control, taint constraints.
    pub hints: Option<&'a RoutingHints>,
    /// Per-request overrides of the cost weights and temperature.
    pub overrides: Option<&'a RouterConfigOverride>,
    /// What separates caches (LoRA adapter, namespace); the default hashes as the reference.
    pub salt: HashSalt,
    /// Expected output length, which makes the request's blocks decay as it generates.
    pub expected_output_tokens: Option<u32>,
    /// Workers to route around while another can serve (ejected by passive health; see
    /// `kvroute_scheduler::SelectRequest::avoided_worker_ids`).
    pub avoided: &'a [kvroute_protocols::WorkerId],
}

impl<'a> RouteRequest<'a> {
    /// An aggregated request with these tokens and nothing else.
    pub fn new(id: RequestId, tokens: &'a [u32]) -> Self {
        Self {
            id,
            tokens,
            phase: RequestPhase::Aggregated,
            hints: None,
            overrides: None,
            salt: HashSalt::default(),
            expected_output_tokens: None,
            avoided: &[],
        }
    }

    /// Everything a [`PreprocessedRequest`] says about routing: its routing tokens, hints
    /// (the LoRA adapter and the cache salt, as the cache namespace, become the hash salt, as in
    /// the engines), overrides and expected output length.
    pub fn from_preprocessed(id: RequestId, req: &'a PreprocessedRequest) -> Self {
        let hints = req.routing.as_ref();
        Self {
            id,
            tokens: req.routing_token_ids(),
            phase: RequestPhase::Aggregated,
            hints,
            overrides: req.router_config_override.as_ref(),
            salt: HashSalt::new(hints.and_then(|h| h.lora_name.as_deref()), req.cache_salt()),
            expected_output_tokens: hints.and_then(|h| h.expected_output_tokens),
            avoided: &[],
        }
    }

    /// The same request, routed around `avoided` workers while another can serve.
    pub fn with_avoided(mut self, avoided: &'a [kvroute_protocols::WorkerId]) -> Self {
        self.avoided = avoided;
        self
    }

    /// The same request for `phase`.
    pub fn with_phase(mut self, phase: RequestPhase) -> Self {
        self.phase = phase;
        self
    }

    /// The same request with routing hints.
    pub fn with_hints(mut self, hints: &'a RoutingHints) -> Self {
        self.expected_output_tokens = self.expected_output_tokens.or(hints.expected_output_tokens);
        self.hints = Some(hints);
        self
    }

    /// The same request with per-request overrides.
    pub fn with_overrides(mut self, overrides: &'a RouterConfigOverride) -> Self {
        self.overrides = Some(overrides);
        self
    }

    /// The same request hashed under `salt`.
    pub fn with_salt(mut self, salt: HashSalt) -> Self {
        self.salt = salt;
        self
    }

    /// The same request with an expected output length.
    pub fn with_expected_output_tokens(mut self, tokens: u32) -> Self {
        self.expected_output_tokens = Some(tokens);
        self
    }
}

/// Why the chosen worker was chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RouteSource {
    /// The policy selected it among the eligible workers.
    Selected,
    /// The request named it for its phase (a preselected worker: matching and scoring are
    /// skipped, the load is still tracked).
    Pinned,
    /// The request's session is bound to it.
    Sticky,
}

/// Wall time spent in each phase of one routing decision (for the overhead metrics only: no
/// decision depends on it).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PhaseTimings {
    /// Hashing the tokens into block and sequence hashes.
    pub hashing: Duration,
    /// Looking the blocks up in the KV indexes.
    pub find_matches: Duration,
    /// Filters, cost model and selection (plus session bookkeeping).
    pub scheduling: Duration,
}

impl PhaseTimings {
    /// The three phases together.
    pub fn total(&self) -> Duration {
        self.hashing + self.find_matches + self.scheduling
    }
}

/// A routing decision.
#[derive(Debug, Clone, PartialEq)]
pub struct Routed {
    /// The request.
    pub id: RequestId,
    /// Where it goes.
    pub worker: WorkerWithDpRank,
    /// Why there.
    pub source: RouteSource,
    /// Leading prompt blocks already cached on `worker` (device tier), as the index sees them.
    pub overlap_blocks: u32,
    /// Full prompt blocks (a trailing partial block is not counted).
    pub prompt_blocks: u32,
    /// Prompt length in tokens.
    pub isl_tokens: u64,
    /// The chosen worker's cost breakdown.
    pub cost: CandidateCost,
    /// Every eligible candidate's breakdown, in slot order (one entry when pinned or sticky).
    pub candidates: Vec<CandidateCost>,
    /// The selection temperature used.
    pub temperature: f64,
    /// A session command to run on the worker *before* sending the request (an `open`); report
    /// its answer with [`crate::KvRouterCore::session_opened`]. Always `None` for queries.
    pub session_open: Option<SessionCommand>,
    /// Time spent per phase.
    pub timings: PhaseTimings,
}

impl Routed {
    /// The prompt tokens predicted to be served from cache on the chosen worker: its device-tier
    /// overlap plus its lower-tier continuation, weighted by the cache-hit weights (as the
    /// reference estimates them), less the cached blocks it cannot keep for want of KV capacity
    /// until it admits the prompt ([`CandidateCost::unkept_blocks`]; the engine evicts an idle
    /// prefix from its tail), capped at the prompt's length.
    pub fn predicted_cached_tokens(&self, block_size: u32) -> u64 {
        let block = u64::from(block_size);
        let unkept = u64::from(self.cost.unkept_blocks) * block;
        let device = u64::from(self.overlap_blocks) * block;
        self.cost
            .cached_tokens(block_size)
            .max(device)
            .saturating_sub(unkept)
            .min(self.isl_tokens)
    }

    /// The prompt tokens cached (device tier) on the eligible candidate holding most of the
    /// prompt but not on the chosen worker: 0 when the chosen worker holds as many as any, or
    /// when it was pinned or sticky (the only candidate). What the cost model traded for load.
    pub fn forgone_cached_tokens(&self, block_size: u32) -> u64 {
        let best = self
            .candidates
            .iter()
            .map(|c| c.overlap_blocks)
            .max()
            .unwrap_or(0);
        let forgone = u64::from(best.saturating_sub(self.overlap_blocks)) * u64::from(block_size);
        forgone.min(self.isl_tokens)
    }

    /// The fraction of the prompt's tokens predicted to be served from cache (0 for an empty
    /// prompt).
    pub fn predicted_hit_rate(&self, block_size: u32) -> f64 {
        if self.isl_tokens == 0 {
            return 0.0;
        }
        self.predicted_cached_tokens(block_size) as f64 / self.isl_tokens as f64
    }
}

/// Hashes a request's prompt into `local` (the index's block hashes) and `seq` (their sequence
/// hashes, for the scheduler).
pub(crate) fn hash_prompt(
    req: &RouteRequest<'_>,
    block_size: u32,
    local: &mut Vec<LocalBlockHash>,
    seq: &mut Vec<u64>,
) {
    *local = compute_block_hashes(req.tokens, block_size as usize, &req.salt);
    seq.clear();
    seq.reserve(local.len());
    let mut prev = None;
    for &block in local.iter() {
        let next = next_seq_hash(prev, block);
        seq.push(next.0);
        prev = Some(next);
    }
}

/// Hashes prompts and matches them against a routing core's exact index, from any thread,
/// without the core: a live router does this before taking the lock its core sits behind, so
/// the lock covers only the decision (from [`crate::KvRouterCore::preparer`]).
#[derive(Debug, Clone)]
pub struct RoutePreparer {
    index: Arc<ConcurrentIndex>,
    block_size: u32,
    /// Whether the policy charges for evictions, and so reads every worker's block count.
    resident: bool,
}

impl RoutePreparer {
    pub(crate) fn new(index: Arc<ConcurrentIndex>, block_size: u32, resident: bool) -> Self {
        Self {
            index,
            block_size,
            resident,
        }
    }

    /// The request's block hashes and what the exact index holds of them now, for
    /// [`crate::KvRouterCore::route_prepared`] or [`crate::KvRouterCore::query_prepared`] with
    /// the same request.
    pub fn prepare(&self, req: &RouteRequest<'_>) -> PreparedRoute {
        let t = Instant::now();
        let (mut local, mut seq) = (Vec::new(), Vec::new());
        hash_prompt(req, self.block_size, &mut local, &mut seq);
        let hashing = t.elapsed();
        let t = Instant::now();
        let exact = if local.is_empty() {
            OverlapScores::default()
        } else {
            self.index.find_matches(&local)
        };
        let resident = self.resident.then(|| {
            let mut counts = Vec::new();
            self.index.device_block_counts(&mut counts);
            counts
        });
        PreparedRoute {
            id: req.id,
            tokens: req.tokens.len(),
            local,
            seq,
            exact,
            resident,
            hashing,
            find_matches: t.elapsed(),
        }
    }
}

/// A request's prompt hashed and matched against the exact index ahead of the routing decision
/// (see [`RoutePreparer`]).
#[derive(Debug, Clone)]
pub struct PreparedRoute {
    id: RequestId,
    tokens: usize,
    pub(crate) local: Vec<LocalBlockHash>,
    pub(crate) seq: Vec<u64>,
    pub(crate) exact: OverlapScores,
    /// Every event worker's device blocks, when the policy charges for evictions.
    pub(crate) resident: Option<Vec<(WorkerWithDpRank, u64)>>,
    pub(crate) hashing: Duration,
    pub(crate) find_matches: Duration,
}

impl PreparedRoute {
    /// Whether this was prepared for `req` (its id and prompt length): another request's
    /// preparation is not used.
    pub(crate) fn fits(&self, req: &RouteRequest<'_>) -> bool {
        self.id == req.id && self.tokens == req.tokens.len()
    }
}
