//! kvroute's indexer against the reference's, side by side, on one recorded stream.
//!
//! `cargo xtask bench indexer-compare (--trace FILE [--trace-block-size 512] | --workload
//! agentic|multi-turn [--seed N]) [--workers 8] [--block-size 16] [--cache-blocks 16384]
//! [--limit N] [--repeats 1] [--ref-threads 4] [--kv-shards CORES] [--only kv,ref-tree,...] [--no-hash]
//! [--readers 1,2]`
//!
//! Prints the workload, one line per run, then a Markdown table (each indexer's best figures and
//! the ratio of kvroute's best to the reference's best, above 1 meaning kvroute is better), then
//! the reader-scaling table (queries per second from 1, 2, ... threads sharing each index that
//! can be shared, `--readers 0` to skip), and last one JSON object. Exits non-zero if any indexer gives any wrong answer.

use anyhow::{Context, bail};
use kvroute_indexer_compare::alloc::CountingAlloc;
use kvroute_indexer_compare::drivers::{Kind, same_hashes};
use kvroute_indexer_compare::run::{Settings, compare, reader_scaling, scaling_table, table};
use kvroute_indexer_compare::workload::{Fleet, Recorded, Source};
use kvroute_protocols::kv_events::KvCacheEventData;

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

struct Args {
    source: Source,
    fleet: Fleet,
    limit: usize,
    settings: Settings,
}

const USAGE: &str = "expected --trace FILE [--trace-block-size T] or --workload agentic|multi-turn [--seed N], \
     and optionally --workers, --block-size, --cache-blocks, --limit, --repeats, --bulk-passes, --ref-threads, \
     --kv-shards, --kv-writers, --only LIST (kv,kv-concurrent,kv-sharded,ref-tree,ref-pool), --no-hash, --readers LIST (1,2; 0 for none)";

fn parse_args() -> anyhow::Result<Args> {
    let mut trace = None;
    let mut workload = None;
    let mut trace_block = 512usize;
    let mut seed = 1u64;
    let mut fleet = Fleet {
        workers: 8,
        block_size: 16,
        cache_blocks: 16384,
    };
    let mut limit = usize::MAX;
    let mut settings = Settings {
        kinds: Kind::ALL.to_vec(),
        ref_threads: 4,
        // One shard, and writer thread, per core.
        kv_shards: std::thread::available_parallelism().map_or(2, |n| n.get()),
        kv_writers: std::thread::available_parallelism().map_or(2, |n| n.get()),
        repeats: 1,
        bulk_passes: 1,
        hash_phase: true,
        readers: vec![1, 2],
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        match flag.as_str() {
            "--bench" => continue, // Passed by `cargo bench` to every bench binary.
            "-h" | "--help" => {
                println!("indexer-compare: kvroute's indexer against the reference's; {USAGE}");
                std::process::exit(0);
            }
            "--no-hash" => {
                settings.hash_phase = false;
                continue;
            }
            _ => {}
        }
        let value = it.next().with_context(|| format!("{flag} needs a value"))?;
        let num = || {
            value
                .parse::<usize>()
                .with_context(|| format!("{flag} {value}: not a number"))
        };
        match flag.as_str() {
            "--trace" => trace = Some(value.clone()),
            "--trace-block-size" => trace_block = num()?,
            "--workload" => workload = Some(value.clone()),
            "--seed" => seed = num()? as u64,
            "--workers" => fleet.workers = num()?,
            "--block-size" => fleet.block_size = num()?,
            "--cache-blocks" => fleet.cache_blocks = num()?,
            "--limit" => limit = num()?,
            "--repeats" => settings.repeats = num()?.max(1),
            "--bulk-passes" => settings.bulk_passes = num()?.max(1),
            "--ref-threads" => settings.ref_threads = num()?.max(1),
            "--kv-shards" => settings.kv_shards = num()?.clamp(1, kvroute_indexer::MAX_SHARDS),
            "--kv-writers" => settings.kv_writers = num()?.max(1),
            "--readers" => {
                settings.readers = value
                    .split(',')
                    .map(|n| {
                        n.trim()
                            .parse::<usize>()
                            .with_context(|| format!("--readers {value}: expected counts like 1,2"))
                    })
                    .filter(|n| !matches!(n, Ok(0)))
                    .collect::<anyhow::Result<_>>()?;
            }
            "--only" => {
                settings.kinds = value
                    .split(',')
                    .map(|s| match s.trim() {
                        "kv" => Ok(Kind::KvIndex),
                        "kv-concurrent" => Ok(Kind::KvConcurrent),
                        "kv-sharded" => Ok(Kind::KvSharded),
                        "ref-tree" => Ok(Kind::RefRadixTree),
                        "ref-pool" => Ok(Kind::RefThreadPool),
                        other => bail!(
                            "--only {other}: expected kv, kv-concurrent, kv-sharded, ref-tree or ref-pool"
                        ),
                    })
                    .collect::<anyhow::Result<_>>()?;
            }
            _ => bail!("unknown flag {flag}; {USAGE}"),
        }
    }
    let source = match (trace, workload) {
        (Some(path), None) => Source::Trace {
            path,
            block_tokens: trace_block,
        },
        (None, Some(name)) => Source::Synth { name, seed },
        _ => bail!("give exactly one of --trace and --workload; {USAGE}"),
    };
    Ok(Args {
        source,
        fleet,
        limit,
        settings,
    })
}

fn main() -> anyhow::Result<()> {
    let args = parse_args()?;
    // Load and simulate on another thread: glibc gives it its own malloc arena, so what it frees
    // is not recycled into the indexes built on this thread.
    let (source, fleet, limit) = (args.source.clone(), args.fleet.clone(), args.limit);
    let w = std::thread::spawn(move || -> anyhow::Result<Recorded> {
        let requests = source.load(limit)?;
        Ok(Recorded::simulate(
            &requests,
            &fleet,
            source.block_tokens(),
        )?)
    })
    .join()
    .map_err(|_| anyhow::anyhow!("simulation panicked"))??;
    if w.requests() == 0 {
        bail!("the workload has no requests");
    }
    let mut tokens = Vec::new();
    w.tokens(w.requests() - 1, &mut tokens);
    if !same_hashes(&tokens, w.block_size) {
        bail!("kvroute and the reference hash the same prompt differently");
    }
    drop(tokens);

    let queried = w.local.len() as u64;
    let prompts = &w.prompt_tokens;
    let mean = prompts.iter().sum::<usize>() as f64 / prompts.len() as f64;
    let max = prompts.iter().max().copied().unwrap_or(0);
    println!(
        "indexer-compare: {}: {} requests (prompt mean {:.0} / max {} tokens), {} workers, block size {}, cache {} blocks/worker",
        args.source.label(),
        w.requests(),
        mean,
        max,
        w.workers,
        w.block_size,
        args.fleet.cache_blocks
    );
    println!(
        "  {} events: {} blocks stored, {} removed, {} held at the end; {} blocks queried, {:.1}% of them cached on the chosen worker",
        w.events.len(),
        w.stored_blocks,
        w.removed_blocks,
        w.final_blocks,
        queried,
        100.0 * w.matched_blocks as f64 / queried.max(1) as f64
    );
    if args.settings.kinds.contains(&Kind::KvSharded) {
        // How evenly the workers' events split between the sharded index's writer threads: the
        // busiest shard bounds its bulk apply.
        let sharded = kvroute_indexer::ConcurrentIndex::with_shards(args.settings.kv_shards);
        let mut ops = vec![0usize; sharded.shards()];
        for e in &w.events {
            ops[sharded.shard_of(e.worker_id)] += match &e.event.data {
                KvCacheEventData::Stored(s) => s.blocks.len(),
                KvCacheEventData::Removed(r) => r.block_hashes.len(),
                KvCacheEventData::Cleared => 1,
            };
        }
        let total = ops.iter().sum::<usize>().max(1);
        let shares: Vec<String> = ops
            .iter()
            .map(|&n| format!("{:.0}%", 100.0 * n as f64 / total as f64))
            .collect();
        println!(
            "  kv Sharded: {} shards ({} writer threads) take {} of the block operations",
            ops.len(),
            args.settings.kv_writers,
            shares.join(" / ")
        );
    }
    let results = compare(&w, &args.settings)?;
    let (markdown, json) = table(&w, &results);
    println!("every answer of every indexer checked against the model: all correct");
    println!("{markdown}");
    let mut scaling = Vec::new();
    if !args.settings.readers.is_empty() {
        for &kind in &args.settings.kinds {
            if let Some(v) = reader_scaling(&w, kind, &args.settings)? {
                scaling.push((kind, v));
            }
        }
    }
    let scaling_json = if scaling.is_empty() {
        serde_json::Value::Null
    } else {
        let (markdown, json) = scaling_table(&scaling);
        println!(
            "Reader scaling: threads querying one shared index holding the whole stream, every answer checked ({} cores here)",
            std::thread::available_parallelism().map_or(1, |n| n.get())
        );
        println!("{markdown}");
        json
    };
    let report = serde_json::json!({
        "workload": args.source.label(),
        "requests": w.requests(),
        "prompt_mean_tokens": mean.round(),
        "prompt_max_tokens": max,
        "blocks_stored": w.stored_blocks,
        "blocks_removed": w.removed_blocks,
        "blocks_queried": queried,
        "repeats": args.settings.repeats,
        "ref_threads": args.settings.ref_threads,
        "figures": json,
        "reader_scaling": scaling_json,
    });
    println!("{report}");
    Ok(())
}
