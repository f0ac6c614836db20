//! The in-memory store shared by several router threads.

use std::sync::Arc;
use std::time::Duration;

use kvroute_protocols::WorkerWithDpRank;
use kvroute_sessions::{AffinityBinding, AffinityKind, AffinityStore, InMemoryAffinityStore};

const THREADS: u64 = 4;
const PER_THREAD: u64 = 2000;

fn binding(worker: u64) -> AffinityBinding {
    AffinityBinding {
        worker: WorkerWithDpRank::new(worker, 0),
        kind: AffinityKind::RouterOnly,
    }
}

#[test]
fn concurrent_get_and_put_keep_every_thread_s_bindings() {
    let store = Arc::new(InMemoryAffinityStore::new(100_000));
    let handles: Vec<_> = (0..THREADS)
        .map(|t| {
            let store = Arc::clone(&store);
            std::thread::spawn(move || {
                for i in 0..PER_THREAD {
                    let own = format!("t{t}-{i}");
                    store
                        .put(&own, binding(t), Duration::from_secs(60), Duration::ZERO)
                        .expect("room");
                    // Read our own binding and a neighbour's shared session.
                    assert_eq!(
                        store.get(&own, Duration::from_secs(1)).map(|tk| tk.binding),
                        Some(binding(t))
                    );
                    let shared = format!("shared-{}", i % 16);
                    store
                        .put(&shared, binding(t), Duration::from_secs(60), Duration::ZERO)
                        .expect("room");
                    assert!(store.peek(&shared, Duration::from_secs(1)).is_some());
                    if i % 3 == 0 {
                        assert_eq!(store.remove(&own).map(|b| b.worker.worker_id), Some(t));
                    }
                }
            })
        })
        .collect();
    for h in handles {
        h.join().expect("no thread panicked");
    }
    let kept_per_thread = PER_THREAD - PER_THREAD.div_ceil(3);
    assert_eq!(store.len() as u64, THREADS * kept_per_thread + 16);
    // Own bindings were refreshed at t=1, so they live until 61; the shared ones until 60.
    assert_eq!(store.expire(Duration::from_secs(60)).len(), 16);
    assert_eq!(
        store.expire(Duration::from_secs(61)).len() as u64,
        THREADS * kept_per_thread
    );
    assert_eq!(store.len(), 0);
}

#[test]
fn the_bound_holds_under_contention() {
    let max = 500;
    let store = Arc::new(InMemoryAffinityStore::new(max));
    let handles: Vec<_> = (0..THREADS)
        .map(|t| {
            let store = Arc::clone(&store);
            std::thread::spawn(move || {
                (0..400u64)
                    .filter(|i| {
                        store
                            .put(
                                &format!("t{t}-{i}"),
                                binding(t),
                                Duration::from_secs(60),
                                Duration::ZERO,
                            )
                            .is_ok()
                    })
                    .count()
            })
        })
        .collect();
    let accepted: usize = handles
        .into_iter()
        .map(|h| h.join().expect("no panic"))
        .sum();
    assert_eq!(accepted, max, "exactly max_sessions puts succeed");
    assert_eq!(store.len(), max);
}
