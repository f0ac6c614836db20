//! Queries: for each worker, the prefix of a request it holds. A query walks the request's
//! sequence-hash chain along segments (`walk_segments`), intersecting worker sets until none is
//! left, then continues each worker's device match into the slower tiers (`walk_tiers`); the
//! walks report into a `Gathered`, which becomes the [`OverlapScores`]. Applying events is the
//! parent module's; the layout both read is in `nodes`.

use kvroute_protocols::WorkerWithDpRank;
use kvroute_protocols::kv_events::{LocalBlockHash, StorageTier};
use smallvec::SmallVec;

use super::nodes::{INLINE_SLOTS, Loc, TierNodes};
use super::{KvIndex, TIERS};
use crate::hash::{SequenceHash, next_seq_hash};
use crate::scores::{OverlapScores, TierScore, WorkerMap};

/// An answer as walks report it: each worker's device match at most once, in slot order within
/// one index (several indexes holding disjoint workers may report into one, see
/// [`KvIndex::gather`]).
#[derive(Debug, Default)]
pub(crate) struct Gathered {
    /// (worker, leading device blocks, device blocks the worker holds); on the stack for up to
    /// 32 matching workers, so a query allocates only its answer.
    device: SmallVec<[(WorkerWithDpRank, u32, usize); 32]>,
    lower: Vec<TierScore>,
}

impl Gathered {
    /// The answer, its per-worker maps sorted once.
    ///
    /// Takes `&mut self`: moving a `Gathered` copies its inline buffer (a kilobyte).
    pub(crate) fn finish(&mut self) -> OverlapScores {
        self.device.sort_unstable_by_key(|&(w, _, _)| w);
        answer(self.device.iter().copied(), std::mem::take(&mut self.lower))
    }
}

/// The answer from each worker's (leading device blocks, device blocks held), given in worker
/// order, each worker once: each map allocated once, at its size.
fn answer(
    device: impl Iterator<Item = (WorkerWithDpRank, u32, usize)>,
    lower_tiers: Vec<TierScore>,
) -> OverlapScores {
    let n = device.size_hint().1.unwrap_or(0);
    let (mut scores, mut sizes) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for (worker, blocks, held) in device {
        scores.push((worker, blocks));
        sizes.push((worker, held));
    }
    OverlapScores {
        scores: WorkerMap::from_sorted(scores),
        tree_sizes: WorkerMap::from_sorted(sizes),
        lower_tiers,
    }
}

impl KvIndex {
    /// For each worker, the prefix of `local` it holds: leading blocks on the device, then their
    /// continuation in the slower tiers (see [`OverlapScores`]).
    pub fn find_matches(&self, local: &[LocalBlockHash]) -> OverlapScores {
        let mut chain = Vec::new();
        self.find_matches_with(local, &mut chain)
    }

    /// [`KvIndex::find_matches`] reusing `chain` as scratch for the request's sequence hashes.
    pub fn find_matches_with(
        &self,
        local: &[LocalBlockHash],
        chain: &mut Vec<u64>,
    ) -> OverlapScores {
        chain.clear();
        let device = &self.tiers[StorageTier::Device.index()];
        if self.slots.len() <= INLINE_SLOTS as usize
            && !device.is_empty()
            && self.tiers[1..].iter().all(|nodes| nodes.is_empty())
        {
            // Nothing offloaded anywhere and a fleet within the inline bits: the device walk
            // alone, its matches gathered first so the answer is allocated once at its size.
            let mut found = [(0u32, 0u32); INLINE_SLOTS as usize];
            let mut n = 0;
            self.walk_segments(device, local, |slot, depth| {
                found[n] = (slot, depth);
                n += 1;
            });
            // Sorted by worker on the stack, so no list is built just to be sorted.
            let found = &mut found[..n];
            found.sort_unstable_by_key(|&(slot, _)| self.slots[slot as usize].worker);
            let device = found
                .iter()
                .filter_map(|&(slot, depth)| self.device_match(slot, depth));
            return answer(device, Vec::new());
        }
        let mut out = Gathered::default();
        self.gather(local, chain, &mut out);
        out.finish()
    }

    /// Adds this index's part of [`KvIndex::find_matches`] to `out`: every match of a worker it
    /// holds. Indexes holding disjoint sets of workers (the shards of a
    /// [`crate::ConcurrentIndex`]) gather into one `out` and [`Gathered::finish`] it once.
    /// `chain` caches the request's sequence hashes, a function of `local` only, so the shards
    /// share it: clear it once per request, not per shard.
    pub(crate) fn gather(
        &self,
        local: &[LocalBlockHash],
        chain: &mut Vec<u64>,
        out: &mut Gathered,
    ) {
        if self.tiers[1..].iter().all(|nodes| nodes.is_empty()) {
            let nodes = &self.tiers[StorageTier::Device.index()];
            if nodes.is_empty() {
            } else if self.slots.len() <= INLINE_SLOTS as usize {
                self.walk_segments(nodes, local, |slot, depth| {
                    if let Some(found) = self.device_match(slot, depth) {
                        out.device.push(found);
                    }
                });
            } else {
                self.walk(nodes, local, chain, |slot, depth| {
                    self.report(out, StorageTier::Device, slot, depth);
                });
            }
        } else {
            for word in 0..self.slots.len().div_ceil(64) {
                self.walk_tiers(word, local, chain, out);
            }
        }
    }

    /// `slot`'s worker with its `blocks` leading device blocks and the device blocks it holds
    /// (none for a slot no worker has).
    #[inline]
    fn device_match(&self, slot: u32, blocks: u32) -> Option<(WorkerWithDpRank, u32, usize)> {
        let state = &self.slots[slot as usize];
        let held = state.lanes[StorageTier::Device.index()].blocks.len();
        state.worker.map(|worker| (worker, blocks, held))
    }

    /// Records that `slot` holds `blocks` of the request in `tier` (> 0 only).
    #[inline]
    fn report(&self, out: &mut Gathered, tier: StorageTier, slot: u32, blocks: u32) {
        if tier == StorageTier::Device {
            if let Some(found) = self.device_match(slot, blocks) {
                out.device.push(found);
            }
            return;
        }
        if let Some(worker) = self.slots[slot as usize].worker {
            out.lower.push(TierScore {
                worker,
                tier,
                blocks,
            });
        }
    }

    /// Walks the request's chain through every tier at once for the slots of one 64-slot word,
    /// as the reference extends a device match: a slot matches the device tier from the first
    /// block; where its device match ends (at the first block, for a slot with none) it goes on
    /// in the host tier, where that ends in the disk tier, then in the external one. Each tier is
    /// credited the run of blocks it holds right after the faster tiers' runs, and a block a slot
    /// holds in a tier it has already left does not count.
    fn walk_tiers(
        &self,
        word: usize,
        local: &[LocalBlockHash],
        chain: &mut Vec<u64>,
        out: &mut Gathered,
    ) {
        if local.is_empty() {
            return;
        }
        let base = word as u32 * 64;
        let in_word = (self.slots.len() - word * 64).min(64);
        // Slots walking each tier, one bit per slot of the word.
        let mut active = [0u64; TIERS];
        active[0] = u64::MAX >> (64 - in_word);
        // Where each slot's run in its current lower tier began (device runs begin at 0).
        let mut begun = [0u32; 64];
        // Each tier's node of the previous block, if that tier was walked there.
        let mut at = [None; TIERS];
        let mut depth = 0;
        while depth < local.len() {
            let seq = chain_at(chain, local, depth);
            // Slots whose run in the previous tier ended here; they try this tier from here.
            let mut joining = 0u64;
            for (t, tier) in StorageTier::ALL.into_iter().enumerate() {
                let walking = active[t] | joining;
                if walking == 0 {
                    // A tier left off has no node of the previous block to go on from: it finds
                    // its next by lookup, which the tiers that may be left off and taken up
                    // again (every tier but the device, walked from the first block) allow.
                    at[t] = None;
                    continue;
                }
                let nodes = &self.tiers[t];
                at[t] = if nodes.is_empty() {
                    None
                } else {
                    nodes.follow(at[t], seq, local[depth].0)
                };
                let bits = word_bits(nodes, at[t], word);
                let kept = walking & bits;
                let dropped = walking & !bits;
                // A slot that joins and drops at once held nothing here; device runs start at 0.
                let mut ended = if depth == 0 { 0 } else { dropped & !joining };
                while ended != 0 {
                    let bit = ended.trailing_zeros();
                    ended &= ended - 1;
                    let blocks = depth as u32 - begun[bit as usize];
                    self.report(out, tier, base + bit, blocks);
                }
                let mut started = joining & kept;
                while started != 0 {
                    let bit = started.trailing_zeros();
                    started &= started - 1;
                    begun[bit as usize] = depth as u32;
                }
                active[t] = kept;
                joining = dropped;
            }
            depth += 1;
            if active.iter().all(|&a| a == 0) {
                return;
            }
        }
        // The chain ended with these runs still going.
        for (t, tier) in StorageTier::ALL.into_iter().enumerate() {
            let mut left = active[t];
            while left != 0 {
                let bit = left.trailing_zeros();
                left &= left - 1;
                self.report(out, tier, base + bit, depth as u32 - begun[bit as usize]);
            }
        }
    }

    /// The device walk for fleets within the inline bits (at most 64 slots): follows the prompt
    /// along each segment by comparing local hashes, and hashes and looks up only where the
    /// prompt leaves a segment. Reports what [`KvIndex::walk`] would.
    fn walk_segments(
        &self,
        nodes: &TierNodes,
        local: &[LocalBlockHash],
        mut report: impl FnMut(u32, u32),
    ) {
        let mut emit = |mut bits: u64, depth: usize| {
            if depth == 0 {
                return;
            }
            while bits != 0 {
                let slot = bits.trailing_zeros();
                bits &= bits - 1;
                if (slot as usize) < self.slots.len() {
                    report(slot, depth as u32);
                }
            }
        };
        let Some(&first) = local.first() else {
            return;
        };
        let mut active = u64::MAX;
        let mut depth = 0;
        let mut seq = next_seq_hash(None, first).0;
        'walk: while let Some((seg, mut p)) = nodes.locate(seq) {
            let segment = nodes.segment(seg);
            loop {
                let kept = active & segment.bits[p];
                if kept != active {
                    emit(active & !kept, depth);
                    active = kept;
                    if active == 0 {
                        return;
                    }
                }
                depth += 1;
                // Skip the stretch where the prompt follows the segment and every slot still
                // walking holds each block: local hashes compared, bits read only where they
                // change, no hashing.
                let same = segment.stretch(p + 1, &local[depth..], active);
                p += same;
                depth += same;
                let Some(&want) = local.get(depth) else {
                    break 'walk;
                };
                match segment.locals.get(p + 1) {
                    // The segment goes on with this block: its sequence hash is known. A dead
                    // position (no bits) may live on elsewhere, so it is looked up.
                    Some(&next) if next == want.0 => {
                        if segment.bits[p + 1] == 0 {
                            seq = segment.seqs[p + 1];
                            continue 'walk;
                        }
                        p += 1;
                    }
                    _ => {
                        seq = next_seq_hash(Some(SequenceHash(segment.seqs[p])), want).0;
                        continue 'walk;
                    }
                }
            }
        }
        emit(active, depth);
    }

    /// Walks the request's chain through one tier, reporting each slot's match depth (> 0 only).
    fn walk(
        &self,
        nodes: &TierNodes,
        local: &[LocalBlockHash],
        chain: &mut Vec<u64>,
        mut report: impl FnMut(u32, u32),
    ) {
        let wide_words = self
            .slots
            .len()
            .saturating_sub(INLINE_SLOTS as usize)
            .div_ceil(64);
        let mut active = u64::MAX;
        let mut active_hi = vec![u64::MAX; wide_words];
        let mut emit = |mut bits: u64, base: u32, depth: usize| {
            if depth == 0 {
                return;
            }
            while bits != 0 {
                let bit = bits.trailing_zeros();
                bits &= bits - 1;
                let slot = base + bit;
                if (slot as usize) < self.slots.len() {
                    report(slot, depth as u32);
                }
            }
        };
        let mut depth = 0;
        // The node of the previous block, from which the next is found without a lookup.
        let mut at = None;
        while depth < local.len() {
            let seq = match chain.get(depth) {
                Some(&s) => s,
                None => {
                    let prev = chain.last().map(|&s| SequenceHash(s));
                    let s = next_seq_hash(prev, local[depth]).0;
                    chain.push(s);
                    s
                }
            };
            let Some(loc) = nodes.follow(at, seq, local[depth].0) else {
                break;
            };
            at = Some(loc);
            let bits = nodes.bits_at(loc);
            let kept = active & bits;
            emit(active & !kept, 0, depth);
            active = kept;
            let mut any_hi = false;
            if wide_words > 0 {
                let words = nodes.spill_at(loc);
                for (j, a) in active_hi.iter_mut().enumerate() {
                    let kept = *a & words.get(j).copied().unwrap_or(0);
                    emit(*a & !kept, INLINE_SLOTS + 64 * j as u32, depth);
                    *a = kept;
                    any_hi |= kept != 0;
                }
            }
            depth += 1;
            if active == 0 && !any_hi {
                return;
            }
        }
        emit(active, 0, depth);
        for (j, a) in active_hi.iter().enumerate() {
            emit(*a, INLINE_SLOTS + 64 * j as u32, depth);
        }
    }
}

/// The request's sequence hash at `depth`, extending the memoised `chain` (which holds every
/// depth below it) by one block when needed.
#[inline]
fn chain_at(chain: &mut Vec<u64>, local: &[LocalBlockHash], depth: usize) -> u64 {
    if let Some(&s) = chain.get(depth) {
        return s;
    }
    let prev = chain.last().map(|&s| SequenceHash(s));
    let s = next_seq_hash(prev, local[depth]).0;
    chain.push(s);
    s
}

/// The bits of one 64-slot word of the node at `loc` in `nodes` (0 when there is none).
#[inline]
fn word_bits(nodes: &TierNodes, loc: Option<Loc>, word: usize) -> u64 {
    let Some(loc) = loc else {
        return 0;
    };
    if word == 0 {
        return nodes.bits_at(loc);
    }
    nodes.spill_at(loc).get(word - 1).copied().unwrap_or(0)
}
