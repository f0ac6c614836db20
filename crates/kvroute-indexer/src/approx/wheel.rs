//! Approximate mode's expiry queue: predictions bucketed by deadline.
//!
//! Every prediction has one entry, in the bucket of the deadline it had when it was queued. A
//! decision that refreshes a prediction leaves its entry where it is; when the entry's bucket
//! comes due the caller finds the prediction's deadline later and queues it again there. So the
//! queue holds one entry per prediction, and a prediction refreshed by every turn of a
//! conversation is queued again about once per TTL, not once per turn. A plain queue in
//! deadline order could not take such an entry back at its place; buckets can, and their width
//! bounds how late a prediction goes: [`BUCKETS_PER_TTL`].

use std::collections::VecDeque;

use kvroute_protocols::WorkerWithDpRank;

/// Buckets a TTL spans: a prediction goes at the first expiry at or after the end of its
/// deadline's bucket, at most `ttl / BUCKETS_PER_TTL` after its deadline (under 2 s of the
/// default 120 s TTL), and a bucket's entries wait together.
pub(super) const BUCKETS_PER_TTL: u64 = 64;

/// A queued prediction: (the deadline it was queued at, its worker rank, its sequence hash).
pub(super) type Entry = (u64, WorkerWithDpRank, u64);

/// Entries bucketed by deadline, on a ring of buckets as long as a TTL and a little more.
#[derive(Debug)]
pub(super) struct Wheel {
    /// A bucket's width, in nanoseconds of the caller's clock.
    width: u64,
    /// Bucket `b` (queued deadlines in `((b - 1) * width, b * width]`) is
    /// `slots[b % slots.len()]`; every entry's bucket is in `next..next + slots.len()`.
    slots: Vec<VecDeque<Entry>>,
    /// The earliest bucket that may hold entries.
    next: u64,
    /// Entries queued, over all buckets.
    len: usize,
}

impl Wheel {
    /// An empty queue for deadlines at most `ttl` (nanoseconds) after the time they are set.
    pub(super) fn new(ttl: u64) -> Self {
        let width = (ttl / BUCKETS_PER_TTL).max(1);
        // A deadline set at `now` (after the buckets up to `now` were popped) is at most
        // `ttl / width + 2` buckets past `next`, rounding up twice.
        let slots = usize::try_from(ttl / width + 3).unwrap_or(usize::MAX);
        Self {
            width,
            slots: (0..slots).map(|_| VecDeque::new()).collect(),
            next: 0,
            len: 0,
        }
    }

    /// Entries queued.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// Queues `entry` in the bucket of its deadline (the earliest still kept if that one was
    /// popped already: a deadline set by a clock that went back).
    pub(super) fn push(&mut self, entry: Entry) {
        let ring = self.slots.len() as u64;
        let bucket = entry.0.div_ceil(self.width).max(self.next);
        // Deadlines are at most a TTL ahead of the latest expiry, so this holds; a later bucket
        // would alias an earlier one, and expiring a little early is the lesser harm.
        debug_assert!(bucket < self.next + ring, "deadline beyond the ring");
        let bucket = bucket.min(self.next + ring - 1);
        self.slots[(bucket % ring) as usize].push_back(entry);
        self.len += 1;
    }

    /// Takes the first entry queued in the earliest bucket holding any, if that bucket ends at
    /// or before `until` (any bucket when `None`: pruning takes the earliest deadlines whatever
    /// the time).
    pub(super) fn pop(&mut self, until: Option<u64>) -> Option<Entry> {
        let ring = self.slots.len() as u64;
        loop {
            let due = until.is_none_or(|t| self.next.saturating_mul(self.width) <= t);
            if self.len == 0 {
                // Nothing queued: only move the ring up to `until`, so that deadlines set from
                // now on fit it.
                if let Some(t) = until {
                    self.next = self.next.max(t / self.width + 1);
                }
                return None;
            }
            if !due {
                return None;
            }
            let slot = &mut self.slots[(self.next % ring) as usize];
            if let Some(entry) = slot.pop_front() {
                self.len -= 1;
                return Some(entry);
            }
            // Passed empty: a bucket that was far fuller than it is now gives back half of its
            // room, so a burst does not keep its memory for good.
            if slot.capacity() > 1024 {
                slot.shrink_to(slot.capacity() / 2);
            }
            self.next += 1;
        }
    }

    /// Keeps only the entries `keep` accepts.
    pub(super) fn retain(&mut self, mut keep: impl FnMut(&Entry) -> bool) {
        for slot in &mut self.slots {
            slot.retain(&mut keep);
        }
        self.len = self.slots.iter().map(VecDeque::len).sum();
    }

    /// Bytes reserved by the buckets.
    pub(super) fn bytes(&self) -> usize {
        self.slots.len() * size_of::<VecDeque<Entry>>()
            + self.slots.iter().map(VecDeque::capacity).sum::<usize>() * size_of::<Entry>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(deadline: u64, seq: u64) -> Entry {
        (deadline, WorkerWithDpRank::from_worker_id(1), seq)
    }

    #[test]
    fn entries_come_due_at_the_end_of_their_bucket() {
        // A TTL of 640 ns: buckets 10 ns wide.
        let mut wheel = Wheel::new(640);
        wheel.push(entry(15, 1));
        wheel.push(entry(20, 2));
        wheel.push(entry(21, 3));
        assert_eq!(wheel.pop(Some(19)), None);
        let mut due: Vec<u64> = std::iter::from_fn(|| wheel.pop(Some(20)))
            .map(|e| e.2)
            .collect();
        due.sort_unstable();
        assert_eq!(due, [1, 2]);
        assert_eq!(wheel.pop(Some(29)), None);
        assert_eq!(wheel.pop(Some(30)), Some(entry(21, 3)));
        assert_eq!(wheel.len(), 0);
    }

    #[test]
    fn a_deadline_already_passed_goes_in_the_earliest_bucket_kept() {
        let mut wheel = Wheel::new(640);
        wheel.push(entry(500, 1));
        assert_eq!(wheel.pop(Some(300)), None);
        // The clock went back: the entry is kept, and comes due with the next bucket.
        wheel.push(entry(100, 2));
        assert_eq!(wheel.pop(Some(309)), None);
        assert_eq!(wheel.pop(Some(310)), Some(entry(100, 2)));
    }

    #[test]
    fn an_idle_ring_moves_up_to_the_clock_and_takes_a_ttl_ahead() {
        let mut wheel = Wheel::new(640);
        assert_eq!(wheel.pop(Some(1_000_000)), None);
        wheel.push(entry(1_000_640, 1));
        assert_eq!(wheel.pop(Some(1_000_639)), None);
        assert_eq!(wheel.pop(Some(1_000_640)), Some(entry(1_000_640, 1)));
    }

    #[test]
    fn pruning_takes_the_earliest_buckets_whatever_the_time() {
        let mut wheel = Wheel::new(640);
        wheel.push(entry(300, 3));
        wheel.push(entry(100, 1));
        wheel.push(entry(200, 2));
        let order: Vec<u64> = std::iter::from_fn(|| wheel.pop(None))
            .map(|e| e.2)
            .collect();
        assert_eq!(order, [1, 2, 3]);
    }
}
