//! The timed replays and the side-by-side table.

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use anyhow::bail;

use crate::alloc::live_bytes;
use crate::drivers::{Kind, Scores, build};
use crate::workload::{Op, Recorded};

/// How to run the comparison.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Indexers to run, in this order (the order rotates between repeats).
    pub kinds: Vec<Kind>,
    /// Event threads of the reference's thread pool (its router's default is 4).
    pub ref_threads: usize,
    /// Worker shards of kvroute's sharded index.
    pub kv_shards: usize,
    /// Writer threads applying to those shards (each takes from any shard).
    pub kv_writers: usize,
    /// Times each indexer runs; the table keeps each one's best figures.
    pub repeats: usize,
    /// Fresh indexes each run fills in bulk; the run's bulk figure is their median (a bulk
    /// apply takes tens of milliseconds, so one is at the mercy of a noisy machine).
    pub bulk_passes: usize,
    /// Also time hashing each prompt plus the query.
    pub hash_phase: bool,
    /// Reader threads to time querying a shared index with (empty: no reader-scaling phase).
    pub readers: Vec<usize>,
}

/// What one indexer did on one run.
#[derive(Debug, Clone, Default)]
pub struct Figures {
    /// Event application, interleaved with the queries, up to the point each query saw it
    /// applied (for the thread pool: enqueueing plus the flush before the next query).
    pub apply: Duration,
    /// All events back to back into a fresh index, timed until all are applied (the median of
    /// [`Settings::bulk_passes`] indexes).
    pub bulk_apply: Duration,
    /// Per-query latency of a find over given local hashes, sorted.
    pub find_ns: Vec<u64>,
    /// Per-query latency of hashing the prompt plus the find, sorted.
    pub hash_find_ns: Vec<u64>,
    /// Live heap bytes the index holds at the end.
    pub heap_bytes: usize,
}

impl Figures {
    fn best(self, other: Figures) -> Figures {
        let pick = |a: Vec<u64>, b: Vec<u64>| {
            if a.is_empty() || (!b.is_empty() && percentile(&b, 0.5) < percentile(&a, 0.5)) {
                b
            } else {
                a
            }
        };
        Figures {
            apply: self.apply.min(other.apply),
            bulk_apply: self.bulk_apply.min(other.bulk_apply),
            find_ns: pick(self.find_ns, other.find_ns),
            hash_find_ns: pick(self.hash_find_ns, other.hash_find_ns),
            heap_bytes: self.heap_bytes.min(other.heap_bytes),
        }
    }
}

fn check(w: &Recorded, r: usize, got: &Scores, kind: Kind, what: &str) -> anyhow::Result<()> {
    let expected = &w.expected[r * w.workers..(r + 1) * w.workers];
    for (worker, &e) in expected.iter().enumerate() {
        let s = got.score(worker as u64);
        if s != e {
            bail!(
                "{} ({what}), request {r}: says worker {worker} holds {s} leading blocks, expected {e}",
                kind.name()
            );
        }
    }
    Ok(())
}

/// Replays the stream through a fresh `kind`, checking every answer.
pub fn replay(w: &Recorded, kind: Kind, settings: &Settings) -> anyhow::Result<Figures> {
    let mut f = Figures {
        find_ns: Vec::with_capacity(w.requests()),
        hash_find_ns: Vec::with_capacity(w.requests()),
        ..Figures::default()
    };
    let mut tokens = Vec::new();
    let base = live_bytes();
    let mut index = build(kind, w.block_size, settings);
    index.prepare(&w.events);
    let mut pending = false;
    for op in &w.ops {
        match *op {
            Op::Event(i) => {
                let start = Instant::now();
                index.apply(&w.events, i)?;
                f.apply += start.elapsed();
                pending = true;
            }
            Op::Query(r) => {
                if pending {
                    let start = Instant::now();
                    index.sync()?;
                    f.apply += start.elapsed();
                    pending = false;
                }
                let query = index.query(w.query(r));
                let start = Instant::now();
                let scores = index.find(query);
                f.find_ns.push(start.elapsed().as_nanos() as u64);
                check(w, r, &scores, kind, "find")?;
                drop(scores);
                if settings.hash_phase {
                    w.tokens(r, &mut tokens);
                    let start = Instant::now();
                    let scores = index.hash_find(&tokens);
                    f.hash_find_ns.push(start.elapsed().as_nanos() as u64);
                    check(w, r, &scores, kind, "hash + find")?;
                }
            }
        }
    }
    index.sync()?;
    index.release();
    drop(tokens);
    f.heap_bytes = live_bytes().saturating_sub(base);
    drop(index);
    f.find_ns.sort_unstable();
    f.hash_find_ns.sort_unstable();
    f.bulk_apply = bulk_apply(w, kind, settings)?;
    Ok(f)
}

/// Every event into a fresh index back to back, until all are applied: the median of
/// `settings.bulk_passes` fresh indexes.
fn bulk_apply(w: &Recorded, kind: Kind, settings: &Settings) -> anyhow::Result<Duration> {
    let mut times = Vec::with_capacity(settings.bulk_passes.max(1));
    for _ in 0..settings.bulk_passes.max(1) {
        let mut index = build(kind, w.block_size, settings);
        index.prepare(&w.events);
        let start = Instant::now();
        for i in 0..w.events.len() {
            index.apply(&w.events, i)?;
        }
        index.sync()?;
        times.push(start.elapsed());
    }
    times.sort_unstable();
    Ok(times[times.len() / 2])
}

/// Queries per second from each count of reader threads in `settings.readers`, all querying one
/// shared `kind` index that holds the whole stream (no events arrive meanwhile). Each thread
/// runs the workload's queries in order from its own starting point, for as many passes as one
/// thread needs for about a quarter second; every answer is checked against the answer one
/// thread got first on the same index. `None` for an index that cannot be shared.
pub fn reader_scaling(
    w: &Recorded,
    kind: Kind,
    settings: &Settings,
) -> anyhow::Result<Option<Vec<(usize, f64)>>> {
    let mut index = build(kind, w.block_size, settings);
    index.prepare(&w.events);
    for i in 0..w.events.len() {
        index.apply(&w.events, i)?;
    }
    index.sync()?;
    index.release();
    let Some(shared) = index.shared() else {
        return Ok(None);
    };
    let queries: Vec<_> = (0..w.requests()).map(|r| index.query(w.query(r))).collect();
    let start = Instant::now();
    let answers: Vec<Vec<u32>> = queries
        .iter()
        .map(|q| shared.find_shared(q).all(w.workers))
        .collect();
    let one_pass = start.elapsed().max(Duration::from_micros(1));
    let passes =
        (Duration::from_millis(250).as_secs_f64() / one_pass.as_secs_f64()).ceil() as usize;
    let n = queries.len();
    let mut out = Vec::new();
    for &readers in &settings.readers {
        let start = Instant::now();
        let wrong = std::thread::scope(|s| {
            let handles: Vec<_> = (0..readers)
                .map(|k| {
                    let (queries, answers) = (&queries, &answers);
                    s.spawn(move || {
                        let mut wrong = 0usize;
                        for j in 0..passes * n {
                            let r = (j + k * n / readers) % n;
                            let got = shared.find_shared(&queries[r]);
                            wrong += usize::from(got.all(w.workers) != answers[r]);
                        }
                        wrong
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("a reader thread panicked"))
                .sum::<usize>()
        });
        let elapsed = start.elapsed();
        if wrong > 0 {
            bail!(
                "{} with {readers} readers: {wrong} answers differ from one thread's",
                kind.name()
            );
        }
        let qps = (readers * passes * n) as f64 / elapsed.as_secs_f64();
        eprintln!(
            "  readers {readers}: {:<15} {:>10.0} queries/s",
            kind.name(),
            qps
        );
        out.push((readers, qps));
    }
    Ok(Some(out))
}

/// The reader-scaling table (Markdown): thousands of queries per second for each reader count,
/// then each count's speed-up over one reader; and the same figures as JSON.
pub fn scaling_table(results: &[(Kind, Vec<(usize, f64)>)]) -> (String, serde_json::Value) {
    let mut out = String::new();
    let _ = write!(out, "| readers |");
    for (k, _) in results {
        let _ = write!(out, " {} (k queries/s) |", k.name());
    }
    let _ = writeln!(out);
    let _ = write!(out, "| ---: |");
    for _ in results {
        let _ = write!(out, " ---: |");
    }
    let _ = writeln!(out);
    let counts: Vec<usize> = results
        .first()
        .map(|(_, v)| v.iter().map(|(n, _)| *n).collect())
        .unwrap_or_default();
    let mut json = serde_json::Map::new();
    for (i, n) in counts.iter().enumerate() {
        let _ = write!(out, "| {n} |");
        for (k, v) in results {
            let (_, qps) = v[i];
            let base = v[0].1;
            let _ = write!(out, " {} ({:.2}x) |", fmt(qps / 1000.0), qps / base);
            json.entry(k.name().to_owned())
                .or_insert_with(|| serde_json::json!({}))
                .as_object_mut()
                .expect("inserted as an object")
                .insert(n.to_string(), serde_json::json!(round3(qps / 1000.0)));
        }
        let _ = writeln!(out);
    }
    (out, json.into())
}

/// Runs every indexer `repeats` times (rotating the order so none always runs first on a noisy
/// machine) and keeps each one's best figures.
pub fn compare(w: &Recorded, settings: &Settings) -> anyhow::Result<Vec<(Kind, Figures)>> {
    let mut best: Vec<(Kind, Option<Figures>)> =
        settings.kinds.iter().map(|&k| (k, None)).collect();
    let n = best.len();
    for rep in 0..settings.repeats.max(1) {
        for j in 0..n {
            let slot = (j + rep) % n;
            let kind = best[slot].0;
            let figures = replay(w, kind, settings)?;
            eprintln!(
                "  run {}: {:<15} apply {:>8.2} M/s, find p50 {:>9.2} us",
                rep + 1,
                kind.name(),
                mblocks_per_s(w, figures.apply),
                percentile(&figures.find_ns, 0.5)
            );
            best[slot].1 = Some(match best[slot].1.take() {
                Some(prev) => prev.best(figures),
                None => figures,
            });
        }
    }
    Ok(best
        .into_iter()
        .filter_map(|(k, f)| f.map(|f| (k, f)))
        .collect())
}

/// The `p` quantile of sorted nanoseconds, in microseconds.
pub fn percentile(sorted: &[u64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i] as f64 / 1000.0
}

fn mblocks_per_s(w: &Recorded, d: Duration) -> f64 {
    (w.stored_blocks + w.removed_blocks) as f64 / d.as_secs_f64() / 1e6
}

/// One row: a metric per indexer, and whether higher is better.
struct Row {
    name: &'static str,
    higher_better: bool,
    value: fn(&Recorded, &Figures) -> f64,
}

const ROWS: &[Row] = &[
    Row {
        name: "apply, interleaved (M blocks/s)",
        higher_better: true,
        value: |w, f| mblocks_per_s(w, f.apply),
    },
    Row {
        name: "apply, bulk (M blocks/s)",
        higher_better: true,
        value: |w, f| mblocks_per_s(w, f.bulk_apply),
    },
    Row {
        name: "find p50 (us)",
        higher_better: false,
        value: |_, f| percentile(&f.find_ns, 0.5),
    },
    Row {
        name: "find p99 (us)",
        higher_better: false,
        value: |_, f| percentile(&f.find_ns, 0.99),
    },
    Row {
        name: "hash+find p50 (us)",
        higher_better: false,
        value: |_, f| percentile(&f.hash_find_ns, 0.5),
    },
    Row {
        name: "hash+find p99 (us)",
        higher_better: false,
        value: |_, f| percentile(&f.hash_find_ns, 0.99),
    },
    Row {
        name: "heap bytes per block",
        higher_better: false,
        value: |w, f| f.heap_bytes as f64 / w.final_blocks.max(1) as f64,
    },
];

/// The side-by-side table (Markdown), with the ratio of kvroute's best to the reference's best
/// (above 1 means kvroute is better), and one JSON line of the same figures.
pub fn table(w: &Recorded, results: &[(Kind, Figures)]) -> (String, serde_json::Value) {
    let mut out = String::new();
    let _ = write!(out, "| metric |");
    for (k, _) in results {
        let _ = write!(out, " {} |", k.name());
    }
    let _ = writeln!(out, " kvroute / ref |");
    let _ = write!(out, "| --- |");
    for _ in results {
        let _ = write!(out, " ---: |");
    }
    let _ = writeln!(out, " ---: |");
    let mut json = serde_json::Map::new();
    for row in ROWS {
        let values: Vec<(Kind, f64)> = results
            .iter()
            .map(|(k, f)| (*k, (row.value)(w, f)))
            .filter(|(_, v)| v.is_finite())
            .collect();
        if values.is_empty() {
            continue;
        }
        let _ = write!(out, "| {} |", row.name);
        for (k, _) in results {
            match values.iter().find(|(kk, _)| kk == k) {
                Some((_, v)) => {
                    let _ = write!(out, " {} |", fmt(*v));
                }
                None => {
                    let _ = write!(out, " – |");
                }
            }
        }
        let best = |ours: bool| {
            let it = values
                .iter()
                .filter(|(k, _)| k.is_kvroute() == ours)
                .map(|(_, v)| *v);
            if row.higher_better {
                it.fold(f64::NAN, f64::max)
            } else {
                it.fold(f64::NAN, f64::min)
            }
        };
        let (ours, theirs) = (best(true), best(false));
        let ratio = if row.higher_better {
            ours / theirs
        } else {
            theirs / ours
        };
        if ratio.is_finite() {
            let _ = writeln!(out, " {ratio:.2}x |");
        } else {
            let _ = writeln!(out, " – |");
        }
        let mut entry = serde_json::Map::new();
        for (k, v) in &values {
            entry.insert(k.name().to_owned(), serde_json::json!(round3(*v)));
        }
        // No ratio (JSON null, not 0) when only one side ran.
        let ratio = ratio.is_finite().then(|| round3(ratio));
        entry.insert("ratio".to_owned(), serde_json::json!(ratio));
        json.insert(row.name.to_owned(), entry.into());
    }
    (out, json.into())
}

fn round3(v: f64) -> f64 {
    if v.is_finite() {
        (v * 1000.0).round() / 1000.0
    } else {
        0.0
    }
}

fn fmt(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0}")
    } else if v >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}
