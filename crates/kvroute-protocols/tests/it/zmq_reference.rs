//! The decoder as it was before it walked the msgpack bytes itself: the payload decoded into an
//! [`rmpv::Value`] tree, then the tree walked. Kept only as the reference the typed walk
//! (`kvroute_protocols::decode_event_batch`) is compared against, payload for payload, in
//! `zmq_differential`. Its results, errors and their messages, must be the walk's exactly.

use std::fmt::{self, Display};

use kvroute_protocols::kv_events::ExternalSequenceBlockHash;
use kvroute_protocols::zmq_events::{
    BlockExtraKeys, BlockRemoved, BlockStored, EngineEventBatch, EngineKvEvent, MAX_DEPTH,
    MmExtraKey,
};
use kvroute_protocols::{DpRank, ProtocolError};
use rmpv::Value;

/// The event tags we understand, as listed in errors.
const TAGS: &str = "BlockStored, BlockRemoved, AllBlocksCleared";

/// Decodes one payload `msgpack([ts, [events], dp_rank])`.
pub(crate) fn decode_event_batch(payload: &[u8]) -> Result<EngineEventBatch, ProtocolError> {
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
    let dp_rank = match items.get(2) {
        None | Some(Value::Nil) => None,
        Some(v) => Some(uint::<DpRank>(v, &"batch dp_rank")?),
    };
    let mut events = Vec::with_capacity(raw_events.len());
    let mut errors = Vec::new();
    for (i, raw) in raw_events.iter().enumerate() {
        match event_from_value(i, raw) {
            Ok(event) => events.push(event),
            Err(error) => errors.push(error),
        }
    }
    Ok(EngineEventBatch {
        ts,
        events,
        dp_rank,
        errors,
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
    extra_keys: Option<&'a Value>,
    cache_salt: Option<&'a Value>,
    group_idx: Option<&'a Value>,
    kv_cache_spec_kind: Option<&'a Value>,
    kv_cache_spec_sliding_window: Option<&'a Value>,
    locality: Option<&'a Value>,
}

impl<'a> Fields<'a> {
    /// Positional fields: the declaration order of the engines' msgspec structs.
    fn from_array(tag: &str, items: &'a [Value]) -> Self {
        let slot = |i: usize| items.get(i);
        let mut f = Fields::default();
        match tag {
            "BlockStored" => {
                f.block_hashes = slot(1);
                f.parent_block_hash = slot(2);
                f.token_ids = slot(3);
                f.block_size = slot(4);
                f.lora_id = slot(5);
                f.medium = slot(6);
                f.lora_name = slot(7);
                f.extra_keys = slot(8);
                f.group_idx = slot(9);
                f.kv_cache_spec_kind = slot(10);
                f.kv_cache_spec_sliding_window = slot(11);
                f.locality = slot(12);
            }
            "BlockRemoved" => {
                f.block_hashes = slot(1);
                f.medium = slot(2);
                f.group_idx = slot(3);
                f.locality = slot(4);
            }
            _ => {}
        }
        f
    }

    /// Named fields; returns the `"type"` tag too.
    fn from_map(entries: &'a [(Value, Value)]) -> (Option<&'a str>, Self) {
        let mut f = Fields::default();
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
                Some("extra_keys") => f.extra_keys = Some(v),
                Some("cache_salt") => f.cache_salt = Some(v),
                Some("group_idx") => f.group_idx = Some(v),
                Some("kv_cache_spec_kind") => f.kv_cache_spec_kind = Some(v),
                Some("kv_cache_spec_sliding_window") => {
                    f.kv_cache_spec_sliding_window = Some(v);
                }
                Some("locality") => f.locality = Some(v),
                // Unknown keys (session_id, ownership, lookahead_token_ids, whatever a newer
                // engine adds) are ignored: forward compatible.
                _ => {}
            }
        }
        (tag, f)
    }
}

fn event_from_value(index: usize, value: &Value) -> Result<EngineKvEvent, ProtocolError> {
    let (tag, f) = match value {
        Value::Array(items) => {
            let tag = items.first().and_then(Value::as_str).ok_or_else(|| {
                err(format!(
                    "events[{index}] must start with its type name ({TAGS})"
                ))
            })?;
            (tag, Fields::from_array(tag, items))
        }
        Value::Map(entries) => {
            let (tag, f) = Fields::from_map(entries);
            let tag =
                tag.ok_or_else(|| err(format!("events[{index}] has no string \"type\" ({TAGS})")))?;
            (tag, f)
        }
        other => {
            return Err(err(format!(
                "events[{index}] must be an array or a map, got {}",
                kind(other)
            )));
        }
    };
    match tag {
        "BlockStored" => block_stored(index, &f).map(EngineKvEvent::BlockStored),
        "BlockRemoved" => {
            let ctx = |field| At {
                index,
                event: "BlockRemoved",
                field,
            };
            Ok(EngineKvEvent::BlockRemoved(BlockRemoved {
                block_hashes: hashes(
                    required(f.block_hashes, &ctx("block_hashes"))?,
                    &ctx("block_hashes"),
                )?,
                medium: opt_string(f.medium, &ctx("medium"))?,
                group_idx: opt_uint(f.group_idx, &ctx("group_idx"))?,
                locality: opt_string(f.locality, &ctx("locality"))?,
            }))
        }
        "AllBlocksCleared" => Ok(EngineKvEvent::AllBlocksCleared),
        other => Err(err(format!(
            "events[{index}] has unknown type {other:?}, expected one of {TAGS}"
        ))),
    }
}

fn block_stored(index: usize, f: &Fields<'_>) -> Result<BlockStored, ProtocolError> {
    let ctx = |field| At {
        index,
        event: "BlockStored",
        field,
    };
    let block_size: u32 = uint(
        required(f.block_size, &ctx("block_size"))?,
        &ctx("block_size"),
    )?;
    let block_hashes = hashes(
        required(f.block_hashes, &ctx("block_hashes"))?,
        &ctx("block_hashes"),
    )?;
    let token_ids = tokens(required(f.token_ids, &ctx("token_ids"))?, &ctx("token_ids"))?;
    if block_size == 0 && !token_ids.is_empty() {
        return Err(err(format!(
            "{} must be at least 1 when token_ids are given, got 0",
            ctx("block_size")
        )));
    }
    let lora_name = opt_string(f.lora_name, &ctx("lora_name"))?;
    let extra_keys = match optional(f.extra_keys) {
        None => Vec::new(),
        Some(v) => {
            let keys = extra_keys(v, lora_name.as_deref(), &ctx("extra_keys"))?;
            if keys.len() != block_hashes.len() {
                return Err(err(format!(
                    "{} must have one entry per block hash ({}), got {}",
                    ctx("extra_keys"),
                    block_hashes.len(),
                    keys.len()
                )));
            }
            keys
        }
    };
    Ok(BlockStored {
        block_hashes,
        parent_block_hash: optional(f.parent_block_hash)
            .map(|v| hash(v, &ctx("parent_block_hash")))
            .transpose()?,
        token_ids,
        block_size,
        lora_id: opt_uint(f.lora_id, &ctx("lora_id"))?,
        medium: opt_string(f.medium, &ctx("medium"))?,
        lora_name,
        extra_keys,
        cache_salt: opt_string(f.cache_salt, &ctx("cache_salt"))?,
        group_idx: opt_uint(f.group_idx, &ctx("group_idx"))?,
        kv_cache_spec_kind: opt_string(f.kv_cache_spec_kind, &ctx("kv_cache_spec_kind"))?,
        kv_cache_spec_sliding_window: opt_uint(
            f.kv_cache_spec_sliding_window,
            &ctx("kv_cache_spec_sliding_window"),
        )?,
        locality: opt_string(f.locality, &ctx("locality"))?,
    })
}

/// vLLM's `extra_keys`: one entry per block, nil or an array of untagged keys.
fn extra_keys(
    v: &Value,
    lora_name: Option<&str>,
    what: &dyn Display,
) -> Result<Vec<BlockExtraKeys>, ProtocolError> {
    let Value::Array(entries) = v else {
        return Err(err(format!("{what} must be an array, got {}", kind(v))));
    };
    entries
        .iter()
        .enumerate()
        .map(|(i, entry)| match entry {
            Value::Nil => Ok(BlockExtraKeys::default()),
            Value::Array(keys) => Ok(block_extra_keys(keys, lora_name)),
            other => Err(err(format!(
                "{what}[{i}] must be nil or an array, got {}",
                kind(other)
            ))),
        })
        .collect()
}

/// Interprets one block's untagged keys in vLLM's order: the LoRA name (when the event names a
/// LoRA), `(identifier, offset)` pairs, the cache salt, prompt-embedding digests. Anything else
/// is counted as unknown rather than rejected, so that the block is known to carry an identity
/// this decoder cannot reproduce.
fn block_extra_keys(keys: &[Value], lora_name: Option<&str>) -> BlockExtraKeys {
    let mut out = BlockExtraKeys::default();
    let mut rest = keys;
    if let Some(lora) = lora_name
        && let Some((first, tail)) = rest.split_first()
        && matches!(first, Value::String(_))
    {
        if first.as_str() != Some(lora) {
            out.unknown += 1;
        }
        rest = tail;
    }
    for key in rest {
        match key {
            Value::String(_) => match (key.as_str(), &out.cache_salt) {
                (Some(salt), None) => out.cache_salt = Some(salt.to_owned()),
                _ => out.unknown += 1,
            },
            Value::Array(pair) => match &pair[..] {
                [Value::String(id), Value::Integer(offset)] => {
                    match (id.as_str(), offset.as_i64()) {
                        (Some(identifier), Some(offset)) => out.mm.push(MmExtraKey {
                            identifier: identifier.to_owned(),
                            offset,
                        }),
                        _ => out.unknown += 1,
                    }
                }
                _ => out.unknown += 1,
            },
            Value::Binary(digest) => out.prompt_embeds.push(digest.clone()),
            _ => out.unknown += 1,
        }
    }
    out
}

/// A present, non-nil field.
fn optional(v: Option<&Value>) -> Option<&Value> {
    v.filter(|v| !v.is_nil())
}

fn required<'a>(v: Option<&'a Value>, what: &dyn Display) -> Result<&'a Value, ProtocolError> {
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

fn uint<T: TryFrom<u64>>(v: &Value, what: &dyn Display) -> Result<T, ProtocolError> {
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

fn opt_uint<T: TryFrom<u64>>(
    v: Option<&Value>,
    what: &dyn Display,
) -> Result<Option<T>, ProtocolError> {
    optional(v).map(|v| uint(v, what)).transpose()
}

fn opt_string(v: Option<&Value>, what: &dyn Display) -> Result<Option<String>, ProtocolError> {
    optional(v).map(|v| string(v, what)).transpose()
}

fn string(v: &Value, what: &dyn Display) -> Result<String, ProtocolError> {
    v.as_str()
        .map(str::to_owned)
        .ok_or_else(|| err(format!("{what} must be a UTF-8 string, got {}", kind(v))))
}

fn hash(v: &Value, what: &dyn Display) -> Result<ExternalSequenceBlockHash, ProtocolError> {
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

fn hashes(v: &Value, what: &dyn Display) -> Result<Vec<ExternalSequenceBlockHash>, ProtocolError> {
    let Value::Array(items) = v else {
        return Err(err(format!("{what} must be an array, got {}", kind(v))));
    };
    items
        .iter()
        .enumerate()
        .map(|(i, h)| hash(h, &format_args!("{what}[{i}]")))
        .collect()
}

/// Token ids: a flat array of integers, or (SGLang with EAGLE speculative decoding) an array of
/// `[token, next_token]` bigrams, one per token, read as their first tokens: SGLang sends one
/// bigram per token of the page (`(raw[j], raw[j + 1])`), so the pages' tokens are the firsts.
fn tokens(v: &Value, what: &dyn Display) -> Result<Vec<u32>, ProtocolError> {
    let Value::Array(items) = v else {
        return Err(err(format!("{what} must be an array, got {}", kind(v))));
    };
    let bigrams = matches!(items.first(), Some(Value::Array(_)));
    items
        .iter()
        .enumerate()
        .map(|(i, item)| {
            let at = format_args!("{what}[{i}]");
            match item {
                Value::Array(pair) if bigrams && pair.len() == 2 => {
                    uint::<u32>(&pair[1], &at)?;
                    uint(&pair[0], &at)
                }
                other if bigrams => Err(err(format!(
                    "{at} must be a [token, token] pair, got {}",
                    kind(other)
                ))),
                other => uint(other, &at),
            }
        })
        .collect()
}
