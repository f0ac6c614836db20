//! `--engine llamacpp`: the fleet is N real llama.cpp servers (`tests/python/llamacpp/servers.py`
//! over the tiny model `make_model.py` writes once per bench), one slot each and fresh for every
//! run, and the load is streamed multi-turn chat conversations over shared system prompts.
//!
//! The conversations come in families: the conversations of a family share a long system prompt
//! and each has its own user turns; every reply the engine streams back is appended to that
//! conversation's history as the assistant's message before its next turn, as a chat client
//! does. A few clients work closed-loop, each running one conversation turn after turn and then
//! taking the next one not yet started; the conversations are ordered so that families alternate,
//! so the conversations in flight together are mostly of different families and a family's later
//! conversations find its system prompt cached. The text is drawn from the words the model's
//! vocabulary was learned on, from the bench's seed.
//!
//! The servers run with one slot and `--slot-prompt-similarity 0` (what
//! `tests/python/llamacpp/e2e.py` measured to make each engine a prefix cache: every request
//! saves the slot to llama.cpp's host-memory prompt cache and restores the cached prompt sharing
//! most of the new one); `--cache-ram 0` turns that memory off, so an engine keeps only the prompt
//! its one slot last held.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::str::FromStr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::fleet::{self, Engine, Fleet, MODEL};
use super::load::{self, Sample};
use crate::cmd::run_command;
use crate::procs::Proc;

/// Context tokens per slot; the longest conversation stays well under it.
const CTX_PER_SLOT: u32 = 4096;
/// How long the servers may take to print their lines.
const START_BOUND: Duration = Duration::from_secs(60);
/// The words the text is made of: those `make_model.py` learned its vocabulary on (as
/// `e2e.py`'s), so each is one or two tokens.
const WORDS: &[&str] = &[
    "cache", "block", "token", "prefix", "router", "worker", "engine", "slot", "prompt", "stream",
    "request", "reply", "model", "system", "user", "turn", "answer", "family", "memory", "queue",
    "load", "metric", "latency", "batch", "decode", "prefill", "the", "a", "of", "to", "and", "in",
    "is", "it", "that", "on", "for", "with", "as", "by", "at", "from", "this", "be", "are", "was",
    "an", "or",
];

/// llama.cpp's host-memory prompt cache per server (`--cache-ram`, MiB): one variant axis of
/// the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum CacheRam {
    /// llama.cpp's default (8 GiB).
    Default,
    /// This many MiB; 0 turns the prompt memory off.
    Mib(u64),
}

impl FromStr for CacheRam {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        if s == "default" {
            return Ok(CacheRam::Default);
        }
        s.parse().map(CacheRam::Mib).map_err(|_| {
            format!("--cache-ram takes `default` or a size in MiB (0 turns it off), got `{s}`")
        })
    }
}

impl std::fmt::Display for CacheRam {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CacheRam::Default => f.write_str("default"),
            CacheRam::Mib(m) => write!(f, "{m}"),
        }
    }
}

/// How large the conversation load is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Sizing {
    /// Families (one system prompt each).
    pub(crate) families: usize,
    /// Conversations per family.
    pub(crate) per_family: usize,
    /// User turns per conversation (one request each).
    pub(crate) turns: usize,
    /// Clients, each with one request in flight.
    pub(crate) clients: usize,
    /// Tokens each reply is cut at (the tiny model never ends a reply on its own).
    pub(crate) max_tokens: u32,
    /// Sentences of twelve words in a system prompt.
    pub(crate) system_sentences: usize,
    /// Sentences of ten words in a user turn.
    pub(crate) turn_sentences: usize,
}

impl Sizing {
    /// The full run: 8 families of 4 conversations, 6 turns each (192 requests), 4 clients;
    /// the longest prompt is about 1,900 tokens, a system prompt about 780.
    pub(crate) const FULL: Sizing = Sizing {
        families: 8,
        per_family: 4,
        turns: 6,
        clients: 4,
        max_tokens: 16,
        system_sentences: 25,
        turn_sentences: 6,
    };
    /// `--quick`: 4 families of 2 conversations, 3 turns each (24 requests), 2 clients.
    pub(crate) const QUICK: Sizing = Sizing {
        families: 4,
        per_family: 2,
        turns: 3,
        clients: 2,
        max_tokens: 8,
        system_sentences: 12,
        turn_sentences: 3,
    };

    /// Requests of one run.
    pub(crate) fn requests(self) -> usize {
        self.families * self.per_family * self.turns
    }
}

/// One conversation: its family's system prompt and its own user turns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Conversation {
    pub(crate) family: usize,
    pub(crate) system: String,
    pub(crate) turns: Vec<String>,
}

/// The conversations of a run, deterministic from `seed`, ordered so that families alternate
/// (the first conversation of every family, then the second of every family, ...).
pub(crate) fn conversations(seed: u64, sizing: Sizing) -> Vec<Conversation> {
    let mut rng = SplitMix(seed ^ 0x6b76_726f_7574_6521);
    let systems: Vec<String> = (0..sizing.families)
        .map(|f| {
            let mut text = format!("You are assistant {f} of seed {seed}.");
            for _ in 0..sizing.system_sentences {
                text.push(' ');
                text.push_str(&sentence(&mut rng, 12));
            }
            text
        })
        .collect();
    let mut out = Vec::with_capacity(sizing.families * sizing.per_family);
    for _ in 0..sizing.per_family {
        for (family, system) in systems.iter().enumerate() {
            let turns = (0..sizing.turns)
                .map(|_| {
                    (0..sizing.turn_sentences)
                        .map(|_| sentence(&mut rng, 10))
                        .collect::<Vec<_>>()
                        .join(" ")
                })
                .collect();
            out.push(Conversation {
                family,
                system: system.clone(),
                turns,
            });
        }
    }
    out
}

/// `words` words of [`WORDS`], the first capitalized, ending in a full stop.
fn sentence(rng: &mut SplitMix, words: usize) -> String {
    let mut text = String::new();
    for i in 0..words {
        let word = WORDS[(rng.next() % WORDS.len() as u64) as usize];
        if i == 0 {
            let mut chars = word.chars();
            text.extend(chars.next().map(|c| c.to_ascii_uppercase()));
            text.push_str(chars.as_str());
        } else {
            text.push(' ');
            text.push_str(word);
        }
    }
    text.push('.');
    text
}

/// splitmix64: enough randomness for text, and the same on every machine.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

/// The tiny model's files, written once per bench.
pub(crate) struct ModelFiles {
    pub(crate) gguf: PathBuf,
    /// The same vocabulary for the `tokenizers` crate (what kvroute reads).
    pub(crate) tokenizer: PathBuf,
    /// Its ChatML template, for kvroute's `chat_template=`.
    pub(crate) template: PathBuf,
}

/// The scripts' directory in the repository.
pub(crate) fn scripts(root: &Path) -> PathBuf {
    root.join("tests/python/llamacpp")
}

/// Writes the tiny model (seed 0, as the tests use) into `dir` with `make_model.py`.
pub(crate) fn write_model(python: &Path, root: &Path, dir: &Path) -> Result<ModelFiles> {
    run_command(
        Command::new(python)
            .arg(scripts(root).join("make_model.py"))
            .arg(dir)
            .args(["--seed", "0"]),
    )?;
    let files = ModelFiles {
        gguf: dir.join("model.gguf"),
        tokenizer: dir.join("tokenizer.json"),
        template: dir.join("template.jinja"),
    };
    for path in [&files.gguf, &files.tokenizer, &files.template] {
        if !path.is_file() {
            bail!("make_model.py wrote no {}", path.display());
        }
    }
    Ok(files)
}

/// What a llama.cpp fleet is started from.
pub(crate) struct Servers<'a> {
    pub(crate) python: &'a Path,
    pub(crate) root: &'a Path,
    pub(crate) model: &'a ModelFiles,
    /// Where each server writes its log.
    pub(crate) log_dir: &'a Path,
}

/// Starts `engines` fresh llama.cpp servers (one slot each) with `servers.py`; they stop with
/// the returned fleet's process.
pub(crate) async fn start(
    servers: &Servers<'_>,
    engines: usize,
    cache_ram: CacheRam,
    log: &Path,
) -> Result<Fleet> {
    std::fs::create_dir_all(servers.log_dir)
        .with_context(|| format!("cannot create {}", servers.log_dir.display()))?;
    let mut cmd = Command::new(servers.python);
    cmd.arg(scripts(servers.root).join("servers.py"))
        .arg(&servers.model.gguf)
        .args(["-n", &engines.to_string(), "--slots", "1"])
        .args(["--ctx-per-slot", &CTX_PER_SLOT.to_string()])
        .args(["--threads", "1", "--slot-similarity", "0", "--alias", MODEL])
        .arg("--log-dir")
        .arg(servers.log_dir);
    if let CacheRam::Mib(mib) = cache_ram {
        cmd.args(["--cache-ram-mib", &mib.to_string()]);
    }
    let (proc, lines) = Proc::spawn_with_ready_lines_holding_stdin(
        "llama.cpp servers",
        &mut cmd,
        log,
        engines,
        START_BOUND,
    )
    .await?;
    let engines = lines
        .iter()
        .map(|l| parse_line(l))
        .collect::<Result<Vec<_>>>()?;
    Ok(Fleet { engines, proc })
}

/// Parses `llamacpp i=0 url=http://127.0.0.1:PORT pid=PID`: an engine without KV events.
pub(crate) fn parse_line(line: &str) -> Result<Engine> {
    let url = line
        .split_whitespace()
        .find_map(|w| w.strip_prefix("url="))
        .with_context(|| format!("servers.py's line has no `url=`: {line}"))?;
    Ok(Engine {
        url: url.to_owned(),
        kv_events: String::new(),
        kv_events_replay: String::new(),
    })
}

/// How the conversations reach the router.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Api {
    /// `/v1/chat/completions` with the messages.
    Chat,
    /// `/v1/completions` with the messages rendered as the model's template renders them
    /// (ChatML, [`render`]): the same prompt tokens, for a router that reads no text from chats.
    Text,
}

/// The prompt the model's ChatML template (`make_model.py`'s `CHAT_TEMPLATE`) makes of
/// `messages`, with the generation prompt.
pub(crate) fn render(messages: &[Value]) -> String {
    let mut text = String::new();
    for m in messages {
        let role = m["role"].as_str().unwrap_or_default();
        let content = m["content"].as_str().unwrap_or_default();
        let _ = write!(text, "<|im_start|>{role}\n{content}<|im_end|>\n");
    }
    text.push_str("<|im_start|>assistant\n");
    text
}

/// Runs `conversations` through the router at `base` (`http://HOST:PORT`) with `sizing.clients`
/// closed-loop clients, each taking the next conversation not yet started and running its turns
/// one after the other, as a user chats; returns one sample per turn (conversation-major) and
/// the wall time.
pub(crate) async fn converse(
    http: &reqwest::Client,
    base: &str,
    api: Api,
    conversations: &Arc<Vec<Conversation>>,
    sizing: Sizing,
) -> (Vec<Sample>, Duration) {
    let next = Arc::new(AtomicUsize::new(0));
    let samples = Arc::new(Mutex::new(vec![
        Sample {
            error: Some("not sent".to_owned()),
            ..Sample::default()
        };
        conversations.len() * sizing.turns
    ]));
    let start = Instant::now();
    let mut clients = JoinSet::new();
    for _ in 0..sizing.clients {
        let (http, base) = (http.clone(), base.to_owned());
        let (next, samples, conversations) = (next.clone(), samples.clone(), conversations.clone());
        clients.spawn(async move {
            loop {
                let index = next.fetch_add(1, Ordering::Relaxed);
                let Some(conversation) = conversations.get(index) else {
                    return;
                };
                let mut messages = vec![json!({"role": "system", "content": conversation.system})];
                for (turn, content) in conversation.turns.iter().enumerate() {
                    messages.push(json!({"role": "user", "content": content}));
                    let (sample, reply) = turn_request(&http, &base, api, &messages, sizing).await;
                    let failed = sample.error.is_some();
                    samples.lock().expect("samples lock")[index * sizing.turns + turn] = sample;
                    if failed {
                        // The conversation cannot go on without the reply; its later turns stay
                        // "not sent".
                        break;
                    }
                    messages.push(json!({"role": "assistant", "content": reply}));
                }
            }
        });
    }
    while clients.join_next().await.is_some() {}
    let wall = start.elapsed();
    let samples = std::mem::take(&mut *samples.lock().expect("samples lock"));
    (samples, wall)
}

/// One streamed chat turn; the sample and the reply's text.
async fn turn_request(
    http: &reqwest::Client,
    base: &str,
    api: Api,
    messages: &[Value],
    sizing: Sizing,
) -> (Sample, String) {
    let mut body = json!({
        "model": MODEL,
        "max_tokens": sizing.max_tokens,
        "temperature": 0.0,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let url = match api {
        Api::Chat => {
            body["messages"] = json!(messages);
            format!("{base}/v1/chat/completions")
        }
        Api::Text => {
            body["prompt"] = json!(render(messages));
            format!("{base}/v1/completions")
        }
    };
    let result = load::stream(http, &url, body, Instant::now(), load::SseScan::default())
        .await
        .and_then(|(sample, scan)| {
            let usage = scan.usage.as_ref().context("no usage")?;
            if usage["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .is_none()
            {
                bail!("the usage carries no prompt_tokens_details.cached_tokens: {usage}");
            }
            Ok((sample, scan.content))
        });
    result.unwrap_or_else(|e| {
        (
            Sample {
                error: Some(format!("{e:#}")),
                ..Sample::default()
            },
            String::new(),
        )
    })
}

/// llama.cpp's own hit rate, from its counters over every engine: prompt tokens reused from its
/// cache (`llamacpp:prompt_tokens_cached_total`) over those and the ones it computed
/// (`llamacpp:prompt_tokens_total`).
pub(crate) async fn engine_hit_rate(http: &reqwest::Client, engines: &[Engine]) -> Result<f64> {
    let [cached, computed] = fleet::sum_counters(
        http,
        engines,
        [
            "llamacpp:prompt_tokens_cached_total",
            "llamacpp:prompt_tokens_total",
        ],
    )
    .await?;
    if cached + computed == 0.0 {
        bail!("the engines counted no prompt token");
    }
    Ok(cached / (cached + computed))
}
