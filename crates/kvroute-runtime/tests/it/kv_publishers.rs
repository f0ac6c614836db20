//! The ZMQ KV event listener against the engines' own publisher code: vLLM 0.33's and SGLang
//! 0.5.23's `ZmqEventPublisher` and event structs, run by `tests/python/kv_publishers/publish.py`
//! under `$KVROUTE_PYTHON` (vLLM 0.10's wire format is emulated there on top of 0.33's
//! publisher). Each test drives one engine process through its line protocol and checks the
//! router events the listener republishes.
//!
//! The Python environment is required, never skipped: `cargo xtask ci` creates it; see
//! [`python`] for doing it by hand.

use std::collections::BTreeSet;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use kvroute_protocols::kv_events::{
    ExternalSequenceBlockHash, KvCacheEventData, LocalBlockHash, RouterEvent, StorageTier,
};
use kvroute_runtime::{
    BlockHasher, BlockSalt, KvEventPublisher, ZmqKvListener, ZmqKvListenerConfig, ZmqListenerError,
};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};

/// Generous: a slow CI machine must not fail a test, and nothing here asserts on durations.
const PATIENCE: Duration = Duration::from_secs(60);

const SCRIPT: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../tests/python/kv_publishers/publish.py"
);

/// How to get the Python environment these tests need.
const SETUP: &str = "set KVROUTE_PYTHON to a python with the pinned engines: `cargo xtask ci` \
    creates ~/.cache/kvroute/venv from tests/python/requirements.txt and \
    requirements-nodeps.txt and sets it; by hand: `python3 -m venv ~/.cache/kvroute/venv && \
    ~/.cache/kvroute/venv/bin/pip install -r tests/python/requirements.txt && \
    ~/.cache/kvroute/venv/bin/pip install --no-deps -r tests/python/requirements-nodeps.txt && \
    export KVROUTE_PYTHON=~/.cache/kvroute/venv/bin/python`";

/// `$KVROUTE_PYTHON`, checked once to have the pinned engines; fails the test otherwise.
fn python() -> String {
    static CHECKED: std::sync::OnceLock<Result<String, String>> = std::sync::OnceLock::new();
    CHECKED
        .get_or_init(|| {
            let python = std::env::var("KVROUTE_PYTHON")
                .map_err(|_| format!("KVROUTE_PYTHON is not set: {SETUP}"))?;
            let out = std::process::Command::new(&python)
                .args([SCRIPT, "--check"])
                .output()
                .map_err(|e| format!("cannot run KVROUTE_PYTHON={python}: {e}; {SETUP}"))?;
            if !out.status.success() {
                return Err(format!(
                    "KVROUTE_PYTHON={python} lacks the real KV event publishers: {}; {SETUP}",
                    String::from_utf8_lossy(&out.stderr).trim()
                ));
            }
            Ok(python)
        })
        .clone()
        .unwrap_or_else(|e| panic!("{e}"))
}

/// One engine publisher process.
struct Engine {
    _child: Child,
    stdin: ChildStdin,
    stdout: Lines<BufReader<ChildStdout>>,
    endpoint: String,
    replay_endpoint: String,
}

/// What a published batch carried.
struct Published {
    seq: u64,
    /// Per event, the engine block hashes it names.
    hashes: Vec<Vec<u64>>,
}

impl Engine {
    /// Starts `engine` (`vllm`, `vllm010`, `sglang`) publishing blocks of `block_size` tokens.
    async fn start(engine: &str, block_size: u32, extra: &[&str]) -> Self {
        let mut child = Command::new(python())
            .arg(SCRIPT)
            .args(["--engine", engine, "--block-size", &block_size.to_string()])
            .args(extra)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {SCRIPT}: {e}; {SETUP}"));
        let stdin = child.stdin.take().expect("piped");
        let stdout = BufReader::new(child.stdout.take().expect("piped")).lines();
        let mut engine = Self {
            _child: child,
            stdin,
            stdout,
            endpoint: String::new(),
            replay_endpoint: String::new(),
        };
        let ready = engine.read().await;
        assert_eq!(ready["ready"], true, "{ready}");
        engine.endpoint = ready["endpoint"].as_str().expect("endpoint").to_owned();
        engine.replay_endpoint = ready["replay_endpoint"]
            .as_str()
            .expect("replay endpoint")
            .to_owned();
        engine
    }

    async fn read(&mut self) -> Value {
        let line = tokio::time::timeout(PATIENCE, self.stdout.next_line())
            .await
            .expect("the publisher script answers")
            .expect("reading the publisher script")
            .expect("the publisher script exited early (see its stderr above)");
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line}"))
    }

    async fn command(&mut self, command: Value) -> Value {
        let mut line = command.to_string();
        line.push('\n');
        self.stdin.write_all(line.as_bytes()).await.expect("write");
        self.stdin.flush().await.expect("flush");
        let reply = self.read().await;
        assert_eq!(reply["ok"], true, "{command} failed: {reply}");
        reply
    }

    async fn publish_with(&mut self, options: Value) -> Published {
        let mut command = json!({"op": "publish"});
        command
            .as_object_mut()
            .expect("object")
            .extend(options.as_object().expect("object").clone());
        let reply = self.command(command).await;
        Published {
            seq: reply["seq"].as_u64().expect("seq"),
            hashes: reply["hashes"]
                .as_array()
                .expect("hashes")
                .iter()
                .map(|e| {
                    e.as_array()
                        .expect("hashes")
                        .iter()
                        .map(|h| h.as_u64().expect("u64"))
                        .collect()
                })
                .collect(),
        }
    }

    async fn publish(&mut self, events: Value) -> Published {
        self.publish_with(json!({ "events": events })).await
    }

    /// Publishes a batch that the engine keeps for replay but the subscriber never sees.
    async fn publish_dropped(&mut self, events: Value) -> Published {
        self.publish_with(json!({ "events": events, "drop": true }))
            .await
    }

    async fn restart(&mut self) {
        self.command(json!({"op": "restart"})).await;
    }
}

/// A stand-in for the router's content hash (FNV-1a over tokens, LoRA name and salt), so that a
/// salted block is visibly different from an unsalted one.
fn content(tokens: &[u32], salt: BlockSalt<'_>) -> LocalBlockHash {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for &b in bytes {
            h = (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
        }
    };
    for t in tokens {
        eat(&t.to_le_bytes());
    }
    for part in [salt.lora_name, salt.cache_salt] {
        match part {
            None => eat(&[0]),
            Some(text) => {
                eat(&[1]);
                eat(text.as_bytes());
            }
        }
    }
    LocalBlockHash(h)
}

fn hasher() -> BlockHasher {
    Arc::new(content)
}

fn salted(salt: &str) -> BlockSalt<'_> {
    BlockSalt {
        lora_name: None,
        cache_salt: Some(salt),
    }
}

/// `n` distinct tokens from `start`.
fn tokens(start: u32, n: u32) -> Vec<u32> {
    (start..start + n).collect()
}

/// A listener for `engine` on a worker publisher that keeps `ring` events.
async fn listen(
    engine: &Engine,
    config: ZmqKvListenerConfig,
    ring: usize,
) -> (ZmqKvListener, KvEventPublisher) {
    listen_on(engine, config, KvEventPublisher::new(7, ring)).await
}

async fn listen_on(
    engine: &Engine,
    config: ZmqKvListenerConfig,
    publisher: KvEventPublisher,
) -> (ZmqKvListener, KvEventPublisher) {
    let config = ZmqKvListenerConfig {
        endpoint: engine.endpoint.clone(),
        replay_timeout: Duration::from_secs(10),
        ..config
    };
    let listener = tokio::time::timeout(
        PATIENCE,
        ZmqKvListener::connect(config, hasher(), publisher.clone()),
    )
    .await
    .expect("connects in time")
    .expect("connects");
    (listener, publisher)
}

/// Publishes empty batches until the listener has received one (PUB/SUB drops messages until
/// the subscription has reached the publisher), and all before it were replayed or counted lost.
async fn subscribed(engine: &mut Engine, listener: &ZmqKvListener) {
    eventually("the subscription to take hold", async || {
        engine.publish(json!([])).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
        listener.stats().messages > 0
    })
    .await;
}

/// Polls `condition` (bounded by [`PATIENCE`]).
async fn eventually(what: &str, mut condition: impl AsyncFnMut() -> bool) {
    tokio::time::timeout(PATIENCE, async {
        while !condition().await {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("{what} did not happen within {PATIENCE:?}"));
}

/// The republished events from id `from` on.
fn events_from(publisher: &KvEventPublisher, from: u64) -> Vec<RouterEvent> {
    match publisher.last_event_id() {
        Some(last) if last >= from => publisher.range(from, last).expect("held"),
        _ => Vec::new(),
    }
}

/// Waits until `n` events were republished from id `from` on, and returns them.
async fn wait_events(publisher: &KvEventPublisher, from: u64, n: usize) -> Vec<RouterEvent> {
    eventually(&format!("{n} events to be republished"), async || {
        events_from(publisher, from).len() >= n
    })
    .await;
    events_from(publisher, from)
}

fn next_id(publisher: &KvEventPublisher) -> u64 {
    publisher.last_event_id().map_or(0, |id| id + 1)
}

/// A compact view of one router event: (tier, kind, [(engine hash, content hash)]).
#[derive(Debug, Clone, PartialEq, Eq)]
enum Seen {
    Stored {
        tier: StorageTier,
        parent: Option<u64>,
        blocks: Vec<(u64, LocalBlockHash)>,
    },
    Removed {
        tier: StorageTier,
        hashes: Vec<u64>,
    },
    Cleared {
        tier: StorageTier,
        dp_rank: u32,
    },
}

fn seen(event: &RouterEvent) -> Seen {
    let tier = event.storage_tier;
    match &event.event.data {
        KvCacheEventData::Stored(s) => Seen::Stored {
            tier,
            parent: s.parent_hash.map(|p| p.0),
            blocks: s
                .blocks
                .iter()
                .map(|b| (b.block_hash.0, b.tokens_hash))
                .collect(),
        },
        KvCacheEventData::Removed(r) => Seen::Removed {
            tier,
            hashes: r.block_hashes.iter().map(|h| h.0).collect(),
        },
        KvCacheEventData::Cleared => Seen::Cleared {
            tier,
            dp_rank: event.event.dp_rank,
        },
    }
}

/// Stored blocks as the router should see them: the engine's hashes with the content hash of
/// each `block_size` chunk of `tokens` under `salt`.
fn stored(
    tier: StorageTier,
    parent: Option<u64>,
    hashes: &[u64],
    tokens: &[u32],
    block_size: usize,
    salt: BlockSalt<'_>,
) -> Seen {
    Seen::Stored {
        tier,
        parent,
        blocks: hashes
            .iter()
            .zip(tokens.chunks_exact(block_size))
            .map(|(&h, chunk)| (h, content(chunk, salt)))
            .collect(),
    }
}

const DEVICE: StorageTier = StorageTier::Device;

/// Regression (defect 1): vLLM 0.33 answers a replay request with four frames; missed batches
/// are recovered, in order, as if they had arrived.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_with_four_frames_recovers_missed_batches_vllm_0_33() {
    replay_recovers_missed_batches("vllm").await;
}

/// Regression (defect 1), SGLang 0.5.23's four-frame replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_with_four_frames_recovers_missed_batches_sglang_0_5() {
    replay_recovers_missed_batches("sglang").await;
}

/// vLLM 0.10's array events and three-frame replay (emulated: 0.10 is not installed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_with_three_frames_recovers_missed_batches_vllm_0_10() {
    replay_recovers_missed_batches("vllm010").await;
}

async fn replay_recovers_missed_batches(engine_name: &str) {
    let bs = 4;
    let mut engine = Engine::start(engine_name, bs, &[]).await;
    let config = ZmqKvListenerConfig::new("").with_replay(engine.replay_endpoint.clone());
    let (listener, publisher) = listen(&engine, config.with_block_size(bs), 1024).await;
    subscribed(&mut engine, &listener).await;
    let base = listener.stats();
    let from = next_id(&publisher);

    let a = tokens(100, 8);
    let b = tokens(200, 8);
    let c = tokens(300, 4);
    let req = |t: &[u32]| json!({ "tokens": t });
    let pa = engine
        .publish(json!([{"type": "stored", "request": req(&a)}]))
        .await;
    let pb = engine
        .publish_dropped(json!([{"type": "stored", "request": req(&b)}]))
        .await;
    let pr = engine
        .publish_dropped(json!([{"type": "removed", "request": req(&a)}]))
        .await;
    let pc = engine
        .publish(json!([{"type": "stored", "request": req(&c)}]))
        .await;
    assert_eq!(
        (pb.seq, pr.seq, pc.seq),
        (pa.seq + 1, pa.seq + 2, pa.seq + 3)
    );

    let none = BlockSalt::default();
    // vLLM removes block by block; SGLang and vLLM 0.10 in one event.
    let removed: Vec<Seen> = if engine_name == "vllm" {
        pr.hashes[0]
            .iter()
            .map(|&h| Seen::Removed {
                tier: DEVICE,
                hashes: vec![h],
            })
            .collect()
    } else {
        vec![Seen::Removed {
            tier: DEVICE,
            hashes: pr.hashes[0].clone(),
        }]
    };
    let mut expect = vec![
        stored(DEVICE, None, &pa.hashes[0], &a, 4, none),
        stored(DEVICE, None, &pb.hashes[0], &b, 4, none),
    ];
    expect.extend(removed);
    expect.push(stored(DEVICE, None, &pc.hashes[0], &c, 4, none));
    let got: Vec<Seen> = wait_events(&publisher, from, expect.len())
        .await
        .iter()
        .map(seen)
        .collect();
    assert_eq!(got, expect);
    assert_eq!(
        pr.hashes[0], pa.hashes[0],
        "the engine removed what it stored"
    );
    let stats = listener.stats();
    assert_eq!(stats.gaps - base.gaps, 1, "{stats:?}");
    assert_eq!(
        stats.replayed_messages - base.replayed_messages,
        2,
        "{stats:?}"
    );
    assert_eq!(stats.lost_messages, base.lost_messages, "{stats:?}");
}

/// Regression (defect 3): vLLM names `cache_salt` in the first block's `extra_keys` only; the
/// whole chain, continuations included, is hashed with the salt, and the same tokens unsalted
/// hash differently.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cache_salt_changes_the_content_hash_of_the_whole_chain_vllm() {
    let bs = 4;
    let mut engine = Engine::start("vllm", bs, &[]).await;
    let (listener, publisher) = listen(
        &engine,
        ZmqKvListenerConfig::new("").with_block_size(bs),
        1024,
    )
    .await;
    subscribed(&mut engine, &listener).await;
    let from = next_id(&publisher);

    let t = tokens(1, 12);
    let salted_req = json!({"tokens": t, "salt": "tenant-a"});
    // The engine caches the first block, then (a later step) the next two, continuing it.
    let first = engine
        .publish(json!([{"type": "stored", "request": salted_req, "to_block": 1}]))
        .await;
    let rest = engine
        .publish(json!([{"type": "stored", "request": salted_req, "from_block": 1}]))
        .await;
    let plain = engine
        .publish(json!([{"type": "stored", "request": {"tokens": t}}]))
        .await;
    let lora = engine
        .publish(json!([{"type": "stored", "request": {"tokens": t, "lora": "sql-adapter"}}]))
        .await;

    let got: Vec<Seen> = wait_events(&publisher, from, 4)
        .await
        .iter()
        .map(seen)
        .collect();
    let h = |p: &Published| p.hashes[0].clone();
    let lora_salt = BlockSalt {
        lora_name: Some("sql-adapter"),
        cache_salt: None,
    };
    assert_eq!(
        got,
        vec![
            stored(DEVICE, None, &h(&first), &t[..4], 4, salted("tenant-a")),
            stored(
                DEVICE,
                Some(h(&first)[0]),
                &h(&rest),
                &t[4..],
                4,
                salted("tenant-a")
            ),
            stored(DEVICE, None, &h(&plain), &t, 4, BlockSalt::default()),
            stored(DEVICE, None, &h(&lora), &t, 4, lora_salt),
        ]
    );
    assert_ne!(
        content(&t[..4], salted("tenant-a")),
        content(&t[..4], BlockSalt::default())
    );
}

/// Regression (defect 3), SGLang: its `cache_salt` rides on every page's event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cache_salt_changes_the_content_hash_of_the_whole_chain_sglang() {
    let bs = 2;
    let mut engine = Engine::start("sglang", bs, &[]).await;
    let (listener, publisher) = listen(
        &engine,
        ZmqKvListenerConfig::new("").with_block_size(bs),
        1024,
    )
    .await;
    subscribed(&mut engine, &listener).await;
    let from = next_id(&publisher);

    let t = tokens(10, 6);
    let req = json!({"tokens": t, "salt": "tenant-b"});
    let first = engine
        .publish(json!([{"type": "stored", "request": req, "to_block": 1}]))
        .await;
    let rest = engine
        .publish(json!([{"type": "stored", "request": req, "from_block": 1}]))
        .await;
    let got: Vec<Seen> = wait_events(&publisher, from, 2)
        .await
        .iter()
        .map(seen)
        .collect();
    assert_eq!(
        got,
        vec![
            stored(
                DEVICE,
                None,
                &first.hashes[0],
                &t[..2],
                2,
                salted("tenant-b")
            ),
            stored(
                DEVICE,
                Some(first.hashes[0][0]),
                &rest.hashes[0],
                &t[2..],
                2,
                salted("tenant-b")
            ),
        ]
    );
}

/// vLLM's multimodal extra keys make a block's identity more than its tokens: such a block and
/// the rest of its chain are not republished (the router could only predict wrong hits).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multimodal_blocks_are_not_republished_vllm() {
    let bs = 4;
    let mut engine = Engine::start("vllm", bs, &[]).await;
    let (listener, publisher) = listen(
        &engine,
        ZmqKvListenerConfig::new("").with_block_size(bs),
        1024,
    )
    .await;
    subscribed(&mut engine, &listener).await;
    let from = next_id(&publisher);
    let base = listener.stats();

    let t = tokens(1, 12);
    let image = json!({"tokens": t, "mm": [{"id": "image-hash", "offset": 5, "length": 2}]});
    let p = engine
        .publish(json!([{"type": "stored", "request": image}]))
        .await;
    let got: Vec<Seen> = wait_events(&publisher, from, 1)
        .await
        .iter()
        .map(seen)
        .collect();
    assert_eq!(
        got,
        vec![stored(
            DEVICE,
            None,
            &p.hashes[0][..1],
            &t[..4],
            4,
            BlockSalt::default()
        )]
    );
    eventually("the skipped blocks to be counted", async || {
        listener.stats().unhashable_blocks - base.unhashable_blocks == 2
    })
    .await;
}

/// Regression (defect 2): an engine restart (its sequence number going back) clears every lane
/// the listener wrote to, before the new engine's events.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_restart_clears_the_workers_blocks() {
    let bs = 4;
    let mut engine = Engine::start("vllm", bs, &[]).await;
    let config = ZmqKvListenerConfig::new("").with_replay(engine.replay_endpoint.clone());
    let (listener, publisher) = listen(&engine, config.with_block_size(bs), 4096).await;
    subscribed(&mut engine, &listener).await;

    let t = tokens(1, 8);
    engine
        .publish(json!([{"type": "stored", "request": {"tokens": t}}]))
        .await;
    engine
        .publish_with(
            json!({"events": [{"type": "stored", "request": {"tokens": t}}], "dp_rank": 1}),
        )
        .await;
    engine
        .publish(json!([{"type": "stored", "request": {"tokens": t}, "medium": "CPU"}]))
        .await;
    // Far ahead of where the restarted engine will be when the subscription reconnects.
    let last = engine
        .publish_with(json!({"events": [], "repeat": 500}))
        .await;
    eventually("the old engine's batches to arrive", async || {
        listener.stats().messages > last.seq + 499
    })
    .await;
    assert_eq!(listener.stats().tracked_blocks, 6);
    let from = next_id(&publisher);

    engine.restart().await;
    eventually("the restart to be noticed", async || {
        engine.publish(json!([])).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
        listener.stats().restarts == 1
    })
    .await;
    let fresh = tokens(50, 4);
    let p = engine
        .publish(json!([{"type": "stored", "request": {"tokens": fresh}}]))
        .await;
    let got: Vec<Seen> = wait_events(&publisher, from, 4)
        .await
        .iter()
        .map(seen)
        .collect();
    assert_eq!(
        got,
        vec![
            Seen::Cleared {
                tier: DEVICE,
                dp_rank: 0
            },
            Seen::Cleared {
                tier: StorageTier::HostPinned,
                dp_rank: 0
            },
            Seen::Cleared {
                tier: DEVICE,
                dp_rank: 1
            },
            stored(DEVICE, None, &p.hashes[0], &fresh, 4, BlockSalt::default()),
        ]
    );
    assert_eq!(listener.stats().tracked_blocks, 1);
}

/// Regression (defect 4): a hybrid model's sliding-window group drops a block its
/// full-attention group still holds; only the full-attention group feeds the index.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removing_a_block_from_a_non_index_group_keeps_the_prediction() {
    let bs = 4;
    // vLLM's other hash format: sha256 digests as bytes, folded to their last 8 bytes.
    let mut engine = Engine::start("vllm", bs, &["--hash-format", "bytes"]).await;
    let (listener, publisher) = listen(
        &engine,
        ZmqKvListenerConfig::new("").with_block_size(bs),
        1024,
    )
    .await;
    subscribed(&mut engine, &listener).await;
    let from = next_id(&publisher);
    let base = listener.stats();

    let t = tokens(1, 8);
    let req = json!({"tokens": t});
    let p = engine
        .publish(json!([
            {"type": "stored", "request": req, "group": 0, "kind": "sliding_window"},
            {"type": "stored", "request": req, "group": 1, "kind": "full_attention"},
        ]))
        .await;
    // The window slides past the first block.
    engine
        .publish(json!([{"type": "removed", "request": req, "to_block": 1, "group": 0}]))
        .await;
    // The full-attention group evicts it later.
    engine
        .publish(json!([{"type": "removed", "request": req, "to_block": 1, "group": 1}]))
        .await;
    let got: Vec<Seen> = wait_events(&publisher, from, 2)
        .await
        .iter()
        .map(seen)
        .collect();
    assert_eq!(
        p.hashes[0], p.hashes[1],
        "vLLM's hashes do not depend on the group"
    );
    assert_eq!(
        got,
        vec![
            stored(DEVICE, None, &p.hashes[1], &t, 4, BlockSalt::default()),
            Seen::Removed {
                tier: DEVICE,
                hashes: vec![p.hashes[1][0]]
            },
        ]
    );
    assert_eq!(
        listener.stats().other_group_events - base.other_group_events,
        2
    );
}

/// Regression (defect 5): SGLang's default page size is 1; a worker hashing 16-token blocks
/// would never match. The events are skipped, counted, and `check` fails naming both sizes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn block_size_mismatch_is_counted_and_checkable() {
    let mut engine = Engine::start("sglang", 1, &[]).await;
    let (listener, publisher) = listen(
        &engine,
        ZmqKvListenerConfig::new("").with_block_size(16),
        1024,
    )
    .await;
    subscribed(&mut engine, &listener).await;
    assert_eq!(listener.check(), Ok(()));
    engine
        .publish(json!([{"type": "stored", "request": {"tokens": tokens(1, 32)}}]))
        .await;
    eventually("the mismatch to be counted", async || {
        listener.stats().block_size_mismatches > 0
    })
    .await;
    let stats = listener.stats();
    assert_eq!(stats.first_mismatched_block_size, Some(1), "{stats:?}");
    let error = listener.check().unwrap_err();
    assert_eq!(
        error,
        ZmqListenerError::BlockSizeMismatch {
            expected: 16,
            engine: 1
        }
    );
    let message = error.to_string();
    assert!(
        message.contains("--page-size 16") && message.contains("--block-size 16"),
        "{message}"
    );
    assert_eq!(stats.tracked_blocks, 0);
    assert!(events_from(&publisher, 0).is_empty());
}

/// Regression (defect 6): a listener started with its engine learns the blocks the engine
/// cached before the subscription took hold (by replay from sequence 0), and a router that
/// subscribes after the worker's event ring moved on gets them all from the dump of the worker's
/// block-tracking publisher, as the worker sidecar runs it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_cached_before_the_router_subscribed_are_in_the_dump() {
    let bs = 4;
    let mut engine = Engine::start("vllm", bs, &[]).await;
    // The engine caches blocks before anyone listens.
    let early = tokens(1, 8);
    let p_early = engine
        .publish(json!([{"type": "stored", "request": {"tokens": early}}]))
        .await;
    assert_eq!(p_early.seq, 0);
    let config = ZmqKvListenerConfig::new("").with_replay(engine.replay_endpoint.clone());
    // A worker ring of 4 events: a late router cannot catch up from it.
    let publisher = KvEventPublisher::tracking_blocks(7, 4);
    let (listener, publisher) = listen_on(&engine, config.with_block_size(bs), publisher).await;
    subscribed(&mut engine, &listener).await;
    let mut expected: BTreeSet<(u64, LocalBlockHash)> = p_early.hashes[0]
        .iter()
        .zip(early.chunks_exact(4))
        .map(|(&h, chunk)| (h, content(chunk, BlockSalt::default())))
        .collect();
    for i in 0..6 {
        let t = tokens(100 * (i + 1), 4);
        let p = engine
            .publish(json!([{"type": "stored", "request": {"tokens": t}}]))
            .await;
        expected.insert((p.hashes[0][0], content(&t, BlockSalt::default())));
    }
    eventually("every block to be republished", async || {
        listener.stats().tracked_blocks == expected.len() as u64
    })
    .await;
    assert!(
        publisher.range(0, 0).is_err(),
        "the ring no longer holds the first events"
    );
    let dump = publisher.dump_with(|| panic!("a tracking publisher dumps its own blocks"));
    let dumped: BTreeSet<(u64, LocalBlockHash)> = dump
        .events
        .iter()
        .flat_map(|e| match &e.event.data {
            KvCacheEventData::Stored(s) => s
                .blocks
                .iter()
                .map(|b| (b.block_hash.0, b.tokens_hash))
                .collect::<Vec<_>>(),
            other => panic!("a dump holds Stored events, got {other:?}"),
        })
        .collect();
    assert_eq!(dumped, expected);
    let early_parent = dump.events.iter().find_map(|e| match &e.event.data {
        KvCacheEventData::Stored(s) if s.blocks[0].block_hash.0 == p_early.hashes[0][1] => {
            Some(s.parent_hash)
        }
        _ => None,
    });
    assert_eq!(
        early_parent,
        Some(Some(ExternalSequenceBlockHash(p_early.hashes[0][0])))
    );
}

/// Regression (defect 7): the engines' lower-tier mediums map to storage tiers (vLLM: `CPU`,
/// `STORAGE`, `REMOTE` locality; SGLang: `CPU_PINNED`, `DISK`, `EXTERNAL`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lower_tier_mediums_map_to_their_storage_tiers() {
    let bs = 4;
    /// (medium, locality, tier it maps to)
    type Medium = (&'static str, Option<&'static str>, StorageTier);
    let cases: [(&str, &[Medium]); 2] = [
        (
            "vllm",
            &[
                ("CPU", Some("LOCAL"), StorageTier::HostPinned),
                ("STORAGE", None, StorageTier::Disk),
                ("STORAGE", Some("REMOTE"), StorageTier::External),
            ],
        ),
        (
            "sglang",
            &[
                ("CPU_PINNED", None, StorageTier::HostPinned),
                ("DISK", None, StorageTier::Disk),
                ("EXTERNAL", None, StorageTier::External),
            ],
        ),
    ];
    for (engine_name, mediums) in cases {
        let mut engine = Engine::start(engine_name, bs, &[]).await;
        let (listener, publisher) = listen(
            &engine,
            ZmqKvListenerConfig::new("").with_block_size(bs),
            1024,
        )
        .await;
        subscribed(&mut engine, &listener).await;
        let from = next_id(&publisher);
        let t = tokens(1, 4);
        let mut expect = Vec::new();
        for &(medium, locality, tier) in mediums {
            let p = engine
                .publish(json!([{"type": "stored", "request": {"tokens": t},
                                 "medium": medium, "locality": locality}]))
                .await;
            expect.push(stored(
                tier,
                None,
                &p.hashes[0],
                &t,
                4,
                BlockSalt::default(),
            ));
            let p = engine
                .publish(json!([{"type": "removed", "request": {"tokens": t},
                                 "medium": medium, "locality": locality}]))
                .await;
            expect.push(Seen::Removed {
                tier,
                hashes: p.hashes[0].clone(),
            });
        }
        let got: Vec<Seen> = wait_events(&publisher, from, expect.len())
            .await
            .iter()
            .map(seen)
            .collect();
        assert_eq!(got, expect, "{engine_name}");
    }
}
