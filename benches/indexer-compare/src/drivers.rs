//! Each compared indexer behind one small trait, used the way its own router uses it.
//!
//! Whatever an API makes the caller build (the reference takes events and queries by value, in its
//! own types) is built before the clock starts, so conversions never count against either side.

use std::sync::Arc;

use crate::run::Settings;
use dynamo_kv_router::ConcurrentRadixTreeCompressed;
use dynamo_kv_router::indexer::{SyncIndexer, ThreadPoolIndexer};
use dynamo_kv_router::protocols as dy;
use dynamo_kv_router::radix_tree::RadixTree;
use kvroute_indexer::hash::{HashSalt, compute_block_hashes};
use kvroute_indexer::{ConcurrentIndex, IndexWriters, KvIndex, OverlapScores};
use kvroute_protocols::WorkerWithDpRank;
use kvroute_protocols::kv_events::{KvCacheEventData, LocalBlockHash, RouterEvent};

/// Which indexer, as named on the command line and in the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// kvroute's `KvIndex`, one thread.
    KvIndex,
    /// kvroute's `ConcurrentIndex` of one shard, driven from one thread.
    KvConcurrent,
    /// kvroute's `ConcurrentIndex` split into worker shards, applied by `IndexWriters` threads
    /// (kvroute's answer to the reference's thread pool).
    KvSharded,
    /// The reference's single-threaded `RadixTree`.
    RefRadixTree,
    /// The reference's router default: `ThreadPoolIndexer<ConcurrentRadixTreeCompressed>`.
    RefThreadPool,
}

impl Kind {
    /// Every indexer, kvroute's first.
    pub const ALL: [Kind; 5] = [
        Kind::KvIndex,
        Kind::KvConcurrent,
        Kind::KvSharded,
        Kind::RefRadixTree,
        Kind::RefThreadPool,
    ];

    /// Short column name.
    pub fn name(self) -> &'static str {
        match self {
            Kind::KvIndex => "kv KvIndex",
            Kind::KvConcurrent => "kv Concurrent",
            Kind::KvSharded => "kv Sharded",
            Kind::RefRadixTree => "ref RadixTree",
            Kind::RefThreadPool => "ref ThreadPool",
        }
    }

    /// Whether this is one of kvroute's.
    pub fn is_kvroute(self) -> bool {
        matches!(self, Kind::KvIndex | Kind::KvConcurrent | Kind::KvSharded)
    }
}

/// Answers of one query, in either crate's type.
#[derive(Debug)]
pub enum Scores {
    /// kvroute's answer.
    Kv(OverlapScores),
    /// The reference's answer.
    Ref(dy::OverlapScores),
}

impl Scores {
    /// Leading device blocks of workers `0..workers` (rank 0), in order.
    pub fn all(&self, workers: usize) -> Vec<u32> {
        (0..workers as u64).map(|w| self.score(w)).collect()
    }

    /// Leading device blocks `worker` (rank 0) holds.
    pub fn score(&self, worker: u64) -> u32 {
        match self {
            Scores::Kv(s) => s.score(WorkerWithDpRank::from_worker_id(worker)),
            Scores::Ref(s) => s
                .scores
                .get(&dy::WorkerWithDpRank::from_worker_id(worker))
                .copied()
                .unwrap_or(0),
        }
    }
}

/// A query in the form an indexer takes it, built (untimed) right before the find.
///
/// Each side gets a fresh copy of the request's hashes, so both find them hot in cache, as a
/// router does (it computes them just before it asks): borrowing kvroute's straight from the
/// recorded workload made it read them cold while the reference read its fresh copy hot.
#[derive(Debug)]
pub enum Query {
    /// kvroute's hash type.
    Kv(Vec<LocalBlockHash>),
    /// The reference's own hash type, by value.
    Ref(Vec<dy::LocalBlockHash>),
}

/// One indexer under test.
pub trait Indexer {
    /// Takes what the replay will apply, before any clock starts.
    fn prepare(&mut self, events: &[RouterEvent]);
    /// Applies (or enqueues) event `i`.
    fn apply(&mut self, events: &[RouterEvent], i: usize) -> anyhow::Result<()>;
    /// Returns once every event given so far is applied.
    fn sync(&mut self) -> anyhow::Result<()>;
    /// The query over `local` in the form [`Indexer::find`] takes (untimed).
    fn query(&self, local: &[LocalBlockHash]) -> Query;
    /// The overlap of a query with every worker.
    fn find(&mut self, query: Query) -> Scores;
    /// Hashes a prompt's full blocks and finds their overlap.
    fn hash_find(&mut self, tokens: &[u32]) -> Scores;
    /// Drops whatever [`Indexer::prepare`] kept, so only the index is left to measure.
    fn release(&mut self) {}
    /// The index as many threads query it at once, if it can be shared.
    fn shared(&self) -> Option<&dyn SharedFind> {
        None
    }
}

/// An index that many threads can query at once, as its router shares it.
pub trait SharedFind: Sync {
    /// The overlap of a query with every worker, from any thread.
    fn find_shared(&self, query: &Query) -> Scores;
}

impl SharedFind for KvIndex {
    fn find_shared(&self, query: &Query) -> Scores {
        let Query::Kv(q) = query else {
            unreachable!("kvroute queries are built by `query`")
        };
        Scores::Kv(self.find_matches(q))
    }
}

impl SharedFind for ConcurrentIndex {
    fn find_shared(&self, query: &Query) -> Scores {
        let Query::Kv(q) = query else {
            unreachable!("kvroute queries are built by `query`")
        };
        Scores::Kv(self.find_matches(q))
    }
}

impl SharedFind for ThreadPoolIndexer<ConcurrentRadixTreeCompressed> {
    fn find_shared(&self, query: &Query) -> Scores {
        let Query::Ref(q) = query else {
            unreachable!("reference queries are built by `query`")
        };
        Scores::Ref(self.backend().find_matches(q, false))
    }
}

/// Builds the indexer of `kind`; `block_size` is the engine block size, `threads` the event
/// threads of the reference's thread pool, `shards` the worker shards (and writer threads) of
/// kvroute's sharded index.
pub fn build(kind: Kind, block_size: usize, settings: &Settings) -> Box<dyn Indexer> {
    let (threads, shards, writers) = (
        settings.ref_threads,
        settings.kv_shards,
        settings.kv_writers,
    );
    match kind {
        Kind::KvIndex => Box::new(KvSingle {
            index: KvIndex::new(),
            scratch: Vec::new(),
            block_size,
            salt: HashSalt::default(),
        }),
        Kind::KvConcurrent => Box::new(KvShared {
            index: Arc::new(ConcurrentIndex::new()),
            writers: None,
            events: Vec::new(),
            block_size,
            salt: HashSalt::default(),
        }),
        Kind::KvSharded => {
            let index = Arc::new(ConcurrentIndex::with_shards(shards));
            let writers = IndexWriters::with_threads(Arc::clone(&index), writers)
                .expect("the bench starts its writer threads");
            Box::new(KvShared {
                index,
                writers: Some(writers),
                events: Vec::new(),
                block_size,
                salt: HashSalt::default(),
            })
        }
        Kind::RefRadixTree => Box::new(RefTree {
            tree: RadixTree::new(),
            events: Vec::new(),
            block_size: block_size as u32,
        }),
        Kind::RefThreadPool => Box::new(RefPool {
            pool: ThreadPoolIndexer::new(
                ConcurrentRadixTreeCompressed::new(),
                threads.max(1),
                block_size as u32,
            ),
            events: Vec::new(),
            block_size: block_size as u32,
            rt: tokio::runtime::Builder::new_current_thread()
                .build()
                .expect("a current-thread runtime without drivers always builds"),
        }),
    }
}

struct KvSingle {
    index: KvIndex,
    scratch: Vec<u64>,
    block_size: usize,
    salt: HashSalt,
}

impl Indexer for KvSingle {
    fn prepare(&mut self, _: &[RouterEvent]) {}

    fn apply(&mut self, events: &[RouterEvent], i: usize) -> anyhow::Result<()> {
        let out = self.index.apply_event(&events[i]);
        out.result
            .map_err(|e| anyhow::anyhow!("event {i} rejected: {e}"))?;
        if let Some(gap) = out.gap {
            anyhow::bail!("event {i}: unexpected gap {gap:?}");
        }
        Ok(())
    }

    fn sync(&mut self) -> anyhow::Result<()> {
        Ok(())
    }

    fn query(&self, local: &[LocalBlockHash]) -> Query {
        Query::Kv(local.to_vec())
    }

    fn find(&mut self, query: Query) -> Scores {
        let Query::Kv(q) = query else {
            unreachable!("kvroute queries are built by `query`")
        };
        Scores::Kv(self.index.find_matches_with(&q, &mut self.scratch))
    }

    fn hash_find(&mut self, tokens: &[u32]) -> Scores {
        let local = compute_block_hashes(tokens, self.block_size, &self.salt);
        Scores::Kv(self.index.find_matches_with(&local, &mut self.scratch))
    }

    fn shared(&self) -> Option<&dyn SharedFind> {
        Some(&self.index)
    }
}

/// kvroute's shared index, applying events on the caller's thread (`submit`) or, with
/// `writers`, handing them to writer threads that share the shards out.
struct KvShared {
    index: Arc<ConcurrentIndex>,
    writers: Option<IndexWriters>,
    /// Owned copies of the events, made before the clock starts (as the reference's are): the
    /// router hands over the events it decoded, by value, without copying them.
    events: Vec<Option<RouterEvent>>,
    block_size: usize,
    salt: HashSalt,
}

impl Indexer for KvShared {
    fn prepare(&mut self, events: &[RouterEvent]) {
        self.events = events.iter().cloned().map(Some).collect();
    }

    fn apply(&mut self, _: &[RouterEvent], i: usize) -> anyhow::Result<()> {
        let event = self.events[i].take().expect("each event is applied once");
        match &self.writers {
            Some(writers) => writers.send(event),
            None => self.index.submit(event),
        }
        Ok(())
    }

    fn release(&mut self) {
        self.events = Vec::new();
    }

    fn sync(&mut self) -> anyhow::Result<()> {
        // `submit` applies before it returns when no other thread is applying; writers are
        // waited for. Then check nothing went wrong on the way.
        if let Some(writers) = &self.writers {
            writers.flush();
        }
        let gaps = self.index.take_gaps();
        anyhow::ensure!(gaps.is_empty(), "unexpected gaps {gaps:?}");
        Ok(())
    }

    fn query(&self, local: &[LocalBlockHash]) -> Query {
        Query::Kv(local.to_vec())
    }

    fn find(&mut self, query: Query) -> Scores {
        let Query::Kv(q) = query else {
            unreachable!("kvroute queries are built by `query`")
        };
        Scores::Kv(self.index.find_matches(&q))
    }

    fn hash_find(&mut self, tokens: &[u32]) -> Scores {
        let local = compute_block_hashes(tokens, self.block_size, &self.salt);
        Scores::Kv(self.index.find_matches(&local))
    }

    fn shared(&self) -> Option<&dyn SharedFind> {
        Some(&*self.index)
    }
}

struct RefTree {
    tree: RadixTree,
    events: Vec<Option<dy::RouterEvent>>,
    block_size: u32,
}

impl Indexer for RefTree {
    fn prepare(&mut self, events: &[RouterEvent]) {
        self.events = events.iter().map(|e| Some(to_ref(e))).collect();
    }

    fn apply(&mut self, _: &[RouterEvent], i: usize) -> anyhow::Result<()> {
        let event = self.events[i].take().expect("each event is applied once");
        self.tree
            .apply_event(event)
            .map_err(|e| anyhow::anyhow!("event {i} rejected: {e:?}"))
    }

    fn sync(&mut self) -> anyhow::Result<()> {
        Ok(())
    }

    fn query(&self, local: &[LocalBlockHash]) -> Query {
        Query::Ref(local.iter().map(|h| dy::LocalBlockHash(h.0)).collect())
    }

    fn find(&mut self, query: Query) -> Scores {
        let Query::Ref(q) = query else {
            unreachable!("reference queries are built by `query`")
        };
        Scores::Ref(self.tree.find_matches(q, false))
    }

    fn hash_find(&mut self, tokens: &[u32]) -> Scores {
        let local = dy::compute_block_hash_for_seq(
            tokens,
            self.block_size,
            dy::BlockHashOptions::default(),
        );
        Scores::Ref(self.tree.find_matches(local, false))
    }

    fn release(&mut self) {
        self.events = Vec::new();
    }
}

struct RefPool {
    pool: ThreadPoolIndexer<ConcurrentRadixTreeCompressed>,
    events: Vec<Option<dy::RouterEvent>>,
    block_size: u32,
    rt: tokio::runtime::Runtime,
}

impl Indexer for RefPool {
    fn prepare(&mut self, events: &[RouterEvent]) {
        self.events = events.iter().map(|e| Some(to_ref(e))).collect();
    }

    fn apply(&mut self, _: &[RouterEvent], i: usize) -> anyhow::Result<()> {
        let event = self.events[i].take().expect("each event is applied once");
        self.pool
            .enqueue_event(event)
            .map_err(|e| anyhow::anyhow!("event {i} not accepted: {e}"))
    }

    fn sync(&mut self) -> anyhow::Result<()> {
        self.rt
            .block_on(self.pool.flush_and_wait())
            .map_err(|e| anyhow::anyhow!("flush failed: {e}"))
    }

    fn query(&self, local: &[LocalBlockHash]) -> Query {
        Query::Ref(local.iter().map(|h| dy::LocalBlockHash(h.0)).collect())
    }

    fn find(&mut self, query: Query) -> Scores {
        let Query::Ref(q) = query else {
            unreachable!("reference queries are built by `query`")
        };
        // What `KvIndexerInterface::find_matches` does, minus the async wrapper.
        Scores::Ref(self.pool.backend().find_matches(&q, false))
    }

    fn hash_find(&mut self, tokens: &[u32]) -> Scores {
        let local = dy::compute_block_hash_for_seq(
            tokens,
            self.block_size,
            dy::BlockHashOptions::default(),
        );
        Scores::Ref(self.pool.backend().find_matches(&local, false))
    }

    fn release(&mut self) {
        self.events = Vec::new();
    }

    fn shared(&self) -> Option<&dyn SharedFind> {
        Some(&self.pool)
    }
}

/// The same event in the reference's types.
fn to_ref(e: &RouterEvent) -> dy::RouterEvent {
    let data = match &e.event.data {
        KvCacheEventData::Stored(s) => dy::KvCacheEventData::Stored(dy::KvCacheStoreData {
            parent_hash: s.parent_hash.map(|h| dy::ExternalSequenceBlockHash(h.0)),
            start_position: None,
            blocks: s
                .blocks
                .iter()
                .map(|b| dy::KvCacheStoredBlockData {
                    block_hash: dy::ExternalSequenceBlockHash(b.block_hash.0),
                    tokens_hash: dy::LocalBlockHash(b.tokens_hash.0),
                    mm_extra_info: None,
                })
                .collect(),
        }),
        KvCacheEventData::Removed(r) => dy::KvCacheEventData::Removed(dy::KvCacheRemoveData {
            block_hashes: r
                .block_hashes
                .iter()
                .map(|h| dy::ExternalSequenceBlockHash(h.0))
                .collect(),
        }),
        KvCacheEventData::Cleared => dy::KvCacheEventData::Cleared,
    };
    dy::RouterEvent::new(
        e.worker_id,
        dy::KvCacheEvent {
            event_id: e.event.event_id,
            data,
            dp_rank: e.event.dp_rank,
        },
    )
}

/// Checks that both crates hash a prompt into the same local hashes (the comparison would be
/// meaningless otherwise).
pub fn same_hashes(tokens: &[u32], block_size: usize) -> bool {
    let ours = compute_block_hashes(tokens, block_size, &HashSalt::default());
    let theirs =
        dy::compute_block_hash_for_seq(tokens, block_size as u32, dy::BlockHashOptions::default());
    ours.len() == theirs.len() && ours.iter().zip(&theirs).all(|(a, b)| a.0 == b.0)
}
