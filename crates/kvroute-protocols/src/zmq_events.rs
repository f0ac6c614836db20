//! KV cache events as engines (vLLM, SGLang) publish them over ZMQ.
//!
//! A ZMQ message has three frames: `[topic, seq, payload]`, where `seq` is an 8-byte big-endian
//! sequence number and `payload` is `msgpack([ts, [events], dp_rank])` (`dp_rank` may be nil or
//! absent). Engines encode each event with msgspec's `tag=True`, either as an array led by the
//! class name (vLLM 0.10: `["BlockStored", hashes, parent, tokens, block_size, lora_id, medium]`,
//! later fields in the declaration order of vLLM 0.33's struct: `lora_name, extra_keys,
//! group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window, locality`) or as a map with a
//! `"type"` key (vLLM 0.33, SGLang 0.5). Trailing fields that were defaults may be omitted, and
//! newer engines add fields we do not know: both are accepted. Block hashes are integers (signed or
//! unsigned 64-bit) or bytes (e.g. sha256 digests, folded to their last 8 bytes, big-endian, as the
//! reference does).
//!
//! What changes a block's identity besides its tokens is decoded too: vLLM's per-block
//! `extra_keys` (the LoRA name, multimodal `(identifier, offset)` pairs, the request's cache salt
//! on the request's first block only, prompt-embedding digests; published untagged, in that
//! order) into [`BlockExtraKeys`], and SGLang's `cache_salt` (on every event of a salted request).
//!
//! Decoding walks the msgpack bytes once, directly (with `rmp`'s markers), checking as it goes
//! that they are whole msgpack nesting at most [`MAX_DEPTH`] deep: block hashes and token ids go
//! straight from the bytes into their vectors, strings are borrowed until kept, and no value tree
//! is built. It never panics, and its memory use is bounded by a small multiple of the payload
//! size: a length read from the payload is never trusted for more than the bytes left. A payload
//! that is not msgpack fails as a whole; an event that does not decode is reported in
//! [`EngineEventBatch::errors`] and the batch's other events are kept, so one unknown or malformed
//! event does not cost the router the rest of the batch.

use std::fmt::{self, Display};

use crate::DpRank;
use crate::ProtocolError;
use crate::kv_events::ExternalSequenceBlockHash;

mod extra_keys;
mod msgpack;

use extra_keys::extra_keys;
use msgpack::{Cursor, Int, Item, Malformed, is_nil};

/// Maximum msgpack nesting accepted in a payload, counted as `rmpv` counts it: a container costs
/// two, a scalar one, bytes two, a string three. Real payloads need 15 (a multimodal identifier,
/// a string in a pair in a block's entry of `extra_keys` in an event in the events of the batch).
pub const MAX_DEPTH: usize = 32;

/// One decoded ZMQ message.
#[derive(Debug, Clone, PartialEq)]
pub struct ZmqKvMessage {
    /// The topic frame (engines usually send an empty topic or `kv-events`).
    pub topic: Vec<u8>,
    /// The publisher's sequence number; a jump reveals lost messages.
    pub seq: u64,
    /// The events.
    pub batch: EngineEventBatch,
}

/// The payload of one ZMQ message.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineEventBatch {
    /// Engine timestamp (seconds since the epoch, as a float).
    pub ts: f64,
    /// The events that decoded, in order.
    pub events: Vec<EngineKvEvent>,
    /// The data-parallel rank that emitted the batch, if the engine says.
    pub dp_rank: Option<DpRank>,
    /// One error per event that did not decode (each names the event's index); those events
    /// are left out of `events`.
    pub errors: Vec<ProtocolError>,
}

/// One event as the engine describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EngineKvEvent {
    /// Blocks were cached.
    BlockStored(BlockStored),
    /// Blocks were evicted.
    BlockRemoved(BlockRemoved),
    /// The whole cache was dropped.
    AllBlocksCleared,
}

/// A chain of newly cached blocks.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BlockStored {
    /// The engine's hashes of the stored blocks, in sequence order.
    pub block_hashes: Vec<ExternalSequenceBlockHash>,
    /// The block this chain continues, if any.
    pub parent_block_hash: Option<ExternalSequenceBlockHash>,
    /// The tokens of all stored blocks, concatenated. Empty for vLLM's offloading placeholders
    /// (a lower-tier copy of a block whose tokens the connector did not record).
    pub token_ids: Vec<u32>,
    /// Tokens per block; 0 only when `token_ids` is empty.
    pub block_size: u32,
    /// Deprecated numeric LoRA id (older vLLM).
    pub lora_id: Option<u64>,
    /// Storage medium (vLLM: `GPU`, `CPU`, `STORAGE`; SGLang: `GPU`, `CPU_PINNED`, `DISK`,
    /// `EXTERNAL`), if the engine says.
    pub medium: Option<String>,
    /// LoRA adapter name, part of the block's identity when set.
    pub lora_name: Option<String>,
    /// vLLM's extra hash keys, one entry per block hash; empty when the engine sent none.
    pub extra_keys: Vec<BlockExtraKeys>,
    /// SGLang's cache salt of the request that stored these blocks (on every event).
    pub cache_salt: Option<String>,
    /// vLLM's KV cache group (hybrid models have several: full attention, sliding window,
    /// mamba...); `None` when the engine does not say (one group).
    pub group_idx: Option<u32>,
    /// vLLM's kind of that group (`full_attention`, `sliding_window`, `mamba`, ...).
    pub kv_cache_spec_kind: Option<String>,
    /// vLLM's sliding window of that group, in tokens.
    pub kv_cache_spec_sliding_window: Option<u64>,
    /// vLLM's `LOCAL` or `REMOTE`, relative to the publisher, for offloading tiers.
    pub locality: Option<String>,
}

impl BlockStored {
    /// The tokens of each full block, in order (a partial trailing chunk is not a block).
    pub fn token_blocks(&self) -> std::slice::ChunksExact<'_, u32> {
        // `block_size` is validated to be at least 1 whenever there are tokens.
        self.token_ids.chunks_exact(self.block_size.max(1) as usize)
    }
}

/// What vLLM folds into one block's hash besides its tokens (and its parent's hash), decoded from
/// the untagged `extra_keys` entry it publishes: the LoRA name first when the event names a LoRA
/// (not repeated here: it is [`BlockStored::lora_name`]), then multimodal `(identifier, offset)`
/// pairs, then the cache salt (a string, on the first block of a request only), then
/// prompt-embedding digests (bytes).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BlockExtraKeys {
    /// The request's cache salt.
    pub cache_salt: Option<String>,
    /// Multimodal items overlapping the block.
    pub mm: Vec<MmExtraKey>,
    /// Digests of the block's prompt embeddings.
    pub prompt_embeds: Vec<Vec<u8>>,
    /// Entries of no shape listed above (a newer engine's keys, a second string).
    pub unknown: u32,
}

impl BlockExtraKeys {
    /// Whether the block's identity depends on more than its tokens, LoRA name and cache salt
    /// (media, prompt embeddings or keys this decoder does not know).
    pub fn has_content_keys(&self) -> bool {
        !self.mm.is_empty() || !self.prompt_embeds.is_empty() || self.unknown > 0
    }
}

/// A multimodal item in a block's extra keys.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MmExtraKey {
    /// The item's identifier (its content hash, as the engine computed it).
    pub identifier: String,
    /// Where the item starts, in tokens from the block's first token (negative when it started
    /// in an earlier block).
    pub offset: i64,
}

/// Evicted blocks.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BlockRemoved {
    /// The engine's hashes of the evicted blocks.
    pub block_hashes: Vec<ExternalSequenceBlockHash>,
    /// Storage medium, if the engine says.
    pub medium: Option<String>,
    /// vLLM's KV cache group the blocks left.
    pub group_idx: Option<u32>,
    /// vLLM's `LOCAL` or `REMOTE`.
    pub locality: Option<String>,
}

/// The event tags we understand, as listed in errors.
const TAGS: &str = "BlockStored, BlockRemoved, AllBlocksCleared";

/// Decodes the three frames of one ZMQ message.
pub fn decode_zmq_frames(
    topic: &[u8],
    seq: &[u8],
    payload: &[u8],
) -> Result<ZmqKvMessage, ProtocolError> {
    let seq: [u8; 8] = seq.try_into().map_err(|_| {
        ProtocolError::KvEvent(format!(
            "sequence frame must be 8 bytes (big-endian u64), got {} bytes",
            seq.len()
        ))
    })?;
    Ok(ZmqKvMessage {
        topic: topic.to_vec(),
        seq: u64::from_be_bytes(seq),
        batch: decode_event_batch(payload)?,
    })
}

/// Decodes one payload `msgpack([ts, [events], dp_rank])`.
pub fn decode_event_batch(payload: &[u8]) -> Result<EngineEventBatch, ProtocolError> {
    let mut rd = Cursor::new(payload);
    match batch(&mut rd) {
        Ok(batch) if rd.rest.is_empty() => Ok(batch),
        Ok(_) => Err(batch_error(payload, None)),
        Err(Failure::Malformed) => Err(batch_error(payload, None)),
        Err(Failure::Batch(e)) => Err(batch_error(payload, Some(e))),
    }
}

/// Which error a batch that did not decode gets: that it is not msgpack (anywhere in it), else
/// that bytes trail it, else what was wrong with its shape. The walk stops at the first of these
/// it meets, so the payload is checked again whole; only on this error path.
#[cold]
fn batch_error(payload: &[u8], shape: Option<ProtocolError>) -> ProtocolError {
    let mut rd = Cursor::new(payload);
    if rd.skip(MAX_DEPTH).is_err() {
        return not_msgpack(payload);
    }
    if !rd.rest.is_empty() {
        return err(format!(
            "{} trailing bytes after the msgpack batch",
            rd.rest.len()
        ));
    }
    // Not expected without a shape error: the walk fails only where the check above does.
    shape.unwrap_or_else(|| not_msgpack(payload))
}

/// The error for a payload that is not whole msgpack (or nests too deep), with the message `rmpv`
/// gives for the same bytes, as the decoder reported before it walked the bytes itself.
#[cold]
fn not_msgpack(payload: &[u8]) -> ProtocolError {
    let mut rd = payload;
    match rmpv::decode::read_value_with_max_depth(&mut rd, MAX_DEPTH) {
        Err(e) => err(format!("payload is not msgpack: {e}")),
        // Not expected: `Cursor::skip` rejects exactly what rmpv rejects.
        Ok(_) => err(format!(
            "payload is not msgpack: a value is cut short or nests deeper than {MAX_DEPTH}"
        )),
    }
}

fn err(message: String) -> ProtocolError {
    ProtocolError::KvEvent(message)
}

/// Why the walk of a batch stopped.
enum Failure {
    /// The bytes are not whole msgpack.
    Malformed,
    /// The batch is not `[ts, [events], dp_rank]` (the rest of the payload is not read).
    Batch(ProtocolError),
}

impl From<Malformed> for Failure {
    fn from(_: Malformed) -> Self {
        Failure::Malformed
    }
}

fn batch(rd: &mut Cursor<'_>) -> Result<EngineEventBatch, Failure> {
    let shape = |message| Failure::Batch(err(message));
    let (head, depth) = rd.enter(MAX_DEPTH)?;
    let Item::Array(len) = head else {
        return Err(shape(format!(
            "batch must be an array [ts, events, dp_rank], got {}",
            head.kind()
        )));
    };
    if len < 2 {
        return Err(shape(format!(
            "batch must have at least 2 elements [ts, events], got {len}"
        )));
    }
    let ts = match rd.whole(depth)? {
        Item::F64(f) => f,
        Item::F32(f) => f64::from(f),
        Item::Int(i) => i.as_f64(),
        other => {
            return Err(shape(format!(
                "batch ts must be a number, got {}",
                other.kind()
            )));
        }
    };
    let (events_head, event_depth) = rd.enter(depth)?;
    let Item::Array(count) = events_head else {
        return Err(shape(format!(
            "batch events must be an array, got {}",
            events_head.kind()
        )));
    };
    // Every event takes at least 18 bytes (`["AllBlocksCleared"]`), whatever the header claims.
    let mut events = Vec::with_capacity(count.min(rd.rest.len() / 18));
    let mut errors = Vec::new();
    for index in 0..count {
        match split_event(index, rd, event_depth)?.and_then(|(tag, f)| event(index, tag, f)) {
            Ok(event) => events.push(event),
            Err(error) => errors.push(error),
        }
    }
    // `dp_rank` is read after the events, but a bad one fails the batch all the same.
    let dp_rank = if len > 2 { rd.whole(depth)? } else { Item::Nil };
    rd.skip_n(len.saturating_sub(3), depth)?;
    let dp_rank = match dp_rank {
        Item::Nil => None,
        item => Some(uint::<DpRank>(item).map_err(|bad| Failure::Batch(bad.at(&"batch dp_rank")))?),
    };
    Ok(EngineEventBatch {
        ts,
        events,
        dp_rank,
        errors,
    })
}

/// The fields we know, by name (map-encoded events) or position (array-encoded ones).
#[derive(Clone, Copy)]
enum Field {
    BlockHashes,
    ParentBlockHash,
    TokenIds,
    BlockSize,
    LoraId,
    Medium,
    LoraName,
    ExtraKeys,
    CacheSalt,
    GroupIdx,
    KvCacheSpecKind,
    KvCacheSpecSlidingWindow,
    Locality,
}

impl Field {
    fn named(key: &str) -> Option<Field> {
        Some(match key {
            "block_hashes" => Field::BlockHashes,
            "parent_block_hash" => Field::ParentBlockHash,
            "token_ids" => Field::TokenIds,
            "block_size" => Field::BlockSize,
            "lora_id" => Field::LoraId,
            "medium" => Field::Medium,
            "lora_name" => Field::LoraName,
            "extra_keys" => Field::ExtraKeys,
            "cache_salt" => Field::CacheSalt,
            "group_idx" => Field::GroupIdx,
            "kv_cache_spec_kind" => Field::KvCacheSpecKind,
            "kv_cache_spec_sliding_window" => Field::KvCacheSpecSlidingWindow,
            "locality" => Field::Locality,
            // Unknown keys (session_id, ownership, lookahead_token_ids, whatever a newer engine
            // adds) are ignored: forward compatible.
            _ => return None,
        })
    }

    /// The fields after an array-encoded event's tag: the declaration order of the engines'
    /// msgspec structs. Fields past these (a newer engine's) are ignored.
    fn positions(tag: &str) -> &'static [Field] {
        match tag {
            "BlockStored" => &[
                Field::BlockHashes,
                Field::ParentBlockHash,
                Field::TokenIds,
                Field::BlockSize,
                Field::LoraId,
                Field::Medium,
                Field::LoraName,
                Field::ExtraKeys,
                Field::GroupIdx,
                Field::KvCacheSpecKind,
                Field::KvCacheSpecSlidingWindow,
                Field::Locality,
            ],
            "BlockRemoved" => &[
                Field::BlockHashes,
                Field::Medium,
                Field::GroupIdx,
                Field::Locality,
            ],
            _ => &[],
        }
    }
}

/// A field, decoded as the walk meets it; its error is reported only if the event's type needs
/// the field (and in the order the event's fields are checked in).
type Decoded<T> = Option<Result<T, Bad>>;

/// The fields of one event, whichever of the two encodings carried them. `None` is a field that
/// is absent or nil. Block hashes and token ids are decoded as the walk meets them; the others are
/// kept as their heads (a string's bytes are borrowed), `extra_keys` as its bytes, and read when
/// the event is built.
#[derive(Default)]
struct Fields<'a> {
    block_hashes: Decoded<Vec<ExternalSequenceBlockHash>>,
    token_ids: Decoded<Vec<u32>>,
    extra_keys: Option<&'a [u8]>,
    parent_block_hash: Option<Item<'a>>,
    block_size: Option<Item<'a>>,
    lora_id: Option<Item<'a>>,
    medium: Option<Item<'a>>,
    lora_name: Option<Item<'a>>,
    cache_salt: Option<Item<'a>>,
    group_idx: Option<Item<'a>>,
    kv_cache_spec_kind: Option<Item<'a>>,
    kv_cache_spec_sliding_window: Option<Item<'a>>,
    locality: Option<Item<'a>>,
}

impl<'a> Fields<'a> {
    /// Reads one field's value off `rd` (the last of repeated keys wins), or skips it.
    fn read(
        &mut self,
        field: Option<Field>,
        rd: &mut Cursor<'a>,
        depth: usize,
    ) -> Result<(), Malformed> {
        let slot = match field {
            None => return rd.skip(depth),
            Some(Field::BlockHashes) => {
                self.block_hashes = hashes(rd, depth)?;
                return Ok(());
            }
            Some(Field::TokenIds) => {
                self.token_ids = tokens(rd, depth)?;
                return Ok(());
            }
            Some(Field::ExtraKeys) => {
                let raw = rd.value(depth)?;
                self.extra_keys = (!is_nil(raw)).then_some(raw);
                return Ok(());
            }
            Some(Field::ParentBlockHash) => &mut self.parent_block_hash,
            Some(Field::BlockSize) => &mut self.block_size,
            Some(Field::LoraId) => &mut self.lora_id,
            Some(Field::Medium) => &mut self.medium,
            Some(Field::LoraName) => &mut self.lora_name,
            Some(Field::CacheSalt) => &mut self.cache_salt,
            Some(Field::GroupIdx) => &mut self.group_idx,
            Some(Field::KvCacheSpecKind) => &mut self.kv_cache_spec_kind,
            Some(Field::KvCacheSpecSlidingWindow) => &mut self.kv_cache_spec_sliding_window,
            Some(Field::Locality) => &mut self.locality,
        };
        *slot = Some(rd.whole(depth)?).filter(|item| !matches!(item, Item::Nil));
        Ok(())
    }
}

/// An event's tag and fields, or its own error (it has no tag), reported with the batch's others.
type Split<'a> = Result<(&'a str, Fields<'a>), ProtocolError>;

/// Reads one event off `rd`, all of it whatever it holds, and splits it into its tag and fields.
fn split_event<'a>(
    index: usize,
    rd: &mut Cursor<'a>,
    depth: usize,
) -> Result<Split<'a>, Malformed> {
    let mut f = Fields::default();
    match rd.enter(depth)? {
        (Item::Array(len), depth) => {
            // The tag first: it says what the positions mean.
            let tag = if len == 0 {
                None
            } else {
                rd.whole(depth)?.as_str()
            };
            let Some(tag) = tag else {
                rd.skip_n(len.saturating_sub(1), depth)?;
                return Ok(Err(err(format!(
                    "events[{index}] must start with its type name ({TAGS})"
                ))));
            };
            let mut positions = Field::positions(tag).iter();
            for _ in 1..len {
                f.read(positions.next().copied(), rd, depth)?;
            }
            Ok(Ok((tag, f)))
        }
        (Item::Map(len), depth) => {
            let mut tag = None;
            for _ in 0..len {
                match rd.whole(depth)?.as_str() {
                    Some("type") => tag = rd.whole(depth)?.as_str(),
                    Some(key) => f.read(Field::named(key), rd, depth)?,
                    None => rd.skip(depth)?,
                }
            }
            Ok(tag
                .map(|tag| (tag, f))
                .ok_or_else(|| err(format!("events[{index}] has no string \"type\" ({TAGS})"))))
        }
        (other, _) => Ok(Err(err(format!(
            "events[{index}] must be an array or a map, got {}",
            other.kind()
        )))),
    }
}

/// Where a field sits, for error messages: formatted only when one is made (decoding formats
/// nothing on success).
#[derive(Clone, Copy)]
struct At {
    index: usize,
    event: &'static str,
    field: &'static str,
}

impl Display for At {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "events[{}] {}.{}", self.index, self.event, self.field)
    }
}

fn event(index: usize, tag: &str, f: Fields<'_>) -> Result<EngineKvEvent, ProtocolError> {
    match tag {
        "BlockStored" => block_stored(index, f).map(EngineKvEvent::BlockStored),
        "BlockRemoved" => {
            let ctx = |field| At {
                index,
                event: "BlockRemoved",
                field,
            };
            Ok(EngineKvEvent::BlockRemoved(BlockRemoved {
                block_hashes: required(f.block_hashes, &ctx("block_hashes"))?,
                medium: read(f.medium, string, &ctx("medium"))?,
                group_idx: read(f.group_idx, uint, &ctx("group_idx"))?,
                locality: read(f.locality, string, &ctx("locality"))?,
            }))
        }
        "AllBlocksCleared" => Ok(EngineKvEvent::AllBlocksCleared),
        other => Err(err(format!(
            "events[{index}] has unknown type {other:?}, expected one of {TAGS}"
        ))),
    }
}

fn block_stored(index: usize, f: Fields<'_>) -> Result<BlockStored, ProtocolError> {
    let ctx = |field| At {
        index,
        event: "BlockStored",
        field,
    };
    let block_size: u32 = required(f.block_size.map(uint), &ctx("block_size"))?;
    let block_hashes = required(f.block_hashes, &ctx("block_hashes"))?;
    let token_ids = required(f.token_ids, &ctx("token_ids"))?;
    if block_size == 0 && !token_ids.is_empty() {
        return Err(err(format!(
            "{} must be at least 1 when token_ids are given, got 0",
            ctx("block_size")
        )));
    }
    let lora_name = read(f.lora_name, string, &ctx("lora_name"))?;
    let extra_keys = match f.extra_keys {
        None => Vec::new(),
        Some(raw) => {
            let what = ctx("extra_keys");
            let keys = extra_keys(raw, lora_name.as_deref()).map_err(|bad| bad.at(&what))?;
            if keys.len() != block_hashes.len() {
                return Err(err(format!(
                    "{what} must have one entry per block hash ({}), got {}",
                    block_hashes.len(),
                    keys.len()
                )));
            }
            keys
        }
    };
    Ok(BlockStored {
        block_hashes,
        parent_block_hash: read(f.parent_block_hash, hash, &ctx("parent_block_hash"))?,
        token_ids,
        block_size,
        lora_id: read(f.lora_id, uint, &ctx("lora_id"))?,
        medium: read(f.medium, string, &ctx("medium"))?,
        lora_name,
        extra_keys,
        cache_salt: read(f.cache_salt, string, &ctx("cache_salt"))?,
        group_idx: read(f.group_idx, uint, &ctx("group_idx"))?,
        kv_cache_spec_kind: read(f.kv_cache_spec_kind, string, &ctx("kv_cache_spec_kind"))?,
        kv_cache_spec_sliding_window: read(
            f.kv_cache_spec_sliding_window,
            uint,
            &ctx("kv_cache_spec_sliding_window"),
        )?,
        locality: read(f.locality, string, &ctx("locality"))?,
    })
}

/// A field the event's type requires.
fn required<T>(field: Decoded<T>, what: &dyn Display) -> Result<T, ProtocolError> {
    match field {
        None => Err(err(format!("{what} is missing"))),
        Some(decoded) => decoded.map_err(|bad| bad.at(what)),
    }
}

/// An optional scalar field, read from its head.
fn read<T>(
    field: Option<Item<'_>>,
    typed: impl FnOnce(Item<'_>) -> Result<T, Bad>,
    what: &dyn Display,
) -> Result<Option<T>, ProtocolError> {
    field.map(typed).transpose().map_err(|bad| bad.at(what))
}

/// What was wrong with a field (or its `element`-th element), formatted with the field's place
/// only when reported.
struct Bad {
    element: Option<usize>,
    problem: Problem,
}

enum Problem {
    /// It `must be` something else than what it `got`.
    Expected {
        must_be: &'static str,
        got: &'static str,
    },
    /// An integer that is negative or too large.
    OutOfRange(Int),
    /// Bytes that are not whole msgpack (not expected: a field's bytes are kept only once read
    /// whole).
    NotMsgpack,
}

impl Bad {
    fn expected(must_be: &'static str, got: &Item<'_>) -> Self {
        Bad {
            element: None,
            problem: Problem::Expected {
                must_be,
                got: got.kind(),
            },
        }
    }

    fn out_of_range(i: Int) -> Self {
        Bad {
            element: None,
            problem: Problem::OutOfRange(i),
        }
    }

    fn element(self, i: usize) -> Self {
        Bad {
            element: Some(i),
            ..self
        }
    }

    #[cold]
    fn at(&self, what: &dyn Display) -> ProtocolError {
        let place = match self.element {
            Some(i) => format!("{what}[{i}]"),
            None => what.to_string(),
        };
        err(match &self.problem {
            Problem::Expected { must_be, got } => format!("{place} must be {must_be}, got {got}"),
            Problem::OutOfRange(i) => {
                format!("{place} must be an unsigned integer in range, got {i}")
            }
            Problem::NotMsgpack => format!("{place} is not whole msgpack"),
        })
    }
}

fn uint<T: TryFrom<u64>>(item: Item<'_>) -> Result<T, Bad> {
    let Item::Int(i) = item else {
        return Err(Bad::expected("an unsigned integer", &item));
    };
    i.as_u64()
        .and_then(|u| T::try_from(u).ok())
        .ok_or(Bad::out_of_range(i))
}

fn string(item: Item<'_>) -> Result<String, Bad> {
    item.as_str()
        .map(str::to_owned)
        .ok_or_else(|| Bad::expected("a UTF-8 string", &item))
}

fn hash(item: Item<'_>) -> Result<ExternalSequenceBlockHash, Bad> {
    let h = match item {
        Item::Int(Int::Pos(u)) => u,
        // Python sends negative hashes as signed; reinterpret the same 64 bits.
        Item::Int(Int::Neg(s)) => s as u64,
        Item::Bin(bytes) => fold_hash_bytes(bytes),
        other => return Err(Bad::expected("an integer or bytes", &other)),
    };
    Ok(ExternalSequenceBlockHash(h))
}

/// The last (up to) 8 bytes of a byte hash, big-endian, as the reference folds them.
fn fold_hash_bytes(bytes: &[u8]) -> u64 {
    let tail = bytes
        .get(bytes.len().saturating_sub(8)..)
        .unwrap_or_default();
    tail.iter().fold(0, |h, &b| (h << 8) | u64::from(b))
}

/// Reads an array field off `rd` element by element with `element`, which reads one whole element
/// at the depth it is given. The first element that does not decode is the field's error, and the
/// rest of the array is skipped. Nil is an absent field.
fn array_field<'a, T>(
    rd: &mut Cursor<'a>,
    depth: usize,
    mut element: impl FnMut(&mut Cursor<'a>, usize) -> Result<Result<T, Bad>, Malformed>,
) -> Result<Decoded<Vec<T>>, Malformed> {
    let (len, depth) = match rd.enter(depth)? {
        (Item::Nil, _) => return Ok(None),
        (Item::Array(len), inner) => (len, inner),
        (other, inner) => {
            rd.finish(other, inner)?;
            return Ok(Some(Err(Bad::expected("an array", &other))));
        }
    };
    // Each element takes at least a byte: the header cannot make this allocate more.
    let mut out = Vec::with_capacity(len.min(rd.rest.len()));
    for i in 0..len {
        match element(rd, depth)? {
            Ok(value) => out.push(value),
            Err(bad) => {
                rd.skip_n(len.saturating_sub(i).saturating_sub(1), depth)?;
                return Ok(Some(Err(bad.element(i))));
            }
        }
    }
    Ok(Some(Ok(out)))
}

/// Block hashes: integers (signed or unsigned) or bytes.
fn hashes(
    rd: &mut Cursor<'_>,
    depth: usize,
) -> Result<Decoded<Vec<ExternalSequenceBlockHash>>, Malformed> {
    array_field(rd, depth, |rd, depth| {
        // The common case first (an integer needs a level of depth).
        if depth > 0
            && let Some(h) = rd.uint()
        {
            return Ok(Ok(ExternalSequenceBlockHash(h)));
        }
        Ok(hash(rd.whole(depth)?))
    })
}

/// Token ids: a flat array of integers, or (SGLang with EAGLE speculative decoding) an array of
/// `[token, next_token]` bigrams, one per token, read as their first tokens: SGLang sends one
/// bigram per token of the page (`(raw[j], raw[j + 1])`), so the pages' tokens are the firsts.
fn tokens(rd: &mut Cursor<'_>, depth: usize) -> Result<Decoded<Vec<u32>>, Malformed> {
    // Bigrams when the field is an array whose first element is an array.
    let bigrams = {
        let mut ahead = *rd;
        matches!(ahead.item(), Ok(Item::Array(_))) && matches!(ahead.item(), Ok(Item::Array(_)))
    };
    array_field(rd, depth, |rd, depth| {
        if !bigrams {
            // The common case first (an integer needs a level of depth).
            if depth > 0
                && let Some(u) = rd.uint()
            {
                return Ok(u32::try_from(u).map_err(|_| Bad::out_of_range(Int::Pos(u))));
            }
            return Ok(uint(rd.whole(depth)?));
        }
        let (item, inner) = rd.enter(depth)?;
        if let Item::Array(2) = item {
            let token = rd.whole(inner)?;
            let next = rd.whole(inner)?;
            return Ok(uint::<u32>(next).and_then(|_| uint(token)));
        }
        rd.finish(item, inner)?;
        Ok(Err(Bad::expected("a [token, token] pair", &item)))
    })
}
