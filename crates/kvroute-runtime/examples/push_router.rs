//! Two workers serve an engine over the TCP request plane; a push router spreads requests across
//! whatever in-process discovery lists, streams the responses back, and stops sending to a worker
//! once its lease is revoked.
//!
//! Run with `cargo run -p kvroute-runtime --example push_router`.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use kvroute_runtime::{
    Discovery, Engine, EngineError, InProcessDiscovery, InstanceInfo, PushRouter, PushRouterConfig,
    RequestContext, ResponseStream, RouteMode, WorkerServer, WorkerServerConfig,
};

/// Streams a request's words back one at a time, each tagged with the worker that served it.
struct Words {
    worker: u64,
}

impl Engine for Words {
    type Request = String;
    type Response = (u64, String);

    fn generate(
        &self,
        text: String,
        _context: RequestContext,
    ) -> Result<ResponseStream<(u64, String)>, EngineError> {
        let worker = self.worker;
        let words: Vec<_> = text
            .split_whitespace()
            .map(|w| (worker, w.to_owned()))
            .collect();
        Ok(Box::pin(futures::stream::iter(words)))
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let discovery = InProcessDiscovery::new(Duration::from_secs(10));
    let mut servers = Vec::new();
    let mut leases = Vec::new();
    for worker in [1, 2] {
        let engine = Arc::new(Words { worker });
        let server =
            WorkerServer::bind("127.0.0.1:0", engine, WorkerServerConfig::new(worker)).await?;
        let info = InstanceInfo::new(worker, server.local_addr().to_string(), 16);
        leases.push(discovery.register(info).await?);
        servers.push(server);
    }

    let router: PushRouter<String, (u64, String)> =
        PushRouter::new(discovery.watch(), PushRouterConfig::default());
    let mut served = Vec::new();
    for i in 0..4 {
        let stream = router
            .generate(
                &format!("req-{i}"),
                &"hello from kvroute".to_owned(),
                RouteMode::RoundRobin,
            )
            .await?;
        let worker = stream.worker_id();
        let items: Vec<(u64, String)> = stream.map(|item| item.expect("no error")).collect().await;
        println!("req-{i} -> worker {worker}: {items:?}");
        assert_eq!(items.len(), 3);
        assert!(items.iter().all(|(w, _)| *w == worker));
        served.push(worker);
    }
    served.sort_unstable();
    assert_eq!(served, [1, 1, 2, 2], "round-robin alternates");

    // Worker 1 leaves the fleet: every request now goes to worker 2.
    leases.remove(0).revoke();
    for i in 4..6 {
        let stream = router
            .generate(
                &format!("req-{i}"),
                &"still here".to_owned(),
                RouteMode::RoundRobin,
            )
            .await?;
        println!(
            "req-{i} -> worker {} (worker 1 revoked)",
            stream.worker_id()
        );
        assert_eq!(stream.worker_id(), 2);
    }
    for server in &servers {
        server.abort();
    }
    Ok(())
}
