//! Child processes that die with the bench: each runs in a process group of its own (so a Python
//! process and anything it starts go together) and is SIGKILLed when its guard drops, whether the
//! bench finished, failed or was interrupted.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use tokio::sync::oneshot;

/// How many lines of a dead process's log an error shows.
const LOG_TAIL_LINES: usize = 30;

/// A child process (and its process group), killed when dropped.
pub(crate) struct Proc {
    name: String,
    child: Child,
    log: PathBuf,
}

impl Proc {
    /// Starts `cmd` with its standard output and error appended to `log`.
    pub(crate) fn spawn(name: &str, cmd: &mut Command, log: &Path) -> Result<Proc> {
        let out = File::create(log).with_context(|| format!("cannot create {}", log.display()))?;
        let err = out
            .try_clone()
            .with_context(|| format!("cannot reopen {}", log.display()))?;
        cmd.stdin(Stdio::null()).stdout(out).stderr(err);
        Self::spawn_with(name, cmd, log)
    }

    /// Starts `cmd` with its standard error in `log`, and waits up to `bound` for the first line
    /// it prints on standard output (its readiness line), which it returns. The rest of its
    /// output is drained and dropped.
    pub(crate) async fn spawn_with_ready_line(
        name: &str,
        cmd: &mut Command,
        log: &Path,
        bound: Duration,
    ) -> Result<(Proc, String)> {
        let (proc, mut lines) = Self::spawn_with_ready_lines(name, cmd, log, 1, bound).await?;
        Ok((proc, lines.remove(0)))
    }

    /// Like [`Proc::spawn_with_ready_line`], for a process that prints `n` readiness lines
    /// (one per engine, say): waits up to `bound` for all of them.
    pub(crate) async fn spawn_with_ready_lines(
        name: &str,
        cmd: &mut Command,
        log: &Path,
        n: usize,
        bound: Duration,
    ) -> Result<(Proc, Vec<String>)> {
        cmd.stdin(Stdio::null());
        Self::ready_lines(name, cmd, log, n, bound).await
    }

    /// Like [`Proc::spawn_with_ready_lines`], with the child's standard input a pipe held open
    /// for as long as the [`Proc`] lives: for a process that stops when its input closes (as
    /// `tests/python/llamacpp/servers.py` does).
    pub(crate) async fn spawn_with_ready_lines_holding_stdin(
        name: &str,
        cmd: &mut Command,
        log: &Path,
        n: usize,
        bound: Duration,
    ) -> Result<(Proc, Vec<String>)> {
        cmd.stdin(Stdio::piped());
        Self::ready_lines(name, cmd, log, n, bound).await
    }

    async fn ready_lines(
        name: &str,
        cmd: &mut Command,
        log: &Path,
        n: usize,
        bound: Duration,
    ) -> Result<(Proc, Vec<String>)> {
        let err = File::create(log).with_context(|| format!("cannot create {}", log.display()))?;
        cmd.stdout(Stdio::piped()).stderr(err);
        let mut proc = Self::spawn_with(name, cmd, log)?;
        let stdout = proc
            .child
            .stdout
            .take()
            .context("the child's standard output was not piped")?;
        let (tx, rx) = oneshot::channel();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            let first: Vec<String> = lines.by_ref().take(n).map_while(Result::ok).collect();
            if first.len() == n {
                let _ = tx.send(first);
            }
            // Keep draining so the child never blocks on a full pipe.
            for _ in lines {}
        });
        match tokio::time::timeout(bound, rx).await {
            Ok(Ok(lines)) => Ok((proc, lines)),
            _ => {
                // Its output closed early when it exited: give the exit a moment to be seen.
                for _ in 0..20 {
                    if !matches!(proc.child.try_wait(), Ok(None)) {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                proc.check_alive()?;
                bail!(
                    "{name} printed fewer than {n} readiness line(s) within {bound:?}; the end of \
                     its log ({}):\n{}",
                    proc.log.display(),
                    tail(&proc.log)
                )
            }
        }
    }

    /// Spawns `cmd` in a process group of its own; its standard input is the caller's choice.
    fn spawn_with(name: &str, cmd: &mut Command, log: &Path) -> Result<Proc> {
        cmd.process_group(0);
        let child = cmd
            .spawn()
            .with_context(|| format!("could not start {name}: {cmd:?}"))?;
        Ok(Proc {
            name: name.to_owned(),
            child,
            log: log.to_owned(),
        })
    }

    /// Its process id, which is also its process group's id.
    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// An error naming the process, its exit status and the end of its log if it has exited.
    pub(crate) fn check_alive(&mut self) -> Result<()> {
        match self.child.try_wait() {
            Ok(None) => Ok(()),
            Ok(Some(status)) => bail!(
                "{} exited ({status}); the end of its log ({}):\n{}",
                self.name,
                self.log.display(),
                tail(&self.log)
            ),
            Err(e) => bail!("cannot wait for {}: {e}", self.name),
        }
    }

    /// The end of its log, for errors that are not about the process exiting.
    pub(crate) fn log_tail(&self) -> String {
        format!(
            "the end of {}'s log ({}):\n{}",
            self.name,
            self.log.display(),
            tail(&self.log)
        )
    }

    /// SIGKILLs the process group, then the child itself, and reaps it.
    fn kill(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            // The group id is the child's pid (process_group(0)); `--` keeps the negative id
            // from being read as an option.
            let _ = Command::new("kill")
                .args(["-KILL", "--", &format!("-{}", self.child.id())])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The last [`LOG_TAIL_LINES`] lines of `log` (or why it cannot be read).
pub(crate) fn tail(log: &Path) -> String {
    match std::fs::read(log) {
        Ok(bytes) => tail_of(&String::from_utf8_lossy(&bytes), LOG_TAIL_LINES),
        Err(e) => format!("(cannot read {}: {e})", log.display()),
    }
}

/// The last `n` lines of `text`, or a note that it is empty.
pub(crate) fn tail_of(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    if lines.is_empty() {
        return "(empty)".to_owned();
    }
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// A directory removed (with its contents) when dropped.
pub(crate) struct TempDir(pub(crate) PathBuf);

impl TempDir {
    /// Creates a fresh directory named `prefix` plus this process's id under the system's
    /// temporary directory (removing a stale one of the same name first).
    pub(crate) fn new(prefix: &str) -> Result<TempDir> {
        let path = std::env::temp_dir().join(format!("{prefix}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path)
            .with_context(|| format!("cannot create {}", path.display()))?;
        Ok(TempDir(path))
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Runs a bench's async body on a two-thread runtime until it ends or the bench gets SIGINT or
/// SIGTERM (an error then). The signal handlers are installed before the body starts any child,
/// so an interrupt always reaches the clean-up: every [`Proc`] the body holds is dropped, and
/// killed, on the way out.
pub(crate) fn block_on_interruptible<T>(
    body: impl std::future::Future<Output = Result<T>>,
) -> Result<T> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    let result = runtime.block_on(async {
        use tokio::signal::unix::{SignalKind, signal};
        let mut interrupt = signal(SignalKind::interrupt()).context("handling SIGINT")?;
        let mut terminate = signal(SignalKind::terminate()).context("handling SIGTERM")?;
        tokio::select! {
            r = body => r,
            _ = interrupt.recv() => bail!("interrupted (SIGINT); every child was killed"),
            _ = terminate.recv() => bail!("terminated (SIGTERM); every child was killed"),
        }
    });
    runtime.shutdown_timeout(Duration::from_secs(1));
    result
}
