//! vLLM's per-block `extra_keys`, read straight from their msgpack bytes into
//! [`BlockExtraKeys`].

use super::msgpack::{Cursor, Item, Malformed};
use super::{Bad, BlockExtraKeys, MAX_DEPTH, MmExtraKey, Problem, array_field};

/// vLLM's `extra_keys` (its bytes, already checked whole): one entry per block, nil or an array
/// of untagged keys.
pub(super) fn extra_keys(raw: &[u8], lora_name: Option<&str>) -> Result<Vec<BlockExtraKeys>, Bad> {
    let mut rd = Cursor::new(raw);
    // The bytes were checked at their depth in the payload; the limit only has to be no lower.
    let walked = array_field(&mut rd, MAX_DEPTH, |rd, depth| match rd.enter(depth)? {
        (Item::Nil, _) => Ok(Ok(BlockExtraKeys::default())),
        (Item::Array(len), inner) => block_extra_keys(rd, len, inner, lora_name).map(Ok),
        (other, inner) => {
            rd.finish(other, inner)?;
            Ok(Err(Bad::expected("nil or an array", &other)))
        }
    });
    match walked {
        Ok(Some(keys)) => keys,
        // Neither is expected: the bytes are a whole, non-nil value.
        Ok(None) | Err(Malformed) => Err(Bad {
            element: None,
            problem: Problem::NotMsgpack,
        }),
    }
}

/// Interprets one block's untagged keys (the `len` elements next on `rd`) in vLLM's order: the
/// LoRA name (when the event names a LoRA), `(identifier, offset)` pairs, the cache salt,
/// prompt-embedding digests. Anything else is counted as unknown rather than rejected, so that
/// the block is known to carry an identity this decoder cannot reproduce.
fn block_extra_keys(
    rd: &mut Cursor<'_>,
    len: usize,
    depth: usize,
    lora_name: Option<&str>,
) -> Result<BlockExtraKeys, Malformed> {
    let mut out = BlockExtraKeys::default();
    for i in 0..len {
        let (key, inner) = rd.enter(depth)?;
        match key {
            Item::Str(_) if i == 0 && lora_name.is_some() => {
                if key.as_str() != lora_name {
                    out.unknown = out.unknown.saturating_add(1);
                }
            }
            Item::Str(_) => match (key.as_str(), &out.cache_salt) {
                (Some(salt), None) => out.cache_salt = Some(salt.to_owned()),
                _ => out.unknown = out.unknown.saturating_add(1),
            },
            Item::Array(2) => {
                let identifier = rd.whole(inner)?;
                let offset = rd.whole(inner)?;
                match (identifier, offset) {
                    (Item::Str(_), Item::Int(offset)) => {
                        match (identifier.as_str(), offset.as_i64()) {
                            (Some(identifier), Some(offset)) => out.mm.push(MmExtraKey {
                                identifier: identifier.to_owned(),
                                offset,
                            }),
                            _ => out.unknown = out.unknown.saturating_add(1),
                        }
                    }
                    _ => out.unknown = out.unknown.saturating_add(1),
                }
            }
            Item::Bin(digest) => out.prompt_embeds.push(digest.to_vec()),
            other => {
                rd.finish(other, inner)?;
                out.unknown = out.unknown.saturating_add(1);
            }
        }
    }
    Ok(out)
}
