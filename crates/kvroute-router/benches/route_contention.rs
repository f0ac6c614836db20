//! Routing under load: threads routing long prompts through one core behind a mutex (as
//! `KvPushRouter` does) while an event thread applies long chains, in two ways.
//!
//! - `locked`: everything under the lock, as before the router shared its index: `route`
//!   (hashing, matching, deciding) and `apply_event`.
//! - `prepared`: the lock covers decisions only: `RoutePreparer::prepare` hashes and matches
//!   before it, `route_prepared` decides under it; `queue_event` orders an event under it and
//!   `apply_queued` writes it after.
//!
//! Each route is followed by `on_finished` under the same lock hold, so the fleet's load stays
//! flat; the run checks that it drains to zero. Prints routes per second over all threads, route
//! latency (from the start of the route, preparation included, to the decision) and events per
//! second, for each way, in alternating trials.
//!
//! Events come at a paced `--event-rate` (half of them stores of a whole prompt's chain), so that
//! the cores are not all busy and what the routes wait for is the lock.
//!
//! `cargo bench -p kvroute-router --bench route_contention -- [--seconds S] [--trials N]
//! [--routers R] [--prompt-tokens T] [--event-rate E]`

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kvroute_indexer::hash::{HashSalt, compute_block_hashes};
use kvroute_protocols::kv_events::{
    ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheRemoveData, KvCacheStoreData,
    KvCacheStoredBlockData, RouterEvent, StorageTier,
};
use kvroute_router::{
    KvMode, KvRouterCore, Policy, RequestId, RouteRequest, RouterConfig, WorkerSpec,
};
use parking_lot::Mutex;
use rand::SeedableRng;
use rand::rngs::StdRng;

const WORKERS: u64 = 8;
const BLOCK: u32 = 16;
/// Chains each worker keeps; the oldest is evicted when a new one is stored.
const KEPT: usize = 4;

struct Args {
    seconds: f64,
    trials: usize,
    routers: usize,
    prompt_tokens: u32,
    event_rate: f64,
}

fn parse() -> Args {
    let mut a = Args {
        seconds: 2.0,
        trials: 3,
        routers: 2,
        prompt_tokens: 32_768,
        event_rate: 400.0,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value =
            |name: &str| -> String { it.next().unwrap_or_else(|| panic!("{name} needs a value")) };
        match flag.as_str() {
            "--bench" => {}
            "--seconds" => a.seconds = value("--seconds").parse().expect("--seconds: a number"),
            "--trials" => a.trials = value("--trials").parse().expect("--trials: a count"),
            "--routers" => a.routers = value("--routers").parse().expect("--routers: a count"),
            "--event-rate" => {
                a.event_rate = value("--event-rate")
                    .parse()
                    .expect("--event-rate: events per second");
            }
            "--prompt-tokens" => {
                a.prompt_tokens = value("--prompt-tokens")
                    .parse()
                    .expect("--prompt-tokens: a count");
            }
            other => panic!(
                "unknown flag {other}; expected --seconds S, --trials N, --routers R, --prompt-tokens T, --event-rate E"
            ),
        }
    }
    a
}

/// Prompt `family`'s `n` tokens: families share nothing.
fn prompt(family: u64, n: u32) -> Vec<u32> {
    (0..n).map(|i| (family as u32) * 1_000_003 + i).collect()
}

/// The event thread's `k`-th event of `worker`: store a chain of family `k`'s prompt (even
/// `k`), or evict the chain stored `KEPT` stores ago (odd `k`).
fn event(worker: u64, k: u64, tokens: u32) -> RouterEvent {
    let store = k / 2;
    let data = if k.is_multiple_of(2) {
        let local = compute_block_hashes(
            &prompt(store % 16, tokens),
            BLOCK as usize,
            &HashSalt::default(),
        );
        KvCacheEventData::Stored(KvCacheStoreData {
            parent_hash: None,
            blocks: local
                .iter()
                .enumerate()
                .map(|(i, &h)| KvCacheStoredBlockData {
                    block_hash: ExternalSequenceBlockHash(store << 20 | i as u64),
                    tokens_hash: h,
                })
                .collect(),
        })
    } else {
        let gone = store.saturating_sub(KEPT as u64);
        let blocks = if store >= KEPT as u64 {
            (0..u64::from(tokens / BLOCK))
                .rev()
                .map(|i| ExternalSequenceBlockHash(gone << 20 | i))
                .collect()
        } else {
            Vec::new()
        };
        KvCacheEventData::Removed(KvCacheRemoveData {
            block_hashes: blocks,
        })
    };
    RouterEvent {
        worker_id: worker,
        storage_tier: StorageTier::Device,
        event: KvCacheEvent {
            event_id: k,
            dp_rank: 0,
            data,
        },
    }
}

struct Trial {
    routes: u64,
    events: u64,
    latencies: Vec<u64>,
    elapsed: Duration,
}

fn trial(a: &Args, prepared: bool) -> Trial {
    let mut core = KvRouterCore::new(RouterConfig::new(BLOCK).with_policy(Policy::Kv))
        .expect("the default configuration validates");
    for w in 0..WORKERS {
        core.add_worker(&WorkerSpec::new(w), KvMode::Events)
            .expect("a fresh worker id");
    }
    let preparer = core.preparer();
    let index = Arc::clone(core.shared_index());
    let core = Arc::new(Mutex::new((core, StdRng::seed_from_u64(7))));
    let stop = Arc::new(AtomicBool::new(false));
    let next_id = Arc::new(AtomicU64::new(0));
    let events = std::thread::scope(|s| {
        let feeder = {
            let (core, stop, index) = (Arc::clone(&core), Arc::clone(&stop), Arc::clone(&index));
            let (tokens, rate) = (a.prompt_tokens, a.event_rate);
            s.spawn(move || {
                let mut n = 0u64;
                let start = Instant::now();
                while !stop.load(Ordering::Relaxed) {
                    // Paced: the machine has room for the routers, so what is measured is
                    // waiting for the lock, not for a core.
                    let due = Duration::from_secs_f64(n as f64 / rate);
                    if let Some(wait) = due.checked_sub(start.elapsed()) {
                        std::thread::sleep(wait);
                    }
                    let (worker, k) = (n % WORKERS, n / WORKERS);
                    let ev = event(worker, k, tokens);
                    if prepared {
                        core.lock().0.queue_event(ev);
                        index.apply_queued();
                    } else {
                        core.lock().0.apply_event(&ev);
                    }
                    n += 1;
                }
                n
            })
        };
        let start = Instant::now();
        let routers: Vec<_> = (0..a.routers)
            .map(|r| {
                let (core, preparer, next_id) =
                    (Arc::clone(&core), preparer.clone(), Arc::clone(&next_id));
                let (seconds, tokens) = (a.seconds, a.prompt_tokens);
                s.spawn(move || {
                    let mut latencies = Vec::new();
                    let mut family = r as u64;
                    while start.elapsed().as_secs_f64() < seconds {
                        let p = prompt(family % 16, tokens);
                        family += 1;
                        let id = RequestId(next_id.fetch_add(1, Ordering::Relaxed));
                        let req = RouteRequest::new(id, &p);
                        let t = Instant::now();
                        let ready = prepared.then(|| preparer.prepare(&req));
                        let mut guard = core.lock();
                        let (core, rng) = &mut *guard;
                        let routed = match ready {
                            Some(ready) => core.route_prepared(&req, ready, Duration::ZERO, rng),
                            None => core.route(&req, Duration::ZERO, rng),
                        };
                        latencies.push(t.elapsed().as_nanos() as u64);
                        routed.expect("every worker is live");
                        core.on_finished(id);
                    }
                    latencies
                })
            })
            .collect();
        let latencies: Vec<u64> = routers
            .into_iter()
            .flat_map(|h| h.join().expect("a router thread panicked"))
            .collect();
        let elapsed = start.elapsed();
        stop.store(true, Ordering::Relaxed);
        let events = feeder.join().expect("the event thread panicked");
        (latencies, events, elapsed)
    });
    let (mut latencies, events, elapsed) = events;
    let guard = core.lock();
    assert_eq!(guard.0.scheduler().active_requests(), 0, "load left behind");
    latencies.sort_unstable();
    Trial {
        routes: latencies.len() as u64,
        events,
        latencies,
        elapsed,
    }
}

fn pct(sorted: &[u64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i] as f64 / 1e3
}

fn main() {
    let a = parse();
    println!(
        "route contention: {} router threads, {}-token prompts, {WORKERS} workers, {} events/s \
         storing and evicting {}-block chains; {} trials of {} s per way",
        a.routers,
        a.prompt_tokens,
        a.event_rate,
        a.prompt_tokens / BLOCK,
        a.trials,
        a.seconds
    );
    let mut results: [Vec<(f64, f64, f64, f64)>; 2] = [Vec::new(), Vec::new()];
    for t in 0..a.trials {
        for (way, prepared) in [(0, false), (1, true)] {
            let r = trial(&a, prepared);
            let secs = r.elapsed.as_secs_f64();
            let row = (
                r.routes as f64 / secs,
                pct(&r.latencies, 0.5),
                pct(&r.latencies, 0.99),
                r.events as f64 / secs,
            );
            println!(
                "  trial {}: {:>8}: {:>8.0} routes/s, p50 {:>7.1} us, p99 {:>8.1} us, {:>6.0} events/s",
                t + 1,
                if prepared { "prepared" } else { "locked" },
                row.0,
                row.1,
                row.2,
                row.3
            );
            results[way].push(row);
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    println!("| way | routes/s | route p50 (us) | route p99 (us) | events/s |");
    println!("| --- | ---: | ---: | ---: | ---: |");
    for (way, name) in [(0, "locked (before)"), (1, "prepared (now)")] {
        let rows = &results[way];
        let col = |f: fn(&(f64, f64, f64, f64)) -> f64| median(&mut rows.iter().map(f).collect());
        println!(
            "| {name} | {:.0} | {:.1} | {:.1} | {:.0} |",
            col(|r| r.0),
            col(|r| r.1),
            col(|r| r.2),
            col(|r| r.3)
        );
    }
}
