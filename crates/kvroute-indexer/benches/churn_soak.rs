//! Churn soak: tens of millions of events over a bounded live set; the footprint at the end must
//! equal the footprint at steady state.
//!
//! `cargo bench -p kvroute-indexer --bench churn_soak -- [--events 20000000] [--workers 8]
//! [--live-chains 1024]`
//!
//! Each worker holds 16 shared system-prompt prefixes of 4 blocks for good and a rolling window of
//! `--live-chains` request chains of 12 blocks continuing one of them; every new chain evicts the
//! oldest, leaves first, as an engine would. The last line printed is one JSON object.

use std::collections::VecDeque;
use std::time::Instant;

use anyhow::{Context, bail};
use kvroute_indexer::KvIndex;
use kvroute_protocols::kv_events::{
    ExternalSequenceBlockHash as Ext, KvCacheEvent, KvCacheEventData, KvCacheRemoveData,
    KvCacheStoreData, KvCacheStoredBlockData, LocalBlockHash, RouterEvent, StorageTier,
};

const PREFIXES: u64 = 16;
const PREFIX_BLOCKS: u64 = 4;
const CHAIN_BLOCKS: u64 = 12;

fn status_kb(field: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

fn event(worker: u64, event_id: u64, data: KvCacheEventData) -> RouterEvent {
    RouterEvent {
        worker_id: worker,
        storage_tier: StorageTier::Device,
        event: KvCacheEvent {
            event_id,
            data,
            dp_rank: 0,
        },
    }
}

fn main() -> anyhow::Result<()> {
    let (mut events, mut workers, mut live) = (20_000_000u64, 8u64, 1024u64);
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--bench" {
            continue;
        }
        let v: u64 = it
            .next()
            .with_context(|| format!("{flag} needs a value"))?
            .parse()
            .with_context(|| format!("{flag}: not a number"))?;
        match flag.as_str() {
            "--events" => events = v,
            "--workers" => workers = v.max(1),
            "--live-chains" => live = v.max(1),
            _ => bail!("unknown flag {flag}; expected --events, --workers or --live-chains"),
        }
    }
    let mut index = KvIndex::new();
    let mut ids = vec![0u64; workers as usize];
    let mut apply = |index: &mut KvIndex, w: u64, data: KvCacheEventData| -> anyhow::Result<()> {
        let id = ids[w as usize];
        ids[w as usize] += 1;
        let out = index.apply_event(&event(w, id, data));
        if out.gap.is_some() || out.result.is_err() {
            bail!("event {id} of worker {w} failed: {out:?}");
        }
        Ok(())
    };
    // Permanent prefixes: ext id = prefix * 1000 + block.
    for w in 0..workers {
        for p in 0..PREFIXES {
            let blocks = (0..PREFIX_BLOCKS)
                .map(|b| KvCacheStoredBlockData {
                    block_hash: Ext(p * 1000 + b + 1),
                    tokens_hash: LocalBlockHash(p * 1000 + b + 1),
                })
                .collect();
            let data = KvCacheStoreData {
                parent_hash: None,
                blocks,
            };
            apply(&mut index, w, KvCacheEventData::Stored(data))?;
        }
    }
    let mut windows: Vec<VecDeque<u64>> = vec![VecDeque::new(); workers as usize];
    let warmup = 2 * live * workers;
    let mut steady = None;
    let (mut applied, mut block_ops, mut chain) = (0u64, 0u64, 1u64 << 20);
    let start = Instant::now();
    let mut steady_at = start;
    while applied < events {
        let w = chain % workers;
        chain += 1;
        let p = chain % PREFIXES;
        // Chains repeat content every 50,000 so nodes are shared across workers and time.
        let content = chain % 50_000;
        let blocks = (0..CHAIN_BLOCKS)
            .map(|b| KvCacheStoredBlockData {
                block_hash: Ext(chain * 64 + b),
                tokens_hash: LocalBlockHash(content * 64 + b + (1 << 40)),
            })
            .collect();
        let data = KvCacheStoreData {
            parent_hash: Some(Ext(p * 1000 + PREFIX_BLOCKS)),
            blocks,
        };
        apply(&mut index, w, KvCacheEventData::Stored(data))?;
        applied += 1;
        block_ops += CHAIN_BLOCKS;
        let window = &mut windows[w as usize];
        window.push_back(chain);
        if window.len() as u64 > live {
            let old = window.pop_front().unwrap_or_default();
            let data = KvCacheRemoveData {
                block_hashes: (0..CHAIN_BLOCKS).rev().map(|b| Ext(old * 64 + b)).collect(),
            };
            apply(&mut index, w, KvCacheEventData::Removed(data))?;
            applied += 1;
            block_ops += CHAIN_BLOCKS;
        }
        if steady.is_none() && chain - (1 << 20) == warmup {
            steady = Some((index.memory(), status_kb("VmRSS:")));
            steady_at = Instant::now();
        }
    }
    let elapsed = start.elapsed().as_secs_f64();
    let end = (index.memory(), status_kb("VmRSS:"));
    let (steady_mem, steady_rss) = steady.context("run too short to reach steady state")?;
    if let Err(e) = index.check_consistency() {
        bail!("index inconsistent after soak: {e}");
    }
    let expect_blocks = workers * (PREFIXES * PREFIX_BLOCKS + live * CHAIN_BLOCKS);
    if end.0.indexed_blocks as u64 != expect_blocks {
        bail!(
            "{} blocks indexed, expected {expect_blocks}",
            end.0.indexed_blocks
        );
    }
    let report = serde_json::json!({
        "events_applied": applied,
        "block_ops": block_ops,
        "block_ops_per_s": (block_ops as f64 / elapsed).round(),
        "seconds_after_steady": (steady_at.elapsed().as_secs_f64() * 10.0).round() / 10.0,
        "live_blocks": end.0.indexed_blocks,
        "steady_live_nodes": steady_mem.live_nodes,
        "end_live_nodes": end.0.live_nodes,
        "steady_table_bytes": steady_mem.table_bytes,
        "end_table_bytes": end.0.table_bytes,
        "steady_rss_kb": steady_rss,
        "end_rss_kb": end.1,
        "footprint_equal": steady_mem.table_bytes == end.0.table_bytes,
    });
    println!("kvroute-indexer churn soak: {workers} workers, {live} live chains each");
    if let Some(map) = report.as_object() {
        for (k, v) in map {
            println!("{k:<24} {v:>16}");
        }
    }
    println!("{report}");
    if steady_mem.table_bytes != end.0.table_bytes || steady_mem.live_nodes != end.0.live_nodes {
        bail!("footprint changed between steady state and end");
    }
    Ok(())
}
