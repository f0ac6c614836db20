//! A compact hash table from `u64` to `u64` for the index's hot tables.
//!
//! Linear probing over 16-byte slots in Robin Hood order (each run of slots sorted by mixed hash,
//! so by home slot), with backward-shift deletion that stops at the first entry sitting at its
//! home, so deletes stay short at high load. No tombstones, so a table under endless churn keeps
//! the size its live set needs (hashbrown keeps tombstones and doubles when it meets them above
//! half load, which cost the index 2x memory under eviction churn). The slot array is any multiple
//! of 8 long (a key's home slot is its mixed hash scaled onto the array by multiply-shift, not
//! masked). Growing past 2/3 load rebuilds it at 1/3 load; falling below 1/6 rebuilds it at 2/5.
//! A table whose size levels off holds 1/3 to 2/3 of its peak, 24-48 bytes an entry. It used to
//! run at 1/2 to 3/4 (21-32 bytes an entry), but near 3/4 a probe and an insert's shift cross
//! cache lines often enough that applying events ran 17-26% slower for 20-30% less memory per
//! indexed block (benchmarks.md, "Tables at 1/3 to 2/3 load"). A rebuild reads the old
//! runs in hash order and only appends. A probe touches consecutive slots, four to a cache line.
//! Key 0 marks an empty slot, so a real key 0 is kept aside in `zero`.
//!
//! Where a probe loop stops varies from key to key, so it is mispredicted about once an access:
//! most of the index's mispredicted branches when applying events. Probes checking a window of
//! slots into a bit mask, without a branch a slot, were measured and cost more instructions than
//! the mispredictions they saved on baseline x86-64 (benchmarks.md, "Where the per-core gap
//! goes").
//!
//! [`U64Map::peek`] prefetches the slot where a key's probe starts, so a batch of accesses can
//! issue its cache misses together; it is the crate's only `unsafe` (a prefetch hint, which cannot
//! fault), kept because it measured ~15% faster event application than a plain read of the slot.

const EMPTY: u64 = 0;

/// Multiplier spreading keys (engines' block ids can be small sequential integers).
const MIX: u64 = 0x9E37_79B9_7F4A_7C15;

/// A key spread over all 64 bits, whose high bits pick its home slot (multiply-shift, Fibonacci
/// hashing): one multiply, and a bijection, so distinct keys never tie.
#[inline]
fn mix(key: u64) -> u64 {
    key.wrapping_mul(MIX)
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
    slots: Vec<(u64, u64)>,
    len: usize,
    zero: Option<u64>,
}

impl U64Map {
    /// Entries held.
    pub(crate) fn len(&self) -> usize {
        self.len + usize::from(self.zero.is_some())
    }

    /// Whether the map holds nothing.
    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes reserved by the slot array.
    pub(crate) fn bytes(&self) -> usize {
        self.slots.capacity() * std::mem::size_of::<(u64, u64)>()
    }

    /// The slot where the probe for `key` starts: the mixed key scaled onto the slot array
    /// (multiply-shift, so the array need not be a power of two).
    #[inline]
    fn home(&self, key: u64) -> usize {
        self.scale(mix(key))
    }

    /// The home slot of a key whose mixed hash is `mixed`.
    #[inline]
    fn scale(&self, mixed: u64) -> usize {
        ((u128::from(mixed) * self.slots.len() as u128) >> 64) as usize
    }

    /// The slot after `i`, wrapping at the end of the array.
    #[inline]
    fn next(&self, i: usize) -> usize {
        let j = i + 1;
        if j < self.slots.len() { j } else { 0 }
    }

    /// How far slot `j` lies after slot `from`, going round the array.
    #[inline]
    fn distance(&self, from: usize, j: usize) -> usize {
        if j >= from {
            j - from
        } else {
            j + self.slots.len() - from
        }
    }

    /// The slot holding `key`, or the empty slot where it would go.
    #[inline]
    fn find(&self, key: u64) -> usize {
        let mut i = self.home(key);
        loop {
            let k = self.slots[i].0;
            if k == key || k == EMPTY {
                return i;
            }
            i = self.next(i);
        }
    }

    /// The value of `key`.
    #[inline]
    pub(crate) fn get(&self, key: u64) -> Option<u64> {
        if key == EMPTY {
            return self.zero;
        }
        if self.slots.is_empty() {
            return None;
        }
        self.probe(key).ok().map(|i| self.slots[i].1)
    }

    /// Prefetches the slot where a probe for `key` starts, so a later access to `key` finds it in
    /// cache: a batch peeks at all its keys first and the cache misses overlap instead of
    /// queueing one after another. Returns a value for the caller to fold into `black_box` (0
    /// where the prefetch is a real one), so a plain read on other targets is not optimised away.
    #[inline]
    pub(crate) fn peek(&self, key: u64) -> u64 {
        if self.slots.is_empty() {
            return 0;
        }
        let slot = &self.slots[self.home(key)];
        #[cfg(target_arch = "x86_64")]
        #[allow(unsafe_code)]
        // SAFETY: a prefetch is a hint: it reads nothing into the program and cannot fault.
        unsafe {
            core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(
                (slot as *const (u64, u64)).cast(),
            );
        }
        #[cfg(not(target_arch = "x86_64"))]
        return slot.0;
        #[cfg(target_arch = "x86_64")]
        0
    }

    /// A mutable reference to the value of `key`, inserting `default` first if absent; the flag
    /// says whether it was inserted.
    #[inline]
    pub(crate) fn get_or_insert(&mut self, key: u64, default: u64) -> (&mut u64, bool) {
        if key == EMPTY {
            let fresh = self.zero.is_none();
            return (self.zero.get_or_insert(default), fresh);
        }
        self.reserve(1);
        match self.probe(key) {
            Ok(i) => (&mut self.slots[i].1, false),
            Err(i) => {
                let _ = self.insert_at(i, (key, default));
                (&mut self.slots[i].1, true)
            }
        }
    }

    /// The slot holding `key` (`Ok`), or where it goes (`Err`). Robin Hood order: along a run,
    /// entries sit sorted by mixed hash (so by home slot), so the key is absent once the probe
    /// meets an empty slot or an entry sorting after it.
    #[inline]
    fn probe(&self, key: u64) -> Result<usize, usize> {
        let mixed = mix(key);
        let mut i = self.scale(mixed);
        let mut probed = 0;
        loop {
            let k = self.slots[i].0;
            if k == key {
                return Ok(i);
            }
            if k == EMPTY {
                return Err(i);
            }
            let other = mix(k);
            let from_home = self.distance(self.scale(other), i);
            if from_home < probed || (from_home == probed && other > mixed) {
                return Err(i);
            }
            i = self.next(i);
            probed += 1;
        }
    }

    /// Puts `entry` at slot `i`, moving the run from `i` up to the next empty slot on by one.
    #[inline]
    fn insert_at(&mut self, i: usize, entry: (u64, u64)) -> usize {
        let mut carry = std::mem::replace(&mut self.slots[i], entry);
        let mut j = i;
        while carry.0 != EMPTY {
            j = self.next(j);
            carry = std::mem::replace(&mut self.slots[j], carry);
        }
        self.len += 1;
        j
    }

    /// Inserts `key -> value` unless `key` is present; says whether it inserted.
    #[cfg(test)]
    pub(crate) fn insert_new(&mut self, key: u64, value: u64) -> bool {
        self.get_or_insert(key, value).1
    }

    /// Removes `key`, returning its value.
    pub(crate) fn remove(&mut self, key: u64) -> Option<u64> {
        if key == EMPTY {
            return self.zero.take();
        }
        if self.slots.is_empty() {
            return None;
        }
        let mut hole = self.find(key);
        let (k, value) = self.slots[hole];
        if k != key {
            return None;
        }
        // Shift the rest of the run back by one, up to an empty slot or an entry at its home (in
        // Robin Hood order nothing after that one is displaced past the hole).
        let mut j = self.next(hole);
        loop {
            let entry = self.slots[j];
            if entry.0 == EMPTY || self.home(entry.0) == j {
                break;
            }
            self.slots[hole] = entry;
            hole = j;
            j = self.next(j);
        }
        self.slots[hole] = (EMPTY, 0);
        self.len -= 1;
        Some(value)
    }

    /// Every entry, in no particular order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.zero
            .map(|v| (EMPTY, v))
            .into_iter()
            .chain(self.slots.iter().copied().filter(|(k, _)| *k != EMPTY))
    }

    /// Makes room for `extra` more entries at most [`MAX_LOAD`].
    pub(crate) fn reserve(&mut self, extra: usize) {
        let need = self.len + extra;
        if need * MAX_LOAD.1 > self.slots.len() * MAX_LOAD.0 {
            self.rebuild(need, GROWN_LOAD);
        }
    }

    /// Shrinks the slot array when the live set fell below [`MIN_LOAD`] of it.
    pub(crate) fn maybe_shrink(&mut self) {
        if self.slots.len() > 64 && self.len * MIN_LOAD.1 < self.slots.len() * MIN_LOAD.0 {
            self.rebuild(self.len, SETTLED_LOAD);
        }
    }

    /// Re-lays the entries out for `n` entries at `num / den` load.
    fn rebuild(&mut self, n: usize, (num, den): (usize, usize)) {
        let size = (n * den / num + 1).next_multiple_of(8).max(8);
        let old = std::mem::replace(&mut self.slots, vec![(EMPTY, 0); size]);
        self.len = 0;
        // Read from an empty slot on, the old entries come sorted by mixed hash (runs are sorted
        // by it), so each new home is at least the last one's: an entry goes to the first free
        // slot from its home without a probe. Entries running past the end take the probe (as
        // would any out of order).
        let start = old.iter().position(|(k, _)| *k == EMPTY).unwrap_or(0);
        let (mut last, mut free) = (0, 0);
        for &(k, v) in old[start..].iter().chain(&old[..start]) {
            if k == EMPTY {
                continue;
            }
            let home = self.home(k);
            let at = home.max(free);
            if home >= last && at < size {
                self.slots[at] = (k, v);
                self.len += 1;
                (last, free) = (home, at + 1);
            } else if let Err(i) = self.probe(k) {
                let end = self.insert_at(i, (k, v));
                if end >= i {
                    free = free.max(end + 1);
                }
            }
        }
    }

    /// Whether every run is in Robin Hood order: an entry away from its home follows an entry
    /// whose home comes before its own, or the same home and a mixed hash no larger.
    #[cfg(test)]
    pub(crate) fn in_order(&self) -> bool {
        let n = self.slots.len();
        (0..n).all(|i| {
            let (k, _) = self.slots[i];
            if k == EMPTY {
                return true;
            }
            let d = self.distance(self.home(k), i);
            let prev = self.slots[(i + n - 1) % n].0;
            if d == 0 {
                return true;
            }
            let dp = self.distance(self.home(prev), (i + n - 1) % n) + 1;
            prev != EMPTY && (dp > d || (dp == d && mix(prev) <= mix(k)))
        })
    }

    /// Whether both maps hold the same entries.
    pub(crate) fn same_entries(&self, other: &U64Map) -> bool {
        self.len() == other.len() && self.iter().all(|(k, v)| other.get(k) == Some(v))
    }
}

#[cfg(test)]
mod tests;
