//! Engine KV events over ZMQ: subscribe to a vLLM or SGLang engine's PUB socket, decode its
//! msgpack batches with `kvroute_protocols::zmq_events`, detect sequence gaps (and fill them from
//! the engine's replay socket when it has one, as vLLM does), and republish every event through
//! the worker's [`KvEventPublisher`] (which numbers it and keeps it for recovery).
//!
//! Connecting waits for the engine's publisher (up to zeromq's 30 s connect timeout), and the
//! subscription reconnects by itself if the engine goes away; messages missed meanwhile show up
//! as a gap.
//!
//! The engine's own block hashes are opaque to the router, so each stored block also gets the
//! router's content hash of its tokens, computed by a [`BlockHasher`] the caller supplies (the
//! router passes kvroute-indexer's hash; this crate must not know the hashing scheme).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use kvroute_protocols::kv_events::{
    KvCacheEventData, KvCacheRemoveData, KvCacheStoreData, KvCacheStoredBlockData, LocalBlockHash,
    StorageTier,
};
use kvroute_protocols::zmq_events::{BlockStored, EngineKvEvent, decode_event_batch};
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

use crate::kv_publisher::KvEventPublisher;

/// The router's content hash of one block: `(tokens of the block, LoRA adapter name)`.
pub type BlockHasher = Arc<dyn Fn(&[u32], Option<&str>) -> LocalBlockHash + Send + Sync>;

/// Where and what to subscribe to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ZmqKvListenerConfig {
    /// The engine's publisher endpoint, e.g. `tcp://127.0.0.1:5557`.
    pub endpoint: String,
    /// The topic prefix to subscribe to (engines usually publish on an empty topic or `kv-events`;
    /// the empty prefix takes everything).
    pub topic: String,
    /// The engine's replay endpoint (vLLM's `replay_endpoint`, a ROUTER socket that re-sends
    /// buffered batches from a sequence number), used to fill sequence gaps; `None` only counts
    /// them.
    pub replay_endpoint: Option<String>,
    /// How long to wait for each replayed message before giving up on the rest of a gap.
    pub replay_timeout: Duration,
}

impl ZmqKvListenerConfig {
    /// Every topic at `endpoint`.
    pub fn new(endpoint: impl Into<String>) -> Self {
        Self {
            endpoint: endpoint.into(),
            topic: String::new(),
            replay_endpoint: None,
            replay_timeout: Duration::from_secs(1),
        }
    }

    /// The same subscription, filling gaps from the engine's replay socket at `endpoint`.
    pub fn with_replay(mut self, endpoint: impl Into<String>) -> Self {
        self.replay_endpoint = Some(endpoint.into());
        self
    }
}

/// Why the listener could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ZmqListenerError {
    /// Connecting or subscribing failed.
    #[error("cannot subscribe to engine KV events at {endpoint}: {message}")]
    Connect {
        /// The endpoint.
        endpoint: String,
        /// The ZMQ library's message.
        message: String,
    },
}

/// Counters of a running listener.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ZmqListenerStats {
    /// Messages received whose payload decoded.
    pub messages: u64,
    /// Engine events republished.
    pub events: u64,
    /// Times the sequence number jumped forward.
    pub gaps: u64,
    /// Messages missing in those jumps that replay did not recover.
    pub lost_messages: u64,
    /// Messages recovered from the engine's replay socket.
    pub replayed_messages: u64,
    /// Times the sequence number went backwards (the engine restarted).
    pub restarts: u64,
    /// Messages or events that could not be decoded and were skipped.
    pub decode_errors: u64,
}

#[derive(Debug, Default)]
struct Counters {
    messages: AtomicU64,
    events: AtomicU64,
    gaps: AtomicU64,
    lost_messages: AtomicU64,
    restarts: AtomicU64,
    replayed_messages: AtomicU64,
    decode_errors: AtomicU64,
}

/// A running subscription; dropping it stops listening.
#[derive(Debug)]
pub struct ZmqKvListener {
    counters: Arc<Counters>,
    task: tokio::task::JoinHandle<()>,
}

impl ZmqKvListener {
    /// Connects to the engine's publisher and republishes its events through `publisher`.
    pub async fn connect(
        config: ZmqKvListenerConfig,
        hasher: BlockHasher,
        publisher: KvEventPublisher,
    ) -> Result<Self, ZmqListenerError> {
        let connect_error = |e: zeromq::ZmqError| ZmqListenerError::Connect {
            endpoint: config.endpoint.clone(),
            message: e.to_string(),
        };
        let mut socket = SubSocket::new();
        socket
            .connect(&config.endpoint)
            .await
            .map_err(connect_error)?;
        socket
            .subscribe(&config.topic)
            .await
            .map_err(connect_error)?;
        let replay = match &config.replay_endpoint {
            None => None,
            Some(endpoint) => {
                let mut dealer = DealerSocket::new();
                dealer
                    .connect(endpoint)
                    .await
                    .map_err(|e| ZmqListenerError::Connect {
                        endpoint: endpoint.clone(),
                        message: e.to_string(),
                    })?;
                Some((dealer, config.replay_timeout))
            }
        };
        let counters = Arc::new(Counters::default());
        let listener = Listener {
            hasher,
            publisher,
            counters: counters.clone(),
            replay,
            last_seq: None,
        };
        let task = tokio::spawn(listen(socket, listener));
        Ok(Self { counters, task })
    }

    /// The counters so far.
    pub fn stats(&self) -> ZmqListenerStats {
        let c = &self.counters;
        ZmqListenerStats {
            messages: c.messages.load(Ordering::Relaxed),
            events: c.events.load(Ordering::Relaxed),
            gaps: c.gaps.load(Ordering::Relaxed),
            lost_messages: c.lost_messages.load(Ordering::Relaxed),
            restarts: c.restarts.load(Ordering::Relaxed),
            replayed_messages: c.replayed_messages.load(Ordering::Relaxed),
            decode_errors: c.decode_errors.load(Ordering::Relaxed),
        }
    }
}

impl Drop for ZmqKvListener {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The replay protocol's end-of-replay sequence number (vLLM sends `-1` as 8 big-endian bytes).
const END_OF_REPLAY: [u8; 8] = [0xff; 8];

/// The state of one subscription: where the sequence is, and where events go.
struct Listener {
    hasher: BlockHasher,
    publisher: KvEventPublisher,
    counters: Arc<Counters>,
    replay: Option<(DealerSocket, Duration)>,
    last_seq: Option<u64>,
}

async fn listen(mut socket: SubSocket, mut listener: Listener) {
    loop {
        let message = match socket.recv().await {
            Ok(message) => message,
            Err(error) => {
                tracing::warn!(%error, "engine KV event subscription ended");
                return;
            }
        };
        let frames = message.into_vec();
        // The sequence number is read before the payload is decoded, so that an undecodable
        // payload counts as a decode error rather than as a gap.
        let (seq, payload) = match &frames[..] {
            [_topic, seq, payload] => match <[u8; 8]>::try_from(&seq[..]) {
                Ok(seq) => (u64::from_be_bytes(seq), payload),
                Err(_) => {
                    listener.skip(format!(
                        "expected an 8-byte sequence frame, got {} bytes",
                        seq.len()
                    ));
                    continue;
                }
            },
            other => {
                listener.skip(format!(
                    "expected 3 frames [topic, seq, payload], got {}",
                    other.len()
                ));
                continue;
            }
        };
        match listener.last_seq {
            Some(last) if seq > last + 1 => {
                listener.counters.gaps.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(last, seq, "engine KV event sequence gap");
                let recovered = listener.replay(last + 1, seq).await;
                listener
                    .counters
                    .lost_messages
                    .fetch_add(seq - last - 1 - recovered, Ordering::Relaxed);
            }
            Some(last) if seq <= last => {
                listener.counters.restarts.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(last, seq, "engine KV event sequence restarted");
            }
            _ => {}
        }
        listener.last_seq = Some(seq);
        listener.handle(payload);
    }
}

impl Listener {
    /// Decodes one batch and republishes its events.
    fn handle(&self, payload: &[u8]) {
        let batch = match decode_event_batch(payload) {
            Ok(batch) => batch,
            Err(error) => return self.skip(error.to_string()),
        };
        self.counters.messages.fetch_add(1, Ordering::Relaxed);
        let dp_rank = batch.dp_rank.unwrap_or(0);
        for event in batch.events {
            match convert(event, &self.hasher) {
                Ok((tier, data)) => {
                    self.publisher.publish_tier(dp_rank, tier, data);
                    self.counters.events.fetch_add(1, Ordering::Relaxed);
                }
                Err(error) => self.skip(error),
            }
        }
    }

    /// Asks the engine's replay socket for messages `from..until` and republishes them in order;
    /// returns how many were recovered. Replies older than `from` (a previous, timed-out replay)
    /// are ignored; a reply that does not arrive within the timeout ends the attempt.
    async fn replay(&mut self, from: u64, until: u64) -> u64 {
        let Some((socket, timeout)) = &mut self.replay else {
            return 0;
        };
        let timeout = *timeout;
        let request = vec![Bytes::new(), Bytes::copy_from_slice(&from.to_be_bytes())];
        let Ok(request) = ZmqMessage::try_from(request) else {
            return 0;
        };
        if let Err(error) = socket.send(request).await {
            tracing::warn!(%error, "cannot ask the engine to replay KV events");
            return 0;
        }
        let mut next = from;
        let mut payloads = Vec::new();
        while next < until {
            let reply = match tokio::time::timeout(timeout, socket.recv()).await {
                Ok(Ok(reply)) => reply.into_vec(),
                Ok(Err(error)) => {
                    tracing::warn!(%error, "engine KV event replay failed");
                    break;
                }
                Err(_) => {
                    tracing::warn!(from, next, until, "engine KV event replay timed out");
                    break;
                }
            };
            // A DEALER sees the reply envelope's empty delimiter: [b"", seq, payload].
            let (seq, payload) = match &reply[..] {
                [delimiter, seq, payload] if delimiter.is_empty() => (seq, payload),
                _ => break,
            };
            if seq[..] == END_OF_REPLAY || payload.is_empty() {
                break;
            }
            let Ok(seq) = <[u8; 8]>::try_from(&seq[..]).map(u64::from_be_bytes) else {
                break;
            };
            if seq < next {
                continue;
            }
            if seq >= until {
                break;
            }
            // A batch the engine no longer buffers (seq > next) stays lost; later ones still help.
            payloads.push(payload.clone());
            next = seq + 1;
        }
        for payload in &payloads {
            self.handle(payload);
        }
        let recovered = payloads.len() as u64;
        self.counters
            .replayed_messages
            .fetch_add(recovered, Ordering::Relaxed);
        recovered
    }

    fn skip(&self, error: String) {
        skip(&self.counters, error);
    }
}

fn skip(counters: &Counters, error: String) {
    counters.decode_errors.fetch_add(1, Ordering::Relaxed);
    tracing::warn!(%error, "skipping undecodable engine KV events");
}

/// Turns one engine event into the router's form.
fn convert(
    event: EngineKvEvent,
    hasher: &BlockHasher,
) -> Result<(StorageTier, KvCacheEventData), String> {
    Ok(match event {
        EngineKvEvent::BlockStored(stored) => (
            tier(stored.medium.as_deref()),
            stored_data(&stored, hasher)?,
        ),
        EngineKvEvent::BlockRemoved(removed) => (
            tier(removed.medium.as_deref()),
            KvCacheEventData::Removed(KvCacheRemoveData {
                block_hashes: removed.block_hashes,
            }),
        ),
        EngineKvEvent::AllBlocksCleared => (StorageTier::Device, KvCacheEventData::Cleared),
    })
}

fn stored_data(stored: &BlockStored, hasher: &BlockHasher) -> Result<KvCacheEventData, String> {
    let blocks = stored.token_blocks();
    if blocks.len() != stored.block_hashes.len() {
        return Err(format!(
            "BlockStored has {} block hashes but {} full blocks of {} tokens",
            stored.block_hashes.len(),
            blocks.len(),
            stored.block_size
        ));
    }
    let lora = stored.lora_name.as_deref();
    let blocks = stored
        .block_hashes
        .iter()
        .zip(blocks)
        .map(|(hash, tokens)| KvCacheStoredBlockData {
            block_hash: *hash,
            tokens_hash: hasher(tokens, lora),
        })
        .collect();
    Ok(KvCacheEventData::Stored(KvCacheStoreData {
        parent_hash: stored.parent_block_hash,
        blocks,
    }))
}

/// Maps an engine's medium name to a storage tier (vLLM: `GPU`, `CPU`/`CPU_PINNED`, `DISK`).
fn tier(medium: Option<&str>) -> StorageTier {
    match medium.map(str::to_ascii_uppercase).as_deref() {
        None | Some("GPU" | "CUDA" | "DEVICE") => StorageTier::Device,
        Some("CPU" | "CPU_PINNED" | "HOST" | "PINNED") => StorageTier::HostPinned,
        Some("DISK" | "LOCAL_DISK" | "SSD") => StorageTier::Disk,
        Some(_) => StorageTier::External,
    }
}
