//! A compact hash table from `u64` to `u64` for the index's hot tables.
//!
//! Linear probing over 16-byte slots with backward-shift deletion: no tombstones, so a table under
//! endless churn keeps the size its live set needs (hashbrown keeps tombstones and doubles when it
//! meets them above half load, which cost the index 2x memory under eviction churn). Load stays
//! at most 3/4; a probe touches consecutive slots, four to a cache line. Key 0 marks an empty slot,
//! so a real key 0 is kept aside in `zero`.
//!
//! [`U64Map::peek`] prefetches the slot where a key's probe starts, so a batch of accesses can
//! issue its cache misses together; it is the crate's only `unsafe` (a prefetch hint, which cannot
//! fault), kept because it measured ~15% faster event application than a plain read of the slot.

use crate::fasthash::fold_mul;

const EMPTY: u64 = 0;

/// Multiplier spreading keys (engines' block ids can be small sequential integers).
const MIX: u64 = 0x9E37_79B9_7F4A_7C15;

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

    #[inline]
    fn home(&self, key: u64) -> usize {
        fold_mul(key, MIX) as usize & (self.slots.len() - 1)
    }

    /// The slot holding `key`, or the empty slot where it would go.
    #[inline]
    fn find(&self, key: u64) -> usize {
        let mask = self.slots.len() - 1;
        let mut i = self.home(key);
        loop {
            let k = self.slots[i].0;
            if k == key || k == EMPTY {
                return i;
            }
            i = (i + 1) & mask;
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
        let (k, v) = self.slots[self.find(key)];
        (k == key).then_some(v)
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
        let i = self.find(key);
        let fresh = self.slots[i].0 == EMPTY;
        if fresh {
            self.slots[i] = (key, default);
            self.len += 1;
        }
        (&mut self.slots[i].1, fresh)
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
        // Shift later members of the probe run back so no lookup meets a hole before its key.
        let mask = self.slots.len() - 1;
        let mut j = hole;
        loop {
            j = (j + 1) & mask;
            let entry = self.slots[j];
            if entry.0 == EMPTY {
                break;
            }
            // The entry may move into the hole unless its home lies cyclically in (hole, j],
            // that is unless it is nearer to its home than the hole is.
            let from_home = j.wrapping_sub(self.home(entry.0)) & mask;
            if from_home >= j.wrapping_sub(hole) & mask {
                self.slots[hole] = entry;
                hole = j;
            }
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

    /// Makes room for `extra` more entries at most 3/4 load.
    pub(crate) fn reserve(&mut self, extra: usize) {
        let need = self.len + extra;
        if need * 4 > self.slots.len() * 3 {
            self.rebuild(need);
        }
    }

    /// Shrinks the slot array when the live set fell below 1/8 of it.
    pub(crate) fn maybe_shrink(&mut self) {
        if self.slots.len() > 64 && self.len * 8 < self.slots.len() {
            self.rebuild(self.len);
        }
    }

    /// Re-lays the entries out in the smallest power-of-two array holding `n` at 3/4 load.
    fn rebuild(&mut self, n: usize) {
        let size = (n * 4 / 3 + 1).next_power_of_two().max(8);
        let old = std::mem::replace(&mut self.slots, vec![(EMPTY, 0); size]);
        for (k, v) in old.into_iter().filter(|(k, _)| *k != EMPTY) {
            let i = self.find(k);
            self.slots[i] = (k, v);
        }
    }

    /// Whether both maps hold the same entries.
    pub(crate) fn same_entries(&self, other: &U64Map) -> bool {
        self.len() == other.len() && self.iter().all(|(k, v)| other.get(k) == Some(v))
    }
}

#[cfg(test)]
mod tests;
