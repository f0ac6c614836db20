//! Scale-out on NATS: what sharing one fleet between router replicas costs.
//!
//! Against a throwaway `nats-server -js` (on PATH) on loopback, this measures:
//!
//! - fan-out: `--workers` publishers (default 8) each publish `--events` KV `Stored` events
//!   (default 5,000; `--blocks` blocks each, default 4) through `NatsEventPlane` into the
//!   JetStream stream; `--routers` subscribers (default 3) each apply every event to their own
//!   `KvIndex`. Run twice: unpaced (reported: events per second until every router indexed every
//!   event), then paced at `--paced-rate` events/s in all (default 2,000; reported: the time from
//!   an event's publish to the last router having indexed it, p50 and p99);
//! - session visibility: a binding put on one router's `NatsAffinityStore` until another
//!   router's store returns it (`--sessions` samples, default 300; p50, p99);
//! - restart catch-up: a stream holding `--catchup-blocks` blocks (default 1,000,000) of KV
//!   events. A router core reads it all and saves an index snapshot (`NatsSnapshotStore`);
//!   `--tail-events` more events (default 10,000) follow. Then two fresh routers catch up, each
//!   timed until it has applied the last event: one replays the whole stream from its start,
//!   the other loads the snapshot and reads only the events after it (what `kvroute serve
//!   --nats` does); both must end with the same index. Reported: snapshot size and save time,
//!   and both times to caught up.
//!
//! The publishers, the routers and the server share the machine's cores.
//!
//! `cargo xtask bench nats-scaleout` or
//! `cargo bench -p kvroute --bench nats_scaleout -- [--workers N] [--routers R] [--events E]`.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use kvroute_indexer::KvIndex;
use kvroute_nats::testing::NatsServer;
use kvroute_nats::{AffinityBinding, AffinityKind, AffinityStore};
use kvroute_nats::{
    EventStreamConfig, Nats, NatsAffinityStore, NatsAffinityStoreConfig, NatsConfig,
    NatsEventPlane, NatsSnapshotStore,
};
use kvroute_protocols::WorkerWithDpRank;
use kvroute_protocols::kv_events::{
    ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheStoreData,
    KvCacheStoredBlockData, LocalBlockHash, RouterEvent, StorageTier,
};
use kvroute_router::{IndexSnapshot, KvMode, KvRouterCore, RouterConfig, WorkerSpec};
use kvroute_runtime::SnapshotStore;
use kvroute_runtime::{EventPlane, KV_EVENT_SUBJECT, decode_router_event, encode_router_event};
use parking_lot::Mutex;

struct Args {
    workers: u64,
    routers: usize,
    events: u64,
    blocks: u64,
    sessions: usize,
    catchup_blocks: u64,
    tail_events: u64,
    paced_rate: f64,
}

fn args() -> Args {
    let mut a = Args {
        workers: 8,
        routers: 3,
        events: 5_000,
        blocks: 4,
        sessions: 300,
        catchup_blocks: 1_000_000,
        tail_events: 10_000,
        paced_rate: 2_000.0,
    };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < argv.len() {
        let value = || -> u64 {
            argv.get(i + 1)
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("{} expects a number", argv[i]))
        };
        match argv[i].as_str() {
            "--workers" => a.workers = value(),
            "--routers" => a.routers = value() as usize,
            "--events" => a.events = value(),
            "--blocks" => a.blocks = value(),
            "--sessions" => a.sessions = value() as usize,
            "--catchup-blocks" => a.catchup_blocks = value(),
            "--tail-events" => a.tail_events = value(),
            "--paced-rate" => a.paced_rate = value() as f64,
            "--bench" => {
                i += 1;
                continue;
            }
            other => panic!(
                "unknown argument {other}: expected --workers, --routers, --events, --blocks, \
                 --sessions, --catchup-blocks, --tail-events or --paced-rate"
            ),
        }
        i += 2;
    }
    a
}

/// Event `id` of `worker`: `blocks` blocks continuing the worker's previous event's chain.
fn stored(worker: u64, id: u64, blocks: u64) -> RouterEvent {
    let base = id * blocks;
    RouterEvent {
        worker_id: worker,
        storage_tier: StorageTier::Device,
        event: KvCacheEvent {
            event_id: id,
            data: KvCacheEventData::Stored(KvCacheStoreData {
                parent_hash: (id > 0).then(|| ExternalSequenceBlockHash(worker << 40 | (base - 1))),
                blocks: (0..blocks)
                    .map(|b| KvCacheStoredBlockData {
                        block_hash: ExternalSequenceBlockHash(worker << 40 | (base + b)),
                        tokens_hash: LocalBlockHash(base + b),
                    })
                    .collect(),
            }),
            dp_rank: 0,
        },
    }
}

async fn connect(url: &str, name: &str) -> Nats {
    Nats::connect(&NatsConfig::new(url).with_client_name(name))
        .await
        .expect("connect to the bench's nats-server")
}

/// Per (worker, event id): how many routers indexed it, and when the last one did.
type Indexed = HashMap<(u64, u64), (usize, Instant)>;

fn pct(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1e3)
}

async fn fan_out(url: &str, a: &Args, rate: Option<f64>, first_id: u64) {
    let total = a.workers * a.events;
    let published: Arc<Mutex<HashMap<(u64, u64), Instant>>> = Arc::default();
    // Per event: how many routers indexed it, and when the last one did.
    let indexed: Arc<Mutex<Indexed>> = Arc::default();
    let mut routers = Vec::new();
    for r in 0..a.routers {
        let plane = NatsEventPlane::start(
            connect(url, &format!("router-{r}")).await,
            &EventStreamConfig::default(),
        )
        .await
        .unwrap();
        let mut subscription = plane.subscribe(KV_EVENT_SUBJECT).await.unwrap();
        let indexed = indexed.clone();
        let routers_n = a.routers;
        routers.push(tokio::spawn(async move {
            let mut index = KvIndex::new();
            let mut seen = 0u64;
            // A router started now reads the stream from its start: skip earlier runs' events.
            while seen < total {
                let message = subscription.next().await.expect("subscription open");
                let event = decode_router_event(&message.payload).unwrap();
                let _ = index.apply_event(&event);
                if event.event.event_id < first_id {
                    continue;
                }
                seen += 1;
                let now = Instant::now();
                let mut indexed = indexed.lock();
                let entry = indexed
                    .entry((event.worker_id, event.event.event_id))
                    .or_insert((0, now));
                entry.0 += 1;
                if entry.0 == routers_n {
                    entry.1 = now;
                }
            }
            let _ = plane;
            index.block_count(WorkerWithDpRank::from_worker_id(0), StorageTier::Device)
        }));
    }
    let started = Instant::now();
    let mut publishers = Vec::new();
    for w in 0..a.workers {
        let plane = NatsEventPlane::start(
            connect(url, &format!("worker-{w}")).await,
            &EventStreamConfig::default(),
        )
        .await
        .unwrap();
        let published = published.clone();
        let (events, blocks) = (a.events, a.blocks);
        let interval = rate.map(|r| Duration::from_secs_f64(a.workers as f64 / r));
        publishers.push(tokio::spawn(async move {
            let start = Instant::now();
            for id in first_id..first_id + events {
                if let Some(interval) = interval {
                    let due = start + interval * (id - first_id) as u32;
                    tokio::time::sleep_until(due.into()).await;
                }
                let payload = encode_router_event(&stored(w, id, blocks));
                published.lock().insert((w, id), Instant::now());
                plane.publish(KV_EVENT_SUBJECT, payload).await.unwrap();
            }
            assert!(
                plane.settle(Duration::from_secs(60)).await,
                "every event acknowledged"
            );
            plane
        }));
    }
    // Keep every publisher's connection until the routers are done.
    let mut planes = Vec::new();
    for p in publishers {
        planes.push(p.await.unwrap());
    }
    for r in routers {
        r.await.unwrap();
    }
    let elapsed = started.elapsed();
    let published = published.lock();
    let indexed = indexed.lock();
    let mut latencies: Vec<Duration> = indexed
        .iter()
        .filter(|(_, (n, _))| *n == a.routers)
        .filter_map(|(k, (_, at))| published.get(k).map(|p| at.saturating_duration_since(*p)))
        .collect();
    latencies.sort_unstable();
    let pacing = rate.map_or_else(
        || "as fast as they can".to_owned(),
        |r| format!("paced at {r:.0} events/s in all"),
    );
    println!(
        "fan-out ({pacing}): {} workers x {} events ({} blocks each) into {} routers: {:.0} events/s \
         ({:.0} blocks/s) until every router indexed every event; publish -> last router \
         indexed p50 {} p99 {} ({} events)",
        a.workers,
        a.events,
        a.blocks,
        a.routers,
        total as f64 / elapsed.as_secs_f64(),
        (total * a.blocks) as f64 / elapsed.as_secs_f64(),
        ms(pct(&latencies, 50.0)),
        ms(pct(&latencies, 99.0)),
        latencies.len()
    );
}

async fn sessions(url: &str, a: &Args) {
    let writer = NatsAffinityStore::start(
        &connect(url, "router-a").await,
        &NatsAffinityStoreConfig::new(1),
    )
    .await
    .unwrap();
    let reader = NatsAffinityStore::start(
        &connect(url, "router-b").await,
        &NatsAffinityStoreConfig::new(2),
    )
    .await
    .unwrap();
    let now = Duration::from_secs(1);
    let mut latencies = Vec::with_capacity(a.sessions);
    for s in 0..a.sessions {
        let session = format!("bench-{s}");
        let binding = AffinityBinding {
            worker: WorkerWithDpRank::from_worker_id(s as u64 % 8),
            kind: AffinityKind::RouterOnly,
        };
        let put = Instant::now();
        writer
            .put(&session, binding, Duration::from_secs(600), now)
            .unwrap();
        loop {
            if reader.peek(&session, now).is_some() {
                break;
            }
            tokio::time::sleep(Duration::from_micros(100)).await;
        }
        latencies.push(put.elapsed());
    }
    latencies.sort_unstable();
    println!(
        "session binding visible on another router: p50 {} p99 {} ({} bindings, polled every 0.1 ms)",
        ms(pct(&latencies, 50.0)),
        ms(pct(&latencies, 99.0)),
        latencies.len()
    );
}

/// Publishes `count` 16-block events per worker (ids from `first`), and waits for the acks.
async fn publish_history(url: &str, a: &Args, first: u64, count: u64) {
    let config = EventStreamConfig::default();
    let mut publishers = Vec::new();
    for w in 0..a.workers {
        let plane =
            NatsEventPlane::start(connect(url, &format!("catchup-worker-{w}")).await, &config)
                .await
                .unwrap();
        publishers.push(tokio::spawn(async move {
            for id in first..first + count {
                let event = stored(w + 1000, id, 16);
                plane
                    .publish(KV_EVENT_SUBJECT, encode_router_event(&event))
                    .await
                    .unwrap();
            }
            assert!(
                plane.settle(Duration::from_secs(60)).await,
                "every event acknowledged"
            );
        }));
    }
    for p in publishers {
        p.await.unwrap();
    }
}

/// A router core serving every worker the bench publishes for.
fn router_core(a: &Args) -> KvRouterCore {
    let mut core = KvRouterCore::new(RouterConfig::new(16)).unwrap();
    for w in (0..a.workers).chain(1000..1000 + a.workers) {
        core.add_worker(&WorkerSpec::new(w), KvMode::Events)
            .unwrap();
    }
    core
}

/// Applies events from `subscription` to `core` until the one at stream position `last`;
/// returns how many.
async fn apply_until(
    core: &mut KvRouterCore,
    subscription: &mut kvroute_runtime::Subscription,
    last: u64,
) -> u64 {
    let mut applied = 0u64;
    loop {
        let message = subscription.next().await.expect("subscription open");
        core.apply_event(&decode_router_event(&message.payload).unwrap());
        applied += 1;
        if applied.is_multiple_of(250_000) {
            eprintln!("  applied {applied} events");
        }
        if message.sequence == Some(last) {
            return applied;
        }
    }
}

async fn catch_up(url: &str, a: &Args) {
    let blocks_per_event = 16u64;
    let events = a.catchup_blocks.div_ceil(blocks_per_event);
    let per_worker = events.div_ceil(a.workers);
    let config = EventStreamConfig::default();
    publish_history(url, a, 0, per_worker).await;

    // The running router: reads everything, then saves its snapshot.
    let running = NatsEventPlane::start(connect(url, "running-router").await, &config)
        .await
        .unwrap();
    let snapshot_at = running.last_sequence().await.unwrap();
    let mut core = router_core(a);
    let mut subscription = running.subscribe(KV_EVENT_SUBJECT).await.unwrap();
    apply_until(&mut core, &mut subscription, snapshot_at).await;
    let store = NatsSnapshotStore::start(running.nats(), "bench")
        .await
        .unwrap();
    let started = Instant::now();
    // The live router holds its routing lock for the cut only; it reads the blocks after.
    let taken = core.snapshot_cut(snapshot_at);
    let cut = started.elapsed();
    let snapshot = taken.finish();
    let read = started.elapsed() - cut;
    let snapshot_blocks = snapshot.blocks();
    let bytes = bytes::Bytes::from(snapshot.encode());
    let size = bytes.len();
    store.save(bytes).await.unwrap();
    let save = started.elapsed();
    drop(core);

    // More events after the snapshot.
    publish_history(url, a, per_worker, a.tail_events).await;
    let end = running.last_sequence().await.unwrap();

    // A fresh router replaying the whole stream.
    let replayer = NatsEventPlane::start(connect(url, "replaying-router").await, &config)
        .await
        .unwrap();
    let started = Instant::now();
    let mut replayed = router_core(a);
    let mut subscription = replayer.subscribe(KV_EVENT_SUBJECT).await.unwrap();
    let replay_events = apply_until(&mut replayed, &mut subscription, end).await;
    let replay = started.elapsed();

    // A fresh router restoring the snapshot, then reading only what follows it.
    let restarter = NatsEventPlane::start(connect(url, "restarted-router").await, &config)
        .await
        .unwrap();
    let store = NatsSnapshotStore::start(restarter.nats(), "bench")
        .await
        .unwrap();
    let started = Instant::now();
    let mut restored = router_core(a);
    let loaded = store
        .load()
        .await
        .unwrap()
        .expect("the snapshot saved above");
    let snapshot = IndexSnapshot::decode(&loaded).unwrap();
    restored.restore(&snapshot).unwrap();
    let loaded_in = started.elapsed();
    let mut subscription = restarter
        .subscribe_after(KV_EVENT_SUBJECT, snapshot.sequence)
        .await
        .unwrap();
    let tail = apply_until(&mut restored, &mut subscription, end).await;
    let restart = started.elapsed();
    assert!(
        restored.with_index(|a| replayed.with_index(|b| a.same_content(b))),
        "the restored router and the replaying one disagree"
    );
    // The restore keeps the index's layout: about the memory of the index that replayed.
    let (replayed_bytes, restored_bytes) = (
        replayed.shared_index().memory().table_bytes,
        restored.shared_index().memory().table_bytes,
    );
    let blocks: usize = (0..a.workers)
        .map(|w| {
            restored.with_index(|i| {
                i.block_count(
                    WorkerWithDpRank::from_worker_id(w + 1000),
                    StorageTier::Device,
                )
            })
        })
        .sum();
    println!(
        "restart catch-up: index snapshot of {snapshot_blocks} blocks, {:.1} MB: cut in {:.3} ms \
         (the routing lock), blocks read in {:.0} ms (off the lock), cut + read + encoded + \
         saved in {:.2} s",
        size as f64 / 1e6,
        cut.as_secs_f64() * 1e3,
        read.as_secs_f64() * 1e3,
        save.as_secs_f64()
    );
    println!(
        "restart catch-up: replaying the stream from its start, {replay_events} events: \
         caught up in {:.2} s",
        replay.as_secs_f64()
    );
    println!(
        "restart catch-up: from the snapshot ({:.2} s to load and restore) plus {tail} events \
         after it: caught up in {:.2} s ({blocks} catch-up blocks, same index as the replay)",
        loaded_in.as_secs_f64(),
        restart.as_secs_f64()
    );
    println!(
        "restart catch-up: index tables {:.1} MB replayed, {:.1} MB restored from the snapshot",
        replayed_bytes as f64 / 1e6,
        restored_bytes as f64 / 1e6
    );
}

fn main() {
    let a = args();
    let server = NatsServer::start();
    let url = server.url();
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(async {
            eprintln!("nats-scaleout: fan-out, unpaced (throughput) ...");
            fan_out(&url, &a, None, 0).await;
            eprintln!("nats-scaleout: fan-out, paced (latency) ...");
            fan_out(&url, &a, Some(a.paced_rate), a.events).await;
            eprintln!("nats-scaleout: session visibility ...");
            sessions(&url, &a).await;
            eprintln!("nats-scaleout: restart catch-up ...");
            catch_up(&url, &a).await;
        });
}
