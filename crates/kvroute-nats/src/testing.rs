//! A throwaway `nats-server -js` for tests: its own free port and temporary store, stopped and
//! removed on drop, so tests never share state.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The install hint printed when `nats-server` is missing.
pub const INSTALL_HINT: &str = "install it with `sudo apt-get install nats-server` (Debian/Ubuntu), \
     or let `cargo xtask ci` install it; a release binary from https://github.com/nats-io/nats-server \
     on PATH works too";

/// A `nats-server -js` child process on a free loopback port.
#[derive(Debug)]
pub struct NatsServer {
    child: Option<Child>,
    port: u16,
    store: PathBuf,
    /// Extra arguments (authentication, a config file).
    args: Vec<String>,
}

impl NatsServer {
    /// Starts a server and waits (up to 10 s) until it accepts connections.
    ///
    /// # Panics
    /// When `nats-server` is not on `PATH` (with [`INSTALL_HINT`]) or does not come up: a test
    /// that needs NATS fails loudly, it never skips.
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    /// [`Self::start`] with extra `nats-server` arguments, e.g. `["--user", "a", "--pass", "b"]`,
    /// `["--auth", "TOKEN"]` or `["-c", "server.conf"]`.
    pub fn start_with(args: &[&str]) -> Self {
        let port = free_port();
        let store =
            std::env::temp_dir().join(format!("kvroute-nats-test-{}-{port}", std::process::id()));
        let mut server = Self {
            child: None,
            port,
            store,
            args: args.iter().map(|a| (*a).to_owned()).collect(),
        };
        server.spawn();
        server
    }

    /// `nats://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Kills the server (its store stays, as after a crash).
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts it again on the same port and store (after [`Self::stop`]).
    pub fn restart(&mut self) {
        self.stop();
        self.spawn();
    }

    fn spawn(&mut self) {
        let child = Command::new("nats-server")
            .args(["-js", "-a", "127.0.0.1", "-p"])
            .arg(self.port.to_string())
            .arg("-sd")
            .arg(&self.store)
            .args(&self.args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run `nats-server` ({e}): {INSTALL_HINT}"));
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "nats-server did not accept connections on port {} within 10 s",
                self.port
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.store);
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}
