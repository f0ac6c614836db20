//! A worker's reports of its own load ([`WorkerLoadReport`]), carried to the routers.
//!
//! [`LoadReporter`] keeps the latest report of each dp rank of one worker. Whatever knows the
//! engine's load (the simulated engine's queue, a sidecar reading a real engine's metrics)
//! calls [`LoadReporter::report`], typically once per sampling interval. Every subscriber
//! ([`LoadReporter::subscribe`]) receives every rank's report at once, then again on each
//! change, and again each heartbeat while nothing changes: a router that lost one message is
//! corrected within a heartbeat, and a report that stops coming says the worker stopped
//! reporting.
//!
//! Routers read reports on [`LOAD_REPORT_SUBJECT`] of their event plane, as JSON. A worker on a
//! broker publishes there itself ([`LoadReporter::forward_to`]); a worker registered with a
//! router's registry states [`LOAD_REPORTS_METADATA`] `= "true"` and the router's
//! [`crate::KvEventBridge`] subscribes to its reports over the request plane
//! ([`crate::Client::subscribe_load_reports`]), exactly as to its KV events.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::{Stream, StreamExt};
use kvroute_protocols::{DpRank, ProtocolError, WorkerId, WorkerLoadReport};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::event_plane::EventPlane;

/// The event-plane subject load reports travel on (JSON [`WorkerLoadReport`]s).
pub const LOAD_REPORT_SUBJECT: &str = "load_reports";

/// The instance metadata key a worker sets to `"true"` when it serves load reports over the
/// request plane (workers that do not know the call would drop the connection on it, so the
/// bridge asks only those that say so).
pub const LOAD_REPORTS_METADATA: &str = "load_reports";

/// How often a [`LoadReporter`] repeats unchanged reports unless told otherwise.
pub const DEFAULT_REPORT_HEARTBEAT: Duration = Duration::from_secs(1);

/// The latest load reports of one worker, one per dp rank, and their subscribers. Cheap to
/// clone; every clone shares the reports. Subscriptions end when the last clone is dropped.
#[derive(Debug, Clone)]
pub struct LoadReporter {
    worker_id: WorkerId,
    heartbeat: Duration,
    reports: Arc<watch::Sender<BTreeMap<DpRank, WorkerLoadReport>>>,
}

impl LoadReporter {
    /// A reporter for `worker_id` that repeats unchanged reports every `heartbeat` (at least
    /// 1 ms).
    pub fn new(worker_id: WorkerId, heartbeat: Duration) -> Self {
        Self {
            worker_id,
            heartbeat: heartbeat.max(Duration::from_millis(1)),
            reports: Arc::new(watch::Sender::new(BTreeMap::new())),
        }
    }

    /// The worker the reports are about.
    pub fn worker_id(&self) -> WorkerId {
        self.worker_id
    }

    /// How often unchanged reports are repeated.
    pub fn heartbeat(&self) -> Duration {
        self.heartbeat
    }

    /// Records `report` as its rank's latest and, if it differs from the one before, sends it
    /// to every subscriber now. A report that does not validate, or is about another worker, is
    /// refused and changes nothing.
    pub fn report(&self, report: WorkerLoadReport) -> Result<(), ProtocolError> {
        report.validate()?;
        if report.worker_id != self.worker_id {
            return Err(ProtocolError::invalid(
                "worker_id",
                format!("this reporter's worker, {}", self.worker_id),
                report.worker_id.to_string(),
            ));
        }
        self.reports.send_if_modified(|reports| {
            let previous = reports.insert(report.dp_rank, report);
            previous != Some(report)
        });
        Ok(())
    }

    /// Forgets every report (the engine's load can no longer be read): subscribers send
    /// nothing until the next report, so routers stop counting on a stale one once their
    /// report ttl passes.
    pub fn clear(&self) {
        self.reports.send_if_modified(|reports| {
            let had = !reports.is_empty();
            reports.clear();
            had
        });
    }

    /// Every rank's latest report, by rank.
    pub fn latest(&self) -> Vec<WorkerLoadReport> {
        self.reports.borrow().values().copied().collect()
    }

    /// The reports as they come: every rank's latest at once (nothing until the first
    /// report), then every rank's again whenever one changes or a heartbeat passes without a
    /// change. Ends when the last clone of this reporter is dropped. Changes made faster than
    /// the subscriber reads are coalesced: it always sees the latest.
    pub fn subscribe(&self) -> impl Stream<Item = WorkerLoadReport> + Send + 'static {
        let feed = Feed {
            rx: self.reports.subscribe(),
            pending: Vec::new().into_iter(),
            started: false,
            heartbeat: self.heartbeat,
        };
        futures::stream::unfold(feed, |mut feed| async move {
            loop {
                if let Some(report) = feed.pending.next() {
                    return Some((report, feed));
                }
                if feed.started
                    && let Ok(Err(_)) =
                        tokio::time::timeout(feed.heartbeat, feed.rx.changed()).await
                {
                    return None;
                }
                feed.started = true;
                let reports: Vec<_> = feed.rx.borrow_and_update().values().copied().collect();
                feed.pending = reports.into_iter();
            }
        })
    }

    /// Publishes every report [`Self::subscribe`] yields on [`LOAD_REPORT_SUBJECT`] of
    /// `plane`, as JSON, until the reporter's last clone is dropped or the returned task is
    /// aborted. Must be called inside a tokio runtime.
    pub fn forward_to(&self, plane: Arc<dyn EventPlane>) -> JoinHandle<()> {
        let mut reports = Box::pin(self.subscribe());
        tokio::spawn(async move {
            while let Some(report) = reports.next().await {
                if let Err(error) = plane
                    .publish(LOAD_REPORT_SUBJECT, encode_load_report(&report))
                    .await
                {
                    tracing::debug!(%error, "a load report was not published; the next one repeats it");
                }
            }
        })
    }
}

/// A report as it travels on the event plane: JSON, without absent figures.
pub fn encode_load_report(report: &WorkerLoadReport) -> Bytes {
    // A plain struct of integers always serializes.
    Bytes::from(serde_json::to_vec(report).unwrap_or_default())
}

/// One subscriber's place in the reports.
struct Feed {
    rx: watch::Receiver<BTreeMap<DpRank, WorkerLoadReport>>,
    /// Reports read but not yet yielded.
    pending: std::vec::IntoIter<WorkerLoadReport>,
    /// Whether the current reports were read once (the first read does not wait).
    started: bool,
    heartbeat: Duration,
}
