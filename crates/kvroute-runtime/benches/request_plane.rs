//! Request-plane round trips over loopback, on one connection.
//!
//! Each round trip is one small LLM stream: a `PreprocessedRequest` of 32 prompt tokens goes out,
//! one `Annotated<LLMEngineOutput>` item and the end-of-stream frame come back. Two figures:
//!
//! - throughput: many streams in flight on one connection (default 256), streams completed per
//!   second, with the p50/p99 latency each stream saw under that load;
//! - latency: one stream at a time, p50/p99 of the round trip.
//!
//! A stream is counted only once its last frame arrived and it ended. Run with
//! `cargo bench -p kvroute-runtime --bench request_plane -- [--seconds N] [--in-flight N]`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use kvroute_protocols::{
    Annotated, LLMEngineOutput, PreprocessedRequest, PreprocessedRequestBuilder,
};
use kvroute_runtime::{
    ClientConfig, Engine, EngineError, LlmClient, LlmResponse, RequestContext, ResponseStream,
    WorkerServer, WorkerServerConfig,
};

/// Answers every request with one final token.
struct Echo;

impl Engine for Echo {
    type Request = PreprocessedRequest;
    type Response = LlmResponse;

    fn generate(
        &self,
        request: PreprocessedRequest,
        _context: RequestContext,
    ) -> Result<ResponseStream<LlmResponse>, EngineError> {
        let mut output = LLMEngineOutput::stop();
        output.token_ids = vec![request.token_ids.len() as u32];
        Ok(Box::pin(futures::stream::iter([Annotated::from_data(
            output,
        )])))
    }
}

struct Args {
    seconds: f64,
    in_flight: usize,
}

fn args() -> Args {
    let mut args = Args {
        seconds: 3.0,
        in_flight: 256,
    };
    let argv: Vec<String> = std::env::args().collect();
    for pair in argv.windows(2) {
        match pair[0].as_str() {
            "--seconds" => args.seconds = pair[1].parse().unwrap_or(args.seconds),
            "--in-flight" => args.in_flight = pair[1].parse().unwrap_or(args.in_flight),
            _ => {}
        }
    }
    args
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

async fn round_trip(client: &LlmClient, request: &PreprocessedRequest) -> Duration {
    let start = Instant::now();
    let mut stream = client.generate("bench", request).await.expect("send");
    let mut items = 0;
    while let Some(item) = stream.next().await {
        item.expect("item");
        items += 1;
    }
    assert_eq!(items, 1);
    start.elapsed()
}

async fn run(args: Args) {
    let server = WorkerServer::bind("127.0.0.1:0", Arc::new(Echo), WorkerServerConfig::new(1))
        .await
        .expect("bind");
    let client = LlmClient::connect(&server.local_addr().to_string(), ClientConfig::default())
        .await
        .expect("connect");
    let request = PreprocessedRequestBuilder::default()
        .model("bench")
        .token_ids((0..32).collect::<Vec<u32>>())
        .build()
        .expect("request");
    let window = Duration::from_secs_f64(args.seconds);

    // Warm up the connection and the allocator.
    for _ in 0..1000 {
        round_trip(&client, &request).await;
    }

    let start = Instant::now();
    let tasks: Vec<_> = (0..args.in_flight)
        .map(|_| {
            let client = client.clone();
            let request = request.clone();
            tokio::spawn(async move {
                let mut latencies = Vec::new();
                while start.elapsed() < window {
                    latencies.push(round_trip(&client, &request).await);
                }
                latencies
            })
        })
        .collect();
    let mut latencies = Vec::new();
    for task in tasks {
        latencies.extend(task.await.expect("bench task"));
    }
    let elapsed = start.elapsed();
    latencies.sort();
    println!(
        "request_plane/throughput in_flight={} streams={} elapsed={:.2}s rate={:.0} streams/s p50={:?} p99={:?}",
        args.in_flight,
        latencies.len(),
        elapsed.as_secs_f64(),
        latencies.len() as f64 / elapsed.as_secs_f64(),
        percentile(&latencies, 0.50),
        percentile(&latencies, 0.99),
    );

    let start = Instant::now();
    let mut latencies = Vec::new();
    while start.elapsed() < window {
        latencies.push(round_trip(&client, &request).await);
    }
    latencies.sort();
    println!(
        "request_plane/latency in_flight=1 streams={} rate={:.0} streams/s p50={:?} p99={:?}",
        latencies.len(),
        latencies.len() as f64 / start.elapsed().as_secs_f64(),
        percentile(&latencies, 0.50),
        percentile(&latencies, 0.99),
    );
}

fn main() {
    let args = args();
    // Two worker threads: the machine has two cores, shared by client and server.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(run(args));
}
