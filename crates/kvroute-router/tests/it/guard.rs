//! The request guard frees every request, whatever happens to it.

use futures::StreamExt;
use proptest::prelude::*;

use kvroute_router::{KvResponse, Policy};

use crate::support::{Behaviour, Fleet, eventually, idle, request, run};

/// What happens to one request.
#[derive(Debug, Clone, Copy)]
enum Fate {
    /// Read to the end.
    Complete,
    /// The engine sends an error item.
    WorkerError,
    /// The client reads one item, then drops the stream.
    ClientDrop,
    /// The client drops the stream before reading anything.
    Cancel,
    /// The client kills the request on the worker, then reads what is left.
    Kill,
    /// The request stalls and its worker dies under it.
    WorkerDeath,
}

fn fate() -> impl Strategy<Value = Fate> {
    prop_oneof![
        Just(Fate::Complete),
        Just(Fate::WorkerError),
        Just(Fate::ClientDrop),
        Just(Fate::Cancel),
        Just(Fate::Kill),
        Just(Fate::WorkerDeath),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]

    #[test]
    fn guard_frees_everything(fates in proptest::collection::vec((fate(), 0u32..4, 4u32..24), 1..10)) {
        run(async move {
            let mut fleet = Fleet::start(3).await;
            let router = fleet.router(Policy::Kv).await;
            let mut stalled = Vec::new();
            let mut tasks = Vec::new();
            for (i, &(fate, seed, len)) in fates.iter().enumerate() {
                let tokens: Vec<u32> = (0..len).map(|t| seed * 100 + t).collect();
                let behaviour = match fate {
                    Fate::WorkerError => Behaviour::Error,
                    Fate::Complete => Behaviour::Complete,
                    _ => Behaviour::Stall,
                };
                let Ok(KvResponse::Stream(mut stream)) = router.generate(request(tokens, behaviour)).await else {
                    continue; // Its worker already died: nothing was recorded.
                };
                match fate {
                    Fate::Complete | Fate::WorkerError => {
                        tasks.push(tokio::spawn(async move { while stream.next().await.is_some() {} }));
                    }
                    Fate::ClientDrop => {
                        let _ = stream.next().await;
                        drop(stream);
                    }
                    Fate::Cancel => drop(stream),
                    Fate::Kill => {
                        stream.runtime_stream().stream_mut().kill();
                        while stream.next().await.is_some() {}
                    }
                    Fate::WorkerDeath => {
                        let _ = stream.next().await;
                        let worker = stream.worker().worker_id;
                        stalled.push(tokio::spawn(async move { while stream.next().await.is_some() {} }));
                        if i % 2 == 0
                            && let Some(w) = fleet.workers.iter_mut().find(|w| w.id == worker)
                        {
                            w.kill();
                        }
                    }
                }
            }
            // Workers still alive would stall forever: kill them all so every stream ends.
            for w in &mut fleet.workers {
                w.kill();
            }
            for t in tasks.into_iter().chain(stalled) {
                t.await.unwrap();
            }
            eventually("every request was freed", || idle(&router)).await;
            router.with_core(|c| assert_eq!(c.active_requests(), 0));
        });
    }
}

#[test]
fn load_is_tracked_while_in_flight_and_freed_after() {
    run(async {
        let fleet = Fleet::start(2).await;
        let router = fleet.router(Policy::RoundRobin).await;
        let mut streams = Vec::new();
        for seed in 0..4u32 {
            let tokens: Vec<u32> = (0..16).map(|t| seed * 100 + t).collect();
            let Ok(KvResponse::Stream(s)) =
                router.generate(request(tokens, Behaviour::Stall)).await
            else {
                panic!("expected a stream");
            };
            streams.push(s);
        }
        let per_worker: Vec<u64> = router.with_core(|c| {
            c.workers()
                .map(|w| c.worker_load(w).unwrap().active_requests)
                .collect()
        });
        assert_eq!(per_worker, vec![2, 2]);
        // The first token marks the prefill complete.
        let _ = streams[0].next().await;
        let w = streams[0].worker();
        let prefill = router.with_core(|c| c.worker_load(w).unwrap().prefill_tokens);
        assert_eq!(prefill, 16);
        drop(streams);
        assert!(idle(&router));
    });
}
