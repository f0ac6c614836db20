//! A compact hash table from `u64` to `u64` for the index's hot tables.
//!
//! Each slot holds a key's *mixed* hash (a multiply by an odd constant, so a bijection the table
//! can undo) and its value, in linear probing order: an entry sits at or after its home slot with
//! no empty slot between, and the whole array is sorted by mixed hash. A key's home is its mixed
//! hash scaled onto the home range by multiply-shift, so homes rise with mixed hashes and
//! sorting by one sorts by the other. Runs do not wrap round: the array has a tail past the home
//! range that a run near its end spills into (the tail grows by a slot whenever a run reaches the
//! last slot, which stays empty). An empty slot holds `u64::MAX`, which sorts after every key, so
//! a probe is one compare a slot: skip the slots below the key's mixed hash, and the key is there
//! or absent. Removal shifts the rest of the run back up to an empty slot or an entry at its home,
//! so there are no tombstones, and a table under endless churn keeps the size its live set needs
//! (hashbrown keeps tombstones and doubles when it meets them above half load, which cost the index
//! 2x memory under eviction churn).
//!
//! The home range is any multiple of 8 long. Growing past 2/3 load rebuilds it at 1/3 load;
//! falling below 1/6 rebuilds it at 2/5. A table whose size levels off holds 1/3 to 2/3 of its
//! peak, 24-48 bytes an entry. It used to run at 1/2 to 3/4 (21-32 bytes an entry), but near 3/4 a
//! probe and an insert's shift cross cache lines often enough that applying events ran 17-26%
//! slower for 20-30% less memory per indexed block (benchmarks-history.md, "tables at 1/3 to 2/3
//! load", issue 12 step 6).
//! A rebuild reads the old array in order and only appends. A probe touches consecutive slots,
//! four to a cache line. The one key whose mixed hash is `u64::MAX` is kept aside in `aside`.
//!
//! Where a probe loop stops varies from key to key, so it is mispredicted about once an access.
//! Until step 9 the slots held the keys themselves and runs wrapped round the array's end, so each
//! probed slot cost a multiply and a wrap-aware distance (benchmarks-history.md, "Where the
//! per-core gap goes" and step 9).
//!
//! [`U64Map::peek`] prefetches the slots where a key's probe starts, so a batch of accesses can
//! issue its cache misses together; it is the crate's only `unsafe` (a prefetch hint, which cannot
//! fault), kept because it measured ~15% faster event application than a plain read of the slot.

/// An empty slot: sorts after every stored mixed hash.
const EMPTY: u64 = u64::MAX;

/// Multiplier spreading keys (engines' block ids can be small sequential integers).
const MIX: u64 = 0x9E37_79B9_7F4A_7C15;

/// The inverse of [`MIX`] modulo 2^64 (Newton's iteration doubles the correct low bits each
/// step: 3, 6, 12, 24, 48, 96).
const UNMIX: u64 = {
    let mut inv = MIX;
    let mut step = 0;
    while step < 5 {
        inv = inv.wrapping_mul(2u64.wrapping_sub(MIX.wrapping_mul(inv)));
        step += 1;
    }
    inv
};

/// Empty slots kept past the home range when the array is laid out: runs near the end spill
/// into them, so the array rarely has to grow between rebuilds.
const TAIL: usize = 16;

/// A key spread over all 64 bits, whose high bits pick its home slot (multiply-shift, Fibonacci
/// hashing): one multiply, and a bijection, so distinct keys never tie.
#[inline]
fn mix(key: u64) -> u64 {
    key.wrapping_mul(MIX)
}

/// The key whose mixed hash is `mixed`.
#[inline]
fn unmix(mixed: u64) -> u64 {
    mixed.wrapping_mul(UNMIX)
}

/// Load after a rebuild that grows the table (numerator, denominator).
const GROWN_LOAD: (usize, usize) = (1, 3);

/// Load past which an insert grows the table.
const MAX_LOAD: (usize, usize) = (2, 3);

/// Load under which a removal shrinks the table (when it asks, see [`U64Map::maybe_shrink`]).
const MIN_LOAD: (usize, usize) = (1, 6);

/// Load after a rebuild that shrinks it.
const SETTLED_LOAD: (usize, usize) = (2, 5);

/// Map from `u64` keys to `u64` values.
#[derive(Debug, Clone, Default)]
pub(crate) struct U64Map {
    /// `(mixed hash, value)`, sorted by mixed hash, [`EMPTY`] where nothing is; `homes` home
    /// slots and a tail whose last slot is always empty (no slots at all before the first
    /// insert).
    slots: Vec<(u64, u64)>,
    /// Slots a home can be.
    homes: usize,
    /// Entries in `slots`.
    len: usize,
    /// The value of the key whose mixed hash is [`EMPTY`].
    aside: Option<u64>,
}

impl U64Map {
    /// Entries held.
    pub(crate) fn len(&self) -> usize {
        self.len + usize::from(self.aside.is_some())
    }

    /// Whether the map holds nothing.
    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes reserved by the slot array.
    pub(crate) fn bytes(&self) -> usize {
        self.slots.capacity() * std::mem::size_of::<(u64, u64)>()
    }

    /// The home slot of a key whose mixed hash is `mixed` (multiply-shift onto the home range, so
    /// it need not be a power of two, and homes rise with mixed hashes).
    #[inline]
    fn scale(&self, mixed: u64) -> usize {
        ((u128::from(mixed) * self.homes as u128) >> 64) as usize
    }

    /// The slot holding `mixed` (`Ok`), or where it goes (`Err`): the first slot from its home
    /// not below it. The array's last slot is empty, so the scan stops.
    #[inline]
    fn probe(&self, mixed: u64) -> Result<usize, usize> {
        let mut i = self.scale(mixed);
        loop {
            let k = self.slots[i].0;
            if k >= mixed {
                return if k == mixed { Ok(i) } else { Err(i) };
            }
            i += 1;
        }
    }

    /// The value of `key`.
    #[inline]
    pub(crate) fn get(&self, key: u64) -> Option<u64> {
        let mixed = mix(key);
        if mixed == EMPTY {
            return self.aside;
        }
        if self.slots.is_empty() {
            return None;
        }
        self.probe(mixed).ok().map(|i| self.slots[i].1)
    }

    /// Prefetches the slots where a probe for `key` starts, so a later access to `key` finds them
    /// in cache: a batch peeks at all its keys first and the cache misses overlap instead of
    /// queueing one after another. Returns a value for the caller to fold into `black_box` (0
    /// where the prefetch is a real one), so a plain read on other targets is not optimised away.
    #[inline]
    pub(crate) fn peek(&self, key: u64) -> u64 {
        if self.slots.is_empty() {
            return 0;
        }
        let home = self.scale(mix(key));
        // The home's cache line and the one holding the slot two on (the next line when the
        // home sits late in its own), as a probe, and an insert's or removal's shift, often go on
        // past the home: 3-6% faster event application than the home's line alone. The tail
        // keeps 16 slots past the home range, so `home + 2` is in the array.
        let slot = &self.slots[home];
        #[cfg(target_arch = "x86_64")]
        #[allow(unsafe_code)]
        // SAFETY: a prefetch is a hint: it reads nothing into the program and cannot fault.
        unsafe {
            core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(
                (slot as *const (u64, u64)).cast(),
            );
            core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(
                (&self.slots[home + 2] as *const (u64, u64)).cast(),
            );
        }
        #[cfg(not(target_arch = "x86_64"))]
        return slot.0;
        #[cfg(target_arch = "x86_64")]
        0
    }

    /// A mutable reference to the value of `key`, inserting `default` first if absent; the flag
    /// says whether it was inserted.
    #[inline(always)]
    pub(crate) fn get_or_insert(&mut self, key: u64, default: u64) -> (&mut u64, bool) {
        let mixed = mix(key);
        if mixed == EMPTY {
            let fresh = self.aside.is_none();
            return (self.aside.get_or_insert(default), fresh);
        }
        self.reserve(1);
        match self.probe(mixed) {
            Ok(i) => (&mut self.slots[i].1, false),
            Err(i) => {
                self.insert_at(i, (mixed, default));
                (&mut self.slots[i].1, true)
            }
        }
    }

    /// Puts `entry` at slot `i`, moving the run from `i` up to the next empty slot on by one; if
    /// that takes the last slot, the array grows by an empty one.
    #[inline]
    fn insert_at(&mut self, i: usize, entry: (u64, u64)) {
        let mut carry = std::mem::replace(&mut self.slots[i], entry);
        let mut j = i;
        while carry.0 != EMPTY {
            j += 1;
            carry = std::mem::replace(&mut self.slots[j], carry);
        }
        if j + 1 == self.slots.len() {
            self.slots.push((EMPTY, 0));
        }
        self.len += 1;
    }

    /// Inserts `key -> value` unless `key` is present; says whether it inserted.
    #[cfg(test)]
    pub(crate) fn insert_new(&mut self, key: u64, value: u64) -> bool {
        self.get_or_insert(key, value).1
    }

    /// Removes `key`, returning its value.
    pub(crate) fn remove(&mut self, key: u64) -> Option<u64> {
        let mixed = mix(key);
        if mixed == EMPTY {
            return self.aside.take();
        }
        if self.slots.is_empty() {
            return None;
        }
        let mut hole = self.probe(mixed).ok()?;
        let value = self.slots[hole].1;
        // Shift the rest of the run back by one, up to an empty slot or an entry at its home
        // (nothing after that one is displaced past the hole).
        loop {
            let entry = self.slots[hole + 1];
            if entry.0 == EMPTY || self.scale(entry.0) > hole {
                break;
            }
            self.slots[hole] = entry;
            hole += 1;
        }
        self.slots[hole] = (EMPTY, 0);
        self.len -= 1;
        Some(value)
    }

    /// Every entry, in no particular order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.aside.map(|v| (unmix(EMPTY), v)).into_iter().chain(
            self.slots
                .iter()
                .filter(|(k, _)| *k != EMPTY)
                .map(|&(k, v)| (unmix(k), v)),
        )
    }

    /// Makes room for `extra` more entries at most [`MAX_LOAD`].
    #[inline]
    pub(crate) fn reserve(&mut self, extra: usize) {
        let need = self.len + extra;
        if need * MAX_LOAD.1 > self.homes * MAX_LOAD.0 {
            self.grow(need);
        }
    }

    /// Rebuilds the table for `need` entries (kept out of line: inserts inline the check only).
    #[cold]
    #[inline(never)]
    fn grow(&mut self, need: usize) {
        self.rebuild(need, GROWN_LOAD);
    }

    /// Shrinks the slot array when the live set fell below [`MIN_LOAD`] of it.
    pub(crate) fn maybe_shrink(&mut self) {
        if self.homes > 64 && self.len * MIN_LOAD.1 < self.homes * MIN_LOAD.0 {
            self.rebuild(self.len, SETTLED_LOAD);
        }
    }

    /// Re-lays the entries out for `n` entries at `num / den` load.
    fn rebuild(&mut self, n: usize, (num, den): (usize, usize)) {
        let homes = (n * den / num + 1).next_multiple_of(8).max(8);
        let old = std::mem::replace(&mut self.slots, vec![(EMPTY, 0); homes + TAIL]);
        self.homes = homes;
        // The old entries come sorted by mixed hash, so each new home is at least the last
        // one's: an entry goes to the first free slot from its home, without a probe.
        let mut free = 0;
        for &(k, v) in old.iter().filter(|(k, _)| *k != EMPTY) {
            let at = self.scale(k).max(free);
            if at + 1 == self.slots.len() {
                self.slots.push((EMPTY, 0));
            }
            self.slots[at] = (k, v);
            free = at + 1;
        }
    }

    /// Whether the layout holds: the array sorted by mixed hash, every entry at or after its home
    /// with no empty slot between, the home range's tail in place and its last slot empty.
    #[cfg(test)]
    pub(crate) fn in_order(&self) -> bool {
        if self.slots.is_empty() {
            return self.homes == 0 && self.len == 0;
        }
        let held: Vec<(usize, u64)> = (0..self.slots.len())
            .map(|i| (i, self.slots[i].0))
            .filter(|&(_, k)| k != EMPTY)
            .collect();
        self.slots.len() >= self.homes + TAIL
            && self.slots.last().is_some_and(|s| s.0 == EMPTY)
            && held.len() == self.len
            && held.windows(2).all(|w| w[0].1 < w[1].1)
            && held.iter().all(|&(i, k)| {
                let home = self.scale(k);
                home <= i && self.slots[home..i].iter().all(|s| s.0 != EMPTY)
            })
    }

    /// Whether both maps hold the same entries.
    pub(crate) fn same_entries(&self, other: &U64Map) -> bool {
        self.len() == other.len() && self.iter().all(|(k, v)| other.get(k) == Some(v))
    }
}

#[cfg(test)]
mod tests;
