//! The router's synchronous core on its own: requests go where their prompt's KV cache is
//! predicted to live unless that worker is busier, and every request's load is freed when it
//! ends. Virtual time and a seeded RNG make the run reproducible.
//!
//! Run with `cargo run -p kvroute-router --example kv_routing`.

use std::time::Duration;

use kvroute_router::{
    KvMode, KvRouterCore, Policy, RequestId, RouteRequest, RouterConfig, WorkerSpec,
};
use rand::SeedableRng;
use rand::rngs::StdRng;

const BLOCK_SIZE: u32 = 4;

fn main() -> Result<(), kvroute_router::RouteError> {
    let mut core = KvRouterCore::new(RouterConfig::new(BLOCK_SIZE).with_policy(Policy::Kv))
        .expect("valid config");
    // These workers publish no KV events: the router predicts their caches from its own
    // decisions (with a TTL). Workers that do publish them use `KvMode::Events`.
    for id in [1, 2] {
        core.add_worker(&WorkerSpec::new(id), KvMode::Approximate)
            .expect("new worker");
    }
    let mut rng = StdRng::seed_from_u64(7);
    let now = Duration::ZERO;
    let prompt_a: Vec<u32> = (0..16).collect();
    let prompt_b: Vec<u32> = (100..116).collect();

    // Two different prompts while the first is still running: the second avoids the busy worker.
    let first = core.route(&RouteRequest::new(RequestId(1), &prompt_a), now, &mut rng)?;
    let second = core.route(&RouteRequest::new(RequestId(2), &prompt_b), now, &mut rng)?;
    println!(
        "request 1 -> {} (cost {:.1})",
        first.worker, first.cost.cost
    );
    println!(
        "request 2 -> {} (cost {:.1}, request 1 holds the other worker)",
        second.worker, second.cost.cost
    );
    assert_ne!(first.worker, second.worker);

    // Both finish: the engine reported the first token and 8 output tokens, then the end.
    for id in [RequestId(1), RequestId(2)] {
        core.on_first_token(id).expect("active");
        core.on_output_tokens(id, 8).expect("active");
        assert!(
            core.on_finished(id).is_empty(),
            "no session commands to run"
        );
    }
    assert_eq!(core.active_requests(), 0);

    // Prompt A again: its 4 blocks are predicted cached where request 1 ran.
    let again = core.route(&RouteRequest::new(RequestId(3), &prompt_a), now, &mut rng)?;
    println!(
        "request 3 (prompt A again) -> {} with {} of {} blocks cached",
        again.worker, again.overlap_blocks, again.prompt_blocks
    );
    assert_eq!((again.worker, again.overlap_blocks), (first.worker, 4));
    core.on_finished(RequestId(3));
    assert_eq!(core.active_requests(), 0);
    Ok(())
}
