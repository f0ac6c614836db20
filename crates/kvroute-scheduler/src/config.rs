//! The scheduler's configuration, validated once at construction.

use std::time::Duration;

use kvroute_protocols::RouterConfigOverride;

/// Default time after which a request nobody freed is expired (the reference's guard is one hour;
/// the issue asks for five minutes, which also bounds how long a leaked request skews routing).
pub const DEFAULT_REQUEST_EXPIRY: Duration = Duration::from_secs(300);

/// Default age below which a request is kept whatever its worker reports: long enough for a
/// routed request to reach the engine and for the engine's report to reach the router.
pub const DEFAULT_REPORT_GRACE: Duration = Duration::from_secs(5);

/// Everything the scheduler needs to know up front.
#[derive(Debug, Clone, PartialEq)]
pub struct SchedulerConfig {
    /// Tokens per KV block (the engines' page size).
    pub block_size: u32,
    /// The cost model's weights, overridable per request.
    pub cost: CostWeights,
    /// Softmax temperature of selection; 0.0 picks the cheapest worker.
    pub temperature: f64,
    /// Whether generated tokens add decode blocks (and, with an expected output length, decay a
    /// request's exclusive blocks). Off by default, as the reference's
    /// `router_track_output_blocks`: active decode blocks are then the prompt blocks of active
    /// requests only.
    pub track_output_blocks: bool,
    /// A request nobody freed is dropped from the load after this long.
    pub request_expiry: Duration,
    /// A request tracked for less than this is never freed because its worker's report does
    /// not count it ([`crate::Scheduler::reconcile_reported`]); zero frees any the report
    /// leaves out.
    pub report_grace: Duration,
    /// Above these a worker is not eligible at all.
    pub busy: LoadThresholds,
    /// Above these a worker is "full": when every eligible worker is full, requests wait.
    pub queue_threshold: LoadThresholds,
    /// Prefill credit per block a worker holds in a slower tier (host, disk), continuing its
    /// device prefix. Not part of [`CostWeights`], so every policy's weights use them, and not
    /// overridable per request (the reference has no such override).
    pub cache_hit_weights: CacheHitWeights,
}

impl SchedulerConfig {
    /// The reference's defaults for `block_size`.
    pub fn new(block_size: u32) -> Self {
        Self {
            block_size,
            cost: CostWeights::default(),
            temperature: 0.0,
            track_output_blocks: false,
            request_expiry: DEFAULT_REQUEST_EXPIRY,
            report_grace: DEFAULT_REPORT_GRACE,
            busy: LoadThresholds::default(),
            queue_threshold: LoadThresholds::default(),
            cache_hit_weights: CacheHitWeights::reference(),
        }
    }

    /// Checks every field, saying what was wrong and what was expected.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.block_size == 0 {
            return Err(ConfigError::invalid("block_size", "at least 1", 0));
        }
        self.cost.validate()?;
        check_temperature(self.temperature)?;
        if self.request_expiry.is_zero() {
            return Err(ConfigError::invalid(
                "request_expiry",
                "a positive duration",
                "0s",
            ));
        }
        self.busy.validate("busy")?;
        self.queue_threshold.validate("queue_threshold")?;
        self.cache_hit_weights.validate()
    }
}

/// What a block cached in a slower tier is worth, in blocks of prefill credit, against a block
/// in device memory (worth one): the reference's `host_cache_hit_weight` and
/// `disk_cache_hit_weight`.
///
/// A worker's credit is `device_blocks + host * host_blocks + disk * disk_blocks`, where, as in
/// the reference, `host_blocks` is the run of blocks the worker holds in host memory right after
/// its device prefix ends, and `disk_blocks` the run after that on disk (external storage counts
/// as disk). Loading a block from host memory costs less than recomputing it, from disk more, so
/// the defaults credit them 0.75 and 0.25. `overlap_score_credit` multiplies the device blocks
/// only, as in the reference.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CacheHitWeights {
    /// Credit per block in host (CPU, pinned) memory (`host_cache_hit_weight`, 0..=1, default
    /// 0.75).
    pub host: f64,
    /// Credit per block on disk or external storage (`disk_cache_hit_weight`, 0..=1, default
    /// 0.25).
    pub disk: f64,
}

impl Default for CacheHitWeights {
    fn default() -> Self {
        Self::reference()
    }
}

impl CacheHitWeights {
    /// The reference's defaults: 0.75 per host block, 0.25 per disk block.
    pub const fn reference() -> Self {
        Self {
            host: 0.75,
            disk: 0.25,
        }
    }

    /// No credit for slower tiers: only device blocks count, as before kvroute read them.
    pub const fn device_only() -> Self {
        Self {
            host: 0.0,
            disk: 0.0,
        }
    }

    /// Checks that both weights are in 0..=1, naming the configuration key of one that is not.
    pub fn validate(&self) -> Result<(), ConfigError> {
        check_unit("host_cache_hit_weight", self.host)?;
        check_unit("disk_cache_hit_weight", self.disk)
    }
}

/// Weights of the cost
/// `scale * max(prefill_blocks - credit * overlap_blocks, 0) + decode_cost(decode_blocks)`, where
/// `scale = prefill_load_scale + (loaded_prefill_load_scale - prefill_load_scale) * backlog`,
/// `backlog` is the eligible workers' outstanding prefill tokens over their batch budgets
/// (capped at 1), `credit = overlap_credit * (overlap_blocks / prompt_blocks) ^
/// cached_share_exponent`, and `decode_cost` weighs decode blocks up to `1 + decode_tolerance`
/// times the eligible workers' mean at `balanced_decode_weight` and those above at 1
/// ([`CostWeights::decode_cost`]).
///
/// Three presets: [`CostWeights::reference`] (the default) is the reference's cost (a fixed scale
/// of 1, a credit of 1 per cached block, every decode block weighing 1);
/// [`CostWeights::locality`] (the router's default policy, `kv-locality`) weighs prefill 4 to 1
/// against decode blocks (up to 8 to 1 as the prefill backlog builds), a decode block a quarter
/// while the worker's decode load is within twice the mean, and credits a mostly cached prompt's
/// blocks 1.5 times, falling with the square of the cached share, and only the blocks the
/// worker's KV capacity lets it keep;
/// [`CostWeights::load_adaptive`] raises the prefill scale from 1 to 8 as the fleet's prefill
/// backlog builds. Blocks continuing the prefix in slower tiers add
/// [`SchedulerConfig::cache_hit_weights`] to the credit under every preset.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CostWeights {
    /// Multiplies the prefill term when no eligible worker has prefill outstanding (the
    /// reference's `prefill_load_scale`, default 1.0).
    pub prefill_load_scale: f64,
    /// Multiplies the prefill term once the eligible workers' outstanding prefill fills one batch
    /// budget each (`max_num_batched_tokens`, taken as 8192 tokens when a worker did not report
    /// it); between the two the scale is interpolated linearly. Equal to `prefill_load_scale` (a
    /// fixed scale) in the reference's cost.
    pub loaded_prefill_load_scale: f64,
    /// Blocks of prefill credited per cached block (the reference's `overlap_score_credit`,
    /// default 1.0; 0.0 ignores the cache).
    pub overlap_credit: f64,
    /// How the credit falls with the share of the prompt that is cached: the credit per cached
    /// block is `overlap_credit * share ^ cached_share_exponent`. 0.0 (both presets) credits
    /// every cached block alike; 2.0 makes a shared preamble that covers a third of the prompt
    /// worth a ninth of its blocks, while a conversation's continuation that covers most of the
    /// prompt keeps most of its credit. Not overridable per request (the wire format has no
    /// field for it).
    pub cached_share_exponent: f64,
    /// How the credit falls with the candidate's prefill backlog above the least loaded
    /// eligible worker's (the reference's `overlap_score_credit_decay`, default 0.0: no decay):
    /// the credit is divided by `1 + overlap_credit_decay * excess_prefill_blocks /
    /// prompt_blocks`. A worker at the fleet's prefill floor keeps its whole credit; one whose
    /// queue is a prompt's length longer than the floor's keeps `1 / (1 + decay)` of it, so a
    /// burst of requests for one cached prefix spreads out instead of queueing behind it.
    pub overlap_credit_decay: f64,
    /// Weight of a decode block on a worker whose decode load is balanced: while the worker's
    /// decode blocks with this prompt's added stay within `(1 + decode_tolerance)` times the
    /// eligible workers' current mean, each weighs this; the blocks above that weigh 1. 1.0
    /// (the reference's cost) weighs every decode block 1 whatever the balance. The mean is the
    /// fleet's load before this prompt, so on a lightly loaded fleet (a mean near zero) a
    /// prompt's own blocks are already above it and weigh fully: a preamble every request
    /// shares does not herd traffic onto the worker that cached it.
    ///
    /// A decode block is a proxy for load, not for time to first token (under the reference's
    /// engine timing a block of prefill costs a hundred times what a block of decode adds to a
    /// step), so a cost that weighs small differences in decode load fully moves requests off
    /// their cache for little: on a busy fleet every worker runs about as many decodes, and the
    /// differences that remain are noise that costs hits. Weighing them lightly within a
    /// tolerance, and fully beyond it, keeps requests with their cache while the fleet is
    /// balanced and still spreads a worker that decodes far more than the rest (what SGLang's
    /// gateway does with its absolute and relative imbalance thresholds, here in the cost).
    pub balanced_decode_weight: f64,
    /// How far above the eligible workers' mean decode load a worker's still counts as
    /// balanced, as a fraction of the mean (1.0: up to twice the mean); see
    /// [`Self::balanced_decode_weight`].
    pub decode_tolerance: f64,
    /// Whether a worker's cached blocks are credited only as far as its KV capacity lets it keep
    /// them until it admits the prompt (for workers whose capacity is known:
    /// [`WorkerSpec::with_kv_capacity`](crate::WorkerSpec::with_kv_capacity), or an engine's
    /// load report). The blocks the prompt needs beyond what the worker's active requests leave
    /// of its capacity come out of its idle cached prefix, which then earns no credit
    /// ([`CandidateCost::unkept_blocks`](crate::CandidateCost::unkept_blocks)). Without it a
    /// worker that holds a prefix is credited for it even when the long prompts routed there
    /// just before will have evicted it by the time this one is admitted, and a run of them
    /// queues on one worker behind blocks it no longer has.
    pub capacity_credit: bool,
    /// Blocks of prefill charged per block of other prompts' idle cache that placing this
    /// prompt on a worker would evict, beyond what placing it on the eligible worker with the
    /// most free KV capacity would (0.0, the reference's presets: no charge).
    ///
    /// A worker's free capacity is its KV capacity less the blocks it holds
    /// ([`SelectRequest::resident_blocks`](crate::SelectRequest::resident_blocks), or the
    /// blocks of its active requests where that is more); the prompt's uncached blocks must be
    /// allocated there, and what does not fit evicts the least recently used of the blocks it
    /// caches for other prompts: the next turns of other conversations, recomputed later. The
    /// charge is relative to the roomiest eligible worker, so it is silent while every worker
    /// has room for the prompt and once every worker is full alike (then every placement evicts
    /// as much), and speaks only when one worker would evict what another has room for: it
    /// keeps new conversations from piling onto a worker that a shared preamble draws them to
    /// until their histories outgrow its cache. Workers of unknown capacity are never charged.
    pub eviction_weight: f64,
    /// Blocks of prefill charged per block of idle cache a placement would evict on a worker
    /// whose cache is full, times how much more it has been allocating than the eligible worker
    /// that allocated least (its churn above theirs over the mean churn, capped at 1; 0.0, the
    /// reference's presets: no charge).
    ///
    /// A worker's churn is the new blocks (prompt blocks not cached there) routed to it lately,
    /// each weighing half once the fleet has allocated its whole KV capacity again. A full cache
    /// evicts a least recently used block for every new one, so where churn is high the blocks
    /// that go were used recently: the contexts of conversations and agents between turns,
    /// recomputed when they return. Where churn is low they are what nobody has asked for in a
    /// long while. [`Self::eviction_weight`] is silent once every worker is full; this charge is
    /// what then keeps a new conversation (whose uncached blocks are most of its prompt) off the
    /// worker that is cycling through other conversations' live contexts, as SGLang's gateway
    /// sends a prompt that matches little to the worker whose radix tree is smallest. A
    /// continuing conversation's few new blocks weigh little against its cached prefix. Workers
    /// of unknown capacity are never charged.
    ///
    /// Off in every preset, `kv-locality` included: measured (docs/benchmarks.md, "Evictions
    /// charged by churn") at 1 it gained 0.2-0.5 points of hit rate and 15-19% of TTFT p99 on
    /// 16 s of the peers bench's `agentic` (live and in virtual time), but lost 0.1 point on
    /// `multi-turn` in virtual time and 0.01-0.04 on three of the evaluation set's cells, and the
    /// `agentic` gains came from a handful of decisions that other weights flip. Policy `kv`
    /// takes it (`churn_eviction_weight`) for fleets of long agent sessions to try.
    pub churn_eviction_weight: f64,
    /// Blocks of prefill charged per new block a placement allocates (prompt blocks not cached
    /// there), times how much fuller the worker's KV cache is than the emptiest eligible
    /// worker's (fractions of their capacities), times the square of the share of the prompt
    /// that is new there (0.0, the reference's presets: no charge).
    ///
    /// A worker's fill is what [`Self::eviction_weight`] reads: its capacity less its free
    /// blocks, over its capacity. That charge speaks only once a prompt would not fit; this one
    /// speaks while the fleet fills. A new context (a conversation's or an agent's first turn,
    /// whose cached share is a shared preamble at most) placed on a fuller worker will compete
    /// with more of other contexts' blocks as all of them grow, and on an idle fleet nothing
    /// else tells the workers apart but the preamble's small credit, which draws every new
    /// session to the worker that cached it first: on the peers bench's 8-engine `agentic`
    /// cell four of six agent sessions shared one worker and evicted one another while five
    /// workers stayed empty. This is SGLang's gateway sending a prompt that matches little to
    /// the worker whose radix tree is smallest, in the cost. The square of the new share keeps
    /// a continuing context (most of it cached) with its cache however full the worker is;
    /// once every worker is full alike, or while every one is empty, the charge is silent.
    /// Workers of unknown capacity are never charged.
    ///
    /// Off in every preset, `kv-locality` included: measured at 2 (docs/benchmarks.md, "New
    /// contexts charged by occupancy") it took the peers bench's 8-engine `agentic` cell from
    /// 87.5% to 88.5% of prompt tokens cached (its ceiling 88.7%) and its TTFT p99 down by a
    /// third, but lost points on 32 engines (`agentic` 0.3, `rag` 0.2-0.4, the noisy `bursty`
    /// 0.5-1.0; likely where caches never fill within the run, so the spread only forgoes shared
    /// preambles) and raised the evaluation set's `agentic` TTFT p99 6-12% in virtual time
    /// (first turns computed without their preamble). Policy `kv` takes it (`occupancy_weight`) for fleets where new long sessions
    /// outgrow a worker's cache.
    pub occupancy_weight: f64,
    /// Whether the prefill term counts at all (the reference's `track_prefill_tokens`).
    pub track_prefill_tokens: bool,
    /// Whether prompt blocks already active on a worker are counted once (the reference's
    /// `assume_kv_reuse`); when false every prompt block adds to the decode term.
    pub assume_kv_reuse: bool,
}

/// [`CostWeights::eviction_weight`] of the locality cost.
pub(crate) const LOCALITY_EVICTION_WEIGHT: f64 = 1.0;

/// The batch budget assumed for a worker that did not report `max_num_batched_tokens` (vLLM's
/// chunked-prefill default on large GPUs).
pub const DEFAULT_BATCH_BUDGET_TOKENS: u64 = 8192;

impl Default for CostWeights {
    fn default() -> Self {
        Self::reference()
    }
}

impl CostWeights {
    /// The reference's default cost: `max(prefill_blocks - overlap_blocks, 0) + decode_blocks`.
    pub const fn reference() -> Self {
        Self {
            prefill_load_scale: 1.0,
            loaded_prefill_load_scale: 1.0,
            overlap_credit: 1.0,
            cached_share_exponent: 0.0,
            overlap_credit_decay: 0.0,
            balanced_decode_weight: 1.0,
            decode_tolerance: 0.0,
            capacity_credit: false,
            eviction_weight: 0.0,
            churn_eviction_weight: 0.0,
            occupancy_weight: 0.0,
            track_prefill_tokens: true,
            assume_kv_reuse: true,
        }
    }

    /// The locality cost: prefill weighs 4 decode blocks (rising to 8 as the fleet's prefill
    /// backlog fills a batch on every worker), a decode block weighs a quarter on a worker
    /// whose decode load is within twice the eligible workers' mean (and 1 above that), and a
    /// cached block credits up to 1.5 blocks of prefill, `1.5 * share^2` where `share` is the
    /// cached share of the prompt, if the worker can keep it until the prompt is admitted
    /// ([`Self::capacity_credit`]).
    ///
    /// Time to first token is mostly prefill: under the reference's own engine timing a block
    /// of prefill costs a hundred times more time than a block of decode adds to a step, so
    /// with the reference's 1:1 weights a long agent context (thousands of cached blocks) is
    /// moved off its cache as soon as its worker holds as many more decode blocks as it has
    /// cached, and then prefilled from scratch for seconds. Weighing prefill 4 to 1 keeps it.
    /// The credit above 1 per cached block makes a burst of requests for one cached prefix
    /// queue behind it rather than recompute it elsewhere (which costs the whole fleet prefill
    /// time while the burst lasts); the square of the share keeps a preamble every request
    /// shares (a system prompt that is a small part of each prompt) from pulling all traffic
    /// onto the worker that cached it first under light load, where the credit above 1 would
    /// otherwise herd. The rise to 8 under backlog keeps a prompt with its cache when every
    /// worker is queued and decode load is what differs (the cache then saves the most), while
    /// light load is routed as at 4, where a higher fixed scale packs decodes onto cached workers
    /// (light `multi-turn` E2E p99 +35% at a fixed 16). The quarter weight within the decode
    /// tolerance does on a balanced fleet what a fixed 16 would (a prompt is not moved off its
    /// cache for a few hundred more decode blocks that slow nobody's first token), while a
    /// worker that decodes over twice the mean is spread at the full weight, which keeps most
    /// of light `multi-turn`'s E2E (+8% against +35%). The capacity credit stops a run of long
    /// prompts from queueing on one worker for a prefix that the first of them will have
    /// evicted (on the peers bench's `agentic` cells in virtual time, where capacity binds, TTFT
    /// p99 fell up to 7x); where capacity does not bind it changes nothing.
    ///
    /// Measured in docs/benchmarks.md ("The default policy against the reference"): on every
    /// workload of the evaluation set, light and saturated, it beats the reference's router on
    /// hit rate and TTFT p99 (ties at the floor where no request waits), and [`Self::reference`]
    /// on both too.
    pub const fn locality() -> Self {
        Self {
            prefill_load_scale: 4.0,
            loaded_prefill_load_scale: 8.0,
            overlap_credit: 1.5,
            cached_share_exponent: 2.0,
            overlap_credit_decay: 0.0,
            balanced_decode_weight: 0.25,
            decode_tolerance: 1.0,
            capacity_credit: true,
            eviction_weight: LOCALITY_EVICTION_WEIGHT,
            churn_eviction_weight: 0.0,
            occupancy_weight: 0.0,
            track_prefill_tokens: true,
            assume_kv_reuse: true,
        }
    }

    /// The load-adaptive cost: the reference's terms, with a prefill scale that rises from 1
    /// with no prefill backlog to 8 once the backlog fills a batch on every worker.
    ///
    /// Time to first token is queue wait plus the request's own uncached prefill. With no
    /// backlog there is no queue, so prefill weighs what the reference gives it (a block of
    /// prefill like a block of decode) and light load is routed exactly as the reference
    /// routes it: spread by active blocks, with a cache hit worth its blocks. As prefill queues
    /// build, queued and uncached prefill become what every request waits on, so they (and the
    /// cache credit, which is prefill not done) outweigh decode blocks up to eight to one: a
    /// conversation stays with its cache even when its worker runs one more request, and load
    /// is balanced by prefill backlog rather than by the prompt blocks of requests that are
    /// already decoding.
    pub const fn load_adaptive() -> Self {
        Self {
            prefill_load_scale: 1.0,
            loaded_prefill_load_scale: 8.0,
            overlap_credit: 1.0,
            cached_share_exponent: 0.0,
            overlap_credit_decay: 0.0,
            balanced_decode_weight: 1.0,
            decode_tolerance: 0.0,
            capacity_credit: false,
            eviction_weight: 0.0,
            churn_eviction_weight: 0.0,
            occupancy_weight: 0.0,
            track_prefill_tokens: true,
            assume_kv_reuse: true,
        }
    }

    /// These weights with policy kv's tunable weights set where given (`None` keeps the
    /// configured value). Serve's `[router]` keys and replay's flags of the same names both come
    /// here.
    pub fn with_tuning(mut self, t: &CostTuning) -> Self {
        if let Some(c) = t.overlap_credit {
            self.overlap_credit = c;
        }
        if let Some(s) = t.prefill_load_scale {
            self.prefill_load_scale = s;
            self.loaded_prefill_load_scale = s;
        }
        if let Some(s) = t.loaded_prefill_load_scale {
            self.loaded_prefill_load_scale = s;
        }
        if let Some(e) = t.cached_share_exponent {
            self.cached_share_exponent = e;
        }
        if let Some(w) = t.balanced_decode_weight {
            self.balanced_decode_weight = w;
        }
        if let Some(d) = t.decode_tolerance {
            self.decode_tolerance = d;
        }
        if let Some(c) = t.capacity_credit {
            self.capacity_credit = c;
        }
        if let Some(e) = t.eviction_weight {
            self.eviction_weight = e;
        }
        if let Some(e) = t.churn_eviction_weight {
            self.churn_eviction_weight = e;
        }
        if let Some(o) = t.occupancy_weight {
            self.occupancy_weight = o;
        }
        self
    }

    /// These weights with the request's overrides applied (`None` keeps the configured value).
    pub fn with_override(mut self, o: &RouterConfigOverride) -> Self {
        // The wire field names one fixed scale: it replaces both ends of the range.
        if let Some(v) = o.prefill_load_scale {
            self.prefill_load_scale = v;
            self.loaded_prefill_load_scale = v;
        }
        if let Some(v) = o.overlap_score_credit {
            self.overlap_credit = v;
        }
        if let Some(v) = o.track_prefill_tokens {
            self.track_prefill_tokens = v;
        }
        if let Some(v) = o.assume_kv_reuse {
            self.assume_kv_reuse = v;
        }
        self
    }

    /// Checks that every weight is finite and non-negative.
    pub fn validate(&self) -> Result<(), ConfigError> {
        check_weight("prefill_load_scale", self.prefill_load_scale)?;
        check_weight("loaded_prefill_load_scale", self.loaded_prefill_load_scale)?;
        check_weight("overlap_score_credit", self.overlap_credit)?;
        check_weight("cached_share_exponent", self.cached_share_exponent)?;
        check_weight("overlap_score_credit_decay", self.overlap_credit_decay)?;
        check_unit("balanced_decode_weight", self.balanced_decode_weight)?;
        check_weight("decode_tolerance", self.decode_tolerance)?;
        check_weight("eviction_weight", self.eviction_weight)?;
        check_weight("churn_eviction_weight", self.churn_eviction_weight)?;
        check_weight("occupancy_weight", self.occupancy_weight)
    }

    /// Whether the cost reads how many blocks each worker holds
    /// ([`SelectRequest::resident_blocks`](crate::SelectRequest::resident_blocks)): only to
    /// charge for evictions or for occupancy.
    #[inline]
    pub fn charges_evictions(&self) -> bool {
        self.eviction_weight > 0.0
            || self.churn_eviction_weight > 0.0
            || self.occupancy_weight > 0.0
    }

    /// The prefill scale at `backlog` (outstanding prefill over batch budget, clamped to 0..=1).
    #[inline]
    pub fn prefill_scale_at(&self, backlog: f64) -> f64 {
        let b = if backlog.is_nan() {
            0.0
        } else {
            backlog.clamp(0.0, 1.0)
        };
        self.prefill_load_scale + (self.loaded_prefill_load_scale - self.prefill_load_scale) * b
    }

    /// The factor [`Self::overlap_credit_decay`] applies to the credit of a worker whose
    /// outstanding prefill is `excess_blocks` above the eligible workers' least, for a prompt
    /// of `prompt_blocks`: `1 / (1 + decay * excess / prompt)` (1.0 without decay).
    #[inline]
    pub fn credit_decay_at(&self, excess_blocks: f64, prompt_blocks: usize) -> f64 {
        if self.overlap_credit_decay == 0.0 || excess_blocks <= 0.0 {
            return 1.0;
        }
        1.0 / (1.0 + self.overlap_credit_decay * excess_blocks / prompt_blocks.max(1) as f64)
    }

    /// What `decode_blocks` on a worker (this prompt's included) weigh when the eligible
    /// workers' mean before this prompt is `mean_decode_blocks`: `balanced_decode_weight * decode +
    /// (1 - balanced_decode_weight) * max(decode - (1 + decode_tolerance) * mean, 0)`, exactly
    /// `decode_blocks` with the reference's weight of 1.
    #[inline]
    pub fn decode_cost(&self, decode_blocks: f64, mean_decode_blocks: f64) -> f64 {
        if self.balanced_decode_weight >= 1.0 {
            return decode_blocks;
        }
        let above = (decode_blocks - (1.0 + self.decode_tolerance) * mean_decode_blocks).max(0.0);
        self.balanced_decode_weight * decode_blocks + (1.0 - self.balanced_decode_weight) * above
    }

    /// The credit per cached block for a prompt of `prompt_blocks` with `overlap_blocks` cached.
    #[inline]
    pub fn credit(&self, overlap_blocks: u32, prompt_blocks: usize) -> f64 {
        if self.cached_share_exponent == 0.0 || overlap_blocks == 0 {
            return self.overlap_credit;
        }
        let share = if prompt_blocks == 0 {
            1.0
        } else {
            (f64::from(overlap_blocks) / prompt_blocks as f64).min(1.0)
        };
        self.overlap_credit * share.powf(self.cached_share_exponent)
    }
}

/// Policy kv's tunable weights as an operator gives them (`None` keeps the configured value):
/// serve's `[router]` keys and replay's flags of the same names ([`CostWeights::with_tuning`]).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CostTuning {
    /// [`CostWeights::overlap_credit`].
    pub overlap_credit: Option<f64>,
    /// One prefill scale: [`CostWeights::prefill_load_scale`], and also
    /// [`CostWeights::loaded_prefill_load_scale`] unless that is given too.
    pub prefill_load_scale: Option<f64>,
    /// [`CostWeights::loaded_prefill_load_scale`].
    pub loaded_prefill_load_scale: Option<f64>,
    /// [`CostWeights::cached_share_exponent`].
    pub cached_share_exponent: Option<f64>,
    /// [`CostWeights::balanced_decode_weight`].
    pub balanced_decode_weight: Option<f64>,
    /// [`CostWeights::decode_tolerance`].
    pub decode_tolerance: Option<f64>,
    /// [`CostWeights::capacity_credit`].
    pub capacity_credit: Option<bool>,
    /// [`CostWeights::eviction_weight`].
    pub eviction_weight: Option<f64>,
    /// [`CostWeights::churn_eviction_weight`].
    pub churn_eviction_weight: Option<f64>,
    /// [`CostWeights::occupancy_weight`].
    pub occupancy_weight: Option<f64>,
}

/// When a worker counts as loaded; `None` disables a check. Used both for the busy filter and
/// for the queue threshold.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LoadThresholds {
    /// Active decode blocks as a fraction of the worker's KV capacity (workers with unknown
    /// capacity never trip this).
    pub decode_blocks_fraction: Option<f64>,
    /// Active prefill tokens, absolute or relative to the worker's batch budget.
    pub prefill_tokens: Option<PrefillThreshold>,
}

/// A limit on a worker's active (not yet prefilled) prompt tokens.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum PrefillThreshold {
    /// More than this many tokens.
    Absolute(u64),
    /// More than this fraction of the worker's `max_num_batched_tokens` (workers with unknown
    /// budget never trip this).
    FractionOfBatch(f64),
}

impl LoadThresholds {
    fn validate(&self, name: &'static str) -> Result<(), ConfigError> {
        if let Some(f) = self.decode_blocks_fraction
            && !(f.is_finite() && f > 0.0)
        {
            return Err(ConfigError::invalid(name, "decode_blocks_fraction > 0", f));
        }
        if let Some(PrefillThreshold::FractionOfBatch(f)) = self.prefill_tokens
            && !(f.is_finite() && f > 0.0)
        {
            return Err(ConfigError::invalid(
                name,
                "prefill fraction of batch > 0",
                f,
            ));
        }
        Ok(())
    }
}

/// Temperature from the request's override if any, else `configured`; validated.
pub(crate) fn effective_temperature(
    configured: f64,
    o: Option<&RouterConfigOverride>,
) -> Result<f64, ConfigError> {
    let t = o.and_then(|o| o.router_temperature).unwrap_or(configured);
    check_temperature(t)?;
    Ok(t)
}

fn check_temperature(t: f64) -> Result<(), ConfigError> {
    if t.is_finite() && t >= 0.0 {
        Ok(())
    } else {
        Err(ConfigError::invalid(
            "router_temperature",
            "a finite number >= 0",
            t,
        ))
    }
}

fn check_weight(field: &'static str, v: f64) -> Result<(), ConfigError> {
    if v.is_finite() && v >= 0.0 {
        Ok(())
    } else {
        Err(ConfigError::invalid(field, "a finite number >= 0", v))
    }
}

fn check_unit(field: &'static str, v: f64) -> Result<(), ConfigError> {
    if (0.0..=1.0).contains(&v) {
        Ok(())
    } else {
        Err(ConfigError::invalid(field, "a number in 0..=1", v))
    }
}

/// A configuration value (from the config file or a per-request override) out of range.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// `field` must be `expected`, got `got`.
    #[error("{field} must be {expected}, got {got}")]
    Invalid {
        /// The offending field.
        field: &'static str,
        /// What the field must be.
        expected: &'static str,
        /// What it was.
        got: String,
    },
}

impl ConfigError {
    fn invalid(field: &'static str, expected: &'static str, got: impl ToString) -> Self {
        Self::Invalid {
            field,
            expected,
            got: got.to_string(),
        }
    }
}
