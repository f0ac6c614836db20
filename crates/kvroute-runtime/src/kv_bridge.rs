//! Carries KV events from workers in other processes onto a local event plane, with no broker.
//!
//! For every instance discovery lists, [`KvEventBridge`] opens a long-lived
//! `subscribe_kv_events` stream on the worker's request-plane address and republishes each event
//! on [`KV_EVENT_SUBJECT`] of the given [`EventPlane`], where the router consumes them exactly as
//! it would from NATS. Loss is repaired where it always is: a consumer that sees a gap in a
//! worker's event ids asks the worker for the range (or a dump). The bridge resumes a dropped
//! stream from the id after the last one it forwarded, so a reconnect loses nothing the worker
//! still holds. With a real broker the workers publish there themselves and no bridge runs; an
//! engine adapter in the consumer's own process forwards its publisher to the plane directly,
//! and the bridge leaves it out ([`KvEventBridge::start_except`]).
//!
//! A worker whose metadata states [`LOAD_REPORTS_METADATA`] `= "true"` also has its load
//! reports followed (`subscribe_load_reports`) and republished as JSON on
//! [`LOAD_REPORT_SUBJECT`]; they need no repair, since the worker repeats them every heartbeat.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use kvroute_protocols::WorkerId;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::client::{Client, ClientConfig};
use crate::discovery::{DiscoveryEvent, InstanceInfo, InstanceSet, diff_instances};
use crate::error::RequestError;
use crate::event_plane::EventPlane;
use crate::load_reporter::{LOAD_REPORT_SUBJECT, LOAD_REPORTS_METADATA, encode_load_report};

/// The instance metadata key whose value `"false"` says the worker publishes no KV events (the
/// bridge then does not subscribe). kvroute-router reads the same key.
pub const KV_EVENTS_METADATA: &str = "kv_events";

/// How a [`KvEventBridge`] connects.
#[derive(Debug, Clone)]
pub struct KvEventBridgeConfig {
    /// The connection settings (the keepalive detects a worker that vanished).
    pub client: ClientConfig,
    /// The first wait before reconnecting to a worker whose stream dropped; doubles up to
    /// `backoff_max`.
    pub backoff_initial: Duration,
    /// The longest wait between reconnects.
    pub backoff_max: Duration,
}

impl Default for KvEventBridgeConfig {
    fn default() -> Self {
        Self {
            client: ClientConfig {
                first_response_timeout: Some(Duration::from_secs(10)),
                ..ClientConfig::default()
            },
            backoff_initial: Duration::from_millis(50),
            backoff_max: Duration::from_secs(2),
        }
    }
}

/// Follows discovery and forwards every listed worker's KV events to an event plane. Dropping it
/// stops every subscription.
#[derive(Debug)]
pub struct KvEventBridge {
    task: JoinHandle<()>,
}

impl KvEventBridge {
    /// Starts forwarding the KV events of every instance in `instances` to `plane`. Must be
    /// called inside a tokio runtime.
    pub fn start(
        instances: watch::Receiver<InstanceSet>,
        plane: Arc<dyn EventPlane>,
        config: KvEventBridgeConfig,
    ) -> Self {
        Self::start_except(instances, plane, config, HashSet::new())
    }

    /// Like [`KvEventBridge::start`], but leaves out the workers in `local`: those whose KV
    /// events and load reports already reach `plane` without the request plane (an engine
    /// adapter in this process whose publisher forwards there, see
    /// [`crate::KvEventPublisher::forward_to`]). Their servers keep answering ranges and dumps.
    pub fn start_except(
        instances: watch::Receiver<InstanceSet>,
        plane: Arc<dyn EventPlane>,
        config: KvEventBridgeConfig,
        local: HashSet<WorkerId>,
    ) -> Self {
        Self {
            task: tokio::spawn(follow(instances, plane, Arc::new(config), local)),
        }
    }
}

impl Drop for KvEventBridge {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Aborts its forwarders when dropped, so that the map of feeds owns them.
struct Feed(Vec<JoinHandle<()>>);

impl Drop for Feed {
    fn drop(&mut self) {
        for task in &self.0 {
            task.abort();
        }
    }
}

async fn follow(
    mut instances: watch::Receiver<InstanceSet>,
    plane: Arc<dyn EventPlane>,
    config: Arc<KvEventBridgeConfig>,
    local: HashSet<WorkerId>,
) {
    let mut feeds: HashMap<WorkerId, Feed> = HashMap::new();
    let mut known = InstanceSet::default();
    loop {
        let current = instances.borrow_and_update().clone();
        for event in diff_instances(&known, &current) {
            match event {
                DiscoveryEvent::Removed(id) => {
                    feeds.remove(&id);
                }
                DiscoveryEvent::Added(info) if local.contains(&info.id) => {}
                DiscoveryEvent::Added(info) => {
                    let publishes = info
                        .metadata
                        .get(KV_EVENTS_METADATA)
                        .is_none_or(|v| v != "false");
                    let reports = info
                        .metadata
                        .get(LOAD_REPORTS_METADATA)
                        .is_some_and(|v| v == "true");
                    // Inserting replaces (and so stops) the feed of an earlier registration.
                    feeds.remove(&info.id);
                    let mut tasks = Vec::new();
                    if publishes {
                        tasks.push(tokio::spawn(forward(
                            info.clone(),
                            plane.clone(),
                            config.clone(),
                            FeedKind::KvEvents,
                        )));
                    }
                    if reports {
                        tasks.push(tokio::spawn(forward(
                            info.clone(),
                            plane.clone(),
                            config.clone(),
                            FeedKind::LoadReports,
                        )));
                    }
                    if !tasks.is_empty() {
                        feeds.insert(info.id, Feed(tasks));
                    }
                }
            }
        }
        known = current;
        if instances.changed().await.is_err() {
            return;
        }
    }
}

/// Which of a worker's feeds a forwarder follows.
#[derive(Debug, Clone, Copy)]
enum FeedKind {
    KvEvents,
    LoadReports,
}

/// Forwards one of a worker's feeds until aborted, reconnecting with backoff.
async fn forward(
    info: InstanceInfo,
    plane: Arc<dyn EventPlane>,
    config: Arc<KvEventBridgeConfig>,
    kind: FeedKind,
) {
    // The KV event feed resumes from the first id not yet forwarded.
    let mut next: Option<u64> = None;
    let mut backoff = config.backoff_initial;
    loop {
        let outcome = match kind {
            FeedKind::KvEvents => stream_once(&info, plane.as_ref(), &config, &mut next).await,
            FeedKind::LoadReports => reports_once(&info, plane.as_ref(), &config).await,
        };
        match outcome {
            // The worker ended the feed (it is shutting down); its deregistration follows.
            Ok(true) => backoff = config.backoff_initial,
            Ok(false) => {}
            Err(error) => {
                tracing::debug!(worker = info.id, ?kind, %error, "feed dropped; reconnecting");
            }
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(config.backoff_max);
    }
}

/// Runs one subscription; `next` tracks the first id not yet forwarded. Returns whether any
/// event was forwarded.
async fn stream_once(
    info: &InstanceInfo,
    plane: &dyn EventPlane,
    config: &KvEventBridgeConfig,
    next: &mut Option<u64>,
) -> Result<bool, RequestError> {
    let client: Client<(), ()> = Client::connect(&info.address, config.client.clone()).await?;
    let mut events = match client.subscribe_kv_events(*next).await {
        // The worker no longer holds where we stopped: start from now; the consumer sees the
        // gap and rebuilds from a dump.
        Err(RequestError::EventsUnavailable { .. }) => client.subscribe_kv_events(None).await?,
        other => other?,
    };
    let mut forwarded = false;
    let throttle = crate::WarnThrottle::default();
    while let Some(event) = events.next().await {
        let event = event?;
        *next = Some(event.event.event_id + 1);
        let now = std::time::Instant::now();
        match plane.publish_router_event(event).await {
            Ok(()) => {
                if let Some(more) = throttle.flush(now) {
                    tracing::warn!(worker = info.id, "the event plane refused KV events{more}");
                }
            }
            Err(error) => {
                if let Some(more) = throttle.check(now) {
                    tracing::warn!(worker = info.id, %error, "the event plane refused a KV event{more}");
                }
            }
        }
        forwarded = true;
    }
    Ok(forwarded)
}

/// Runs one load-report subscription. Returns whether any report was forwarded.
async fn reports_once(
    info: &InstanceInfo,
    plane: &dyn EventPlane,
    config: &KvEventBridgeConfig,
) -> Result<bool, RequestError> {
    let client: Client<(), ()> = Client::connect(&info.address, config.client.clone()).await?;
    let mut reports = client.subscribe_load_reports().await?;
    let mut forwarded = false;
    while let Some(report) = reports.next().await {
        let report = report?;
        if report.worker_id != info.id {
            // A worker speaks only for itself: another id is a misconfigured fleet.
            tracing::warn!(
                worker = info.id,
                reported = report.worker_id,
                "dropping a load report about another worker"
            );
            continue;
        }
        if let Err(error) = plane
            .publish(LOAD_REPORT_SUBJECT, encode_load_report(&report))
            .await
        {
            tracing::debug!(worker = info.id, %error, "the event plane refused a load report");
        }
        forwarded = true;
    }
    Ok(forwarded)
}
