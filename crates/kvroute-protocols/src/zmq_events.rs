//! KV cache events as engines (vLLM, SGLang) publish them over ZMQ.
//!
//! A ZMQ message has three frames: `[topic, seq, payload]`, where `seq` is an 8-byte big-endian
//! sequence number and `payload` is `msgpack([ts, [events], dp_rank])` (`dp_rank` may be nil or
//! absent). Engines encode each event with msgspec's `tag=True`, either as an array led by the
//! class name (`["BlockStored", hashes, parent, tokens, block_size, lora_id, medium, lora_name,
//! ...]`, older vLLM and SGLang) or as a map with a `"type"` key (newer vLLM). Trailing fields that
//! were defaults may be omitted, and newer engines append fields we do not know: both are accepted.
//! Block hashes are integers (signed or unsigned 64-bit) or bytes (e.g. sha256 digests, folded to
//! their last 8 bytes, big-endian, as the reference does).
//!
//! Decoding walks an [`rmpv::Value`] read with a depth limit; it never panics, and its memory use
//! is bounded by a small multiple of the payload size.

use rmpv::Value;

use crate::DpRank;
use crate::ProtocolError;
use crate::kv_events::ExternalSequenceBlockHash;

/// Maximum msgpack nesting accepted in a payload (real payloads nest four levels deep).
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
    /// The events, in order.
    pub events: Vec<EngineKvEvent>,
    /// The data-parallel rank that emitted the batch, if the engine says.
    pub dp_rank: Option<DpRank>,
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
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockStored {
    /// The engine's hashes of the stored blocks, in sequence order.
    pub block_hashes: Vec<ExternalSequenceBlockHash>,
    /// The block this chain continues, if any.
    pub parent_block_hash: Option<ExternalSequenceBlockHash>,
    /// The tokens of all stored blocks, concatenated.
    pub token_ids: Vec<u32>,
    /// Tokens per block.
    pub block_size: u32,
    /// Deprecated numeric LoRA id (older vLLM).
    pub lora_id: Option<u64>,
    /// Storage medium (`"GPU"`, `"CPU_PINNED"`, ...), if the engine says.
    pub medium: Option<String>,
    /// LoRA adapter name, part of the block's identity when set.
    pub lora_name: Option<String>,
}

impl BlockStored {
    /// The tokens of each full block, in order (a partial trailing chunk is not a block).
    pub fn token_blocks(&self) -> std::slice::ChunksExact<'_, u32> {
        // `block_size` is validated to be at least 1 at decode time.
        self.token_ids.chunks_exact(self.block_size.max(1) as usize)
    }
}

/// Evicted blocks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockRemoved {
    /// The engine's hashes of the evicted blocks.
    pub block_hashes: Vec<ExternalSequenceBlockHash>,
    /// Storage medium, if the engine says.
    pub medium: Option<String>,
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
    let mut rd = payload;
    let value = rmpv::decode::read_value_with_max_depth(&mut rd, MAX_DEPTH)
        .map_err(|e| err(format!("payload is not msgpack: {e}")))?;
    if !rd.is_empty() {
        return Err(err(format!(
            "{} trailing bytes after the msgpack batch",
            rd.len()
        )));
    }
    batch_from_value(&value)
}

fn err(message: String) -> ProtocolError {
    ProtocolError::KvEvent(message)
}

fn batch_from_value(value: &Value) -> Result<EngineEventBatch, ProtocolError> {
    let Value::Array(items) = value else {
        return Err(err(format!(
            "batch must be an array [ts, events, dp_rank], got {}",
            kind(value)
        )));
    };
    if items.len() < 2 {
        return Err(err(format!(
            "batch must have at least 2 elements [ts, events], got {}",
            items.len()
        )));
    }
    let ts = match &items[0] {
        Value::F64(f) => *f,
        Value::F32(f) => f64::from(*f),
        Value::Integer(i) => i.as_f64().unwrap_or(0.0),
        other => {
            return Err(err(format!(
                "batch ts must be a number, got {}",
                kind(other)
            )));
        }
    };
    let Value::Array(raw_events) = &items[1] else {
        return Err(err(format!(
            "batch events must be an array, got {}",
            kind(&items[1])
        )));
    };
    let events = raw_events
        .iter()
        .enumerate()
        .map(|(i, e)| event_from_value(i, e))
        .collect::<Result<Vec<_>, _>>()?;
    let dp_rank = match items.get(2) {
        None | Some(Value::Nil) => None,
        Some(v) => Some(uint::<DpRank>(v, "batch dp_rank")?),
    };
    Ok(EngineEventBatch {
        ts,
        events,
        dp_rank,
    })
}

/// The fields of one event, whichever of the two encodings carried them.
#[derive(Default)]
struct Fields<'a> {
    block_hashes: Option<&'a Value>,
    parent_block_hash: Option<&'a Value>,
    token_ids: Option<&'a Value>,
    block_size: Option<&'a Value>,
    lora_id: Option<&'a Value>,
    medium: Option<&'a Value>,
    lora_name: Option<&'a Value>,
}

fn event_from_value(index: usize, value: &Value) -> Result<EngineKvEvent, ProtocolError> {
    let mut f = Fields::default();
    let tag = match value {
        Value::Array(items) => {
            let tag = items.first().and_then(Value::as_str).ok_or_else(|| {
                err(format!(
                    "events[{index}] must start with its type name ({TAGS})"
                ))
            })?;
            let slot = |i: usize| items.get(i);
            match tag {
                "BlockStored" => {
                    f.block_hashes = slot(1);
                    f.parent_block_hash = slot(2);
                    f.token_ids = slot(3);
                    f.block_size = slot(4);
                    f.lora_id = slot(5);
                    f.medium = slot(6);
                    f.lora_name = slot(7);
                }
                "BlockRemoved" => {
                    f.block_hashes = slot(1);
                    f.medium = slot(2);
                }
                _ => {}
            }
            tag
        }
        Value::Map(entries) => {
            let mut tag = None;
            for (k, v) in entries {
                match k.as_str() {
                    Some("type") => tag = v.as_str(),
                    Some("block_hashes") => f.block_hashes = Some(v),
                    Some("parent_block_hash") => f.parent_block_hash = Some(v),
                    Some("token_ids") => f.token_ids = Some(v),
                    Some("block_size") => f.block_size = Some(v),
                    Some("lora_id") => f.lora_id = Some(v),
                    Some("medium") => f.medium = Some(v),
                    Some("lora_name") => f.lora_name = Some(v),
                    // Unknown keys come from newer engines; ignoring them is forward compatible.
                    _ => {}
                }
            }
            tag.ok_or_else(|| err(format!("events[{index}] has no string \"type\" ({TAGS})")))?
        }
        other => {
            return Err(err(format!(
                "events[{index}] must be an array or a map, got {}",
                kind(other)
            )));
        }
    };
    match tag {
        "BlockStored" => {
            let ctx = |field: &str| format!("events[{index}] BlockStored.{field}");
            let block_size: u32 = uint(
                required(f.block_size, &ctx("block_size"))?,
                &ctx("block_size"),
            )?;
            if block_size == 0 {
                return Err(err(format!(
                    "{} must be at least 1, got 0",
                    ctx("block_size")
                )));
            }
            Ok(EngineKvEvent::BlockStored(BlockStored {
                block_hashes: hashes(
                    required(f.block_hashes, &ctx("block_hashes"))?,
                    &ctx("block_hashes"),
                )?,
                parent_block_hash: optional(f.parent_block_hash)
                    .map(|v| hash(v, &ctx("parent_block_hash")))
                    .transpose()?,
                token_ids: tokens(required(f.token_ids, &ctx("token_ids"))?, &ctx("token_ids"))?,
                block_size,
                lora_id: optional(f.lora_id)
                    .map(|v| uint(v, &ctx("lora_id")))
                    .transpose()?,
                medium: optional(f.medium)
                    .map(|v| string(v, &ctx("medium")))
                    .transpose()?,
                lora_name: optional(f.lora_name)
                    .map(|v| string(v, &ctx("lora_name")))
                    .transpose()?,
            }))
        }
        "BlockRemoved" => {
            let ctx = |field: &str| format!("events[{index}] BlockRemoved.{field}");
            Ok(EngineKvEvent::BlockRemoved(BlockRemoved {
                block_hashes: hashes(
                    required(f.block_hashes, &ctx("block_hashes"))?,
                    &ctx("block_hashes"),
                )?,
                medium: optional(f.medium)
                    .map(|v| string(v, &ctx("medium")))
                    .transpose()?,
            }))
        }
        "AllBlocksCleared" => Ok(EngineKvEvent::AllBlocksCleared),
        other => Err(err(format!(
            "events[{index}] has unknown type {other:?}, expected one of {TAGS}"
        ))),
    }
}

/// A present, non-nil field.
fn optional(v: Option<&Value>) -> Option<&Value> {
    v.filter(|v| !v.is_nil())
}

fn required<'a>(v: Option<&'a Value>, what: &str) -> Result<&'a Value, ProtocolError> {
    optional(v).ok_or_else(|| err(format!("{what} is missing")))
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Nil => "nil",
        Value::Boolean(_) => "a boolean",
        Value::Integer(_) => "an integer",
        Value::F32(_) | Value::F64(_) => "a float",
        Value::String(_) => "a string",
        Value::Binary(_) => "bytes",
        Value::Array(_) => "an array",
        Value::Map(_) => "a map",
        Value::Ext(..) => "an extension value",
    }
}

fn uint<T: TryFrom<u64>>(v: &Value, what: &str) -> Result<T, ProtocolError> {
    let Value::Integer(i) = v else {
        return Err(err(format!(
            "{what} must be an unsigned integer, got {}",
            kind(v)
        )));
    };
    i.as_u64().and_then(|u| T::try_from(u).ok()).ok_or_else(|| {
        err(format!(
            "{what} must be an unsigned integer in range, got {i}"
        ))
    })
}

fn string(v: &Value, what: &str) -> Result<String, ProtocolError> {
    v.as_str()
        .map(str::to_owned)
        .ok_or_else(|| err(format!("{what} must be a UTF-8 string, got {}", kind(v))))
}

fn hash(v: &Value, what: &str) -> Result<ExternalSequenceBlockHash, ProtocolError> {
    let h = match v {
        Value::Integer(i) => match (i.as_u64(), i.as_i64()) {
            (Some(u), _) => u,
            // Python sends negative hashes as signed; reinterpret the same 64 bits.
            (None, Some(s)) => s as u64,
            (None, None) => return Err(err(format!("{what} is out of 64-bit range: {i}"))),
        },
        Value::Binary(bytes) => fold_hash_bytes(bytes),
        other => {
            return Err(err(format!(
                "{what} must be an integer or bytes, got {}",
                kind(other)
            )));
        }
    };
    Ok(ExternalSequenceBlockHash(h))
}

/// The last (up to) 8 bytes of a byte hash, big-endian, as the reference folds them.
fn fold_hash_bytes(bytes: &[u8]) -> u64 {
    let tail = &bytes[bytes.len().saturating_sub(8)..];
    let mut buf = [0u8; 8];
    buf[8 - tail.len()..].copy_from_slice(tail);
    u64::from_be_bytes(buf)
}

fn hashes(v: &Value, what: &str) -> Result<Vec<ExternalSequenceBlockHash>, ProtocolError> {
    let Value::Array(items) = v else {
        return Err(err(format!("{what} must be an array, got {}", kind(v))));
    };
    items
        .iter()
        .enumerate()
        .map(|(i, h)| hash(h, &format!("{what}[{i}]")))
        .collect()
}

/// Token ids: a flat array of integers, or (EAGLE speculative decoding) an array of
/// `[token, next_token]` pairs, flattened to the first of each pair plus the last second.
fn tokens(v: &Value, what: &str) -> Result<Vec<u32>, ProtocolError> {
    let Value::Array(items) = v else {
        return Err(err(format!("{what} must be an array, got {}", kind(v))));
    };
    if let Some(Value::Array(_)) = items.first() {
        let mut out = Vec::with_capacity(items.len() + 1);
        let mut last: Option<u32> = None;
        for (i, pair) in items.iter().enumerate() {
            let at = format!("{what}[{i}]");
            match pair {
                Value::Array(p) if p.len() == 2 => {
                    out.push(uint(&p[0], &at)?);
                    last = Some(uint(&p[1], &at)?);
                }
                other => {
                    return Err(err(format!(
                        "{at} must be a [token, token] pair, got {}",
                        kind(other)
                    )));
                }
            }
        }
        out.extend(last);
        return Ok(out);
    }
    items
        .iter()
        .enumerate()
        .map(|(i, t)| uint(t, &format!("{what}[{i}]")))
        .collect()
}
