//! Prompts routed to workers that publish KV events, counted as cached there until their
//! request's first token (or its end) comes, by when its engine has published their blocks, or at
//! most for [`crate::RouterConfig::inflight_ttl`]: from then on the events alone say what the
//! worker holds, so a block it evicts is not credited on.
//!
//! Only what the exact index did not already show on the chosen worker is recorded: the prompt's
//! blocks from that worker's exact overlap on, each under its sequence hash, which names the
//! block and its whole prefix at once. A later prompt's match on a worker continues its exact
//! overlap there through the recorded blocks, one probe a block, and stops at the first block
//! neither shows. A prompt whose prefix the events have since shown gone finds nothing recorded
//! past it, as the engine, which cannot use a block without its prefix, finds nothing either.
//!
//! Recording a prompt costs a table entry for each block the index does not show (a few in a
//! long conversation, whose earlier turns the events have already stored) rather than one for
//! every block in a second index, and a worker holding nothing in flight costs one probe.

use std::collections::VecDeque;
use std::time::Duration;

use kvroute_indexer::FastMap;
use kvroute_protocols::WorkerWithDpRank;

/// The in-flight blocks of event workers, with their deadlines.
#[derive(Debug)]
pub(super) struct Inflight {
    ttl: Duration,
    /// The most blocks recorded over all workers; beyond it the oldest go first.
    max_blocks: usize,
    /// (worker rank, sequence hash) -> deadline, in nanoseconds of the caller's clock.
    deadlines: FastMap<(WorkerWithDpRank, u64), u64>,
    /// Blocks recorded per worker rank (the ranks a match must look at).
    ranks: FastMap<WorkerWithDpRank, usize>,
    /// Deadlines in the order they were set; an entry refreshed since is skipped when popped.
    /// The TTL is fixed, so this is deadline order too.
    queue: VecDeque<(u64, WorkerWithDpRank, u64)>,
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

impl Inflight {
    pub(super) fn new(ttl: Duration, max_blocks: usize) -> Self {
        Self {
            ttl,
            max_blocks,
            deadlines: FastMap::default(),
            ranks: FastMap::default(),
            queue: VecDeque::new(),
        }
    }

    /// Whether nothing is recorded.
    pub(super) fn is_empty(&self) -> bool {
        self.deadlines.is_empty()
    }

    /// Records that the prompt of sequence hashes `seq` was sent to `worker` at `now`, its first
    /// `from` blocks shown there by the exact index: the others count as cached there until
    /// `now + ttl` (those recorded before are refreshed), or until [`Self::release`]d. Returns
    /// whether anything was recorded.
    pub(super) fn record(
        &mut self,
        worker: WorkerWithDpRank,
        seq: &[u64],
        from: usize,
        now: Duration,
    ) -> bool {
        if self.ttl.is_zero() || from >= seq.len() {
            return false;
        }
        self.expire(now);
        let deadline = nanos(now.saturating_add(self.ttl));
        let mut fresh = 0usize;
        for &hash in &seq[from..] {
            if self.deadlines.insert((worker, hash), deadline).is_none() {
                fresh += 1;
            }
            self.queue.push_back((deadline, worker, hash));
        }
        if fresh > 0 {
            *self.ranks.entry(worker).or_default() += fresh;
        }
        if self.deadlines.len() > self.max_blocks {
            let target = self.max_blocks - self.max_blocks / 5;
            self.pop_while(|_, live| live > target);
        }
        true
    }

    /// Forgets `worker`'s in-flight blocks `seq`: their prompt's prefill is done, so its engine
    /// has published them and its events are the truth from now on (a block the engine evicts
    /// must not stay credited for the rest of the TTL).
    pub(super) fn release(&mut self, worker: WorkerWithDpRank, seq: &[u64]) {
        let mut gone = 0usize;
        for &hash in seq {
            if self.deadlines.remove(&(worker, hash)).is_some() {
                gone += 1;
            }
        }
        // Their queue entries are stale now and are skipped when popped.
        if gone > 0
            && let Some(n) = self.ranks.get_mut(&worker)
        {
            *n -= gone;
            if *n == 0 {
                self.ranks.remove(&worker);
            }
        }
    }

    /// Extends each worker's overlap in `overlaps` (its exact one; a worker absent from it has
    /// none) through its in-flight blocks of the prompt `seq`, adding the workers that hold in
    /// flight what the index does not. `skip` names workers left alone (those that publish no
    /// events).
    pub(super) fn extend(
        &self,
        seq: &[u64],
        overlaps: &mut Vec<(WorkerWithDpRank, u32)>,
        skip: impl Fn(WorkerWithDpRank) -> bool,
    ) {
        for &worker in self.ranks.keys() {
            if skip(worker) {
                continue;
            }
            let at = overlaps.iter().position(|(w, _)| *w == worker);
            let from = at.map_or(0, |i| overlaps[i].1 as usize);
            let end = from
                + seq
                    .get(from..)
                    .unwrap_or_default()
                    .iter()
                    .take_while(|&&hash| self.deadlines.contains_key(&(worker, hash)))
                    .count();
            if end == from {
                continue;
            }
            // At most the prompt's length, which the caller counts in u32 blocks.
            let end = u32::try_from(end).unwrap_or(u32::MAX);
            match at {
                Some(i) => overlaps[i].1 = end,
                None => overlaps.push((worker, end)),
            }
        }
    }

    /// Drops every block whose deadline is at or before `now`.
    pub(super) fn expire(&mut self, now: Duration) {
        let now = nanos(now);
        self.pop_while(|deadline, _| deadline <= now);
    }

    /// Forgets every block of every rank of a worker.
    pub(super) fn remove_worker(&mut self, worker_id: u64) {
        self.deadlines.retain(|(w, _), _| w.worker_id != worker_id);
        self.queue.retain(|(_, w, _)| w.worker_id != worker_id);
        self.ranks.retain(|w, _| w.worker_id != worker_id);
    }

    /// Pops the queue's front while `more(deadline, live blocks)` holds.
    fn pop_while(&mut self, more: impl Fn(u64, usize) -> bool) {
        while let Some(&(deadline, worker, hash)) = self.queue.front() {
            if !more(deadline, self.deadlines.len()) {
                break;
            }
            self.queue.pop_front();
            if self.deadlines.get(&(worker, hash)) != Some(&deadline) {
                continue; // Refreshed later; a newer queue entry stands for it.
            }
            self.deadlines.remove(&(worker, hash));
            if let Some(n) = self.ranks.get_mut(&worker) {
                *n -= 1;
                if *n == 0 {
                    self.ranks.remove(&worker);
                }
            }
        }
        if self.queue.capacity() > 4096 && self.queue.len() * 4 < self.queue.capacity() {
            self.queue.shrink_to(self.queue.len() * 2);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(id: u64) -> WorkerWithDpRank {
        WorkerWithDpRank::from_worker_id(id)
    }

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn a_match_continues_the_exact_overlap_through_what_is_in_flight() {
        let mut f = Inflight::new(10 * S, 1 << 20);
        assert!(f.is_empty());
        // Worker 1 was shown blocks 10 and 11 by its events; 12 and 13 went with the prompt.
        f.record(w(1), &[10, 11, 12, 13], 2, S);
        assert_eq!(f.deadlines.len(), 2);
        let mut o = vec![(w(1), 2), (w(2), 1)];
        f.extend(&[10, 11, 12, 13, 14], &mut o, |_| false);
        assert_eq!(o, vec![(w(1), 4), (w(2), 1)]);
        // Without the exact prefix, the in-flight blocks past it are not reached.
        let mut o = vec![(w(1), 1)];
        f.extend(&[10, 11, 12, 13], &mut o, |_| false);
        assert_eq!(o, vec![(w(1), 1)]);
        // A worker absent from the exact overlaps joins when its in-flight blocks start the
        // prompt; a skipped worker never does.
        f.record(w(3), &[10, 11], 0, S);
        let mut o = Vec::new();
        f.extend(&[10, 11, 12], &mut o, |_| false);
        assert_eq!(o, vec![(w(3), 2)]);
        let mut o = Vec::new();
        f.extend(&[10, 11, 12], &mut o, |x| x == w(3));
        assert!(o.is_empty());
        // A prompt that parts from the recorded one matches up to where they part.
        let mut o = vec![(w(1), 2)];
        f.extend(&[10, 11, 99, 13], &mut o, |x| x == w(3));
        assert_eq!(o, vec![(w(1), 2)]);
        let mut o = vec![(w(1), 2)];
        f.extend(&[10, 99], &mut o, |x| x == w(1));
        assert_eq!(o, vec![(w(1), 2), (w(3), 1)]);
    }

    #[test]
    fn blocks_expire_with_their_ttl_unless_refreshed() {
        let mut f = Inflight::new(10 * S, 1 << 20);
        f.record(w(1), &[1, 2, 3], 0, S);
        // Refreshed at 5 s: blocks 1 and 2 live until 15 s, block 3 until 11 s.
        f.record(w(1), &[1, 2], 0, 5 * S);
        f.expire(11 * S);
        let mut o = Vec::new();
        f.extend(&[1, 2, 3], &mut o, |_| false);
        assert_eq!(o, vec![(w(1), 2)]);
        f.expire(15 * S);
        assert!(f.is_empty());
        assert!(f.ranks.is_empty());
        assert!(f.queue.is_empty());
        // Nothing is recorded with a TTL of zero, or past the prompt's end.
        let mut off = Inflight::new(Duration::ZERO, 1 << 20);
        off.record(w(1), &[1, 2], 0, S);
        assert!(off.is_empty());
        f.record(w(1), &[1, 2], 2, S);
        assert!(f.is_empty());
    }

    #[test]
    fn released_blocks_count_no_more() {
        let mut f = Inflight::new(10 * S, 1 << 20);
        assert!(f.record(w(1), &[1, 2, 3, 4], 1, S));
        assert!(f.record(w(2), &[1, 2], 0, S));
        f.release(w(1), &[2, 3, 4]);
        let mut o = vec![(w(1), 1)];
        f.extend(&[1, 2, 3, 4], &mut o, |x| x == w(2));
        assert_eq!(o, vec![(w(1), 1)]);
        assert_eq!(f.ranks.get(&w(1)), None);
        // The other worker's blocks stand; the stale queue entries pop without harm.
        assert_eq!(f.deadlines.len(), 2);
        f.release(w(2), &[9]);
        assert_eq!(f.ranks.get(&w(2)), Some(&2));
        f.expire(11 * S);
        assert!(f.is_empty() && f.ranks.is_empty() && f.queue.is_empty());
    }

    #[test]
    fn the_oldest_go_beyond_the_cap_and_a_removed_worker_goes_whole() {
        let mut f = Inflight::new(10 * S, 10);
        f.record(w(1), &(0..6).collect::<Vec<u64>>(), 0, S);
        f.record(w(2), &(100..106).collect::<Vec<u64>>(), 0, 2 * S);
        // 12 > 10: pruned down to 8, the oldest (worker 1's first) first.
        assert_eq!(f.deadlines.len(), 8);
        let mut o = Vec::new();
        f.extend(&(0..6).collect::<Vec<u64>>(), &mut o, |_| false);
        assert!(o.is_empty(), "{o:?}");
        assert_eq!(f.ranks.get(&w(1)), Some(&2));
        f.remove_worker(2);
        assert_eq!(f.deadlines.len(), 2);
        assert!(f.queue.iter().all(|(_, w, _)| w.worker_id == 1));
        assert_eq!(f.ranks.get(&w(2)), None);
    }
}
