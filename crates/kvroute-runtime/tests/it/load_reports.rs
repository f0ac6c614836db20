//! Load reports: what a worker's [`LoadReporter`] sends, over the request plane and through the
//! bridge onto an event plane.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use kvroute_protocols::WorkerLoadReport;
use kvroute_runtime::{
    EventPlane, InProcessEventPlane, InstanceInfo, InstanceSet, KV_EVENTS_METADATA, KvEventBridge,
    KvEventBridgeConfig, LOAD_REPORT_SUBJECT, LOAD_REPORTS_METADATA, LoadReporter, RequestError,
    WorkerServerConfig,
};
use tokio::sync::watch;

use crate::support::{bounded, connect, eventually, start_worker_with};

#[tokio::test(start_paused = true)]
async fn a_subscriber_gets_every_rank_then_changes_then_heartbeats() {
    let reporter = LoadReporter::new(7, Duration::from_secs(1));
    let mut feed = Box::pin(reporter.subscribe());
    // Nothing to say before the first report.
    let early = tokio::time::timeout(Duration::from_secs(3), feed.next()).await;
    assert!(early.is_err(), "no report yet, got {early:?}");

    let rank0 = WorkerLoadReport::new(7).with_requests(2, 1);
    let rank1 = WorkerLoadReport::new(7)
        .with_dp_rank(1)
        .with_kv_used_blocks(40);
    reporter.report(rank0).unwrap();
    reporter.report(rank1).unwrap();
    let start = tokio::time::Instant::now();
    assert_eq!(feed.next().await, Some(rank0));
    assert_eq!(feed.next().await, Some(rank1));
    assert_eq!(start.elapsed(), Duration::ZERO, "a change goes out at once");

    // The same report again is no change: the next sending is the heartbeat, a second later.
    reporter.report(rank0).unwrap();
    assert_eq!(feed.next().await, Some(rank0));
    assert_eq!(feed.next().await, Some(rank1));
    assert_eq!(start.elapsed(), Duration::from_secs(1));

    // A change half-way through a heartbeat goes out when it is made.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let busier = rank0.with_requests(3, 4);
    reporter.report(busier).unwrap();
    assert_eq!(feed.next().await, Some(busier));
    assert_eq!(feed.next().await, Some(rank1));
    assert_eq!(start.elapsed(), Duration::from_millis(1500));
    assert_eq!(reporter.latest(), vec![busier, rank1]);

    // Cleared (the engine's load cannot be read): nothing more is sent, not even heartbeats.
    reporter.clear();
    assert!(reporter.latest().is_empty());
    let quiet = tokio::time::timeout(Duration::from_secs(5), feed.next()).await;
    assert!(quiet.is_err(), "nothing after a clear, got {quiet:?}");
    reporter.report(rank1).unwrap();
    assert_eq!(feed.next().await, Some(rank1));

    // The feed ends with the reporter.
    drop(reporter);
    assert_eq!(feed.next().await, None);
}

#[test]
fn a_bad_report_is_refused_and_changes_nothing() {
    let reporter = LoadReporter::new(7, Duration::from_secs(1));
    let good = WorkerLoadReport::new(7).with_requests(1, 0);
    reporter.report(good).unwrap();

    let empty = reporter.report(WorkerLoadReport::new(7)).unwrap_err();
    assert!(empty.to_string().contains("no figure"), "{empty}");
    let other = reporter
        .report(WorkerLoadReport::new(8).with_requests(5, 5))
        .unwrap_err();
    let message = other.to_string();
    assert!(
        message.contains("worker_id") && message.contains('8'),
        "{message}"
    );
    let half = WorkerLoadReport {
        requests_running: Some(3),
        ..WorkerLoadReport::new(7)
    };
    assert!(reporter.report(half).is_err());
    assert_eq!(reporter.latest(), vec![good]);
}

#[tokio::test]
async fn reports_stream_over_the_request_plane() {
    let reporter = LoadReporter::new(3, Duration::from_millis(50));
    let config = WorkerServerConfig::new(3).with_load_reports(reporter.clone());
    let (server, _engine) = start_worker_with(config).await;
    let client = connect(&server).await;
    reporter
        .report(WorkerLoadReport::new(3).with_requests(4, 2))
        .unwrap();

    let mut reports = client.subscribe_load_reports().await.unwrap();
    let first = bounded("the first report", reports.next()).await;
    assert_eq!(first.unwrap().unwrap().requests(), Some(6));
    let changed = WorkerLoadReport::new(3)
        .with_requests(1, 0)
        .with_kv_used_blocks(12);
    reporter.report(changed).unwrap();
    let seen = bounded("the changed report", async {
        loop {
            let report = reports.next().await.unwrap().unwrap();
            if report == changed {
                return report;
            }
        }
    })
    .await;
    assert_eq!(seen.kv_used_blocks, Some(12));
    drop(reports);
    eventually("the subscription to close", || client.open_streams() == 0).await;
}

#[tokio::test]
async fn a_worker_without_a_reporter_refuses_the_subscription() {
    let (server, _engine) = start_worker_with(WorkerServerConfig::new(4)).await;
    let client = connect(&server).await;
    let first = client.subscribe_load_reports().await.unwrap().next().await;
    let Some(Err(RequestError::Unsupported { message })) = first else {
        panic!("expected Unsupported, got {first:?}");
    };
    assert!(message.contains("no load reports"), "{message}");
    // The connection survives the refusal.
    assert!(client.subscribe_load_reports().await.is_ok());
}

#[tokio::test]
async fn the_bridge_forwards_reports_of_workers_that_say_they_send_them() {
    let reporting = LoadReporter::new(5, Duration::from_millis(30));
    let (server5, _e5) =
        start_worker_with(WorkerServerConfig::new(5).with_load_reports(reporting.clone())).await;
    // Worker 6 has a reporter too but does not say so: the bridge must not ask it.
    let silent = LoadReporter::new(6, Duration::from_millis(30));
    let (server6, _e6) =
        start_worker_with(WorkerServerConfig::new(6).with_load_reports(silent.clone())).await;
    reporting
        .report(WorkerLoadReport::new(5).with_requests(2, 3))
        .unwrap();
    silent
        .report(WorkerLoadReport::new(6).with_requests(9, 9))
        .unwrap();

    let mut info5 = InstanceInfo::new(5, server5.local_addr().to_string(), 16);
    info5
        .metadata
        .insert(LOAD_REPORTS_METADATA.to_owned(), "true".to_owned());
    // Reports flow even from a worker that publishes no KV events.
    info5
        .metadata
        .insert(KV_EVENTS_METADATA.to_owned(), "false".to_owned());
    let info6 = InstanceInfo::new(6, server6.local_addr().to_string(), 16);
    let (tx, rx) = watch::channel(InstanceSet::default());
    let plane = Arc::new(InProcessEventPlane::default());
    let mut reports = plane.subscribe(LOAD_REPORT_SUBJECT).await.unwrap();
    let _bridge = KvEventBridge::start(rx, plane.clone(), KvEventBridgeConfig::default());
    tx.send_replace(Arc::new([(5, info5), (6, info6)].into_iter().collect()));

    // Several heartbeats' worth: only worker 5's reports, as JSON.
    for _ in 0..4 {
        let message = bounded("a forwarded report", reports.next()).await.unwrap();
        let report = WorkerLoadReport::from_json(&message.payload).unwrap();
        assert_eq!(report.worker_id, 5);
        assert_eq!(report.requests(), Some(5));
    }

    // Once the worker leaves discovery its reports stop.
    tx.send_replace(InstanceSet::default());
    tokio::time::sleep(Duration::from_millis(100)).await;
    while tokio::time::timeout(Duration::from_millis(1), reports.next())
        .await
        .is_ok()
    {}
    let quiet = tokio::time::timeout(Duration::from_millis(200), reports.next()).await;
    assert!(quiet.is_err(), "no reports after removal, got {quiet:?}");
}
