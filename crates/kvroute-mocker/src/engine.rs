//! The engine core: requests in, tokens, finished requests and KV events out, in virtual time.
//!
//! It schedules like vLLM V1: every step first gives each running sequence its next tokens (one
//! for a decoding sequence, a chunk for a prefilling one) within the token budget, preempting the
//! most recently admitted running sequence (recompute: its blocks are freed, it goes back to the
//! front of the queue) when blocks run out; then, if nobody was preempted, it admits waiting
//! requests in arrival order, reusing their longest cached prefix. A block becomes cached (and a
//! `Stored` event is emitted) when the step that computes its last token is scheduled, exactly when
//! vLLM caches it. A step lasts what the [`TimingModel`] says; its tokens are emitted at its end.
//!
//! The engine never reads a clock: the caller passes `now` to every call, and
//! [`Engine::next_wakeup`] says when it next has something to do.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::time::Duration;

use kvroute_indexer::hash::{
    HashSalt, SequenceHash, compute_block_hash, compute_block_hashes, next_seq_hash,
};
use kvroute_protocols::kv_events::LocalBlockHash;

use crate::config::{Admission, ConfigError, MockerConfig};
use crate::kv::{BlockId, BlockPool, FullBlock};
use crate::request::{
    EngineStats, FinishReason, Finished, KvUsage, Request, RequestError, RequestId, StepOutput,
    TokenOutput,
};
use crate::timing::{SeqWork, StepShape, TimingModel};

/// The simulated engine.
#[derive(Debug)]
pub struct Engine {
    config: MockerConfig,
    block_size: usize,
    timing: TimingModel,
    pool: BlockPool,
    clock: Duration,
    slots: Vec<Option<Seq>>,
    free_slots: Vec<usize>,
    by_id: HashMap<RequestId, usize>,
    running: Vec<usize>,
    waiting: VecDeque<usize>,
    step: Option<Step>,
    /// Set when something happened that may let a step start at the current clock.
    poke: bool,
    sessions: HashMap<String, Session>,
    deadlines: BinaryHeap<Reverse<(Duration, u64, String)>>,
    next_session_generation: u64,
    stats: EngineStats,
    scratch_full: Vec<FullBlock>,
}

#[derive(Debug)]
struct Seq {
    id: RequestId,
    session: Option<String>,
    /// Local and sequence hashes of every full block of the sequence so far.
    hashes: Vec<(LocalBlockHash, SequenceHash)>,
    /// Tokens of the trailing partial block.
    tail: Vec<u32>,
    num_tokens: usize,
    /// Tokens of the original prompt; `num_tokens` grows past it with the output.
    prompt_len: usize,
    num_computed: usize,
    blocks: Vec<BlockId>,
    /// Leading entries of `blocks` already in the prefix cache (hits or registered).
    num_cached: usize,
    generated: u32,
    max_output: u32,
    fingerprint: u64,
    admitted_once: bool,
    cached_prompt_tokens: u32,
    preemptions: u32,
    /// The prompt's KV arrives from a prefill worker (disaggregated serving): at its first
    /// admission every prompt block is taken as computed except the last token's.
    remote_kv: bool,
}

#[derive(Debug)]
struct Step {
    end: Duration,
    batch: Vec<(usize, RequestId, usize)>,
}

#[derive(Debug)]
struct Session {
    timeout: Duration,
    deadline: Duration,
    generation: u64,
    held: Vec<BlockId>,
}

impl Engine {
    /// An engine with every block free, at virtual time zero.
    pub fn new(config: MockerConfig, dp_rank: u32) -> Result<Self, ConfigError> {
        config.validate()?;
        Ok(Self {
            block_size: config.block_size as usize,
            timing: TimingModel::for_engine(&config),
            pool: BlockPool::new(config.num_blocks, dp_rank),
            config,
            clock: Duration::ZERO,
            slots: Vec::new(),
            free_slots: Vec::new(),
            by_id: HashMap::new(),
            running: Vec::new(),
            waiting: VecDeque::new(),
            step: None,
            poke: false,
            sessions: HashMap::new(),
            deadlines: BinaryHeap::new(),
            next_session_generation: 0,
            stats: EngineStats::default(),
            scratch_full: Vec::new(),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &MockerConfig {
        &self.config
    }

    /// The engine's virtual time: the last `now` it was given or the end of its last step.
    pub fn clock(&self) -> Duration {
        self.clock
    }

    /// Lifetime counters.
    pub fn stats(&self) -> EngineStats {
        self.stats
    }

    /// Block accounting now; `used + free == capacity` always holds.
    pub fn kv_usage(&self) -> KvUsage {
        KvUsage {
            capacity: self.pool.capacity(),
            used: self.pool.used(),
            free: self.pool.free(),
            cached: self.pool.cached_len(),
        }
    }

    /// The sequence hashes of every cached block, sorted; the external block hash of each is the
    /// same value.
    pub fn cached_block_hashes(&self) -> Vec<u64> {
        self.pool.cached_hashes()
    }

    /// How many leading full blocks of `tokens` are in the prefix cache now: what a router's
    /// index should report as this engine's overlap.
    pub fn cached_prefix_blocks(&self, tokens: &[u32]) -> usize {
        let locals = compute_block_hashes(tokens, self.block_size, &HashSalt::default());
        let mut prev = None;
        locals
            .into_iter()
            .take_while(|&local| {
                let seq = next_seq_hash(prev, local);
                prev = Some(seq);
                self.pool.lookup(seq).is_some()
            })
            .count()
    }

    /// Requests admitted and not finished (running or preempted back to waiting).
    pub fn num_requests(&self) -> usize {
        self.by_id.len()
    }

    /// Requests in the running batch.
    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// Requests queued for admission (new or preempted).
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Open sessions.
    pub fn num_sessions(&self) -> usize {
        self.sessions.len()
    }

    /// Whether session `name` is open.
    pub fn has_session(&self, name: &str) -> bool {
        self.sessions.contains_key(name)
    }

    /// When the engine next has something to do, if ever without new input.
    pub fn next_wakeup(&self) -> Option<Duration> {
        let deadline = self.deadlines.peek().map(|Reverse((d, _, _))| *d);
        let busy = match &self.step {
            Some(step) => Some(step.end),
            None if self.poke && !self.waiting.is_empty() => Some(self.clock),
            None => None,
        };
        match (busy, deadline) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Queues a request arriving at `now` (earlier values count as the engine's clock).
    pub fn add_request(&mut self, now: Duration, request: Request) -> Result<(), RequestError> {
        let id = request.id;
        if request.tokens.is_empty() {
            return Err(RequestError::EmptyPrompt(id));
        }
        if request.max_output_tokens == 0 {
            return Err(RequestError::NoOutput(id));
        }
        if self.by_id.contains_key(&id) {
            return Err(RequestError::DuplicateId(id));
        }
        let total = request.tokens.len() as u64 + u64::from(request.max_output_tokens);
        let needed = total.div_ceil(self.block_size as u64);
        if needed > self.pool.capacity() as u64 {
            return Err(RequestError::TooLong {
                id,
                needed,
                capacity: self.pool.capacity() as u64,
            });
        }
        self.sync_idle_clock(now);
        if let Some(name) = &request.session {
            let Some(session) = self.sessions.get_mut(name) else {
                return Err(RequestError::UnknownSession {
                    id,
                    session: name.clone(),
                });
            };
            // Activity slides the deadline; a request in flight must not lose its session.
            session.deadline = self.clock + session.timeout;
            let entry = (session.deadline, session.generation, name.clone());
            self.deadlines.push(Reverse(entry));
        }
        let seq = self.new_seq(request);
        let slot = match self.free_slots.pop() {
            Some(slot) => {
                self.slots[slot] = Some(seq);
                slot
            }
            None => {
                self.slots.push(Some(seq));
                self.slots.len() - 1
            }
        };
        self.by_id.insert(id, slot);
        self.waiting.push_back(slot);
        self.poke = true;
        self.prune_deadlines();
        Ok(())
    }

    /// Queues a request whose prompt KV was computed by a prefill worker and transferred here:
    /// at admission the engine allocates and caches every prompt block (emitting `Stored` for
    /// them, as a decode worker that received the blocks would) and computes only the last
    /// prompt token. A preempted request recomputes locally, since its blocks are gone.
    pub fn add_prefilled_request(
        &mut self,
        now: Duration,
        request: Request,
    ) -> Result<(), RequestError> {
        let id = request.id;
        self.add_request(now, request)?;
        if let Some(&slot) = self.by_id.get(&id) {
            self.seq_mut(slot).remote_kv = true;
        }
        Ok(())
    }

    /// Cancels a request; returns whether the engine held it. Its blocks are freed at once (a
    /// cancelled request never joins its session) and a `Cancelled` finish is reported.
    pub fn cancel(&mut self, now: Duration, id: RequestId, out: &mut StepOutput) -> bool {
        let Some(&slot) = self.by_id.get(&id) else {
            return false;
        };
        self.sync_idle_clock(now);
        self.running.retain(|&s| s != slot);
        self.waiting.retain(|&s| s != slot);
        let seq = self.take_slot(slot);
        self.pool.release(&seq.blocks);
        out.finished
            .push(self.finish_record(&seq, FinishReason::Cancelled));
        self.pool.drain_events(&mut out.events);
        self.poke = true;
        true
    }

    /// Opens (or refreshes) a session that keeps its requests' cached blocks for `timeout` after
    /// its last activity (the config's default when `None`).
    pub fn open_session(&mut self, now: Duration, name: &str, timeout: Option<Duration>) {
        self.sync_idle_clock(now);
        let timeout = timeout.unwrap_or(Duration::from_secs(
            self.config.default_session_timeout_secs,
        ));
        let deadline = self.clock + timeout;
        let generation = self.next_session_generation;
        self.next_session_generation += 1;
        let session = self.sessions.entry(name.to_owned()).or_insert(Session {
            timeout,
            deadline,
            generation,
            held: Vec::new(),
        });
        session.timeout = timeout;
        session.deadline = deadline;
        let entry = (deadline, session.generation, name.to_owned());
        self.deadlines.push(Reverse(entry));
        self.prune_deadlines();
    }

    /// Closes a session, freeing the blocks it held; returns whether it was open.
    pub fn close_session(&mut self, now: Duration, name: &str) -> bool {
        self.sync_idle_clock(now);
        match self.sessions.remove(name) {
            Some(session) => {
                self.pool.release(&session.held);
                self.poke = true;
                self.prune_deadlines();
                true
            }
            None => false,
        }
    }

    /// Runs every step and session expiry due up to `now`, returning what they produced.
    pub fn advance_to(&mut self, now: Duration) -> StepOutput {
        let mut out = StepOutput::default();
        self.advance_into(now, &mut out);
        out
    }

    /// Like [`Self::advance_to`], appending to `out` so that a driver can reuse its buffers.
    pub fn advance_into(&mut self, now: Duration, out: &mut StepOutput) {
        loop {
            let deadline = self.deadlines.peek().map(|Reverse((d, _, _))| *d);
            match self.step.as_ref().map(|s| s.end) {
                Some(end) => {
                    let due = deadline.map_or(end, |d| d.min(end));
                    if due > now {
                        break;
                    }
                    if deadline.is_some_and(|d| d < end) {
                        self.clock = self.clock.max(due);
                        self.expire_sessions();
                    } else {
                        self.clock = end;
                        self.finish_step(out);
                    }
                }
                None => {
                    if self.try_start_step() {
                        continue;
                    }
                    self.poke = false;
                    match deadline {
                        Some(d) if d <= now => {
                            self.clock = self.clock.max(d);
                            self.expire_sessions();
                        }
                        _ => {
                            self.clock = self.clock.max(now);
                            break;
                        }
                    }
                }
            }
        }
        self.prune_deadlines();
        self.pool.drain_events(&mut out.events);
    }

    /// Moves an idle engine's clock forward so new work starts at `now`, not in the past.
    fn sync_idle_clock(&mut self, now: Duration) {
        if self.step.is_none() {
            self.clock = self.clock.max(now);
        }
    }

    fn new_seq(&mut self, request: Request) -> Seq {
        let salt = HashSalt::default();
        let locals = compute_block_hashes(&request.tokens, self.block_size, &salt);
        let mut hashes = Vec::with_capacity(locals.len() + 1);
        let mut prev = None;
        for local in locals {
            let seq = next_seq_hash(prev, local);
            hashes.push((local, seq));
            prev = Some(seq);
        }
        let tail = request.tokens[hashes.len() * self.block_size..].to_vec();
        // The output depends only on the seed and the prompt, like greedy decoding.
        let mut fingerprint = splitmix64(self.config.seed ^ prev.map_or(0, |s| s.0));
        for &t in &tail {
            fingerprint = splitmix64(fingerprint ^ u64::from(t));
        }
        let num_tokens = request.tokens.len();
        Seq {
            id: request.id,
            session: request.session,
            hashes,
            tail,
            num_tokens,
            prompt_len: num_tokens,
            num_computed: 0,
            blocks: Vec::new(),
            num_cached: 0,
            generated: 0,
            max_output: request.max_output_tokens,
            fingerprint: splitmix64(fingerprint ^ num_tokens as u64),
            admitted_once: false,
            cached_prompt_tokens: 0,
            preemptions: 0,
            remote_kv: false,
        }
    }

    fn seq(&self, slot: usize) -> &Seq {
        self.slots[slot]
            .as_ref()
            .expect("scheduled slot holds a sequence")
    }

    fn seq_mut(&mut self, slot: usize) -> &mut Seq {
        self.slots[slot]
            .as_mut()
            .expect("scheduled slot holds a sequence")
    }

    fn take_slot(&mut self, slot: usize) -> Seq {
        let seq = self.slots[slot].take().expect("slot holds a sequence");
        self.by_id.remove(&seq.id);
        self.free_slots.push(slot);
        seq
    }

    fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    /// Plans the next step at the current clock; false when nothing can run.
    fn try_start_step(&mut self) -> bool {
        let mut budget = self.config.max_num_batched_tokens as usize;
        let mut batch = Vec::new();
        let mut shape = StepShape::default();
        let mut preempted = false;

        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let slot = self.running[i];
            let (remaining, computed, have) = {
                let s = self.seq(slot);
                (
                    s.num_tokens - s.num_computed,
                    s.num_computed,
                    s.blocks.len(),
                )
            };
            let n = remaining.min(budget);
            let need = self.blocks_for(computed + n).saturating_sub(have);
            let mut scheduled = true;
            loop {
                let mut blocks = std::mem::take(&mut self.seq_mut(slot).blocks);
                let ok = self.pool.allocate(need, &mut blocks);
                self.seq_mut(slot).blocks = blocks;
                if ok {
                    break;
                }
                let victim = self
                    .running
                    .pop()
                    .expect("running holds the current sequence");
                self.preempt(victim);
                preempted = true;
                if victim == slot {
                    scheduled = false;
                    break;
                }
            }
            if !scheduled {
                break;
            }
            self.cache_full_blocks(slot, computed + n);
            add_to_shape(&mut shape, self.seq(slot), n);
            batch.push((slot, self.seq(slot).id, n));
            budget -= n;
            i += 1;
        }

        while !preempted
            && budget > 0
            && self.running.len() < self.config.max_num_seqs as usize
            && !self.waiting.is_empty()
        {
            let slot = self.waiting[0];
            let Some(n) = self.admit(slot, budget) else {
                break;
            };
            self.waiting.pop_front();
            self.running.push(slot);
            let computed = self.seq(slot).num_computed;
            self.cache_full_blocks(slot, computed + n);
            add_to_shape(&mut shape, self.seq(slot), n);
            batch.push((slot, self.seq(slot).id, n));
            budget -= n;
        }

        if batch.is_empty() {
            return false;
        }
        self.stats.steps += 1;
        let end = self.clock + self.timing.step_duration(&shape);
        self.step = Some(Step { end, batch });
        true
    }

    /// Takes a waiting sequence's prefix hits and first blocks; returns its chunk size, or `None`
    /// (touching nothing) when the blocks are not there.
    fn admit(&mut self, slot: usize, budget: usize) -> Option<usize> {
        let bs = self.block_size;
        let seq = self.seq(slot);
        // At least one token must be computed to produce logits, as in vLLM.
        let max_hit_blocks = (seq.num_tokens - 1) / bs;
        let mut hits: Vec<BlockId> = Vec::new();
        let mut hits_free = 0;
        for &(_, h) in seq.hashes.iter().take(max_hit_blocks) {
            match self.pool.lookup(h) {
                Some(b) => {
                    hits_free += usize::from(self.pool.is_free(b));
                    hits.push(b);
                }
                None => break,
            }
        }
        let hit_tokens = hits.len() * bs;
        // Transferred KV covers the prompt; the last token is computed here for its logits.
        let computed = if seq.remote_kv {
            seq.num_tokens - 1
        } else {
            hit_tokens
        };
        let n = (seq.num_tokens - computed).min(budget);
        let need = self.blocks_for(computed + n) - hits.len();
        let reserve = match self.config.admission {
            Admission::FirstChunk => need,
            Admission::WholePrompt => self.blocks_for(seq.num_tokens) - hits.len(),
        };
        if reserve + hits_free > self.pool.free() {
            return None;
        }
        for &b in &hits {
            self.pool.acquire(b);
        }
        let mut blocks = hits;
        let ok = self.pool.allocate(need, &mut blocks);
        debug_assert!(ok, "free blocks were counted before allocating");
        let num_hits = hit_tokens / bs;
        let seq = self.seq_mut(slot);
        seq.blocks = blocks;
        seq.num_cached = num_hits;
        seq.num_computed = computed;
        let transferred = std::mem::take(&mut seq.remote_kv);
        if !seq.admitted_once {
            seq.admitted_once = true;
            seq.cached_prompt_tokens = hit_tokens as u32;
            let prompt = seq.num_tokens as u64;
            self.stats.admitted += 1;
            self.stats.prompt_tokens += prompt;
            self.stats.cached_prompt_tokens += hit_tokens as u64;
            if transferred {
                self.stats.transferred_prompt_tokens += prompt;
                self.stats.transferred_cached_tokens += hit_tokens as u64;
            }
        }
        Some(n)
    }

    /// Registers the blocks that become full once the first `upto` tokens are computed.
    fn cache_full_blocks(&mut self, slot: usize, upto: usize) {
        let bs = self.block_size;
        let mut full = std::mem::take(&mut self.scratch_full);
        full.clear();
        let seq = self.seq_mut(slot);
        let end = (upto / bs).min(seq.hashes.len());
        for k in seq.num_cached..end {
            full.push(FullBlock {
                block: seq.blocks[k],
                parent: k.checked_sub(1).map(|p| seq.hashes[p].1),
                seq: seq.hashes[k].1,
                local: seq.hashes[k].0,
            });
        }
        seq.num_cached = seq.num_cached.max(end);
        self.pool.register(&full);
        self.scratch_full = full;
    }

    fn preempt(&mut self, slot: usize) {
        let seq = self.slots[slot]
            .as_mut()
            .expect("preempted slot holds a sequence");
        let blocks = std::mem::take(&mut seq.blocks);
        seq.num_computed = 0;
        seq.num_cached = 0;
        seq.preemptions += 1;
        self.pool.release(&blocks);
        self.stats.preemptions += 1;
        self.waiting.push_front(slot);
    }

    fn finish_step(&mut self, out: &mut StepOutput) {
        let Some(step) = self.step.take() else {
            return;
        };
        let at = step.end;
        for (slot, id, n) in step.batch {
            // A request cancelled mid-step may have left its slot to a newer request.
            let Some(seq) = self.slots[slot].as_mut().filter(|s| s.id == id) else {
                continue;
            };
            seq.num_computed += n;
            if seq.num_computed < seq.num_tokens {
                continue;
            }
            let index = seq.generated;
            let token = (splitmix64(seq.fingerprint ^ u64::from(index).wrapping_mul(GOLDEN))
                % u64::from(self.config.vocab_size)) as u32;
            seq.generated += 1;
            out.tokens.push(TokenOutput {
                request_id: id,
                token,
                index,
                at,
            });
            self.stats.output_tokens += 1;
            if seq.generated >= seq.max_output {
                self.finish(slot, out);
                continue;
            }
            seq.num_tokens += 1;
            seq.tail.push(token);
            if seq.tail.len() == self.block_size {
                let local = compute_block_hash(&seq.tail, &HashSalt::default());
                let parent = seq.hashes.last().map(|&(_, s)| s);
                seq.hashes.push((local, next_seq_hash(parent, local)));
                seq.tail.clear();
            }
        }
        self.poke = true;
    }

    fn finish(&mut self, slot: usize, out: &mut StepOutput) {
        self.running.retain(|&s| s != slot);
        let seq = self.take_slot(slot);
        out.finished
            .push(self.finish_record(&seq, FinishReason::Length));
        let session = seq
            .session
            .as_ref()
            .and_then(|name| self.sessions.get_mut(name));
        match session {
            Some(session) => {
                // The session keeps the cached prefix (the next turn extends it) and lets go of
                // what it held for the previous turn.
                let (keep, rest) = seq.blocks.split_at(seq.num_cached);
                let old = std::mem::replace(&mut session.held, keep.to_vec());
                session.deadline = self.clock + session.timeout;
                let entry = (
                    session.deadline,
                    session.generation,
                    seq.session.clone().unwrap_or_default(),
                );
                self.deadlines.push(Reverse(entry));
                self.pool.release(rest);
                self.pool.release(&old);
            }
            None => self.pool.release(&seq.blocks),
        }
    }

    fn finish_record(&self, seq: &Seq, reason: FinishReason) -> Finished {
        Finished {
            request_id: seq.id,
            reason,
            at: self.clock,
            cached_prompt_tokens: seq.cached_prompt_tokens,
            output_tokens: seq.generated,
            preemptions: seq.preemptions,
        }
    }

    /// Pops deadline entries made stale by later activity, so that `next_wakeup` is exact.
    fn prune_deadlines(&mut self) {
        while let Some(Reverse((deadline, generation, name))) = self.deadlines.peek() {
            let live = self
                .sessions
                .get(name)
                .is_some_and(|s| s.generation == *generation && s.deadline == *deadline);
            if live {
                break;
            }
            self.deadlines.pop();
        }
    }

    /// Drops every session whose deadline is the current clock or earlier.
    fn expire_sessions(&mut self) {
        while let Some(Reverse((deadline, generation, name))) = self.deadlines.peek().cloned() {
            if deadline > self.clock {
                break;
            }
            self.deadlines.pop();
            let live = self
                .sessions
                .get(&name)
                .is_some_and(|s| s.generation == generation && s.deadline == deadline);
            if live && let Some(session) = self.sessions.remove(&name) {
                self.pool.release(&session.held);
                self.poke = true;
            }
        }
    }
}

fn add_to_shape(shape: &mut StepShape, seq: &Seq, n: usize) {
    shape.add(SeqWork {
        prompt_len: seq.prompt_len as u64,
        len: seq.num_tokens as u64,
        computed: seq.num_computed as u64,
        new_tokens: n as u64,
        generated: u64::from(seq.generated),
    });
}

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// A fast, well-mixed 64-bit permutation (Vigna's splitmix64 finalizer).
pub(crate) fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(GOLDEN);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests;
