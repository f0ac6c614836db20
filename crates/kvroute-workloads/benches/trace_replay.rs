//! Replays a Mooncake-format trace against the index as a fleet would drive it.
//!
//! `cargo bench -p kvroute-workloads --bench trace_replay -- (--trace FILE | --workload
//! agentic|multi-turn [--seed N]) [--workers 8] [--block-size 16] [--trace-block-size 512]
//! [--cache-blocks 16384] [--threads N] [--limit N]`
//!
//! `--workload` replays a seeded synthetic workload ([`kvroute_workloads::synth`]) instead of a
//! recorded trace; its ids stand for 512-token blocks.
//!
//! It lives here, not in kvroute-indexer, because it needs this crate's workloads and simulated
//! fleet, and the layering lets the indexer's benches use only crates below the indexer.
//!
//! Each request's `hash_ids` expand deterministically into engine blocks of synthetic tokens. A
//! simulation ([`Recorded::simulate`], untimed, run first) routes each request to the worker with
//! the lowest cost (blocks to prefill plus a decaying load), stores its new blocks there and evicts
//! that worker's least recently used leaves beyond `--cache-blocks`, producing the event stream and
//! the expected answer of every query. The timed phase replays queries and events against the
//! index, checks every answer, and exits non-zero on any mismatch. The last line printed is one
//! JSON object.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use kvroute_indexer::{ConcurrentIndex, KvIndex, OverlapScores};
use kvroute_protocols::WorkerWithDpRank;
use kvroute_workloads::fleet::{Fleet, Op, Recorded};

struct Args {
    trace: String,
    workload: Option<String>,
    seed: u64,
    workers: usize,
    block_size: usize,
    trace_block_size: usize,
    cache_blocks: usize,
    threads: usize,
    limit: usize,
}

fn parse_args() -> anyhow::Result<Args> {
    let mut args = Args {
        trace: String::new(),
        workload: None,
        seed: 1,
        workers: 8,
        block_size: 16,
        trace_block_size: 512,
        cache_blocks: 16384,
        threads: 1,
        limit: usize::MAX,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--bench" {
            continue; // Passed by `cargo bench` to every bench binary.
        }
        let value = it.next().with_context(|| format!("{flag} needs a value"))?;
        let num = || {
            value
                .parse::<usize>()
                .with_context(|| format!("{flag} {value}: not a number"))
        };
        match flag.as_str() {
            "--trace" => args.trace = value.clone(),
            "--workload" => args.workload = Some(value.clone()),
            "--seed" => args.seed = num()? as u64,
            "--workers" => args.workers = num()?,
            "--block-size" => args.block_size = num()?,
            "--trace-block-size" => args.trace_block_size = num()?,
            "--cache-blocks" => args.cache_blocks = num()?,
            "--threads" => args.threads = num()?.max(1),
            "--limit" => args.limit = num()?,
            _ => bail!(
                "unknown flag {flag}; expected --trace, --workload, --seed, --workers, --block-size, --trace-block-size, --cache-blocks, --threads or --limit"
            ),
        }
    }
    if args.trace.is_empty() == args.workload.is_none() {
        bail!("give exactly one of --trace FILE and --workload agentic|multi-turn");
    }
    if args.block_size == 0 || !args.trace_block_size.is_multiple_of(args.block_size) {
        bail!("--trace-block-size must be a positive multiple of --block-size");
    }
    if !(1..=64).contains(&args.workers) {
        bail!("--workers must be 1..=64, got {}", args.workers);
    }
    Ok(args)
}

/// The first `--limit` requests of the trace as `(input_length, hash_ids)`.
fn load_trace(args: &Args) -> anyhow::Result<Vec<(usize, Vec<u64>)>> {
    let records = if let Some(name) = &args.workload {
        kvroute_workloads::synth::Workload::from_name(name)?
            .generate(args.seed)
            .into_iter()
            .map(|r| r.record)
            .collect()
    } else {
        let text = std::fs::read_to_string(&args.trace)
            .with_context(|| format!("reading trace {}", args.trace))?;
        kvroute_workloads::trace::parse_jsonl(&text).with_context(|| args.trace.clone())?
    };
    Ok(records
        .into_iter()
        .take(args.limit)
        .map(|r| (r.input_length as usize, r.hash_ids))
        .collect())
}

/// A field of /proc/self/status in kB (0 when unavailable).
fn status_kb(field: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

fn verify(got: &OverlapScores, expected: &[u32], r: usize) -> anyhow::Result<()> {
    for (w, &e) in expected.iter().enumerate() {
        let s = got.score(WorkerWithDpRank::from_worker_id(w as u64));
        if s != e {
            bail!("request {r}: index says worker {w} holds {s} leading blocks, expected {e}");
        }
    }
    Ok(())
}

struct Timings {
    apply: Duration,
    find: Duration,
    latencies_ns: Vec<u64>,
    events: u64,
    /// The index's own accounting and the process RSS (kB) at the end, index still alive.
    memory: kvroute_indexer::MemoryStats,
    rss_after_kb: u64,
    /// Blocks per second queried by the extra reader threads, if any.
    concurrent_find: Option<f64>,
}

impl Timings {
    fn new(requests: usize) -> Self {
        Self {
            apply: Duration::ZERO,
            find: Duration::ZERO,
            latencies_ns: Vec::with_capacity(requests),
            events: 0,
            memory: kvroute_indexer::MemoryStats::default(),
            rss_after_kb: 0,
            concurrent_find: None,
        }
    }
}

/// The timed replay on one thread against a plain index.
fn replay(w: &Recorded, workers: usize) -> anyhow::Result<Timings> {
    let mut index = KvIndex::new();
    let mut t = Timings::new(w.offsets.len());
    let mut scratch = Vec::new();
    for op in &w.ops {
        match op {
            Op::Query(r) => {
                let q = &w.local[w.offsets[*r]..w.offsets[*r + 1]];
                let start = Instant::now();
                let scores = index.find_matches_with(q, &mut scratch);
                let dt = start.elapsed();
                t.find += dt;
                t.latencies_ns.push(dt.as_nanos() as u64);
                verify(&scores, &w.expected[r * workers..(r + 1) * workers], *r)?;
            }
            Op::Event(i) => {
                let ev = &w.events[*i];
                let start = Instant::now();
                let out = index.apply_event(ev);
                t.apply += start.elapsed();
                t.events += 1;
                if let Err(e) = out.result {
                    bail!("event {} rejected: {e}", ev.event.event_id);
                }
                if let Some(gap) = out.gap {
                    bail!("unexpected gap {gap:?}");
                }
            }
        }
    }
    t.memory = index.memory();
    t.rss_after_kb = status_kb("VmRSS:");
    Ok(t)
}

/// The same replay through [`ConcurrentIndex`] while `readers` threads query it nonstop.
fn replay_shared(w: &Arc<Recorded>, workers: usize, readers: usize) -> anyhow::Result<Timings> {
    let shared = Arc::new(ConcurrentIndex::new());
    let done = Arc::new(AtomicBool::new(false));
    let extra = Arc::new(AtomicU64::new(0));
    let handles: Vec<_> = (0..readers)
        .map(|k| {
            let (shared, done, extra, w) = (
                Arc::clone(&shared),
                Arc::clone(&done),
                Arc::clone(&extra),
                Arc::clone(w),
            );
            std::thread::spawn(move || {
                let n = w.offsets.len() - 1;
                let mut r = k * 7919 % n.max(1);
                let mut blocks = 0u64;
                while !done.load(Ordering::Relaxed) {
                    let q = &w.local[w.offsets[r]..w.offsets[r + 1]];
                    std::hint::black_box(shared.find_matches(q));
                    blocks += q.len() as u64;
                    r = (r + 1) % n;
                }
                extra.fetch_add(blocks, Ordering::Relaxed);
            })
        })
        .collect();
    let wall = Instant::now();
    let mut t = Timings::new(w.offsets.len());
    let mut result = Ok(());
    for op in &w.ops {
        match op {
            Op::Query(r) => {
                let q = &w.local[w.offsets[*r]..w.offsets[*r + 1]];
                let start = Instant::now();
                let scores = shared.find_matches(q);
                let dt = start.elapsed();
                t.find += dt;
                t.latencies_ns.push(dt.as_nanos() as u64);
                if let Err(e) = verify(&scores, &w.expected[r * workers..(r + 1) * workers], *r) {
                    result = Err(e);
                    break;
                }
            }
            Op::Event(i) => {
                let ev = &w.events[*i];
                let start = Instant::now();
                shared.submit(ev.clone());
                t.apply += start.elapsed();
                t.events += 1;
            }
        }
    }
    let wall = wall.elapsed();
    done.store(true, Ordering::Relaxed);
    for h in handles {
        let _ = h.join();
    }
    result?;
    t.memory = shared.memory();
    t.rss_after_kb = status_kb("VmRSS:");
    t.concurrent_find = Some(extra.load(Ordering::Relaxed) as f64 / wall.as_secs_f64());
    Ok(t)
}

fn percentile(sorted: &[u64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i] as f64 / 1000.0
}

fn main() -> anyhow::Result<()> {
    let args = Arc::new(parse_args()?);
    // Load and simulate on another thread: glibc gives it its own malloc arena, so the memory it
    // frees is not recycled by the index on this thread, and the RSS delta below is the index's.
    let workload = {
        let args = Arc::clone(&args);
        std::thread::spawn(move || -> anyhow::Result<Recorded> {
            let trace = load_trace(&args)?;
            let fleet = Fleet {
                workers: args.workers,
                block_size: args.block_size,
                cache_blocks: args.cache_blocks,
            };
            Ok(Recorded::simulate(&trace, &fleet, args.trace_block_size)?)
        })
        .join()
        .map_err(|_| anyhow::anyhow!("simulation panicked"))??
    };
    let workload = Arc::new(workload);
    let rss_before_kb = status_kb("VmRSS:");
    let mut t = if args.threads > 1 {
        replay_shared(&workload, args.workers, args.threads - 1)?
    } else {
        replay(&workload, args.workers)?
    };
    t.latencies_ns.sort_unstable();
    let queried = workload.local.len() as u64;
    let applied = workload.stored_blocks + workload.removed_blocks;
    let apply_s = t.apply.as_secs_f64();
    let find_s = t.find.as_secs_f64();
    let blocks = t.memory.indexed_blocks.max(1);
    let rss_delta = t.rss_after_kb.saturating_sub(rss_before_kb) * 1024;
    let report = serde_json::json!({
        "events_applied": t.events,
        "blocks_queried": queried,
        "blocks_stored": workload.stored_blocks,
        "blocks_removed": workload.removed_blocks,
        "apply_blocks_per_s": (applied as f64 / apply_s).round(),
        "find_blocks_per_s": (queried as f64 / find_s).round(),
        "block_ops_per_s": ((queried + applied) as f64 / (apply_s + find_s)).round(),
        "find_p50_us": percentile(&t.latencies_ns, 0.50),
        "find_p99_us": percentile(&t.latencies_ns, 0.99),
        "bytes_per_block": (rss_delta as f64 / blocks as f64).round(),
        "accounted_bytes_per_block": (t.memory.table_bytes as f64 / blocks as f64).round(),
        "blocks_indexed": t.memory.indexed_blocks,
        "live_nodes": t.memory.live_nodes,
        "peak_rss_mb": (status_kb("VmHWM:") as f64 / 1024.0).round(),
        "hit_rate": (workload.matched_blocks as f64 / queried.max(1) as f64 * 1e4).round() / 1e4,
        "threads": args.threads,
        "concurrent_find_blocks_per_s": t.concurrent_find.map(f64::round),
    });
    println!(
        "kvroute-indexer trace replay: {} requests, {} workers, block size {}, cache {} blocks/worker",
        workload.offsets.len() - 1,
        args.workers,
        args.block_size,
        args.cache_blocks
    );
    println!("{:<28} {:>16}", "metric", "value");
    if let Some(map) = report.as_object() {
        for (k, v) in map {
            println!("{k:<28} {v:>16}");
        }
    }
    println!("{report}");
    Ok(())
}
