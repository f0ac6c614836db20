//! vLLM's KV connector handshake, played by the simulated engines: a prefill for remote decode
//! holds its prompt's full blocks and names them in `kv_transfer_params`; a decode request
//! carrying those parameters pulls them (once) from the engine they name, at `remote_host` /
//! `remote_port` (`POST /kv_transfer/pull`, this simulator's own stand-in for NIXL's read), or
//! is refused when that engine holds no such blocks, held them too long, or cannot be reached.
//!
//! The shapes are NixlConnector's (`vllm/distributed/kv_transfer/kv_connector/v1/
//! nixl_connector.py`, `request_finished`): the prefill answers `do_remote_prefill: true`,
//! `do_remote_decode: false`, `remote_engine_id`, `remote_block_ids` (its full blocks only: a
//! trailing partial block is recomputed by the decode engine), `remote_host`, `remote_port`. A
//! real engine frees blocks nobody read after its abort timeout
//! (`VLLM_NIXL_ABORT_REQUEST_TIMEOUT`); here that is `--kv-transfer-ttl`. Engines of different
//! `kvroute engine-sim` processes hand blocks to each other as well.

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

/// What a request takes into the engine from its `kv_transfer_params` (once pulled).
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

    /// Takes the blocks `ids` that engine `engine` holds for `prompt` (once); the prompt
    /// tokens they carry, or why they cannot be taken.
    pub(super) fn take(&self, engine: &str, ids: &[u64], prompt: &[u32]) -> Result<u32, String> {
        let Some(&first) = ids.first() else {
            // A prompt shorter than a block: nothing to transfer, the decode engine computes it.
            return Ok(0);
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
        Ok(tokens.len() as u32)
    }
}

/// Blocks a decode request asks to pull (`do_remote_prefill`).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub(super) struct Pull {
    pub(super) engine_id: String,
    pub(super) block_ids: Vec<u64>,
    #[serde(skip)]
    host: String,
    #[serde(skip)]
    port: u16,
}

/// What a request's `kv_transfer_params` ask of the engine.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Asked {
    /// Prefill and hold the blocks (`do_remote_decode`).
    RemoteDecode,
    /// Pull the blocks another engine holds (`do_remote_prefill`).
    RemotePrefill(Pull),
    /// Nothing (both flags false).
    Nothing,
}

/// Reads `params`; an error says what is wrong with them.
pub(super) fn asked(params: &Value) -> Result<Asked, String> {
    let flag = |key: &str| params.get(key).and_then(Value::as_bool).unwrap_or(false);
    match (flag("do_remote_decode"), flag("do_remote_prefill")) {
        (true, false) => Ok(Asked::RemoteDecode),
        (false, false) => Ok(Asked::Nothing),
        (true, true) => Err(
            "kv_transfer_params: do_remote_decode and do_remote_prefill are both true; expected \
             one of them"
                .to_owned(),
        ),
        (false, true) => {
            let engine_id = params
                .get("remote_engine_id")
                .and_then(Value::as_str)
                .ok_or(
                    "kv_transfer_params.remote_engine_id must be a string (the prefill engine's id)",
                )?;
            let block_ids: Vec<u64> = params
                .get("remote_block_ids")
                .and_then(Value::as_array)
                .and_then(|ids| ids.iter().map(Value::as_u64).collect())
                .ok_or("kv_transfer_params.remote_block_ids must be a list of block ids")?;
            let host = params
                .get("remote_host")
                .and_then(Value::as_str)
                .ok_or("kv_transfer_params.remote_host must be the prefill engine's host")?;
            let port = params
                .get("remote_port")
                .and_then(Value::as_u64)
                .and_then(|p| u16::try_from(p).ok())
                .ok_or("kv_transfer_params.remote_port must be the prefill engine's port")?;
            Ok(Asked::RemotePrefill(Pull {
                engine_id: engine_id.to_owned(),
                block_ids,
                host: host.to_owned(),
                port,
            }))
        }
    }
}

/// The body of `POST /kv_transfer/pull`.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub(super) struct PullRequest {
    #[serde(flatten)]
    pub(super) pull: Pull,
    pub(super) prompt: Vec<u32>,
}

/// Pulls `pull`'s blocks for `prompt` from the engine holding them: the prompt tokens
/// transferred, or why not (that engine refused, or cannot be reached).
pub(super) async fn pull(
    client: &reqwest::Client,
    pull: &Pull,
    prompt: &[u32],
) -> Result<u32, String> {
    if pull.block_ids.is_empty() {
        return Ok(0);
    }
    let url = format!("http://{}:{}/kv_transfer/pull", pull.host, pull.port);
    let body = PullRequest {
        pull: pull.clone(),
        prompt: prompt.to_vec(),
    };
    let response = client.post(&url).json(&body).send().await.map_err(|e| {
        format!(
            "cannot pull blocks {:?} from the prefill engine {} at {}:{}: {e}",
            pull.block_ids, pull.engine_id, pull.host, pull.port
        )
    })?;
    let status = response.status();
    let answer: Value = response.json().await.unwrap_or(Value::Null);
    if status.is_success() {
        return answer["transferred_tokens"]
            .as_u64()
            .map(|n| n as u32)
            .ok_or_else(|| format!("the prefill engine answered the pull with {answer}"));
    }
    Err(answer["error"]["message"].as_str().map_or_else(
        || format!("the pull failed with HTTP {status}: {answer}"),
        str::to_owned,
    ))
}

#[cfg(test)]
mod tests;
