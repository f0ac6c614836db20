//! The engine side of vLLM's ZMQ KV event feed: what [`crate::ZmqKvListener`] decodes, encoded as
//! vLLM 0.33's `ZmqEventPublisher` sends it, for simulated engines that must look like vLLM.
//!
//! [`encode_vllm_batch`] writes a batch byte for byte as vLLM's msgspec structs encode it
//! (`KVEventBatch` is `array_like`, so always `[ts, [events], dp_rank or nil]`; each event
//! a map tagged with `"type"` holding its required fields and the optional ones that are set, in
//! declaration order). msgspec sizes a struct's map header by the struct's field count, not by
//! the fields written, so `BlockStored` (16 keys with the tag) always gets a `map16` header; the
//! pinned fixtures in the tests were captured from vLLM's own structs.
//!
//! [`VllmKvPublisher`] binds the PUB socket (frames `[topic, seq as 8 big-endian bytes,
//! payload]`, seq from 0) and the replay ROUTER socket (a request `[identity, b"", start seq]`
//! is answered with `[identity, b"", topic, seq, payload]` for every buffered batch from `start`,
//! then `[identity, b"", b"", -1 as 8 bytes, b""]`), as vLLM's publisher thread does.
//!
//! Per-block `extra_keys` (LoRA names, media, cache salts) are not encoded: kvroute's simulated
//! engines have none.

use std::collections::VecDeque;

use bytes::Bytes;
use kvroute_protocols::zmq_events::{BlockRemoved, BlockStored, EngineEventBatch, EngineKvEvent};
use tokio::sync::mpsc;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

/// How many batches the replay socket keeps by default (vLLM's `buffer_steps`).
pub const DEFAULT_REPLAY_BUFFER: usize = 10_000;

/// The replay protocol's end marker: sequence number -1, as 8 big-endian bytes.
const END_SEQ: [u8; 8] = [0xff; 8];

/// Why a publisher could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum VllmPublisherError {
    /// A socket could not bind its endpoint.
    #[error("cannot bind the {socket} socket to {endpoint}: {message}")]
    Bind {
        /// `PUB` or `ROUTER`.
        socket: &'static str,
        /// The endpoint asked for.
        endpoint: String,
        /// What the ZMQ library said.
        message: String,
    },
}

/// A vLLM-compatible KV event publisher: PUB plus replay ROUTER, served by one task.
///
/// Cheap to publish from any thread; dropping it stops the task and closes both sockets.
#[derive(Debug)]
pub struct VllmKvPublisher {
    tx: mpsc::UnboundedSender<Bytes>,
    endpoint: String,
    replay_endpoint: String,
}

impl VllmKvPublisher {
    /// Binds the PUB socket to `endpoint` and the replay socket to `replay_endpoint` (e.g.
    /// `tcp://127.0.0.1:0` for a free port), sending `topic` on every message and keeping the
    /// last `buffer` batches for replay. Must be called inside a tokio runtime.
    pub async fn bind(
        endpoint: &str,
        replay_endpoint: &str,
        topic: &str,
        buffer: usize,
    ) -> Result<Self, VllmPublisherError> {
        let error = |socket, endpoint: &str, e: zeromq::ZmqError| VllmPublisherError::Bind {
            socket,
            endpoint: endpoint.to_owned(),
            message: e.to_string(),
        };
        let mut publisher = PubSocket::new();
        let bound = publisher
            .bind(endpoint)
            .await
            .map_err(|e| error("PUB", endpoint, e))?
            .to_string();
        let mut replay = RouterSocket::new();
        let replay_bound = replay
            .bind(replay_endpoint)
            .await
            .map_err(|e| error("ROUTER", replay_endpoint, e))?
            .to_string();
        let (tx, rx) = mpsc::unbounded_channel();
        let feed = Feed {
            topic: Bytes::copy_from_slice(topic.as_bytes()),
            next_seq: 0,
            buffer: VecDeque::new(),
            capacity: buffer.max(1),
        };
        tokio::spawn(serve(publisher, replay, rx, feed));
        Ok(Self {
            tx,
            endpoint: bound,
            replay_endpoint: replay_bound,
        })
    }

    /// The PUB socket's bound endpoint (the real port when bound to port 0).
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The replay socket's bound endpoint.
    pub fn replay_endpoint(&self) -> &str {
        &self.replay_endpoint
    }

    /// Numbers `batch` with the next sequence number and sends it. Batches go out in the order
    /// of the calls; a subscriber that is not connected yet misses them (PUB semantics) and can
    /// fetch them from the replay socket.
    pub fn publish(&self, batch: &EngineEventBatch) {
        // The task only ends when this handle is dropped.
        let _ = self.tx.send(encode_vllm_batch(batch).into());
    }
}

/// The publisher task's memory: the topic, the next sequence number and the replay buffer.
struct Feed {
    topic: Bytes,
    next_seq: u64,
    buffer: VecDeque<(u64, Bytes)>,
    capacity: usize,
}

async fn serve(
    mut publisher: PubSocket,
    mut replay: RouterSocket,
    mut rx: mpsc::UnboundedReceiver<Bytes>,
    mut feed: Feed,
) {
    loop {
        tokio::select! {
            payload = rx.recv() => {
                let Some(payload) = payload else { return };
                let seq = feed.next_seq;
                feed.next_seq += 1;
                let frames = vec![feed.topic.clone(), seq_frame(seq), payload.clone()];
                if let Ok(message) = ZmqMessage::try_from(frames)
                    && let Err(error) = publisher.send(message).await
                {
                    tracing::warn!(%error, "vLLM KV event publisher could not send a batch");
                }
                if feed.buffer.len() == feed.capacity {
                    feed.buffer.pop_front();
                }
                feed.buffer.push_back((seq, payload));
            }
            request = replay.recv() => {
                let Ok(request) = request else { return };
                answer_replay(&mut replay, &feed, request.into_vec()).await;
            }
        }
    }
}

/// Answers one replay request as vLLM's `_service_replay` does; a malformed one is ignored.
async fn answer_replay(replay: &mut RouterSocket, feed: &Feed, frames: Vec<Bytes>) {
    let [identity, _, start] = &frames[..] else {
        tracing::warn!(frames = frames.len(), "ignoring a malformed replay request");
        return;
    };
    let mut start_bytes = [0u8; 8];
    let n = start.len().min(8);
    start_bytes[8 - n..].copy_from_slice(&start[start.len() - n..]);
    let start = u64::from_be_bytes(start_bytes);
    let reply = |topic: Bytes, seq: Bytes, payload: Bytes| {
        ZmqMessage::try_from(vec![identity.clone(), Bytes::new(), topic, seq, payload])
    };
    for (seq, payload) in feed.buffer.iter().filter(|(seq, _)| *seq >= start) {
        let Ok(message) = reply(feed.topic.clone(), seq_frame(*seq), payload.clone()) else {
            continue;
        };
        if replay.send(message).await.is_err() {
            return;
        }
    }
    if let Ok(end) = reply(Bytes::new(), Bytes::from_static(&END_SEQ), Bytes::new()) {
        let _ = replay.send(end).await;
    }
}

fn seq_frame(seq: u64) -> Bytes {
    Bytes::copy_from_slice(&seq.to_be_bytes())
}

/// The msgpack payload vLLM 0.33 publishes for `batch` (its `errors` are not encoded).
pub fn encode_vllm_batch(batch: &EngineEventBatch) -> Vec<u8> {
    let mut w = Writer(Vec::with_capacity(64));
    // An `array_like` struct writes every field, defaults included.
    w.array_len(3);
    w.f64(batch.ts);
    w.array_len(batch.events.len());
    for event in &batch.events {
        match event {
            EngineKvEvent::BlockStored(stored) => w.stored(stored),
            EngineKvEvent::BlockRemoved(removed) => w.removed(removed),
            EngineKvEvent::AllBlocksCleared => {
                w.map_len(1, 1);
                w.str("type");
                w.str("AllBlocksCleared");
            }
        }
    }
    w.opt_uint(batch.dp_rank.map(u64::from));
    w.0
}

/// Fields of vLLM 0.33's `BlockStored`, with the tag: msgspec sizes the map header by this.
const BLOCK_STORED_FIELDS: usize = 16;
/// Fields of vLLM 0.33's `BlockRemoved`, with the tag.
const BLOCK_REMOVED_FIELDS: usize = 6;

/// The few msgpack forms vLLM's events use, each in msgpack's shortest encoding (as msgspec
/// writes them) except map headers, which take the struct's size.
struct Writer(Vec<u8>);

impl Writer {
    fn stored(&mut self, s: &BlockStored) {
        let optional = [
            s.group_idx.is_some(),
            s.kv_cache_spec_kind.is_some(),
            s.kv_cache_spec_sliding_window.is_some(),
            s.locality.is_some(),
        ];
        let written = 8 + optional.iter().filter(|&&set| set).count();
        self.map_len(written, BLOCK_STORED_FIELDS);
        self.str("type");
        self.str("BlockStored");
        self.str("block_hashes");
        self.array_len(s.block_hashes.len());
        for h in &s.block_hashes {
            self.uint(h.0);
        }
        self.str("parent_block_hash");
        self.opt_uint(s.parent_block_hash.map(|h| h.0));
        self.str("token_ids");
        self.array_len(s.token_ids.len());
        for &t in &s.token_ids {
            self.uint(u64::from(t));
        }
        self.str("block_size");
        self.uint(u64::from(s.block_size));
        self.str("lora_id");
        self.opt_uint(s.lora_id);
        self.str("medium");
        self.opt_str(s.medium.as_deref());
        self.str("lora_name");
        self.opt_str(s.lora_name.as_deref());
        if let Some(group) = s.group_idx {
            self.str("group_idx");
            self.uint(u64::from(group));
        }
        if let Some(kind) = &s.kv_cache_spec_kind {
            self.str("kv_cache_spec_kind");
            self.str(kind);
        }
        if let Some(window) = s.kv_cache_spec_sliding_window {
            self.str("kv_cache_spec_sliding_window");
            self.uint(window);
        }
        if let Some(locality) = &s.locality {
            self.str("locality");
            self.str(locality);
        }
    }

    fn removed(&mut self, r: &BlockRemoved) {
        let written = 3 + usize::from(r.group_idx.is_some()) + usize::from(r.locality.is_some());
        self.map_len(written, BLOCK_REMOVED_FIELDS);
        self.str("type");
        self.str("BlockRemoved");
        self.str("block_hashes");
        self.array_len(r.block_hashes.len());
        for h in &r.block_hashes {
            self.uint(h.0);
        }
        self.str("medium");
        self.opt_str(r.medium.as_deref());
        if let Some(group) = r.group_idx {
            self.str("group_idx");
            self.uint(u64::from(group));
        }
        if let Some(locality) = &r.locality {
            self.str("locality");
            self.str(locality);
        }
    }

    fn nil(&mut self) {
        self.0.push(0xc0);
    }

    fn f64(&mut self, v: f64) {
        self.0.push(0xcb);
        self.0.extend_from_slice(&v.to_be_bytes());
    }

    fn uint(&mut self, v: u64) {
        match v {
            0..=0x7f => self.0.push(v as u8),
            0x80..=0xff => self.0.extend_from_slice(&[0xcc, v as u8]),
            0x100..=0xffff => {
                self.0.push(0xcd);
                self.0.extend_from_slice(&(v as u16).to_be_bytes());
            }
            0x1_0000..=0xffff_ffff => {
                self.0.push(0xce);
                self.0.extend_from_slice(&(v as u32).to_be_bytes());
            }
            _ => {
                self.0.push(0xcf);
                self.0.extend_from_slice(&v.to_be_bytes());
            }
        }
    }

    fn opt_uint(&mut self, v: Option<u64>) {
        match v {
            Some(v) => self.uint(v),
            None => self.nil(),
        }
    }

    fn str(&mut self, s: &str) {
        let n = s.len();
        match n {
            0..=31 => self.0.push(0xa0 | n as u8),
            32..=0xff => self.0.extend_from_slice(&[0xd9, n as u8]),
            0x100..=0xffff => {
                self.0.push(0xda);
                self.0.extend_from_slice(&(n as u16).to_be_bytes());
            }
            _ => {
                self.0.push(0xdb);
                self.0.extend_from_slice(&(n as u32).to_be_bytes());
            }
        }
        self.0.extend_from_slice(s.as_bytes());
    }

    fn opt_str(&mut self, s: Option<&str>) {
        match s {
            Some(s) => self.str(s),
            None => self.nil(),
        }
    }

    fn array_len(&mut self, n: usize) {
        match n {
            0..=15 => self.0.push(0x90 | n as u8),
            16..=0xffff => {
                self.0.push(0xdc);
                self.0.extend_from_slice(&(n as u16).to_be_bytes());
            }
            _ => {
                self.0.push(0xdd);
                self.0.extend_from_slice(&(n as u32).to_be_bytes());
            }
        }
    }

    /// A map header for `n` entries of a struct with `fields` fields (msgspec reserves the
    /// header for the largest count the struct can write).
    fn map_len(&mut self, n: usize, fields: usize) {
        if fields <= 15 {
            self.0.push(0x80 | n as u8);
        } else {
            self.0.push(0xde);
            self.0.extend_from_slice(&(n as u16).to_be_bytes());
        }
    }
}

#[cfg(test)]
mod tests;
