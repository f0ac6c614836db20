//! The nodes of one storage tier: which slots hold each prefix, laid out along the chains they
//! were stored in.
//!
//! A node is a prefix, keyed by its sequence hash. Nodes live in segments: runs of consecutive
//! blocks of one stored chain, each position holding its block's local hash, its sequence hash
//! and the bits of slots 0..64 that hold it. A chain stored after its parent goes on at the end
//! of the parent's segment when the parent ends one, else it starts a segment. A query then walks
//! a long prompt along a segment comparing local hashes in sequential memory, and needs a table
//! lookup (and a hash) only where the segment ends or the prompt leaves it, the way the
//! reference's radix tree compares the run of local hashes on one edge. Each field has an array
//! of its own, and one bit a block marks where the slot bits change: the walk compares local
//! hashes eight at a time (8 bytes a block streamed) and reads bits only at the marks, since
//! elsewhere they equal the bits it already checked.
//!
//! A live node never moves (only dead tails are cut and only wholly dead segments are freed), so
//! the lanes keep a node's location instead of its sequence hash: a removal reaches the node with
//! no lookup, and a stored chain is placed after its parent with none.
//!
//! Invariants (checked by the index's audit): `loc` maps every live node to its position, and a
//! position is live exactly when `loc` maps its sequence hash to it; within a segment each
//! position's sequence hash chains from the previous one (`seq[p] = next_seq_hash(seq[p - 1],
//! local[p])`), so a walk that matched the local hash at `p` knows the sequence hash there
//! without hashing; a position's change mark is set exactly when its bits differ from the
//! previous position's (and at position 0); dead positions have no bits; a segment's last
//! position is live (dead tails are cut off) and a segment without live positions is emptied and
//! put on the free list.

use crate::FastMap;
use crate::hash::{SequenceHash, next_seq_hash};
use crate::table::U64Map;
use kvroute_protocols::kv_events::LocalBlockHash;

/// A run of consecutive blocks of one chain, one array per field. A walk streams the local
/// hashes (8 bytes a block) and one bit a block saying where the slot bits change, and reads the
/// bits only there: along a stretch every worker stored alike, the bits are all equal.
#[derive(Debug, Default)]
pub(super) struct Segment {
    /// Each block's local hash.
    pub(super) locals: Vec<u64>,
    /// Slots 0..64 holding each block's prefix (0 once dead).
    pub(super) bits: Vec<u64>,
    /// Bit `p % 64` of word `p / 64` is set where `bits[p]` differs from `bits[p - 1]` (and at
    /// `p = 0`); bits past the end are clear.
    changes: Vec<u64>,
    /// Each block's sequence hash.
    pub(super) seqs: Vec<u64>,
    live: u32,
}

impl Segment {
    /// Blocks in the segment.
    #[inline]
    pub(super) fn len(&self) -> usize {
        self.locals.len()
    }

    /// Whether the bits of position `p` differ from those of `p - 1` (always at 0).
    #[inline]
    pub(super) fn changes_at(&self, p: usize) -> bool {
        self.changes[p / 64] >> (p % 64) & 1 != 0
    }

    /// How many positions from `from` on the prompt `want` follows with every slot of `active`
    /// holding each, given that `active` holds position `from - 1`. Goes a window of up to 64
    /// positions (one word of change marks) at a time: compares the window's local hashes, then
    /// checks the bits only at the marks within the part that matched (elsewhere they equal bits
    /// already checked).
    #[inline]
    pub(super) fn stretch(&self, from: usize, want: &[LocalBlockHash], active: u64) -> usize {
        let locals = self.locals.get(from..).unwrap_or(&[]);
        let n = locals.len().min(want.len());
        let mut i = 0;
        while i < n {
            let q = from + i;
            let span = (64 - q % 64).min(n - i);
            let same = same_locals(&locals[i..i + span], &want[i..i + span]);
            let mut marks = self.changes[q / 64] >> (q % 64);
            if same < 64 {
                marks &= (1u64 << same) - 1;
            }
            while marks != 0 {
                let k = q + marks.trailing_zeros() as usize;
                if self.bits[k] & active != active {
                    return k - from;
                }
                marks &= marks - 1;
            }
            i += same;
            if same < span {
                break;
            }
        }
        i
    }

    fn mark(&mut self, p: usize, changed: bool) {
        let word = &mut self.changes[p / 64];
        let bit = 1u64 << (p % 64);
        if changed {
            *word |= bit;
        } else {
            *word &= !bit;
        }
    }

    /// Sets the bits of position `p`, keeping the change marks of `p` and `p + 1`.
    #[inline]
    fn set_bits(&mut self, p: usize, new: u64) {
        if self.bits[p] == new {
            return;
        }
        self.bits[p] = new;
        self.mark(p, p == 0 || self.bits[p - 1] != new);
        if let Some(&after) = self.bits.get(p + 1) {
            self.mark(p + 1, after != new);
        }
    }

    /// Appends a block held by nobody yet.
    fn push(&mut self, local: u64, seq: u64) {
        let p = self.len();
        self.locals.push(local);
        self.bits.push(0);
        self.seqs.push(seq);
        if p.is_multiple_of(64) {
            self.changes.push(0);
        }
        self.mark(p, p == 0 || self.bits[p - 1] != 0);
    }

    /// Drops the last block.
    fn pop(&mut self) {
        let p = self.len() - 1;
        self.mark(p, false);
        self.locals.pop();
        self.bits.pop();
        self.seqs.pop();
        self.changes.truncate(p.div_ceil(64));
    }

    fn reserve(&mut self, extra: usize) {
        self.locals.reserve(extra);
        self.bits.reserve(extra);
        self.seqs.reserve(extra);
        self.changes
            .reserve((self.len() + extra).div_ceil(64) - self.changes.len());
    }

    fn capacity(&self) -> usize {
        self.locals.capacity()
    }

    fn clear(&mut self) {
        self.locals.clear();
        self.bits.clear();
        self.seqs.clear();
        self.changes.clear();
    }

    fn shrink_to(&mut self, fit: usize) {
        self.locals.shrink_to(fit);
        self.bits.shrink_to(fit);
        self.seqs.shrink_to(fit);
        self.changes.shrink_to(fit.div_ceil(64));
    }

    fn bytes(&self) -> usize {
        8 * (self.locals.capacity()
            + self.bits.capacity()
            + self.seqs.capacity()
            + self.changes.capacity())
    }
}

/// How many leading local hashes of `have` and `want` (of equal length) are equal: compared eight
/// at a time with one branch a chunk (a walk spends nearly all its time here), then one by one in
/// the chunk that differs.
#[inline]
fn same_locals(have: &[u64], want: &[LocalBlockHash]) -> usize {
    const CHUNK: usize = 8;
    let mut i = 0;
    for (h, w) in have.chunks_exact(CHUNK).zip(want.chunks_exact(CHUNK)) {
        if h.iter().zip(w).fold(0, |acc, (a, b)| acc | (a ^ b.0)) != 0 {
            break;
        }
        i += CHUNK;
    }
    i + have[i..]
        .iter()
        .zip(&want[i..])
        .take_while(|(a, b)| **a == b.0)
        .count()
}

/// Shared nodes of one tier: which slots hold each prefix.
#[derive(Debug, Default)]
pub(super) struct TierNodes {
    /// Sequence hash -> the node's [`Loc`]. Present while any slot holds the node.
    loc: U64Map,
    /// Sequence hash -> bits of slots 64.. (word `j` covers slots `64 * (j + 1)..`). Present only
    /// while a slot of 64 or above holds the node.
    pub(super) hi: FastMap<u64, Box<[u64]>>,
    segs: Vec<Segment>,
    free: Vec<u32>,
    /// Blocks of the chain being stored that may still need a place (see `expect_chain`).
    room: usize,
}

/// Where a node sits: `segment << 32 | position`. A live node never moves, so lanes keep it.
pub(super) type Loc = u64;

/// The node a stored block continues: its sequence hash, and its place in this tier when known.
#[derive(Debug, Clone, Copy)]
pub(super) struct Parent {
    pub(super) seq: u64,
    pub(super) loc: Option<Loc>,
}

/// Freed segments up to this capacity keep their memory for reuse.
const REUSED_SEGMENT_BLOCKS: usize = 64;

/// Slots below this number live in a position's inline bits.
pub(super) const INLINE_SLOTS: u32 = 64;

fn encode(seg: u32, pos: usize) -> Loc {
    (u64::from(seg) << 32) | pos as u64
}

fn decode(loc: Loc) -> (u32, usize) {
    ((loc >> 32) as u32, (loc & 0xffff_ffff) as usize)
}

impl TierNodes {
    /// Live nodes.
    pub(super) fn len(&self) -> usize {
        self.loc.len()
    }

    /// Whether no slot holds anything in this tier.
    pub(super) fn is_empty(&self) -> bool {
        self.loc.is_empty()
    }

    /// Where the live node `seq` is: its segment and position.
    #[inline]
    pub(super) fn locate(&self, seq: u64) -> Option<(u32, usize)> {
        self.loc.get(seq).map(decode)
    }

    /// Where the live node `seq` is.
    pub(super) fn loc_of(&self, seq: u64) -> Option<Loc> {
        self.loc.get(seq)
    }

    /// Segment `seg`.
    #[inline]
    pub(super) fn segment(&self, seg: u32) -> &Segment {
        &self.segs[seg as usize]
    }

    /// The sequence hash of the node at `loc`.
    #[inline]
    pub(super) fn seq_at(&self, loc: Loc) -> u64 {
        let (seg, p) = decode(loc);
        self.segs[seg as usize].seqs[p]
    }

    /// Whether `loc` is where the live node `seq` sits.
    pub(super) fn is_live_at(&self, seq: u64, loc: Loc) -> bool {
        self.loc.get(seq) == Some(loc)
    }

    /// Peeks where the node `seq` would be found (see [`U64Map::peek`]).
    #[inline]
    pub(super) fn peek(&self, seq: u64) -> u64 {
        self.loc.peek(seq)
    }

    /// Peeks at the node at `loc`, so releasing it finds it in cache.
    #[inline]
    pub(super) fn peek_at(&self, loc: Loc) -> u64 {
        let (seg, p) = decode(loc);
        let s = &self.segs[seg as usize];
        s.bits.get(p).copied().unwrap_or(0) ^ s.seqs.get(p).copied().unwrap_or(0)
    }

    /// Peeks at the location entry of the node at `loc` if releasing `slot` would free it.
    #[inline]
    pub(super) fn peek_death(&self, loc: Loc, slot: u32) -> u64 {
        let (seg, p) = decode(loc);
        let s = &self.segs[seg as usize];
        match s.bits.get(p) {
            Some(&bits) if bits & !(1u64 << (slot % 64)) == 0 => self.loc.peek(s.seqs[p]),
            _ => 0,
        }
    }

    /// The live node right after `parent` in its segment if its block has local hash `local`:
    /// the node continuing `parent` with that block, found without hashing or a lookup. A dead
    /// position there may live on elsewhere, so it is not returned; nor is a node held only by
    /// slots past the inline bits (its bits are 0), which then takes the lookup.
    #[inline]
    pub(super) fn next_live(&self, parent: Loc, local: u64) -> Option<Loc> {
        let (seg, p) = decode(parent);
        let s = &self.segs[seg as usize];
        match (s.locals.get(p + 1), s.bits.get(p + 1)) {
            (Some(&next), Some(&bits)) if next == local && bits != 0 => Some(encode(seg, p + 1)),
            _ => None,
        }
    }

    /// Bits of slots 0..64 holding the live node `seq` (`None` when nobody holds it).
    #[inline]
    pub(super) fn bits(&self, seq: u64) -> Option<u64> {
        self.locate(seq)
            .map(|(seg, p)| self.segs[seg as usize].bits[p])
    }

    /// Bytes reserved by the tier: the location table, the segments and the spill bits.
    pub(super) fn bytes(&self) -> usize {
        self.loc.bytes()
            + super::table_bytes(&self.hi)
            + self.hi.values().map(|w| w.len() * 8).sum::<usize>()
            + self.segs.capacity() * std::mem::size_of::<Segment>()
            + self.segs.iter().map(Segment::bytes).sum::<usize>()
            + self.free.capacity() * 4
    }

    /// Gives back location-table memory once most nodes are gone.
    pub(super) fn maybe_shrink(&mut self) {
        self.loc.maybe_shrink();
    }

    /// Says that a chain of `blocks` blocks is about to be stored, so a segment it starts or
    /// extends grows once for all of them.
    pub(super) fn expect_chain(&mut self, blocks: usize) {
        self.room = blocks;
    }

    /// Adds `slot` to the node `seq` (whose block has local hash `local` and continues
    /// `parent`); returns where the node is and whether the slot already held it.
    pub(super) fn add(
        &mut self,
        parent: Option<Parent>,
        seq: u64,
        local: u64,
        slot: u32,
    ) -> (Loc, bool) {
        // Where the node goes if it is new, worked out before the one probe that finds or claims
        // its entry: after its parent when the parent ends a segment, else in a new segment.
        let parent = parent.and_then(|p| match p.loc {
            Some(loc) => Some(decode(loc)),
            None => self.locate(p.seq),
        });
        let after = parent
            .filter(|&(seg, at)| at + 1 == self.segs[seg as usize].len())
            .map(|(seg, _)| seg);
        let (new_seg, new_pos) = match after {
            Some(seg) => (seg, self.segs[seg as usize].len()),
            None => (
                self.free.last().copied().unwrap_or(self.segs.len() as u32),
                0,
            ),
        };
        let (at, fresh) = self.loc.get_or_insert(seq, encode(new_seg, new_pos));
        let loc = *at;
        let (seg, _) = decode(loc);
        if fresh {
            if after.is_none() && self.free.pop().is_none() {
                self.segs.push(Segment::default());
            }
            let s = &mut self.segs[seg as usize];
            if s.len() == s.capacity() {
                // Room for the rest of the chain at once (still at least doubling).
                s.reserve(self.room.max(1));
            }
            s.push(local, seq);
            s.live += 1;
        }
        self.room = self.room.saturating_sub(1);
        (loc, self.hold(loc, seq, slot))
    }

    /// Adds `slot` to the live node `seq` at `loc`; says whether the slot already held it.
    #[inline]
    pub(super) fn hold(&mut self, loc: Loc, seq: u64, slot: u32) -> bool {
        if slot < INLINE_SLOTS {
            let (seg, p) = decode(loc);
            let s = &mut self.segs[seg as usize];
            let bits = s.bits[p];
            let mask = 1u64 << slot;
            s.set_bits(p, bits | mask);
            return bits & mask != 0;
        }
        let word = (slot / 64 - 1) as usize;
        let mask = 1u64 << (slot % 64);
        let words = self
            .hi
            .entry(seq)
            .or_insert_with(|| vec![0; word + 1].into_boxed_slice());
        if words.len() <= word {
            let mut grown = words.to_vec();
            grown.resize(word + 1, 0);
            *words = grown.into_boxed_slice();
        }
        let had = words[word] & mask != 0;
        words[word] |= mask;
        had
    }

    /// Removes `slot` from the live node at `loc`, dropping the node once nobody holds it.
    #[inline]
    pub(super) fn release(&mut self, loc: Loc, slot: u32) {
        let (seg, p) = decode(loc);
        if slot < INLINE_SLOTS {
            let s = &mut self.segs[seg as usize];
            let bits = s.bits[p] & !(1u64 << slot);
            s.set_bits(p, bits);
            if bits != 0
                || (!self.hi.is_empty() && self.hi.contains_key(&self.segs[seg as usize].seqs[p]))
            {
                return;
            }
        } else {
            let seq = self.segs[seg as usize].seqs[p];
            let word = (slot / 64 - 1) as usize;
            if let Some(words) = self.hi.get_mut(&seq) {
                if let Some(w) = words.get_mut(word) {
                    *w &= !(1u64 << (slot % 64));
                }
                if words.iter().any(|w| *w != 0) {
                    return;
                }
                self.hi.remove(&seq);
            }
            if self.segs[seg as usize].bits[p] != 0 {
                return;
            }
        }
        self.kill(seg, p);
    }

    /// Forgets the node at position `p` of segment `seg` (its bits are already clear), cutting
    /// dead tails and freeing empty segments.
    fn kill(&mut self, seg: u32, p: usize) {
        let s = &mut self.segs[seg as usize];
        self.loc.remove(s.seqs[p]);
        s.live -= 1;
        if s.live == 0 {
            // A small segment keeps its memory for the next chain (churn stores and frees them
            // by the million); a large one gives it back.
            if s.capacity() > REUSED_SEGMENT_BLOCKS {
                *s = Segment::default();
            } else {
                s.clear();
            }
            self.free.push(seg);
            return;
        }
        if p + 1 < s.len() {
            // The segment's last position is live: nothing to cut.
            return;
        }
        // Without spill bits a position is live exactly when it has bits; with them, ask `loc`.
        let spill = !self.hi.is_empty();
        while let (Some(&last), Some(&last_seq)) = (s.bits.last(), s.seqs.last()) {
            if last != 0 || (spill && self.loc.get(last_seq) == Some(encode(seg, s.len() - 1))) {
                break;
            }
            s.pop();
        }
        // Give memory back once a segment is a quarter full, to the power of two pushing would
        // have reached (shrinking at every halving would copy back and forth at a boundary).
        let fit = s.len().next_power_of_two().max(4);
        if s.capacity() >= 4 * fit {
            s.shrink_to(fit);
        }
    }

    /// Checks the invariants in the module docs.
    pub(super) fn check(&self) -> Result<(), String> {
        for (seq, loc) in self.loc.iter() {
            let (seg, p) = decode(loc);
            let at = self.segs.get(seg as usize).and_then(|s| s.seqs.get(p));
            if at != Some(&seq) {
                return Err(format!("node {seq:#x} is not where its location says"));
            }
        }
        for (i, s) in self.segs.iter().enumerate() {
            if s.bits.len() != s.len()
                || s.seqs.len() != s.len()
                || s.changes.len() != s.len().div_ceil(64)
            {
                return Err(format!("segment {i}: its arrays differ in length"));
            }
            let mut live = 0;
            for (p, &seq) in s.seqs.iter().enumerate() {
                let here = self.loc.get(seq) == Some(encode(i as u32, p));
                live += u32::from(here);
                if !here && s.bits[p] != 0 {
                    return Err(format!("segment {i} position {p} is dead but has bits"));
                }
                let prev = p.checked_sub(1).map(|q| SequenceHash(s.seqs[q]));
                if p > 0 && next_seq_hash(prev, LocalBlockHash(s.locals[p])).0 != seq {
                    return Err(format!("segment {i} position {p} does not chain"));
                }
                if s.changes_at(p) != (p == 0 || s.bits[p] != s.bits[p - 1]) {
                    return Err(format!("segment {i} position {p}: wrong change mark"));
                }
            }
            if s.len() % 64 != 0 && s.changes.last().is_some_and(|w| w >> (s.len() % 64) != 0) {
                return Err(format!("segment {i}: change marks past its end"));
            }
            if live != s.live {
                return Err(format!(
                    "segment {i}: {live} live positions, counted {}",
                    s.live
                ));
            }
            let end = s.seqs.len().checked_sub(1);
            if let Some(last) = end
                && self.loc.get(s.seqs[last]) != Some(encode(i as u32, last))
            {
                return Err(format!("segment {i} ends with a dead position"));
            }
        }
        Ok(())
    }
}
