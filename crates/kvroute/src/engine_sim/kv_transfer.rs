//! vLLM's KV connector handshake, played by the simulated engines of one process: a prefill for
//! remote decode holds its prompt's full blocks and names them in `kv_transfer_params`; a decode
//! request carrying those parameters takes them (once), or is refused when they name blocks no
//! engine holds, or held too long.
//!
//! The shapes are NixlConnector's (`vllm/distributed/kv_transfer/kv_connector/v1/
//! nixl_connector.py`, `request_finished`): the prefill answers `do_remote_prefill: true`,
//! `do_remote_decode: false`, `remote_engine_id`, `remote_block_ids` (its full blocks only: a
//! trailing partial block is recomputed by the decode engine), `remote_host`, `remote_port`. A
//! real engine frees blocks nobody read after its abort timeout
//! (`VLLM_NIXL_ABORT_REQUEST_TIMEOUT`); here that is `--kv-transfer-ttl`. Only engines of the
//! same `kvroute engine-sim` process can hand blocks to each other.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use serde_json::{Value, json};

/// Blocks held for remote decode, by every engine of the process.
#[derive(Debug)]
pub(super) struct Transfers {
    ttl: Duration,
    held: Mutex<Held>,
}

#[derive(Debug, Default)]
struct Held {
    /// By (engine id, first block id).
    blocks: HashMap<(String, u64), HeldBlocks>,
    next_block: u64,
}

/// One prefill's blocks, held for its decode engine.
#[derive(Debug)]
struct HeldBlocks {
    ids: Vec<u64>,
    /// The tokens they hold.
    tokens: Vec<u32>,
    /// When they are freed.
    expires: Instant,
}

/// Where a prefilling engine can be reached (`remote_*` of its parameters).
#[derive(Debug, Clone)]
pub(super) struct EngineAddress {
    pub(super) engine_id: String,
    pub(super) host: String,
    pub(super) port: u16,
}

/// What a request's `kv_transfer_params` ask of the engine.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Handshake {
    /// None: an ordinary request.
    None,
    /// Prefill and hold the blocks for a decode engine (`do_remote_decode`).
    RemoteDecode,
    /// Continue from blocks another engine prefilled: this many prompt tokens arrived.
    RemotePrefill { transferred_tokens: u32 },
}

impl Transfers {
    /// Nothing held; blocks are kept `ttl` for their decode engine.
    pub(super) fn new(ttl: Duration) -> Self {
        Self {
            ttl,
            held: Mutex::default(),
        }
    }

    /// Holds `prompt`'s full blocks on `engine` and returns the parameters naming them.
    pub(super) fn hold(&self, engine: &EngineAddress, prompt: &[u32], block_size: u32) -> Value {
        let full = prompt.len() / block_size as usize;
        let mut held = self.held.lock();
        let first = held.next_block;
        held.next_block += full as u64;
        let ids: Vec<u64> = (first..first + full as u64).collect();
        if !ids.is_empty() {
            let tokens = prompt[..full * block_size as usize].to_vec();
            let expires = Instant::now() + self.ttl;
            let key = (engine.engine_id.clone(), first);
            let blocks = HeldBlocks {
                ids: ids.clone(),
                tokens,
                expires,
            };
            held.blocks.insert(key, blocks);
        }
        json!({
            "do_remote_prefill": true,
            "do_remote_decode": false,
            "remote_block_ids": ids,
            "remote_engine_id": engine.engine_id,
            "remote_host": engine.host,
            "remote_port": engine.port,
        })
    }

    /// What `params` (a request's `kv_transfer_params`) ask for, taking the blocks they name
    /// for a decode request; an error says what is wrong with them.
    pub(super) fn handshake(&self, params: &Value, prompt: &[u32]) -> Result<Handshake, String> {
        if params.is_null() {
            return Ok(Handshake::None);
        }
        let flag = |key: &str| params.get(key).and_then(Value::as_bool).unwrap_or(false);
        match (flag("do_remote_decode"), flag("do_remote_prefill")) {
            (true, false) => Ok(Handshake::RemoteDecode),
            (false, true) => self.take(params, prompt),
            (false, false) => Ok(Handshake::None),
            (true, true) => Err(
                "kv_transfer_params: do_remote_decode and do_remote_prefill are both true; \
                 expected one of them"
                    .to_owned(),
            ),
        }
    }

    fn take(&self, params: &Value, prompt: &[u32]) -> Result<Handshake, String> {
        let engine = params
            .get("remote_engine_id")
            .and_then(Value::as_str)
            .ok_or(
                "kv_transfer_params.remote_engine_id must be a string (the prefill engine's id)",
            )?;
        let ids: Vec<u64> = params
            .get("remote_block_ids")
            .and_then(Value::as_array)
            .and_then(|ids| ids.iter().map(Value::as_u64).collect())
            .ok_or("kv_transfer_params.remote_block_ids must be a list of block ids")?;
        let Some(&first) = ids.first() else {
            // A prompt shorter than a block: nothing to transfer, the decode engine computes it.
            return Ok(Handshake::RemotePrefill {
                transferred_tokens: 0,
            });
        };
        let mut held = self.held.lock();
        let key = (engine.to_owned(), first);
        let Some(HeldBlocks {
            ids: held_ids,
            tokens,
            expires,
        }) = held.blocks.remove(&key)
        else {
            return Err(format!(
                "kv_transfer_params name blocks {ids:?} of engine {engine}, which holds no such \
                 blocks (never prefilled there, or already read)"
            ));
        };
        if expires <= Instant::now() {
            return Err(format!(
                "kv_transfer_params name blocks {ids:?} of engine {engine}, which it held for \
                 {:?} and freed (expired)",
                self.ttl
            ));
        }
        if held_ids != ids || !prompt.starts_with(&tokens) {
            return Err(format!(
                "kv_transfer_params name blocks {ids:?} of engine {engine}, which hold another \
                 prompt's KV (blocks {held_ids:?}); expected the parameters of this prompt's prefill"
            ));
        }
        Ok(Handshake::RemotePrefill {
            transferred_tokens: tokens.len() as u32,
        })
    }
}

#[cfg(test)]
mod tests;
