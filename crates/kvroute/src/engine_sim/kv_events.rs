//! One simulated engine's KV events as vLLM publishes them (`--kv-events`).
//!
//! The mocker's events name blocks by the indexer's sequence hash and carry no tokens, while
//! vLLM's `BlockStored` carries every stored block's tokens (the router hashes them itself). So
//! the HTTP side tells [`BlockTokens`] the tokens of each request's blocks (prompt at admission,
//! output as it streams) and holds them while the request lives; the feed task translates the
//! mocker's events in order, attaching the tokens, and holds a stored block's tokens until its
//! `Removed`. A request lets go of its blocks [`RELEASE_GRACE`] after it ends, because the engine
//! publishes a step's events after it sends the step's tokens, so the release must not overtake
//! the `Stored` it covers; a `Stored` whose tokens have not arrived yet (its last token is still
//! on its way to the HTTP side) waits for them up to [`TOKENS_WAIT`].
//!
//! The engine's block hash is the mocker's sequence hash, published as an integer: block hashes
//! are opaque to the listener.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::future::BoxFuture;
use kvroute_indexer::hash::{HashSalt, SequenceHash, compute_block_hash, next_seq_hash};
use kvroute_protocols::kv_events::{KvCacheEventData, KvCacheStoreData, RouterEvent};
use kvroute_protocols::zmq_events::{BlockRemoved, BlockStored, EngineEventBatch, EngineKvEvent};
use kvroute_runtime::{
    EventPlane, EventPlaneError, KvEventPublisher, Subscription, VllmKvPublisher,
    decode_router_event,
};
use parking_lot::Mutex;
use tokio::sync::{Notify, mpsc};

/// How long after its request ends a block's tokens stay held for a `Stored` still in flight.
const RELEASE_GRACE: Duration = Duration::from_secs(2);
/// How long a `Stored` waits for tokens the HTTP side has not registered yet.
const TOKENS_WAIT: Duration = Duration::from_secs(1);
/// vLLM's name of device memory.
const MEDIUM: &str = "GPU";

/// The tokens of the blocks some request or the engine's cache still needs, by sequence hash.
#[derive(Default)]
pub(super) struct BlockTokens {
    blocks: Mutex<HashMap<u64, Held>>,
    added: Notify,
}

struct Held {
    tokens: Box<[u32]>,
    /// Live requests holding the block, plus one while the engine has it cached.
    refs: u32,
}

impl BlockTokens {
    fn hold(&self, hash: u64, tokens: &[u32]) {
        self.blocks
            .lock()
            .entry(hash)
            .or_insert_with(|| Held {
                tokens: tokens.into(),
                refs: 0,
            })
            .refs += 1;
        self.added.notify_waiters();
    }

    fn release(&self, hashes: &[u64]) {
        let mut blocks = self.blocks.lock();
        for hash in hashes {
            if let Some(held) = blocks.get_mut(hash) {
                held.refs -= 1;
                if held.refs == 0 {
                    blocks.remove(hash);
                }
            }
        }
    }

    /// Takes a cache reference on `hash` and appends its tokens to `out`; waits for the tokens
    /// up to [`TOKENS_WAIT`]. False when they never came.
    async fn cache(&self, hash: u64, out: &mut Vec<u32>) -> bool {
        let deadline = tokio::time::Instant::now() + TOKENS_WAIT;
        loop {
            let added = self.added.notified();
            tokio::pin!(added);
            added.as_mut().enable();
            if let Some(held) = self.blocks.lock().get_mut(&hash) {
                held.refs += 1;
                out.extend_from_slice(&held.tokens);
                return true;
            }
            if tokio::time::timeout_at(deadline, added).await.is_err() {
                return false;
            }
        }
    }
}

/// One request's hold on the blocks of its sequence, prompt then output, as they fill.
pub(super) struct RequestBlocks {
    store: Arc<BlockTokens>,
    block_size: usize,
    parent: Option<SequenceHash>,
    partial: Vec<u32>,
    held: Vec<u64>,
}

impl RequestBlocks {
    pub(super) fn new(store: Arc<BlockTokens>, block_size: u32) -> Self {
        Self {
            store,
            block_size: block_size as usize,
            parent: None,
            partial: Vec::new(),
            held: Vec::new(),
        }
    }

    /// Adds tokens to the sequence; every block they fill is held.
    pub(super) fn push(&mut self, tokens: &[u32]) {
        for &token in tokens {
            self.partial.push(token);
            if self.partial.len() == self.block_size {
                let local = compute_block_hash(&self.partial, &HashSalt::default());
                let seq = next_seq_hash(self.parent, local);
                self.store.hold(seq.0, &self.partial);
                self.held.push(seq.0);
                self.parent = Some(seq);
                self.partial.clear();
            }
        }
    }
}

impl Drop for RequestBlocks {
    fn drop(&mut self) {
        let held = std::mem::take(&mut self.held);
        if held.is_empty() {
            return;
        }
        let store = Arc::clone(&self.store);
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                tokio::time::sleep(RELEASE_GRACE).await;
                store.release(&held);
            });
        }
    }
}

/// Starts the feed of one engine: binds vLLM's PUB and replay sockets on `host` (free ports;
/// the replay socket keeps `buffer` batches), forwards the engine's events from `events` to
/// them. Returns the publisher (its endpoints) and the token store the HTTP side fills.
pub(super) async fn start(
    host: &str,
    events: &KvEventPublisher,
    block_size: u32,
    buffer: usize,
) -> anyhow::Result<(Arc<VllmKvPublisher>, Arc<BlockTokens>)> {
    let any = format!("tcp://{host}:0");
    let zmq = Arc::new(VllmKvPublisher::bind(&any, &any, "", buffer).await?);
    let (tx, rx) = mpsc::unbounded_channel();
    if !events.forward_to(Arc::new(Sink(tx))) {
        anyhow::bail!("the engine's KV event publisher already forwards elsewhere");
    }
    let store = Arc::new(BlockTokens::default());
    tokio::spawn(feed(rx, Arc::clone(&store), Arc::clone(&zmq), block_size));
    Ok((zmq, store))
}

/// An event plane that hands the engine's events, in order and as they are, to the feed task.
struct Sink(mpsc::UnboundedSender<RouterEvent>);

impl EventPlane for Sink {
    fn publish<'a>(
        &'a self,
        _subject: &'a str,
        payload: Bytes,
    ) -> BoxFuture<'a, Result<(), EventPlaneError>> {
        // The publisher sends only KV events, through `publish_router_event`.
        let result = match decode_router_event(&payload) {
            Ok(event) => {
                let _ = self.0.send(event);
                Ok(())
            }
            Err(_) => Err(EventPlaneError::Unsupported {
                what: "publishing anything but KV events to the simulated engine's event sink",
            }),
        };
        Box::pin(async move { result })
    }

    fn publish_router_event(
        &self,
        event: RouterEvent,
    ) -> BoxFuture<'_, Result<(), EventPlaneError>> {
        let _ = self.0.send(event);
        Box::pin(async { Ok(()) })
    }

    fn subscribe<'a>(
        &'a self,
        _pattern: &'a str,
    ) -> BoxFuture<'a, Result<Subscription, EventPlaneError>> {
        Box::pin(async {
            Err(EventPlaneError::Unsupported {
                what: "subscribing to the simulated engine's event sink",
            })
        })
    }
}

/// Translates the engine's events into vLLM batches: what arrived together goes out together.
async fn feed(
    mut rx: mpsc::UnboundedReceiver<RouterEvent>,
    store: Arc<BlockTokens>,
    zmq: Arc<VllmKvPublisher>,
    block_size: u32,
) {
    while let Some(first) = rx.recv().await {
        let mut arrived = vec![first];
        while let Ok(more) = rx.try_recv() {
            arrived.push(more);
        }
        let mut events = Vec::with_capacity(arrived.len());
        for event in arrived {
            translate(&store, event, block_size, &mut events).await;
        }
        if events.is_empty() {
            continue;
        }
        let ts = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        zmq.publish(&EngineEventBatch {
            ts,
            events,
            dp_rank: Some(0),
            errors: Vec::new(),
        });
    }
}

async fn translate(
    store: &BlockTokens,
    event: RouterEvent,
    block_size: u32,
    out: &mut Vec<EngineKvEvent>,
) {
    match event.event.data {
        KvCacheEventData::Stored(stored) => {
            if let Some(stored) = vllm_stored(store, stored, block_size).await {
                out.push(EngineKvEvent::BlockStored(stored));
            }
        }
        KvCacheEventData::Removed(removed) => {
            let hashes: Vec<u64> = removed.block_hashes.iter().map(|h| h.0).collect();
            store.release(&hashes);
            out.push(EngineKvEvent::BlockRemoved(BlockRemoved {
                block_hashes: removed.block_hashes,
                medium: Some(MEDIUM.to_owned()),
                ..BlockRemoved::default()
            }));
        }
        KvCacheEventData::Cleared => out.push(EngineKvEvent::AllBlocksCleared),
    }
}

/// The `BlockStored` of a mocker `Stored`; a chain is cut at the first block whose tokens never
/// arrived (its descendants then reach the listener as orphans, which it skips and counts).
async fn vllm_stored(
    store: &BlockTokens,
    stored: KvCacheStoreData,
    block_size: u32,
) -> Option<BlockStored> {
    let mut block_hashes = Vec::with_capacity(stored.blocks.len());
    let mut token_ids = Vec::with_capacity(stored.blocks.len() * block_size as usize);
    for block in &stored.blocks {
        if !store.cache(block.block_hash.0, &mut token_ids).await {
            tracing::warn!(
                hash = block.block_hash.0,
                "no tokens known for a stored block: its chain is not published"
            );
            break;
        }
        block_hashes.push(block.block_hash);
    }
    (!block_hashes.is_empty()).then(|| BlockStored {
        block_hashes,
        parent_block_hash: stored.parent_hash,
        token_ids,
        block_size,
        medium: Some(MEDIUM.to_owned()),
        ..BlockStored::default()
    })
}

#[cfg(test)]
mod tests;
