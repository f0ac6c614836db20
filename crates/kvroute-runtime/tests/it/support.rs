//! A test engine and helpers shared by the tests.

use std::collections::BTreeSet;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use futures::StreamExt;
use kvroute_protocols::kv_events::KvCacheEvent;
use kvroute_protocols::{Annotated, SessionAction, SessionControl};
use kvroute_runtime::{
    Client, ClientConfig, Engine, EngineError, RequestContext, RequestError, ResponseStream,
    WorkerServer, WorkerServerConfig,
};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

/// A test request: stream `items` numbers, `interval` apart (0 = as fast as possible).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Job {
    pub(crate) items: u32,
    pub(crate) interval_ms: u64,
    /// Refuse the request with this message instead.
    pub(crate) reject: Option<String>,
    /// After this many items, report the engine unavailable (`RequestContext::fail`) and end the
    /// stream, as an engine adapter whose engine went away does (0: at `generate`).
    pub(crate) unavailable_after: Option<u32>,
    /// Padding to make a request big.
    pub(crate) padding: Vec<u8>,
}

impl Job {
    pub(crate) fn new(items: u32) -> Self {
        Self {
            items,
            interval_ms: 0,
            reject: None,
            unavailable_after: None,
            padding: Vec::new(),
        }
    }

    pub(crate) fn slow(items: u32, interval_ms: u64) -> Self {
        Self {
            interval_ms,
            ..Self::new(items)
        }
    }
}

/// The item the test engine sends after a graceful stop.
pub(crate) const STOPPED: u32 = u32::MAX;

pub(crate) type Item = Annotated<u32>;
pub(crate) type TestClient = Client<Job, Item>;

/// Counts live streams (a slot is held until the engine's stream is dropped) and sessions.
#[derive(Default)]
pub(crate) struct TestEngine {
    pub(crate) active: Arc<AtomicUsize>,
    pub(crate) started: AtomicUsize,
    pub(crate) sessions: Mutex<BTreeSet<String>>,
    pub(crate) dump: Mutex<Vec<KvCacheEvent>>,
    /// The context of every request started, to check what the engine was told.
    pub(crate) contexts: Mutex<Vec<RequestContext>>,
}

impl TestEngine {
    /// How many started requests were killed.
    pub(crate) fn killed(&self) -> usize {
        self.contexts
            .lock()
            .iter()
            .filter(|c| c.is_killed())
            .count()
    }
}

struct SlotGuard(Arc<AtomicUsize>);

impl Drop for SlotGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Engine for TestEngine {
    type Request = Job;
    type Response = Item;

    fn generate(
        &self,
        job: Job,
        context: RequestContext,
    ) -> Result<ResponseStream<Item>, EngineError> {
        if let Some(message) = job.reject {
            return Err(EngineError::Rejected { message });
        }
        fn unavailable() -> EngineError {
            EngineError::Unavailable {
                message: "engine connection refused".to_owned(),
            }
        }
        if job.unavailable_after == Some(0) {
            return Err(unavailable());
        }
        self.started.fetch_add(1, Ordering::SeqCst);
        self.contexts.lock().push(context.clone());
        self.active.fetch_add(1, Ordering::SeqCst);
        let guard = SlotGuard(self.active.clone());
        let state = (0u32, guard, context, job, false);
        Ok(Box::pin(futures::stream::unfold(
            state,
            |(i, guard, context, job, stopped)| async move {
                if stopped || i >= job.items {
                    return None;
                }
                if job.unavailable_after == Some(i) {
                    context.fail(unavailable());
                    return None;
                }
                if job.interval_ms > 0 {
                    tokio::select! {
                        _ = tokio::time::sleep(Duration::from_millis(job.interval_ms)) => {}
                        _ = context.stopped() => {}
                    }
                }
                if context.is_stopped() {
                    return Some((
                        Annotated::from_data(STOPPED),
                        (i, guard, context, job, true),
                    ));
                }
                let mut item = Annotated::from_data(i);
                item.id = Some(context.id().to_owned());
                Some((item, (i + 1, guard, context, job, false)))
            },
        )))
    }

    fn session_control(&self, control: SessionControl) -> Result<(), EngineError> {
        let mut sessions = self.sessions.lock();
        match control.action {
            Some(SessionAction::Open) => {
                sessions.insert(control.session_id);
                Ok(())
            }
            Some(SessionAction::Close) => {
                if sessions.remove(&control.session_id) {
                    Ok(())
                } else {
                    Err(EngineError::Rejected {
                        message: format!("no session {}", control.session_id),
                    })
                }
            }
            _ => Err(EngineError::Unsupported {
                operation: "session_control without open/close",
            }),
        }
    }

    fn kv_dump(&self) -> Vec<KvCacheEvent> {
        self.dump.lock().clone()
    }
}

/// A worker serving a fresh test engine on an ephemeral loopback port.
pub(crate) async fn start_worker(worker_id: u64) -> (WorkerServer, Arc<TestEngine>) {
    start_worker_with(WorkerServerConfig::new(worker_id)).await
}

pub(crate) async fn start_worker_with(
    config: WorkerServerConfig,
) -> (WorkerServer, Arc<TestEngine>) {
    let engine = Arc::new(TestEngine::default());
    let server = WorkerServer::bind("127.0.0.1:0", engine.clone(), config)
        .await
        .expect("bind loopback");
    (server, engine)
}

pub(crate) async fn connect(server: &WorkerServer) -> TestClient {
    Client::connect(&server.local_addr().to_string(), ClientConfig::default())
        .await
        .expect("connect")
}

/// Collects a stream's data items, panicking on an error item.
pub(crate) async fn collect(stream: kvroute_runtime::ClientStream<Item>) -> Vec<u32> {
    stream
        .map(|item| item.expect("stream item").data.expect("data item"))
        .collect()
        .await
}

/// Safety bound for anything that should happen "soon": a hang fails the test instead of CI.
pub(crate) async fn bounded<F: Future>(what: &str, future: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(10), future)
        .await
        .unwrap_or_else(|_| panic!("{what} did not happen"))
}

/// Waits until `condition` holds (bounded).
pub(crate) async fn eventually(what: &str, mut condition: impl FnMut() -> bool) {
    bounded(what, async {
        while !condition() {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    })
    .await;
}

/// Reads a stream until its first error (skipping items), or its end.
pub(crate) async fn first_error<S>(mut stream: S) -> Option<RequestError>
where
    S: futures::Stream<Item = Result<Item, RequestError>> + Unpin,
{
    while let Some(item) = stream.next().await {
        if let Err(e) = item {
            return Some(e);
        }
    }
    None
}
