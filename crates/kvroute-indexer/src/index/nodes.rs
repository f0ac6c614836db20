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
//! A node is live while any slot holds it: inline bits, or spill bits kept by its location. In
//! the device tier the location table maps only *entries*: live nodes at a segment's first
//! position or right after a dead position. Every other live node sits right after its parent
//! (the position before it chains to it and is live, and a live node is unique), so whoever
//! looks for it stands at the parent and finds it there; and a live node not right after its
//! live parent is an entry. A store appending to its parent's segment therefore touches no
//! table but to check that the node is not live elsewhere (a run of such nodes is appended at
//! once, see `append_run`), and an eviction (leaves first) finds the position before alive and
//! drops no entry. A node becomes an entry when the one before it dies. Slower tiers' tables
//! map every live node: their chains may continue a parent held in another tier, whose place in
//! this tier is then looked up by hash.
//!
//! Invariants (checked by the index's audit): `loc` maps every entry (every live node, in a
//! tier that maps every node) to its position and nothing else; within a segment each
//! position's sequence hash chains from the previous one (`seq[p] = next_seq_hash(seq[p - 1],
//! local[p])`), so a walk that matched the local hash at `p` knows the sequence hash there
//! without hashing; a position's change mark is set exactly when its bits differ from the
//! previous position's (and at position 0); a segment's last position is live (dead tails are
//! cut off) and a segment without live positions is emptied and put on the free list; the
//! live counts are right; no two live positions share a sequence hash.

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

    /// Appends a block held by the inline slots `bits` (none yet when 0).
    #[inline]
    fn push(&mut self, local: u64, seq: u64, bits: u64) {
        let p = self.len();
        let changed = self.bits.last().is_none_or(|&prev| prev != bits);
        self.locals.push(local);
        self.bits.push(bits);
        self.seqs.push(seq);
        if p.is_multiple_of(64) {
            // A fresh word: only this position's mark to set.
            self.changes.push(u64::from(changed));
        } else if changed {
            self.changes[p / 64] |= 1u64 << (p % 64);
        }
    }

    /// Drops the last block.
    fn pop(&mut self) {
        self.truncate(self.len() - 1);
    }

    /// Drops every block from position `len` on.
    fn truncate(&mut self, len: usize) {
        self.locals.truncate(len);
        self.bits.truncate(len);
        self.seqs.truncate(len);
        self.changes.truncate(len.div_ceil(64));
        if !len.is_multiple_of(64)
            && let Some(word) = self.changes.last_mut()
        {
            *word &= (1u64 << (len % 64)) - 1;
        }
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

/// How many leading local hashes of `have` and `want` (of equal length) are equal. A walk spends
/// nearly all its time here, and the whole window matches far more often than not: that case is
/// one `memcmp` (vectorised by the C library for the machine it runs on); otherwise the hashes are
/// compared eight at a time with one branch a chunk, then one by one in the chunk that differs.
#[inline]
fn same_locals(have: &[u64], want: &[LocalBlockHash]) -> usize {
    const CHUNK: usize = 8;
    let want: &[u64] = bytemuck::cast_slice(want);
    if have == want {
        return have.len();
    }
    let mut i = 0;
    for (h, w) in have.chunks_exact(CHUNK).zip(want.chunks_exact(CHUNK)) {
        if h.iter().zip(w).fold(0, |acc, (a, b)| acc | (a ^ b)) != 0 {
            break;
        }
        i += CHUNK;
    }
    i + have[i..]
        .iter()
        .zip(&want[i..])
        .take_while(|(a, b)| a == b)
        .count()
}

/// Shared nodes of one tier: which slots hold each prefix.
#[derive(Debug, Default)]
pub(super) struct TierNodes {
    /// Sequence hash -> the node's [`Loc`], for the live nodes that may have to be found by hash.
    /// With `every_node`, all of them; otherwise only *entries*, the live nodes at a segment's
    /// first position or right after a dead one (see the module docs).
    loc: U64Map,
    /// Whether `loc` maps every live node, not just entries.
    every_node: bool,
    /// Live nodes.
    live: usize,
    /// Node location -> bits of slots 64.. (word `j` covers slots `64 * (j + 1)..`). Present
    /// only while a slot of 64 or above holds the node.
    hi: FastMap<Loc, Box<[u64]>>,
    segs: Vec<Segment>,
    free: Vec<u32>,
    /// Blocks of the chain being stored that may still need a place (see `expect_chain`).
    room: usize,
}

/// Where a node sits: `segment << 32 | position`. A live node never moves, so lanes keep it.
pub(super) type Loc = u64;

/// The node a stored block continues: its sequence hash, and its place in this tier. No place
/// means the node is not live in this tier or, in a tier mapping every node, was not looked up
/// (a slower tier's chain continuing a parent held in another tier): either way a lookup by hash
/// finds it if it is live.
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

/// The position of `loc` in its segment: `loc - k` is the node `k` positions before it, for
/// `k` up to this.
pub(super) fn position(loc: Loc) -> usize {
    decode(loc).1
}

impl TierNodes {
    /// An empty tier whose location table maps every live node (`every_node`) or only entries.
    pub(super) fn new(every_node: bool) -> Self {
        Self {
            every_node,
            ..Self::default()
        }
    }

    /// Whether the location table maps every live node (else only entries).
    pub(super) fn every_node(&self) -> bool {
        self.every_node
    }

    /// Live nodes.
    pub(super) fn len(&self) -> usize {
        self.live
    }

    /// Whether no slot holds anything in this tier.
    pub(super) fn is_empty(&self) -> bool {
        self.live == 0
    }

    /// Where the live node `seq` is, if the location table maps it: every live node in a tier
    /// that maps every node, else only entries. A walk at a live node that does not find the
    /// next one right after it in its segment looks here: that node, if live, is an entry (its
    /// position before holds the walk's node, which is live, only if it sits right after it).
    #[inline]
    pub(super) fn locate(&self, seq: u64) -> Option<(u32, usize)> {
        self.loc.get(seq).map(decode)
    }

    /// The live node continuing the live node at `at` (the previous block's node in this tier,
    /// `None` if there is none) with the block of local hash `local` and sequence hash `seq`.
    #[inline]
    pub(super) fn follow(&self, at: Option<Loc>, seq: u64, local: u64) -> Option<Loc> {
        at.and_then(|l| self.next_live(l, local))
            .or_else(|| self.loc.get(seq))
    }

    /// Bits of slots 0..64 holding the node at `loc`.
    #[inline]
    pub(super) fn bits_at(&self, loc: Loc) -> u64 {
        let (seg, p) = decode(loc);
        self.segs[seg as usize].bits[p]
    }

    /// Bits of slots 64.. holding the node at `loc` (empty when none of them holds it).
    #[inline]
    pub(super) fn spill_at(&self, loc: Loc) -> &[u64] {
        if self.hi.is_empty() {
            return &[];
        }
        self.hi.get(&loc).map_or(&[][..], |w| &w[..])
    }

    /// Whether any slot holds the node at position `p` of `s`, the segment `seg`.
    #[inline]
    fn live_at(hi: &FastMap<Loc, Box<[u64]>>, s: &Segment, seg: u32, p: usize) -> bool {
        s.bits[p] != 0 || (!hi.is_empty() && hi.contains_key(&encode(seg, p)))
    }

    /// Whether `loc` is a live node's place.
    pub(super) fn is_live(&self, loc: Loc) -> bool {
        let (seg, p) = decode(loc);
        self.segs
            .get(seg as usize)
            .is_some_and(|s| p < s.len() && Self::live_at(&self.hi, s, seg, p))
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

    /// The local hash of the block of the node at `loc`.
    #[inline]
    pub(super) fn local_at(&self, loc: Loc) -> u64 {
        let (seg, p) = decode(loc);
        self.segs[seg as usize].locals[p]
    }

    /// Every live node, as (sequence hash, location).
    pub(super) fn live_nodes(&self) -> impl Iterator<Item = (u64, Loc)> + '_ {
        self.segs.iter().enumerate().flat_map(move |(i, s)| {
            let seg = i as u32;
            (0..s.len())
                .filter(move |&p| Self::live_at(&self.hi, s, seg, p))
                .map(move |p| (s.seqs[p], encode(seg, p)))
        })
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
            Some(&bits)
                if bits & !(1u64 << (slot % 64)) == 0
                    && (self.every_node || p == 0 || s.bits[p - 1] == 0) =>
            {
                self.loc.peek(s.seqs[p])
            }
            _ => 0,
        }
    }

    /// The live node right after `parent` in its segment if its block has local hash `local`:
    /// the node continuing `parent` with that block, found without hashing or a lookup. A dead
    /// position there may live on elsewhere, so it is not returned.
    #[inline]
    pub(super) fn next_live(&self, parent: Loc, local: u64) -> Option<Loc> {
        let (seg, p) = decode(parent);
        let s = &self.segs[seg as usize];
        match s.locals.get(p + 1) {
            Some(&next) if next == local && Self::live_at(&self.hi, s, seg, p + 1) => {
                Some(encode(seg, p + 1))
            }
            _ => None,
        }
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
        let parent = parent.and_then(|p| p.loc.or_else(|| self.loc.get(p.seq)));
        // A live node is found right after its parent, or else it is in the location table.
        let known = parent
            .and_then(|at| self.next_live(at, local))
            .or_else(|| self.loc.get(seq));
        if let Some(loc) = known {
            self.room = self.room.saturating_sub(1);
            return (loc, self.hold(loc, slot));
        }
        // A new node goes after its parent when the parent ends a segment, else it starts one.
        let after = parent
            .map(decode)
            .filter(|&(seg, at)| at + 1 == self.segs[seg as usize].len())
            .map(|(seg, _)| seg);
        let seg = match after {
            Some(seg) => seg,
            None => match self.free.pop() {
                Some(seg) => seg,
                None => {
                    self.segs.push(Segment::default());
                    (self.segs.len() - 1) as u32
                }
            },
        };
        let s = &mut self.segs[seg as usize];
        if s.len() == s.capacity() {
            // Room for the rest of the chain at once (still at least doubling).
            s.reserve(self.room.max(1));
        }
        let loc = encode(seg, s.len());
        // A new node is born held by `slot` when the slot is inline; a spilling slot holds it
        // through the spill table below.
        let inline = if slot < INLINE_SLOTS { 1u64 << slot } else { 0 };
        s.push(local, seq, inline);
        s.live += 1;
        self.live += 1;
        if self.every_node || after.is_none() {
            self.loc.get_or_insert(seq, loc);
        }
        self.room = self.room.saturating_sub(1);
        if inline != 0 {
            return (loc, false);
        }
        (loc, self.hold(loc, slot))
    }

    /// Appends a run of new nodes after `tail`, the last position of its segment, all held by the
    /// inline `slot`, in a tier whose table maps only entries: `run` gives each block's sequence
    /// and local hash, in chain order. Each appended node continues the one before it at the end
    /// of the segment, so nothing can be live right after its parent, and it is not an entry: one
    /// table probe checks that it is not live elsewhere, and nothing is inserted. Stops at the
    /// first block live elsewhere or refused by `claim`, which is given each block's index and
    /// future location before it is appended (the caller's lane entry); returns how many were
    /// appended. The segment grows once and each array is extended once for the whole run.
    #[inline]
    pub(super) fn append_run(
        &mut self,
        tail: Loc,
        run: &[(u64, Option<Loc>)],
        locals: impl Fn(usize) -> u64,
        slot: u32,
        mut claim: impl FnMut(usize, Loc) -> bool,
    ) -> usize {
        debug_assert!(!self.every_node && slot < INLINE_SLOTS);
        let (seg, at) = decode(tail);
        let base = self.segs[seg as usize].len();
        debug_assert_eq!(at + 1, base, "the run goes on at the end of the segment");
        let mut n = 0;
        for &(seq, _) in run {
            if self.loc.get(seq).is_some() || !claim(n, encode(seg, base + n)) {
                break;
            }
            n += 1;
        }
        if n == 0 {
            return 0;
        }
        let bit = 1u64 << slot;
        let s = &mut self.segs[seg as usize];
        if s.capacity() < base + n {
            s.reserve(self.room.max(n));
        }
        s.locals.extend((0..n).map(&locals));
        s.seqs.extend(run[..n].iter().map(|&(seq, _)| seq));
        s.bits.resize(base + n, bit);
        // Only the first new position can change bits; marks past the old end are clear.
        s.changes.resize((base + n).div_ceil(64), 0);
        if s.bits[base - 1] != bit {
            s.mark(base, true);
        }
        s.live += n as u32;
        self.live += n;
        self.room = self.room.saturating_sub(n);
        n
    }

    /// Whether `loc` is the last position of its segment (a tier whose table maps only entries
    /// can append a run of new nodes after it, see `append_run`).
    #[inline]
    pub(super) fn ends_segment(&self, loc: Loc) -> bool {
        let (seg, p) = decode(loc);
        !self.every_node && p + 1 == self.segs[seg as usize].len()
    }

    /// Adds `slot` to the live node at `loc`; says whether the slot already held it.
    #[inline]
    pub(super) fn hold(&mut self, loc: Loc, slot: u32) -> bool {
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
            .entry(loc)
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
            if bits != 0 || (!self.hi.is_empty() && self.hi.contains_key(&loc)) {
                return;
            }
        } else {
            let word = (slot / 64 - 1) as usize;
            if let Some(words) = self.hi.get_mut(&loc) {
                if let Some(w) = words.get_mut(word) {
                    *w &= !(1u64 << (slot % 64));
                }
                if words.iter().any(|w| *w != 0) {
                    return;
                }
                self.hi.remove(&loc);
            }
            if self.segs[seg as usize].bits[p] != 0 {
                return;
            }
        }
        self.kill(seg, p);
    }

    /// Releases `slot` from the `n` nodes that end the segment at `top` (its last position and
    /// the `n - 1` before it) when `slot` alone holds each of them and no slot spills: they all
    /// die, and the segment is cut back once instead of a position at a time. Engines evict a
    /// chain's deepest blocks first, so a removal often names such runs. Returns `false`, having
    /// changed nothing, when the nodes are not such a run.
    pub(super) fn release_tail(&mut self, top: Loc, n: usize, slot: u32) -> bool {
        if slot >= INLINE_SLOTS || !self.hi.is_empty() {
            return false;
        }
        let (seg, p) = decode(top);
        let s = &mut self.segs[seg as usize];
        if p + 1 != s.len() || n > s.len() {
            return false;
        }
        let start = s.len() - n;
        let only = 1u64 << slot;
        if s.bits[start..].iter().any(|&b| b != only) {
            return false;
        }
        // Without spill bits a node is live exactly when its bits are set. Each node of the run
        // but the first follows a live one, so only the first can be an entry.
        if self.every_node {
            for &seq in &s.seqs[start..] {
                self.loc.remove(seq);
            }
        } else if start == 0 || s.bits[start - 1] == 0 {
            self.loc.remove(s.seqs[start]);
        }
        s.live -= n as u32;
        self.live -= n;
        if s.live == 0 {
            self.free_segment(seg);
            return true;
        }
        s.truncate(start);
        self.cut_dead_tail(seg);
        true
    }

    /// Puts the segment `seg`, whose nodes are all dead, on the free list.
    fn free_segment(&mut self, seg: u32) {
        let s = &mut self.segs[seg as usize];
        // A small segment keeps its memory for the next chain (churn stores and frees them by
        // the million); a large one gives it back.
        if s.capacity() > REUSED_SEGMENT_BLOCKS {
            *s = Segment::default();
        } else {
            s.clear();
        }
        self.free.push(seg);
    }

    /// Cuts the dead positions off the end of segment `seg` (which holds a live node) and gives
    /// memory back once it is a quarter full, to the power of two pushing would have reached
    /// (shrinking at every halving would copy back and forth at a boundary).
    fn cut_dead_tail(&mut self, seg: u32) {
        let s = &mut self.segs[seg as usize];
        while s.len() > 0 && !Self::live_at(&self.hi, s, seg, s.len() - 1) {
            s.pop();
        }
        let fit = s.len().next_power_of_two().max(4);
        if s.capacity() >= 4 * fit {
            s.shrink_to(fit);
        }
    }

    /// Forgets the node at position `p` of segment `seg` (nobody holds it any more): drops its
    /// location entry if it has one and makes the live node after it an entry, cuts dead tails
    /// and frees empty segments.
    #[inline]
    fn kill(&mut self, seg: u32, p: usize) {
        let s = &mut self.segs[seg as usize];
        let entry = self.every_node || p == 0 || !Self::live_at(&self.hi, s, seg, p - 1);
        if entry {
            self.loc.remove(s.seqs[p]);
        }
        s.live -= 1;
        self.live -= 1;
        if s.live == 0 {
            self.free_segment(seg);
            return;
        }
        if p + 1 < s.len() {
            // The node after this one, if live, now follows a dead position: an entry. The
            // segment's last position is live, so there is no tail to cut.
            if !self.every_node && Self::live_at(&self.hi, s, seg, p + 1) {
                self.loc.get_or_insert(s.seqs[p + 1], encode(seg, p + 1));
            }
            return;
        }
        self.cut_dead_tail(seg);
    }

    /// Checks the invariants in the module docs.
    pub(super) fn check(&self) -> Result<(), String> {
        for (seq, loc) in self.loc.iter() {
            let (seg, p) = decode(loc);
            let at = self.segs.get(seg as usize).and_then(|s| s.seqs.get(p));
            if at != Some(&seq) || !self.is_live(loc) {
                return Err(format!("node {seq:#x} is not live where its location says"));
            }
        }
        for &loc in self.hi.keys() {
            let (seg, p) = decode(loc);
            if self.segs.get(seg as usize).is_none_or(|s| p >= s.len()) {
                return Err(format!("spill bits for {loc:#x}, past every segment"));
            }
        }
        let (mut live_nodes, mut entries) = (0, 0);
        for (i, s) in self.segs.iter().enumerate() {
            let seg = i as u32;
            if s.bits.len() != s.len()
                || s.seqs.len() != s.len()
                || s.changes.len() != s.len().div_ceil(64)
            {
                return Err(format!("segment {i}: its arrays differ in length"));
            }
            let mut live = 0;
            for (p, &seq) in s.seqs.iter().enumerate() {
                let here = Self::live_at(&self.hi, s, seg, p);
                live += u32::from(here);
                let entry =
                    here && (self.every_node || p == 0 || !Self::live_at(&self.hi, s, seg, p - 1));
                entries += usize::from(entry);
                if entry && self.loc.get(seq) != Some(encode(seg, p)) {
                    return Err(format!(
                        "segment {i} position {p} is an entry missing from the location table"
                    ));
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
            live_nodes += live as usize;
            if s.len() > 0 && !Self::live_at(&self.hi, s, seg, s.len() - 1) {
                return Err(format!("segment {i} ends with a dead position"));
            }
        }
        if live_nodes != self.live {
            return Err(format!("{live_nodes} live nodes, counted {}", self.live));
        }
        if entries != self.loc.len() {
            return Err(format!(
                "{entries} entries, {} in the location table",
                self.loc.len()
            ));
        }
        Ok(())
    }
}
