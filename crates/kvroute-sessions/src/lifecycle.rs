//! Engine session lifecycle: the commands the coordinator asks the transport to run, and the
//! trait a transport (or a simulator) implements to run them synchronously.

use std::sync::Mutex;
use std::time::Duration;

use kvroute_protocols::WorkerWithDpRank;

/// Work for the transport, produced by the coordinator (it never performs I/O itself).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SessionCommand {
    /// Ask `worker` to open an engine session; report the answer to
    /// [`crate::SessionCoordinator::open_finished`].
    Open {
        /// The session.
        session_id: String,
        /// The routed worker.
        worker: WorkerWithDpRank,
        /// The session's inactivity timeout.
        timeout: Duration,
    },
    /// Close the engine session on `worker` (best effort; nothing to report).
    Close {
        /// The session.
        session_id: String,
        /// The worker holding it.
        worker: WorkerWithDpRank,
    },
}

/// A transport failure running a lifecycle command.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LifecycleError {
    /// The worker could not be reached or answered with an error.
    #[error(
        "session_control {action} for session {session_id:?} on worker {worker} failed: {reason}"
    )]
    Transport {
        /// `open` or `close`.
        action: &'static str,
        /// The session.
        session_id: String,
        /// The worker.
        worker: WorkerWithDpRank,
        /// What went wrong.
        reason: String,
    },
}

/// Runs lifecycle commands against workers. The live transport answers over the request plane;
/// the simulator and tests answer in process.
pub trait SessionLifecycle: Send + Sync {
    /// Asks `worker` to open `session_id`; `Ok(true)` if it accepted, `Ok(false)` if it refused.
    fn open(
        &self,
        session_id: &str,
        worker: WorkerWithDpRank,
        timeout: Duration,
    ) -> Result<bool, LifecycleError>;

    /// Asks `worker` to close `session_id`.
    fn close(&self, session_id: &str, worker: WorkerWithDpRank) -> Result<(), LifecycleError>;
}

/// An in-process lifecycle for tests: accepts or refuses every open, and records every command.
#[derive(Debug)]
pub struct FakeLifecycle {
    accept_open: bool,
    log: Mutex<Vec<SessionCommand>>,
}

impl FakeLifecycle {
    /// A fake whose workers accept every `open`.
    pub fn accepting() -> Self {
        Self {
            accept_open: true,
            log: Mutex::new(Vec::new()),
        }
    }

    /// A fake whose workers refuse every `open`.
    pub fn refusing() -> Self {
        Self {
            accept_open: false,
            log: Mutex::new(Vec::new()),
        }
    }

    /// Every command received so far, in order.
    pub fn commands(&self) -> Vec<SessionCommand> {
        self.log.lock().map(|l| l.clone()).unwrap_or_default()
    }

    fn record(&self, cmd: SessionCommand) {
        if let Ok(mut log) = self.log.lock() {
            log.push(cmd);
        }
    }
}

impl SessionLifecycle for FakeLifecycle {
    fn open(
        &self,
        session_id: &str,
        worker: WorkerWithDpRank,
        timeout: Duration,
    ) -> Result<bool, LifecycleError> {
        self.record(SessionCommand::Open {
            session_id: session_id.to_owned(),
            worker,
            timeout,
        });
        Ok(self.accept_open)
    }

    fn close(&self, session_id: &str, worker: WorkerWithDpRank) -> Result<(), LifecycleError> {
        self.record(SessionCommand::Close {
            session_id: session_id.to_owned(),
            worker,
        });
        Ok(())
    }
}
