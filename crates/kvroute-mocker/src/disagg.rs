//! Disaggregated serving roles for the live mocker: a prefill worker computes the prompt,
//! answers one token carrying `disaggregated_params`, and (bootstrap path) hands the KV to the
//! decode worker that pulls its room; a decode worker given a `prefill_result` or
//! `bootstrap_info` fetches the KV (a simulated transfer) instead of computing the prompt.
//!
//! The bootstrap rendezvous is real TCP: the prefill worker runs a [`BootstrapServer`] and
//! advertises it in discovery metadata under [`BOOTSTRAP_HOST_KEY`] / [`BOOTSTRAP_PORT_KEY`]. A
//! decode worker connects, sends the room id (8 bytes, big-endian) and reads one answer (4-byte
//! big-endian length, then JSON: `{"params": ...}` or `{"error": "..."}`), given once the room's
//! prefill ends. Either side may arrive first.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use kvroute_indexer::hash::{HashSalt, compute_block_hashes, next_seq_hash};
use kvroute_protocols::{
    BOOTSTRAP_HOST_KEY, BOOTSTRAP_PORT_KEY, BootstrapInfo, DpRank, PreprocessedRequest, WorkerId,
};
use parking_lot::Mutex;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tokio::time::Instant;

/// Largest bootstrap answer accepted, so a bad peer cannot make the reader allocate at will.
const MAX_ANSWER_BYTES: u32 = 16 << 20;

/// What a live mocker does in disaggregated serving.
#[derive(Debug, Clone)]
pub enum Role {
    /// A prefill worker: every request generates exactly one token, whose item carries
    /// `disaggregated_params`; bootstrap requests fill their room in `rooms` when they finish.
    Prefill {
        /// This worker's id, reported in the params (`worker_id.prefill_worker_id`).
        worker_id: WorkerId,
        /// The rooms its [`BootstrapServer`] serves (from [`BootstrapServer::rooms`]).
        rooms: Option<Arc<BootstrapRooms>>,
    },
    /// A decode worker: a request with `prefill_result` or `bootstrap_info` receives its prompt
    /// KV after the simulated transfer instead of computing it; other requests are served whole.
    Decode(DecodeConfig),
}

/// How a decode worker fetches transferred KV.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DecodeConfig {
    /// Modelled transfer time per prompt block (before the config's speed-up). The default,
    /// 0.08 ms, is a 2 MiB block (16 tokens of an 8B model) over ~25 GB/s of RDMA.
    pub transfer_per_block: Duration,
    /// How long to wait for a bootstrap room before failing the request.
    pub pull_timeout: Duration,
}

impl Default for DecodeConfig {
    fn default() -> Self {
        Self {
            transfer_per_block: Duration::from_micros(80),
            pull_timeout: Duration::from_secs(30),
        }
    }
}

/// The outcome of one room: the prefill's params, or why it failed.
pub type RoomOutcome = Result<Value, String>;

enum Room {
    /// Decode sides waiting for the prefill to end.
    Waiting(Vec<oneshot::Sender<RoomOutcome>>),
    /// The prefill ended before anyone pulled; kept until `expires`.
    Ready(RoomOutcome, Instant),
}

/// The rooms of one prefill worker's bootstrap server.
#[derive(Default)]
pub struct BootstrapRooms {
    rooms: Mutex<HashMap<u64, Room>>,
}

/// How long an unpulled outcome is kept: a decode side that has not asked by then never will.
const ROOM_TTL: Duration = Duration::from_secs(120);

impl BootstrapRooms {
    /// Fills `room`: waiting decode sides get the outcome now, later ones when they pull.
    pub fn post(&self, room: u64, outcome: RoomOutcome) {
        let now = Instant::now();
        let mut rooms = self.rooms.lock();
        // Forget outcomes nobody pulled in time and waiters that gave up.
        rooms.retain(|_, r| match r {
            Room::Ready(_, expires) => *expires > now,
            Room::Waiting(waiters) => waiters.iter().any(|w| !w.is_closed()),
        });
        match rooms.remove(&room) {
            Some(Room::Waiting(waiters)) => {
                for waiter in waiters {
                    let _ = waiter.send(outcome.clone());
                }
            }
            _ => {
                rooms.insert(room, Room::Ready(outcome, now + ROOM_TTL));
            }
        }
    }

    /// The outcome of `room`, now if the prefill already ended, else when it does.
    pub fn pull(&self, room: u64) -> oneshot::Receiver<RoomOutcome> {
        let (tx, rx) = oneshot::channel();
        let mut rooms = self.rooms.lock();
        match rooms.remove(&room) {
            Some(Room::Ready(outcome, _)) => {
                let _ = tx.send(outcome);
            }
            Some(Room::Waiting(mut waiters)) => {
                waiters.push(tx);
                rooms.insert(room, Room::Waiting(waiters));
            }
            None => {
                rooms.insert(room, Room::Waiting(vec![tx]));
            }
        }
        rx
    }

    /// Rooms held (waiting or ready).
    pub fn len(&self) -> usize {
        self.rooms.lock().len()
    }

    /// Whether no room is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl std::fmt::Debug for BootstrapRooms {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BootstrapRooms")
            .field("rooms", &self.len())
            .finish()
    }
}

/// A prefill worker's bootstrap server: decode workers pull finished rooms from it.
/// Dropping it stops accepting connections.
#[derive(Debug)]
pub struct BootstrapServer {
    addr: SocketAddr,
    rooms: Arc<BootstrapRooms>,
    task: tokio::task::JoinHandle<()>,
}

impl BootstrapServer {
    /// Listens on `addr` (e.g. `127.0.0.1:0`); must be called inside a tokio runtime.
    pub async fn bind(addr: &str) -> std::io::Result<Self> {
        let listener = TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let rooms = Arc::new(BootstrapRooms::default());
        let task = tokio::spawn(accept(listener, Arc::clone(&rooms)));
        Ok(Self { addr, rooms, task })
    }

    /// Where it listens.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Its rooms, for [`Role::Prefill`].
    pub fn rooms(&self) -> Arc<BootstrapRooms> {
        Arc::clone(&self.rooms)
    }

    /// The discovery metadata entries that advertise this server.
    pub fn metadata(&self) -> [(String, String); 2] {
        [
            (BOOTSTRAP_HOST_KEY.to_owned(), self.addr.ip().to_string()),
            (BOOTSTRAP_PORT_KEY.to_owned(), self.addr.port().to_string()),
        ]
    }
}

impl Drop for BootstrapServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn accept(listener: TcpListener, rooms: Arc<BootstrapRooms>) {
    loop {
        let Ok((socket, _)) = listener.accept().await else {
            continue;
        };
        tokio::spawn(serve_pull(socket, Arc::clone(&rooms)));
    }
}

async fn serve_pull(mut socket: TcpStream, rooms: Arc<BootstrapRooms>) {
    let Ok(room) = socket.read_u64().await else {
        return;
    };
    let outcome = rooms
        .pull(room)
        .await
        .unwrap_or_else(|_| Err("the prefill worker dropped the room".to_owned()));
    let body = match outcome {
        Ok(params) => json!({ "params": params }),
        Err(error) => json!({ "error": error }),
    }
    .to_string();
    let _ = socket.write_u32(body.len() as u32).await;
    let _ = socket.write_all(body.as_bytes()).await;
}

/// Pulls `info`'s room from the prefill worker's bootstrap server: the prefill's params, or why
/// it failed (unreachable, timed out, prefill failed).
pub async fn pull(info: &BootstrapInfo, timeout: Duration) -> RoomOutcome {
    let fetch = async {
        let addr = format!("{}:{}", info.bootstrap_host, info.bootstrap_port);
        let mut socket = TcpStream::connect(&addr)
            .await
            .map_err(|e| format!("cannot reach bootstrap server {addr}: {e}"))?;
        socket
            .write_u64(info.bootstrap_room)
            .await
            .map_err(|e| format!("bootstrap server {addr}: {e}"))?;
        let len = socket
            .read_u32()
            .await
            .map_err(|e| format!("bootstrap server {addr} closed without an answer: {e}"))?;
        if len > MAX_ANSWER_BYTES {
            return Err(format!(
                "bootstrap answer of {len} bytes exceeds {MAX_ANSWER_BYTES}"
            ));
        }
        let mut body = vec![0; len as usize];
        socket
            .read_exact(&mut body)
            .await
            .map_err(|e| format!("bootstrap server {addr}: {e}"))?;
        let answer: Value =
            serde_json::from_slice(&body).map_err(|e| format!("bad bootstrap answer: {e}"))?;
        match (answer.get("params"), answer.get("error")) {
            (Some(params), _) => Ok(params.clone()),
            (None, Some(error)) => Err(format!(
                "prefill failed: {}",
                error.as_str().unwrap_or("unknown error")
            )),
            (None, None) => Err("bootstrap answer has neither params nor error".to_owned()),
        }
    };
    tokio::time::timeout(timeout, fetch)
        .await
        .unwrap_or_else(|_| {
            Err(format!(
                "bootstrap room {} not filled within {timeout:?}",
                info.bootstrap_room
            ))
        })
}

/// The `disaggregated_params` a prefill worker returns: who prefilled (as the reference reads
/// it, `worker_id.prefill_worker_id` / `prefill_dp_rank`), and the sequence hashes of the full
/// prompt blocks it holds.
pub fn prefill_params(
    worker_id: WorkerId,
    dp_rank: DpRank,
    tokens: &[u32],
    block_size: u32,
) -> Value {
    let mut prev = None;
    let hashes: Vec<u64> = compute_block_hashes(tokens, block_size as usize, &HashSalt::default())
        .into_iter()
        .map(|local| {
            let seq = next_seq_hash(prev, local);
            prev = Some(seq);
            seq.0
        })
        .collect();
    json!({
        "worker_id": { "prefill_worker_id": worker_id, "prefill_dp_rank": dp_rank },
        "prompt_tokens": tokens.len(),
        "block_size": block_size,
        "block_hashes": hashes,
    })
}

/// Where a decode worker's prompt KV comes from.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum KvSource {
    /// Computed here (aggregated serving, or a prefill worker's own request).
    Local,
    /// Pulled from a bootstrap room.
    Bootstrap(BootstrapInfo),
    /// Read with the params of a finished prefill.
    Result(Value),
}

/// Where `request`'s KV comes from on a worker with `role`.
pub(crate) fn kv_source(role: Option<&Role>, request: &PreprocessedRequest) -> KvSource {
    if !matches!(role, Some(Role::Decode(_))) {
        return KvSource::Local;
    }
    if let Some(result) = &request.prefill_result {
        return KvSource::Result(result.disaggregated_params.clone());
    }
    match &request.bootstrap_info {
        Some(info) => KvSource::Bootstrap(info.clone()),
        None => KvSource::Local,
    }
}

/// Checks a prefill's params against the prompt: the blocks they name must be this prompt's
/// (same block size, same chain), or the decode worker would serve someone else's KV.
pub(crate) fn check_params(params: &Value, tokens: &[u32], block_size: u32) -> Result<(), String> {
    let Some(hashes) = params.get("block_hashes").and_then(Value::as_array) else {
        return Err("disaggregated_params has no block_hashes array".to_owned());
    };
    let theirs = params.get("block_size").and_then(Value::as_u64);
    if theirs != Some(u64::from(block_size)) {
        return Err(format!(
            "disaggregated_params block_size must be {block_size}, got {theirs:?}"
        ));
    }
    let expect = prefill_params(0, 0, tokens, block_size);
    if Some(hashes) != expect["block_hashes"].as_array() {
        return Err(format!(
            "disaggregated_params name {} blocks that are not this prompt's {} blocks",
            hashes.len(),
            tokens.len() / block_size as usize
        ));
    }
    Ok(())
}

/// The modelled transfer time of `tokens` worth of KV.
pub(crate) fn transfer_time(
    config: &DecodeConfig,
    tokens: usize,
    block_size: u32,
    speedup: f64,
) -> Duration {
    let blocks = tokens.div_ceil(block_size as usize) as u32;
    config
        .transfer_per_block
        .saturating_mul(blocks)
        .div_f64(speedup)
}

#[cfg(test)]
mod tests;
