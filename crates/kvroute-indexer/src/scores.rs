//! The answer to an overlap query.

use kvroute_protocols::WorkerWithDpRank;
use kvroute_protocols::kv_events::StorageTier;

/// For each worker, how much of a request's prefix it already holds, tier by tier.
///
/// Only workers that hold at least the first block (in some tier) appear. Device-tier (GPU)
/// matches, the ones that save prefill outright, are in `scores`. As in the reference, a worker's
/// match goes on in the slower tiers where its device match ends: the host tier holds the next
/// run of blocks, the disk tier the run after that, then the external tier; each run is reported
/// separately in `lower_tiers` so a cost model can weigh the tiers differently. A block held only
/// in a tier the walk has already left (on the host after a disk run, say) does not count.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OverlapScores {
    /// Leading blocks held in device memory, per worker and rank.
    pub scores: WorkerMap<u32>,
    /// Per worker and slower tier (host, disk, external), the run of blocks held there that
    /// continues the worker's match in the faster tiers; only runs of at least one block.
    pub lower_tiers: Vec<TierScore>,
    /// Total device blocks held by each worker that appears in `scores`.
    pub tree_sizes: WorkerMap<usize>,
}

/// A worker's run of blocks in one storage tier other than the device, continuing its match in
/// the faster tiers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TierScore {
    /// The worker and rank.
    pub worker: WorkerWithDpRank,
    /// The tier.
    pub tier: StorageTier,
    /// Blocks of the request held in that tier, right after the faster tiers' match.
    pub blocks: u32,
}

impl OverlapScores {
    /// Device-tier leading blocks held by `worker` (0 when absent).
    pub fn score(&self, worker: WorkerWithDpRank) -> u32 {
        self.scores.get(&worker).copied().unwrap_or(0)
    }

    /// Blocks `worker` is credited in `tier` (0 when absent): its leading device blocks, or its
    /// run in a slower tier continuing the faster tiers' match.
    pub fn tier_score(&self, worker: WorkerWithDpRank, tier: StorageTier) -> u32 {
        if tier == StorageTier::Device {
            return self.score(worker);
        }
        self.lower_tiers
            .iter()
            .find(|t| t.worker == worker && t.tier == tier)
            .map_or(0, |t| t.blocks)
    }

    /// The longest device-tier match of any worker.
    pub fn max_score(&self) -> u32 {
        self.scores.values().copied().max().unwrap_or(0)
    }
}

/// Values per worker rank for one answer, sorted by worker: one allocation of exactly the
/// answer's size, a lookup by binary search.
///
/// An answer names the few workers that hold a prompt's first block, so building a hash map for
/// it cost more than the walk it reports (two maps, hashing and growing, about half of a short
/// query's time); a sorted vector is built with one sort and reads back in a fixed order.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct WorkerMap<V> {
    entries: Vec<(WorkerWithDpRank, V)>,
}

impl<V> Default for WorkerMap<V> {
    fn default() -> Self {
        Self {
            entries: Vec::new(),
        }
    }
}

impl<V> WorkerMap<V> {
    /// An empty map.
    pub fn new() -> Self {
        Self::default()
    }

    /// The value of `worker`.
    #[inline]
    pub fn get(&self, worker: &WorkerWithDpRank) -> Option<&V> {
        self.entries
            .binary_search_by(|(w, _)| w.cmp(worker))
            .ok()
            .map(|i| &self.entries[i].1)
    }

    /// Whether `worker` has a value.
    pub fn contains_key(&self, worker: &WorkerWithDpRank) -> bool {
        self.get(worker).is_some()
    }

    /// Sets the value of `worker`, returning its previous one.
    pub fn insert(&mut self, worker: WorkerWithDpRank, value: V) -> Option<V> {
        match self.entries.binary_search_by(|(w, _)| w.cmp(&worker)) {
            Ok(i) => Some(std::mem::replace(&mut self.entries[i].1, value)),
            Err(i) => {
                self.entries.insert(i, (worker, value));
                None
            }
        }
    }

    /// Workers with a value.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no worker has a value.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Every (worker, value), by worker.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = (&WorkerWithDpRank, &V)> + '_ {
        self.entries.iter().map(|(w, v)| (w, v))
    }

    /// Every worker with a value, in order.
    pub fn keys(&self) -> impl ExactSizeIterator<Item = &WorkerWithDpRank> + '_ {
        self.entries.iter().map(|(w, _)| w)
    }

    /// Every value, by worker.
    pub fn values(&self) -> impl ExactSizeIterator<Item = &V> + '_ {
        self.entries.iter().map(|(_, v)| v)
    }

    /// A map from entries already sorted by worker, each worker once.
    pub(crate) fn from_sorted(entries: Vec<(WorkerWithDpRank, V)>) -> Self {
        debug_assert!(entries.windows(2).all(|p| p[0].0 < p[1].0));
        Self { entries }
    }
}

impl<V> FromIterator<(WorkerWithDpRank, V)> for WorkerMap<V> {
    /// Collects entries; a worker given twice keeps its last value.
    fn from_iter<I: IntoIterator<Item = (WorkerWithDpRank, V)>>(iter: I) -> Self {
        let mut entries: Vec<(WorkerWithDpRank, V)> = iter.into_iter().collect();
        // Stable, so the last value of a worker given twice stays last among its equals.
        entries.sort_by_key(|&(w, _)| w);
        let mut out: Vec<(WorkerWithDpRank, V)> = Vec::with_capacity(entries.len());
        for (w, v) in entries {
            match out.last_mut() {
                Some(last) if last.0 == w => last.1 = v,
                _ => out.push((w, v)),
            }
        }
        Self { entries: out }
    }
}

impl<'a, V> IntoIterator for &'a WorkerMap<V> {
    type Item = (&'a WorkerWithDpRank, &'a V);
    type IntoIter = std::iter::Map<
        std::slice::Iter<'a, (WorkerWithDpRank, V)>,
        fn(&'a (WorkerWithDpRank, V)) -> (&'a WorkerWithDpRank, &'a V),
    >;

    fn into_iter(self) -> Self::IntoIter {
        self.entries.iter().map(|(w, v)| (w, v))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(id: u64, rank: u32) -> WorkerWithDpRank {
        WorkerWithDpRank::new(id, rank)
    }

    #[test]
    fn worker_map_keeps_workers_sorted_and_distinct() {
        let mut map = WorkerMap::new();
        assert_eq!(map.insert(w(7, 0), 3u32), None);
        assert_eq!(map.insert(w(2, 1), 5), None);
        assert_eq!(map.insert(w(2, 0), 1), None);
        assert_eq!(map.insert(w(7, 0), 4), Some(3));
        assert_eq!(map.len(), 3);
        assert_eq!(
            map.keys().copied().collect::<Vec<_>>(),
            [w(2, 0), w(2, 1), w(7, 0)]
        );
        assert_eq!(map.values().copied().collect::<Vec<_>>(), [1, 5, 4]);
        assert_eq!(map.get(&w(7, 0)), Some(&4));
        assert_eq!(map.get(&w(7, 1)), None);
        assert!(map.contains_key(&w(2, 1)));
        assert!(!map.contains_key(&w(3, 0)));
    }

    #[test]
    fn worker_map_collects_in_any_order_keeping_the_last_value() {
        let map: WorkerMap<u32> = [(w(9, 0), 1), (w(1, 0), 2), (w(9, 0), 3), (w(5, 2), 4)]
            .into_iter()
            .collect();
        let pairs: Vec<_> = (&map).into_iter().map(|(k, v)| (*k, *v)).collect();
        assert_eq!(pairs, [(w(1, 0), 2), (w(5, 2), 4), (w(9, 0), 3)]);
        // The same entries collected in another order make an equal map.
        let again: WorkerMap<u32> = [(w(5, 2), 4), (w(9, 0), 3), (w(1, 0), 2)]
            .into_iter()
            .collect();
        assert_eq!(map, again);
        assert!(WorkerMap::<u32>::new().is_empty());
    }

    #[test]
    fn scores_read_through_the_maps() {
        let scores = OverlapScores {
            scores: [(w(1, 0), 4), (w(2, 0), 9)].into_iter().collect(),
            lower_tiers: vec![TierScore {
                worker: w(1, 0),
                tier: StorageTier::HostPinned,
                blocks: 2,
            }],
            tree_sizes: [(w(1, 0), 40), (w(2, 0), 90)].into_iter().collect(),
        };
        assert_eq!(scores.score(w(2, 0)), 9);
        assert_eq!(scores.score(w(3, 0)), 0);
        assert_eq!(scores.max_score(), 9);
        assert_eq!(scores.tier_score(w(1, 0), StorageTier::HostPinned), 2);
        assert_eq!(scores.tier_score(w(1, 0), StorageTier::Device), 4);
    }
}
