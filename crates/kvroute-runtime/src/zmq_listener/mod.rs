//! Engine KV events over ZMQ: subscribe to a vLLM or SGLang engine's PUB socket, decode its
//! msgpack batches with `kvroute_protocols::zmq_events`, detect sequence gaps (and fill them from
//! the engine's replay socket when it has one), and republish the events through the worker's
//! [`KvEventPublisher`] (which numbers them and keeps them for recovery).
//!
//! Connecting waits for the engine's publisher (up to zeromq's 30 s connect timeout), and the
//! subscription reconnects by itself if the engine goes away; messages missed meanwhile show up
//! as a gap. The first message received counts as a gap from sequence 0 when it is not 0, so a
//! listener started with its engine replays what the engine published before the subscription
//! took hold. A sequence number that goes backwards is an engine restart: the listener publishes
//! a `Cleared` for every (dp rank, tier) it wrote to before applying the new batch.
//!
//! The engine's own block hashes are opaque to the router, so each stored block also gets the
//! router's content hash of its tokens, computed by a [`BlockHasher`] the caller supplies (the
//! router passes kvroute-indexer's hash; this crate must not know the hashing scheme) with the
//! block's [`BlockSalt`]. Rules (see `translate.rs`):
//! - The cache salt (vLLM's per-block `extra_keys`, on a request's first block only; SGLang's
//!   `cache_salt`, on every event) applies to every block of the chain: a block without one
//!   takes the salt of the same engine block in another tier (vLLM's offloading events carry no
//!   extra keys), else inherits its parent's.
//! - A block whose `extra_keys` carry more than its LoRA name and cache salt (multimodal items,
//!   prompt embeddings, unknown keys), a block without tokens (vLLM's offloading placeholders)
//!   and a LoRA block named by number only (vLLM 0.10) cannot be hashed by the router: it and the
//!   rest of its chain are skipped and counted.
//! - Of a hybrid model's KV cache groups (vLLM's `group_idx`) one feeds the index: the first
//!   group stored whose kind holds whole prefixes; other groups' events are skipped and counted.
//! - An event whose `block_size` differs from [`ZmqKvListenerConfig::block_size`] is skipped,
//!   counted and logged as an error; [`ZmqKvListener::check`] turns it into an error.
//! - The index learns exactly the blocks the listener remembers: a block already republished is
//!   not stored twice (vLLM re-announces reused prefixes), a removal names only remembered
//!   blocks, and a continuation of a block it does not remember is skipped (the index would
//!   reject it). zeromq's DEALER does not reconnect, so the replay socket is connected afresh
//!   after an engine restart or a failed replay.
//!
//! The listener remembers the blocks it republished (bounded by
//! [`ZmqKvListenerConfig::max_tracked_blocks`]) for the rules above. Dumps for routers that
//! subscribe later come from the worker's publisher: [`KvEventPublisher::tracking_blocks`] keeps
//! the blocks its events hold.

mod translate;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use kvroute_protocols::kv_events::LocalBlockHash;
use kvroute_protocols::zmq_events::decode_event_batch;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

use crate::kv_publisher::KvEventPublisher;
use translate::Translator;

/// The router's content hash of one block: its tokens and what else names the block's cache.
pub type BlockHasher = Arc<dyn Fn(&[u32], BlockSalt<'_>) -> LocalBlockHash + Send + Sync>;

/// What besides its tokens names a block's cache, as the router's hash folds it in.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct BlockSalt<'a> {
    /// The LoRA adapter the block was computed with.
    pub lora_name: Option<&'a str>,
    /// The request's cache salt (vLLM's `cache_salt`, SGLang's cache salt): a private cache
    /// namespace.
    pub cache_salt: Option<&'a str>,
}

/// How many blocks a listener remembers unless told otherwise (about 35 MB when full).
pub const DEFAULT_MAX_TRACKED_BLOCKS: usize = 1 << 20;

/// Where and what to subscribe to, and what to expect.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ZmqKvListenerConfig {
    /// The engine's publisher endpoint, e.g. `tcp://127.0.0.1:5557`.
    pub endpoint: String,
    /// The topic prefix to subscribe to (engines usually publish on an empty topic or `kv-events`;
    /// the empty prefix takes everything).
    pub topic: String,
    /// The engine's replay endpoint (a ROUTER socket that re-sends buffered batches from a
    /// sequence number), used to fill sequence gaps; `None` only counts them.
    pub replay_endpoint: Option<String>,
    /// How long to wait for each replayed message before giving up on the rest of a gap.
    pub replay_timeout: Duration,
    /// Tokens per block the worker's requests are hashed with; events of another block size are
    /// skipped and counted (they could never match). `None` accepts any size.
    pub block_size: Option<u32>,
    /// Most blocks remembered (for salt inheritance and duplicate filtering); blocks beyond it
    /// are not republished (counted in [`ZmqListenerStats::untracked_blocks`]).
    pub max_tracked_blocks: usize,
}

impl ZmqKvListenerConfig {
    /// Every topic at `endpoint`, no replay, any block size.
    pub fn new(endpoint: impl Into<String>) -> Self {
        Self {
            endpoint: endpoint.into(),
            topic: String::new(),
            replay_endpoint: None,
            replay_timeout: Duration::from_secs(1),
            block_size: None,
            max_tracked_blocks: DEFAULT_MAX_TRACKED_BLOCKS,
        }
    }

    /// The same subscription, filling gaps from the engine's replay socket at `endpoint`.
    pub fn with_replay(mut self, endpoint: impl Into<String>) -> Self {
        self.replay_endpoint = Some(endpoint.into());
        self
    }

    /// The same subscription, accepting only blocks of `tokens` tokens (the worker's block size).
    pub fn with_block_size(mut self, tokens: u32) -> Self {
        self.block_size = Some(tokens);
        self
    }

    /// The same subscription, limited to topics starting with `topic`.
    pub fn with_topic(mut self, topic: impl Into<String>) -> Self {
        self.topic = topic.into();
        self
    }

    /// The same subscription, waiting `timeout` for each replayed message.
    pub fn with_replay_timeout(mut self, timeout: Duration) -> Self {
        self.replay_timeout = timeout;
        self
    }

    /// The same subscription, remembering at most `blocks` blocks.
    pub fn with_max_tracked_blocks(mut self, blocks: usize) -> Self {
        self.max_tracked_blocks = blocks;
        self
    }
}

/// Why the listener could not start, or cannot work as configured.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
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
    /// The engine publishes blocks of another size than the worker hashes: no prefix can match.
    #[error(
        "the engine's KV events use {engine} tokens per block but the worker expects {expected}: \
         start the engine with --block-size {expected} (vLLM) or --page-size {expected} (SGLang), \
         or configure the worker with block size {engine}"
    )]
    BlockSizeMismatch {
        /// The worker's block size.
        expected: u32,
        /// The first mismatching block size the engine sent.
        engine: u32,
    },
}

/// Counters of a running listener.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ZmqListenerStats {
    /// Messages received whose payload decoded.
    pub messages: u64,
    /// Engine events republished (in whole or in part).
    pub events: u64,
    /// Times the sequence number jumped forward (or started above 0).
    pub gaps: u64,
    /// Messages missing in those jumps that replay did not recover.
    pub lost_messages: u64,
    /// Messages recovered from the engine's replay socket.
    pub replayed_messages: u64,
    /// Times the sequence number went backwards (the engine restarted).
    pub restarts: u64,
    /// Messages or events that could not be decoded and were skipped.
    pub decode_errors: u64,
    /// Stored events skipped because their block size is not the worker's.
    pub block_size_mismatches: u64,
    /// The block size of the first of them.
    pub first_mismatched_block_size: Option<u32>,
    /// Events of KV cache groups that do not feed the index, skipped.
    pub other_group_events: u64,
    /// Blocks the router cannot hash (media, prompt embeddings, unknown extra keys, no tokens,
    /// a LoRA without a name) and the rest of their chains, skipped.
    pub unhashable_blocks: u64,
    /// Blocks whose parent this listener never republished (stored before it subscribed, or
    /// skipped), skipped as the index would reject them.
    pub orphan_blocks: u64,
    /// Blocks not republished because the block table was full.
    pub untracked_blocks: u64,
    /// Blocks currently remembered (republished and not removed).
    pub tracked_blocks: u64,
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
    block_size_mismatches: AtomicU64,
    /// The first mismatching block size plus one; 0 for none.
    first_mismatched_block_size: AtomicU64,
    other_group_events: AtomicU64,
    unhashable_blocks: AtomicU64,
    orphan_blocks: AtomicU64,
    untracked_blocks: AtomicU64,
    tracked_blocks: AtomicU64,
}

/// A running subscription; dropping it stops listening.
#[derive(Debug)]
pub struct ZmqKvListener {
    counters: Arc<Counters>,
    block_size: Option<u32>,
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
                // The first connection waits as long as the subscription's (zeromq's timeout).
                let mut dealer = DealerSocket::new();
                dealer
                    .connect(endpoint)
                    .await
                    .map_err(|e| ZmqListenerError::Connect {
                        endpoint: endpoint.clone(),
                        message: e.to_string(),
                    })?;
                Some(Replay {
                    endpoint: endpoint.clone(),
                    socket: Some(dealer),
                    timeout: config.replay_timeout,
                })
            }
        };
        if config.block_size.is_none() {
            tracing::warn!(
                endpoint = %config.endpoint,
                "engine KV event block sizes are not checked: set the worker's block size"
            );
        }
        let counters = Arc::new(Counters::default());
        let translator = Translator::new(
            hasher,
            config.block_size,
            config.max_tracked_blocks,
            counters.clone(),
        );
        let listener = Listener {
            translator,
            publisher,
            counters: counters.clone(),
            replay,
            last_seq: None,
        };
        let task = tokio::spawn(listen(socket, listener));
        Ok(Self {
            counters,
            block_size: config.block_size,
            task,
        })
    }

    /// The counters so far.
    pub fn stats(&self) -> ZmqListenerStats {
        let c = &self.counters;
        let load = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        ZmqListenerStats {
            messages: load(&c.messages),
            events: load(&c.events),
            gaps: load(&c.gaps),
            lost_messages: load(&c.lost_messages),
            restarts: load(&c.restarts),
            replayed_messages: load(&c.replayed_messages),
            decode_errors: load(&c.decode_errors),
            block_size_mismatches: load(&c.block_size_mismatches),
            first_mismatched_block_size: load(&c.first_mismatched_block_size)
                .checked_sub(1)
                .and_then(|size| u32::try_from(size).ok()),
            other_group_events: load(&c.other_group_events),
            unhashable_blocks: load(&c.unhashable_blocks),
            orphan_blocks: load(&c.orphan_blocks),
            untracked_blocks: load(&c.untracked_blocks),
            tracked_blocks: load(&c.tracked_blocks),
        }
    }

    /// An error if the feed cannot work as configured: the engine sent blocks of another size
    /// than [`ZmqKvListenerConfig::block_size`]. A worker should fail (or at least refuse to
    /// advertise KV events) on it.
    pub fn check(&self) -> Result<(), ZmqListenerError> {
        match (self.block_size, self.stats().first_mismatched_block_size) {
            (Some(expected), Some(engine)) => {
                Err(ZmqListenerError::BlockSizeMismatch { expected, engine })
            }
            _ => Ok(()),
        }
    }
}

impl Drop for ZmqKvListener {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The replay protocol's end-of-replay sequence number (`-1` as 8 big-endian bytes).
const END_OF_REPLAY: [u8; 8] = [0xff; 8];

/// How long reconnecting to the engine's replay socket may take (the engine is up: it just
/// published).
const REPLAY_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

async fn connect_dealer(endpoint: &str) -> Result<DealerSocket, ZmqListenerError> {
    let error = |message: String| ZmqListenerError::Connect {
        endpoint: endpoint.to_owned(),
        message,
    };
    let mut dealer = DealerSocket::new();
    match tokio::time::timeout(REPLAY_CONNECT_TIMEOUT, dealer.connect(endpoint)).await {
        Ok(Ok(())) => Ok(dealer),
        Ok(Err(e)) => Err(error(e.to_string())),
        Err(_) => Err(error(format!(
            "no connection within {REPLAY_CONNECT_TIMEOUT:?}"
        ))),
    }
}

/// The engine's replay socket. zeromq's DEALER does not reconnect by itself, so the socket is
/// dropped when the engine restarts or a replay fails, and connected afresh for the next gap.
struct Replay {
    endpoint: String,
    socket: Option<DealerSocket>,
    timeout: Duration,
}

impl Replay {
    fn disconnect(&mut self) {
        self.socket = None;
    }

    /// Asks for the batches from `from` and reads the whole answer, up to its end marker, so the
    /// socket is clean for the next gap; returns the batches in `from..until`, in order. On a
    /// failure, returns what arrived before it too, and the caller drops the socket (with
    /// whatever it still has queued).
    async fn fetch(&mut self, from: u64, until: u64) -> Result<Vec<Bytes>, (String, Vec<Bytes>)> {
        let mut payloads = Vec::new();
        if self.socket.is_none() {
            let socket = connect_dealer(&self.endpoint)
                .await
                .map_err(|e| (e.to_string(), Vec::new()))?;
            self.socket = Some(socket);
        }
        let Some(socket) = &mut self.socket else {
            return Err(("no replay socket".into(), payloads));
        };
        let request = vec![Bytes::new(), Bytes::copy_from_slice(&from.to_be_bytes())];
        let request = ZmqMessage::try_from(request).map_err(|e| (e.to_string(), Vec::new()))?;
        socket
            .send(request)
            .await
            .map_err(|e| (e.to_string(), Vec::new()))?;
        let mut next = from;
        loop {
            let reply = match tokio::time::timeout(self.timeout, socket.recv()).await {
                Ok(Ok(reply)) => reply.into_vec(),
                Ok(Err(error)) => return Err((error.to_string(), payloads)),
                Err(_) => {
                    let error = format!("no reply within {:?} (at {next})", self.timeout);
                    return Err((error, payloads));
                }
            };
            match parse_replay_reply(&reply) {
                Err(error) => return Err((error, payloads)),
                Ok(ReplayReply::End) => return Ok(payloads),
                // Already received live: not needed.
                Ok(ReplayReply::Batch { seq, .. }) if seq < next || seq >= until => {}
                Ok(ReplayReply::Batch { seq, payload }) => {
                    // A batch the engine no longer buffers (seq > next) stays lost; later ones
                    // still help.
                    payloads.push(payload.clone());
                    next = seq + 1;
                }
            }
        }
    }
}

/// The state of one subscription: where the sequence is, and where events go.
struct Listener {
    translator: Translator,
    publisher: KvEventPublisher,
    counters: Arc<Counters>,
    replay: Option<Replay>,
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
        // Where the sequence should be: the first message of a subscription should be 0.
        let mut expected = listener.last_seq.map_or(0, |last| last + 1);
        if seq < expected {
            listener.counters.restarts.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                last = expected - 1,
                seq,
                "engine KV event sequence went back: the engine restarted, clearing its blocks"
            );
            listener.restart();
            // The new engine numbers from 0 again: what it sent before `seq` is a gap.
            expected = 0;
        }
        if seq > expected {
            listener.counters.gaps.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(expected, seq, "engine KV event sequence gap");
            let recovered = listener.replay(expected, seq).await;
            listener
                .counters
                .lost_messages
                .fetch_add(seq - expected - recovered, Ordering::Relaxed);
        }
        listener.last_seq = Some(seq);
        listener.handle(payload);
    }
}

impl Listener {
    /// Decodes one batch and republishes its events.
    fn handle(&mut self, payload: &[u8]) {
        let batch = match decode_event_batch(payload) {
            Ok(batch) => batch,
            Err(error) => return self.skip(error.to_string()),
        };
        self.counters.messages.fetch_add(1, Ordering::Relaxed);
        for (dp_rank, tier, data) in self.translator.batch(batch) {
            self.publisher.publish_tier(dp_rank, tier, data);
        }
    }

    /// Clears every lane the engine's previous life wrote to.
    fn restart(&mut self) {
        if let Some(replay) = &mut self.replay {
            // The engine's new replay socket is another peer.
            replay.disconnect();
        }
        for (dp_rank, tier, data) in self.translator.restart() {
            self.publisher.publish_tier(dp_rank, tier, data);
        }
    }

    /// Asks the engine's replay socket for messages `from..until` and republishes them in order;
    /// returns how many were recovered. Replies of an earlier, timed-out replay are skipped; a
    /// reply that does not arrive within the timeout ends the attempt.
    async fn replay(&mut self, from: u64, until: u64) -> u64 {
        let Some(replay) = &mut self.replay else {
            return 0;
        };
        let payloads = match replay.fetch(from, until).await {
            Ok(payloads) => payloads,
            Err((error, payloads)) => {
                tracing::warn!(from, until, %error, "engine KV event replay failed");
                replay.disconnect();
                payloads
            }
        };
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
        self.counters.decode_errors.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(%error, "skipping undecodable engine KV events");
    }
}

/// One message from the engine's replay socket.
#[derive(Debug, Clone, PartialEq, Eq)]
enum ReplayReply<'a> {
    /// A buffered batch.
    Batch { seq: u64, payload: &'a Bytes },
    /// The end of this replay.
    End,
}

/// Reads a replay reply as a DEALER sees it: `[b"", topic, seq, payload]` from current vLLM and
/// SGLang, `[b"", seq, payload]` from vLLM 0.10; the end marker has sequence -1 (and an empty
/// payload).
fn parse_replay_reply(frames: &[Bytes]) -> Result<ReplayReply<'_>, String> {
    let (seq, payload) = match frames {
        [delimiter, _, seq, payload] | [delimiter, seq, payload] if delimiter.is_empty() => {
            (seq, payload)
        }
        other => {
            return Err(format!(
                "expected [b\"\", topic, seq, payload] or [b\"\", seq, payload], got {} frames",
                other.len()
            ));
        }
    };
    if seq[..] == END_OF_REPLAY {
        return Ok(ReplayReply::End);
    }
    let seq = <[u8; 8]>::try_from(&seq[..])
        .map(u64::from_be_bytes)
        .map_err(|_| format!("expected an 8-byte sequence frame, got {} bytes", seq.len()))?;
    Ok(ReplayReply::Batch { seq, payload })
}

#[cfg(test)]
mod tests;
