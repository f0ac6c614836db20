//! Approximate mode: for workers that publish no KV events, routing decisions stand in for them.
//!
//! When the router sends a request to a worker it records the request's blocks as *predicted*
//! held there for a TTL. Predictions expire, and a size cap prunes the oldest down to a target
//! ratio of the cap, both driven by the caller's clock (a `Duration` since any fixed origin).
//!
//! **Learning from the engines.** An engine's cache is smaller than the TTL assumes when it is
//! busy: it evicts least-recently-used blocks as new ones are allocated. Each prediction carries
//! the worker's allocation count when it was last used, so its *age* is how many new blocks the
//! router has sent that worker since. Engines report how many prompt tokens they found cached;
//! a report below the prediction says the first block not found was too old to be held, one above
//! it says an older block still was. From these each worker's *effective capacity* (in blocks of
//! age) is learnt, and matches stop at the first block older than it: the predicted cache follows
//! what the engine reports. Ages grow along a prompt (a block is used whenever a later one of the
//! same prefix is), so the cut is a binary search.
//!
//! **Two ways engines forget.** An engine with a paged block cache (vLLM, SGLang) evicts least
//! recently used *blocks*: a block survives a number of new blocks. An engine that keeps a prompt
//! per slot (llama.cpp without its host-memory prompt cache) forgets whole *requests*: a prefix
//! survives until another request takes its slot, however short. Each prediction therefore also
//! carries the worker's request count when it was last used, a second age, and a second capacity
//! (in requests) is learnt from the same reports. Both models learn from every report; each
//! worker's matches are cut by the one whose predictions have lately been closer to what its
//! engine reported (the block model unless the request model is clearly better).

mod wheel;

use std::collections::hash_map::Entry;
use std::time::Duration;

use kvroute_protocols::WorkerWithDpRank;
use kvroute_protocols::kv_events::{
    ExternalSequenceBlockHash, KvCacheRemoveData, KvCacheStoreData, KvCacheStoredBlockData,
    LocalBlockHash, StorageTier,
};

use crate::fasthash::FastMap;
use crate::hash::{SequenceHash, next_seq_hash};
use crate::index::{KvIndex, MemoryStats};
use crate::scores::OverlapScores;
use wheel::Wheel;

/// Settings of approximate mode.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ApproxConfig {
    /// How long a prediction lives unless refreshed by another decision (it goes at most a 64th
    /// of this after its deadline: the expiry queue's buckets are that wide).
    pub ttl: Duration,
    /// The most predicted blocks kept over all workers; beyond it the oldest are pruned.
    pub max_blocks: usize,
    /// Pruning stops at `max_blocks * prune_target_ratio` (0..=1), leaving headroom.
    pub prune_target_ratio: f64,
}

impl Default for ApproxConfig {
    fn default() -> Self {
        Self {
            ttl: Duration::from_secs(120),
            max_blocks: 1 << 20,
            prune_target_ratio: 0.8,
        }
    }
}

/// How far one report moves a worker's learnt capacity in blocks toward what it showed (0..=1):
/// an LRU cache's boundary moves with the traffic, so one report is one sample of it.
const LEARNING_RATE: f64 = 0.5;
/// The same for the capacity in requests: the prompts an engine keeps (its slots) is a small
/// whole number that does not drift, so one report sets it. Ages are whole numbers too, and a
/// capacity moved only part of the way would still count the missing block as held.
const REQUEST_LEARNING_RATE: f64 = 1.0;
/// Reports within this many blocks of the prediction teach nothing (engines such as llama.cpp
/// re-evaluate a prompt's last token, so a fully cached prompt may read one block short).
const REPORT_SLACK_BLOCKS: u32 = 1;
/// A missing block younger than this share of the learnt capacity means a lost cache, not an
/// eviction.
const LOST_FRACTION: f64 = 0.25;
/// At most this many routed requests await their report; beyond it the oldest are forgotten.
const MAX_PENDING_REPORTS: usize = 1 << 16;
/// Weight of the latest report in each model's running error (0..=1).
const ERROR_WEIGHT: f64 = 0.2;
/// The request model cuts a worker's matches only while its running error is below this share of
/// the block model's, so that two models about as good do not take turns.
const SWITCH_RATIO: f64 = 0.8;

/// One predicted block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Prediction {
    /// Expiry, in nanoseconds of the caller's clock.
    deadline: u64,
    /// The deadline of the prediction's one entry in the expiry queue: the deadline it had when
    /// queued, earlier than `deadline` once a later decision refreshed it.
    queued: u64,
    /// The worker's allocation count when the block was last used.
    stamp: u64,
    /// The worker's request count when the block was last used.
    request: u64,
}

/// How a worker's engine forgets, as learnt from its reports.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub enum Retention {
    /// Least recently used blocks go: a block is held until this many new blocks (of age) have
    /// been sent there after its last use (paged caches: vLLM, SGLang, TensorRT-LLM).
    Blocks(f64),
    /// Whole requests go: a prefix is held until this many requests (of age) have been sent there
    /// after its last use (an engine that keeps one prompt a slot, such as llama.cpp without its
    /// prompt cache).
    Requests(f64),
}

impl Retention {
    /// The capacity's unit: `blocks` or `requests` (of age).
    pub fn unit(&self) -> &'static str {
        match self {
            Self::Blocks(_) => "blocks",
            Self::Requests(_) => "requests",
        }
    }

    /// The capacity, in [`Self::unit`].
    pub fn capacity(&self) -> f64 {
        match *self {
            Self::Blocks(c) | Self::Requests(c) => c,
        }
    }
}

/// One way of measuring a prediction's age, and what is learnt in it.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Model {
    /// Ages in new blocks allocated since last use.
    Blocks,
    /// Ages in requests routed since last use.
    Requests,
}

/// What one model has learnt of a worker rank.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Capacity {
    /// Predictions of this age or more are gone by now; unknown until a report says.
    limit: Option<f64>,
    /// Running mean of how far this model's predictions were from the reports, in blocks.
    error: f64,
}

/// What is learnt of one worker rank.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Learned {
    /// New blocks the router has predicted there, ever.
    allocated: u64,
    /// Requests the router has recorded there, ever.
    requests: u64,
    /// Capacity in blocks of age.
    blocks: Capacity,
    /// Capacity in requests of age.
    by_requests: Capacity,
}

impl Learned {
    /// The model whose predictions have lately been closer to the reports.
    fn model(&self) -> Model {
        if self.by_requests.limit.is_some()
            && self.by_requests.error < self.blocks.error * SWITCH_RATIO
        {
            Model::Requests
        } else {
            Model::Blocks
        }
    }

    /// What `model` has learnt.
    fn capacity(&self, model: Model) -> &Capacity {
        match model {
            Model::Blocks => &self.blocks,
            Model::Requests => &self.by_requests,
        }
    }

    /// The capacity in force, if one is learnt.
    fn retention(&self) -> Option<Retention> {
        let model = self.model();
        let limit = self.capacity(model).limit?;
        Some(match model {
            Model::Blocks => Retention::Blocks(limit),
            Model::Requests => Retention::Requests(limit),
        })
    }

    /// A prediction's age in `model`, as a float for comparing with its capacity.
    fn age(&self, model: Model, p: &Prediction) -> f64 {
        match model {
            Model::Blocks => self.allocated.saturating_sub(p.stamp) as f64,
            Model::Requests => self.requests.saturating_sub(p.request) as f64,
        }
    }
}

/// The ages of a run of a prompt's predicted blocks when it was routed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Run {
    /// New blocks allocated on the worker since their last use.
    blocks: u64,
    /// Requests recorded on the worker since their last use.
    requests: u64,
    /// Blocks in the run.
    len: u32,
}

impl Run {
    /// The run's age in `model`.
    fn age(&self, model: Model) -> u64 {
        match model {
            Model::Blocks => self.blocks,
            Model::Requests => self.requests,
        }
    }
}

/// The ages a routed request's predicted blocks had when it was routed, awaiting its report.
#[derive(Debug, Clone, PartialEq, Eq)]
struct PendingReport {
    worker: WorkerWithDpRank,
    /// Runs of equal ages along the prompt; neither age ever falls.
    runs: Vec<Run>,
}

impl PendingReport {
    /// The age, in `model`, block `index` of the prompt had, if it was predicted.
    fn age_at(&self, model: Model, index: u32) -> Option<u64> {
        let mut start = 0u32;
        for run in &self.runs {
            if index < start + run.len {
                return Some(run.age(model));
            }
            start += run.len;
        }
        None
    }

    /// How many of the prompt's blocks `model` predicted held under capacity `limit`.
    fn predicted(&self, model: Model, limit: Option<f64>) -> u32 {
        let mut held = 0u32;
        for run in &self.runs {
            if limit.is_some_and(|c| run.age(model) as f64 >= c) {
                break;
            }
            held += run.len;
        }
        held
    }
}

/// What a report taught (see [`ApproxIndex::on_report`]).
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub enum Learnt {
    /// The report agreed with the prediction, or there was nothing to learn from it.
    Nothing,
    /// The engine held less than predicted: the worker's capacity went down to this (blocks).
    Lowered(f64),
    /// The engine held more than the learnt capacity allowed: it went up to this (blocks).
    Raised(f64),
    /// The engine held nothing of a prompt whose blocks were far younger than its capacity: it
    /// evidently lost its cache, restarted say. The capacity stands; the caller decides what
    /// to drop.
    Lost,
}

/// An index fed by routing decisions instead of events.
///
/// Predicted blocks are stored under their sequence hash as engine block id, so a prefix's parent
/// is always the previous block's sequence hash.
#[derive(Debug)]
pub struct ApproxIndex {
    index: KvIndex,
    config: ApproxConfig,
    /// (worker, sequence hash) -> its deadline and allocation stamp.
    deadlines: FastMap<(WorkerWithDpRank, u64), Prediction>,
    /// Per worker rank: allocations and the learnt capacity.
    learned: FastMap<WorkerWithDpRank, Learned>,
    /// Routed requests (by the caller's id) awaiting their engine's report.
    pending: FastMap<u64, PendingReport>,
    /// One entry per prediction, bucketed by deadline, for expiry and pruning (see [`wheel`]).
    /// A refresh leaves the prediction's entry where it is; popped, an entry whose prediction
    /// was refreshed since is queued again at the deadline it has now. A queue entry per
    /// refresh would hold one per block per turn of every conversation over a TTL (millions on
    /// a busy router) and look each up when it came due.
    queue: Wheel,
    store_scratch: KvCacheStoreData,
    remove_scratch: KvCacheRemoveData,
    /// A recorded prompt's sequence hashes, and what was predicted for each before.
    seq_scratch: Vec<u64>,
    found_scratch: Vec<Option<(u64, u64)>>,
}

impl ApproxIndex {
    /// An empty approximate index.
    pub fn new(config: ApproxConfig) -> Self {
        Self {
            index: KvIndex::new(),
            config,
            deadlines: FastMap::default(),
            learned: FastMap::default(),
            pending: FastMap::default(),
            queue: Wheel::new(nanos(config.ttl)),
            store_scratch: KvCacheStoreData {
                parent_hash: None,
                blocks: Vec::with_capacity(1),
            },
            remove_scratch: KvCacheRemoveData {
                block_hashes: Vec::with_capacity(1),
            },
            seq_scratch: Vec::new(),
            found_scratch: Vec::new(),
        }
    }

    /// Records that the request with blocks `local` was sent to `worker` at `now`: its blocks are
    /// predicted held there until `now + ttl`. Expires and prunes as needed first.
    pub fn record(&mut self, worker: WorkerWithDpRank, local: &[LocalBlockHash], now: Duration) {
        self.record_request(worker, local, now, None);
    }

    /// [`Self::record`] for a request whose engine will report its cached tokens: keeps the
    /// ages its predicted blocks had, under the caller's `request` id, for [`Self::on_report`]
    /// (or [`Self::forget`] when no report comes).
    pub fn record_request(
        &mut self,
        worker: WorkerWithDpRank,
        local: &[LocalBlockHash],
        now: Duration,
        request: Option<u64>,
    ) {
        self.expire(now);
        let deadline = nanos(now.saturating_add(self.config.ttl));
        // The prompt's sequence hashes, once for both passes below.
        self.seq_scratch.clear();
        let mut prev: Option<SequenceHash> = None;
        for &block in local {
            let seq = next_seq_hash(prev, block);
            self.seq_scratch.push(seq.0);
            prev = Some(seq);
        }
        // What was predicted for each block, looked up in a loop of its own: the table is far
        // larger than the CPU's caches and nearly every lookup misses them, and lookups that do
        // nothing else between them overlap their misses (this loop was three quarters of the
        // method's time when each lookup sat among the hashing and the bookkeeping).
        let deadlines = &self.deadlines;
        self.found_scratch.clear();
        self.found_scratch.extend(
            self.seq_scratch
                .iter()
                .map(|&seq| deadlines.get(&(worker, seq)).map(|p| (p.stamp, p.request))),
        );
        // The ages the prompt's predicted blocks have now, and how many blocks are new.
        let learned = self.learned.entry(worker).or_default();
        let (allocated, requests) = (learned.allocated, learned.requests);
        let mut runs: Vec<Run> = Vec::new();
        let mut fresh = 0u64;
        let mut held = true;
        for found in &self.found_scratch {
            match *found {
                Some((stamp, request)) if held => {
                    let blocks = allocated.saturating_sub(stamp);
                    let requests = requests.saturating_sub(request);
                    match runs.last_mut() {
                        Some(run) if run.blocks == blocks && run.requests == requests => {
                            run.len += 1;
                        }
                        _ => runs.push(Run {
                            blocks,
                            requests,
                            len: 1,
                        }),
                    }
                }
                Some(_) => {}
                None => {
                    held = false;
                    fresh += 1;
                }
            }
        }
        learned.allocated += fresh;
        learned.requests += 1;
        let (stamp, request_stamp) = (learned.allocated, learned.requests);
        let mut parent: Option<u64> = None;
        for (&seq, &block) in self.seq_scratch.iter().zip(local) {
            match self.deadlines.entry((worker, seq)) {
                Entry::Occupied(mut held) => {
                    // Its queue entry stays; popped, it is queued again at this deadline.
                    let p = held.get_mut();
                    p.deadline = deadline;
                    p.stamp = stamp;
                    p.request = request_stamp;
                }
                Entry::Vacant(new) => {
                    new.insert(Prediction {
                        deadline,
                        queued: deadline,
                        stamp,
                        request: request_stamp,
                    });
                    self.queue.push((deadline, worker, seq));
                    self.store_scratch.parent_hash = parent.map(ExternalSequenceBlockHash);
                    self.store_scratch.blocks.clear();
                    self.store_scratch.blocks.push(KvCacheStoredBlockData {
                        block_hash: ExternalSequenceBlockHash(seq),
                        tokens_hash: block,
                    });
                    // The parent was stored or refreshed one step earlier, so this cannot fail.
                    let _ = self
                        .index
                        .store(worker, StorageTier::Device, &self.store_scratch);
                }
            }
            parent = Some(seq);
        }
        if let Some(request) = request {
            if self.pending.len() >= MAX_PENDING_REPORTS {
                // Callers forget what gets no report; a full table means one does not.
                self.pending.clear();
            }
            self.pending.insert(request, PendingReport { worker, runs });
        }
        if self.deadlines.len() > self.config.max_blocks {
            let target = (self.config.max_blocks as f64 * self.config.prune_target_ratio) as usize;
            while self.deadlines.len() > target {
                let Some((queued, worker, seq)) = self.queue.pop(None) else {
                    break;
                };
                // The earliest deadlines go first: one refreshed since is queued again at its own.
                self.settle(queued, worker, seq, |_| false);
            }
        }
    }

    /// The engine serving `request` (recorded with [`Self::record_request`]) found `reported`
    /// of its prompt's blocks cached. Each model (blocks, requests) compares it with what it
    /// predicted from the ages the prompt's blocks had when routed and its capacity now. Below
    /// its prediction, the first block not found was too old to be held: the capacity moves
    /// down toward its age (the first shortfall sets it there; [`Learnt::Lost`] when the engine
    /// held none of the prompt and its first block was far too young to be evicted). Above it,
    /// a block the capacity cut was still held: the capacity moves up past its age. Returns
    /// what the model in force before the report learnt (capacities in its unit, see
    /// [`Self::retention`]). Unknown requests teach nothing.
    pub fn on_report(&mut self, request: u64, reported: u32) -> Learnt {
        let Some(pending) = self.pending.remove(&request) else {
            return Learnt::Nothing;
        };
        let learned = self.learned.entry(pending.worker).or_default();
        let in_force = learned.model();
        let by_blocks = learn(&mut learned.blocks, &pending, Model::Blocks, reported);
        let by_requests = learn(
            &mut learned.by_requests,
            &pending,
            Model::Requests,
            reported,
        );
        match in_force {
            Model::Blocks => by_blocks,
            Model::Requests => by_requests,
        }
    }

    /// Forgets a recorded request whose report will not come (it failed, or the engine does
    /// not report cached tokens).
    pub fn forget(&mut self, request: u64) {
        self.pending.remove(&request);
    }

    /// The worker rank's learnt capacity, in blocks of age, once a report has taught one
    /// (whether or not it is the one in force: see [`Self::retention`]).
    pub fn capacity(&self, worker: WorkerWithDpRank) -> Option<f64> {
        self.learned.get(&worker).and_then(|l| l.blocks.limit)
    }

    /// The worker rank's learnt capacity, in requests of age, once a report has taught one
    /// (whether or not it is the one in force: see [`Self::retention`]).
    pub fn request_capacity(&self, worker: WorkerWithDpRank) -> Option<f64> {
        self.learned.get(&worker).and_then(|l| l.by_requests.limit)
    }

    /// The capacity that cuts the worker rank's matches: the model whose predictions have lately
    /// been closer to its engine's reports, once a report has taught one.
    pub fn retention(&self, worker: WorkerWithDpRank) -> Option<Retention> {
        self.learned.get(&worker).and_then(Learned::retention)
    }

    /// Drops every prediction whose deadline is at or before `now`, give or take the expiry
    /// queue's bucket: a prediction goes at most `ttl / 64` after its deadline, never before.
    pub fn expire(&mut self, now: Duration) {
        let now = nanos(now);
        while let Some((queued, worker, seq)) = self.queue.pop(Some(now)) {
            self.settle(queued, worker, seq, |deadline| deadline <= now);
        }
    }

    /// Forgets every prediction for every rank of a worker.
    pub fn remove_worker(&mut self, worker_id: u64) {
        self.index.remove_worker(worker_id);
        self.deadlines.retain(|(w, _), _| w.worker_id != worker_id);
        self.queue.retain(|(_, w, _)| w.worker_id != worker_id);
        self.learned.retain(|w, _| w.worker_id != worker_id);
        self.pending.retain(|_, p| p.worker.worker_id != worker_id);
    }

    /// Forgets every prediction for `worker` except the blocks whose sequence hashes are in
    /// `keep` (an engine evidently lost what was predicted: it restarted or evicted it, and
    /// holds only the prompt it just served). Returns how many predictions were dropped.
    pub fn retain_worker(&mut self, worker: WorkerWithDpRank, keep: &[u64]) -> usize {
        let drop: Vec<u64> = self
            .deadlines
            .keys()
            .filter(|(w, seq)| *w == worker && !keep.contains(seq))
            .map(|&(_, seq)| seq)
            .collect();
        for &seq in &drop {
            self.drop_prediction(worker, seq);
        }
        // Their queue entries are stale now and are skipped when popped (a prediction made again
        // before then is queued anew, and its old entry no longer matches it).
        drop.len()
    }

    /// Overlap of `local` with the predictions (see [`KvIndex::find_matches`]), each worker's
    /// cut at its first block older than the worker's learnt capacity.
    pub fn find_matches(&self, local: &[LocalBlockHash]) -> OverlapScores {
        let mut scores = self.index.find_matches(local);
        // The prompt's sequence hashes, computed once as far as the longest cut needs them.
        let mut seqs: Vec<u64> = Vec::new();
        let mut cuts: Vec<(WorkerWithDpRank, u32)> = Vec::new();
        for (&worker, &score) in scores.scores.iter() {
            let Some(learned) = self.learned.get(&worker) else {
                continue;
            };
            let model = learned.model();
            let Some(capacity) = learned.capacity(model).limit else {
                continue;
            };
            let n = (score as usize).min(local.len());
            let mut prev = seqs.last().map(|&h| SequenceHash(h));
            for &block in &local[seqs.len().min(n)..n] {
                let seq = next_seq_hash(prev, block);
                seqs.push(seq.0);
                prev = Some(seq);
            }
            // Ages never fall along a prompt, so a binary search finds the first too old.
            let too_old = |seq: &u64| {
                self.deadlines
                    .get(&(worker, *seq))
                    .is_none_or(|p| learned.age(model, p) >= capacity)
            };
            let cut = seqs[..n].partition_point(|seq| !too_old(seq)) as u32;
            if cut < score {
                cuts.push((worker, cut));
            }
        }
        for (worker, cut) in cuts {
            scores.scores.insert(worker, cut);
        }
        scores
    }

    /// Every worker rank ever predicted (and not removed) with the blocks it was sent, appended
    /// to `out`: its live predictions (0 once they all expired), for how full its engine's cache
    /// is. Not cut by the capacity learnt for it: an engine that evicts predicted blocks is full
    /// (a least-recently-used cache stays full once it has filled), its place taken by the
    /// blocks of the requests running there and of younger prefixes, so the live predictions
    /// (which a caller caps at the engine's KV capacity) are the better count. Counting only the
    /// blocks younger than the capacity made the worker that evicted most look the roomiest, and
    /// a charge for evictions then sent new prompts to it.
    pub fn block_counts(&self, out: &mut Vec<(WorkerWithDpRank, u64)>) {
        self.index.block_counts(StorageTier::Device, out);
    }

    /// Predicted blocks currently live, over all workers.
    pub fn live_blocks(&self) -> usize {
        self.deadlines.len()
    }

    /// The underlying index's accounting plus this mode's own tables.
    pub fn memory(&self) -> MemoryStats {
        let mut stats = self.index.memory();
        // A map entry is its key, its value and one control byte.
        let prediction = size_of::<((WorkerWithDpRank, u64), Prediction)>() + 1;
        stats.table_bytes += self.deadlines.capacity() * prediction
            + self.queue.bytes()
            + self.learned.capacity() * 81
            + self.seq_scratch.capacity() * 8
            + self.found_scratch.capacity() * 24
            + self
                .pending
                .values()
                .map(|p| 48 + p.runs.capacity() * 24)
                .sum::<usize>();
        stats
    }

    /// Settles a popped queue entry: drops its prediction, unless a later decision refreshed
    /// it to a deadline for which `gone` does not hold: then it is queued again there.
    fn settle(
        &mut self,
        queued: u64,
        worker: WorkerWithDpRank,
        seq: u64,
        gone: impl Fn(u64) -> bool,
    ) {
        let Some(p) = self.deadlines.get_mut(&(worker, seq)) else {
            return; // Dropped already (see `retain_worker`).
        };
        if p.queued != queued {
            return; // Dropped and predicted again since: its own entry stands for it.
        }
        if p.deadline != queued && !gone(p.deadline) {
            // Refreshed since: it lives on to its deadline now.
            p.queued = p.deadline;
            self.queue.push((p.deadline, worker, seq));
            return;
        }
        self.drop_prediction(worker, seq);
    }

    /// Forgets the prediction of block `seq` on `worker`, in the table and in the index.
    fn drop_prediction(&mut self, worker: WorkerWithDpRank, seq: u64) {
        self.deadlines.remove(&(worker, seq));
        self.remove_scratch.block_hashes.clear();
        self.remove_scratch
            .block_hashes
            .push(ExternalSequenceBlockHash(seq));
        // The block was stored when predicted, so this cannot fail.
        let _ = self
            .index
            .remove(worker, StorageTier::Device, &self.remove_scratch);
    }
}

/// What one report teaches `model`, whose capacity is `capacity`: see [`ApproxIndex::on_report`].
/// Also moves the model's running error toward how far its prediction was from the report.
fn learn(capacity: &mut Capacity, pending: &PendingReport, model: Model, reported: u32) -> Learnt {
    let rate = match model {
        Model::Blocks => LEARNING_RATE,
        Model::Requests => REQUEST_LEARNING_RATE,
    };
    let predicted = pending.predicted(model, capacity.limit);
    let miss = f64::from(
        predicted
            .abs_diff(reported)
            .saturating_sub(REPORT_SLACK_BLOCKS),
    );
    capacity.error += ERROR_WEIGHT * (miss - capacity.error);
    if reported.saturating_add(REPORT_SLACK_BLOCKS) < predicted {
        let Some(age) = pending.age_at(model, reported) else {
            return Learnt::Nothing;
        };
        let target = age as f64;
        match capacity.limit {
            // The first miss: in blocks the capacity starts there (had the engine lost its
            // cache, a restart, the cut at this age drops the older predictions all the same).
            // In requests it starts at the least the report allows, one past the oldest block
            // held (at least 1: an engine holds the prompt it served last): a surplus raises it
            // at once, while starting at the missing block's age would count every younger
            // prompt held until a later miss of each age taught otherwise.
            None => {
                let limit = match model {
                    Model::Blocks => target,
                    Model::Requests => reported
                        .checked_sub(1)
                        .and_then(|held| pending.age_at(model, held))
                        .map_or(1.0, |age| age as f64 + 1.0),
                }
                .max(1.0);
                capacity.limit = Some(limit);
                Learnt::Lowered(limit)
            }
            // Nothing of a prompt whose first missing block was far younger than the
            // capacity: the engine lost its cache (a restart). With the prompt's first blocks
            // held it did not: under LRU a prompt's first blocks are its most recently used, so
            // an engine short of memory (preempting, or keeping one prompt a slot as llama.cpp
            // does) loses a prompt's tail first, and the capacity moves down as for any
            // eviction.
            Some(c) if target < lost_below(model, c) && reported <= REPORT_SLACK_BLOCKS => {
                Learnt::Lost
            }
            Some(c) if target >= c => Learnt::Nothing,
            Some(c) => {
                let limit = (c + rate * (target - c)).max(1.0);
                capacity.limit = Some(limit);
                Learnt::Lowered(limit)
            }
        }
    } else if reported > predicted.saturating_add(REPORT_SLACK_BLOCKS) {
        let (Some(limit), Some(age)) = (capacity.limit, pending.age_at(model, reported - 1)) else {
            return Learnt::Nothing;
        };
        let target = age as f64 + 1.0;
        if target <= limit {
            return Learnt::Nothing;
        }
        let limit = limit + rate * (target - limit);
        capacity.limit = Some(limit);
        Learnt::Raised(limit)
    } else {
        Learnt::Nothing
    }
}

/// A prompt held by none of its blocks, whose first block was younger than this in `model`
/// (capacity `c`), was lost, not evicted: in blocks, a quarter of the capacity; in requests, a
/// prefix the worker's very last request used (an engine that keeps a few prompts loses a
/// whole one as soon as one other request comes between, which is eviction as usual).
fn lost_below(model: Model, c: f64) -> f64 {
    match model {
        Model::Blocks => c * LOST_FRACTION,
        Model::Requests => 1.0,
    }
}

/// Nanoseconds of a clock value, saturating (u64 nanoseconds last 584 years).
fn nanos(t: Duration) -> u64 {
    u64::try_from(t.as_nanos()).unwrap_or(u64::MAX)
}
