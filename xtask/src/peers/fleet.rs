//! The simulated fleet of one run: `kvroute engine-sim --dialect vllm --kv-events` with N
//! engines, the bench's tokenizer (a byte-level BPE, one token a word) and a mocker config sized
//! to the bench's token scale;
//! the engines' own prefix-cache counters; and what a process group costs in CPU and memory.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use serde_json::json;

use super::load::word;
use crate::procs::Proc;

/// The served model name, on every engine and router.
pub(crate) const MODEL: &str = "sim";
/// Tokens per KV block, on the engines and every router that needs it.
pub(crate) const BLOCK_SIZE: u32 = 16;
/// Words of the bench's vocabulary (at most 26^3: [`word`] spells three letters).
pub(crate) const VOCABULARY: u32 = 2000;
/// Llama 3's pre-tokenizer pattern: a space joins the word after it.
const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// The simulated engine's KV capacity at token scale 1, in blocks (kvroute-mocker's `h100-8b`
/// sizing: 25,000 blocks of 16 tokens).
const FULL_SCALE_BLOCKS: f64 = 25_000.0;
/// How long an engine fleet may take to print its lines.
const START_BOUND: Duration = Duration::from_secs(60);

/// One engine of the fleet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Engine {
    /// `http://127.0.0.1:PORT`.
    pub(crate) url: String,
    /// Its ZMQ KV event PUB endpoint (empty for a llama.cpp server, which publishes none).
    pub(crate) kv_events: String,
    /// Its ZMQ replay endpoint (empty for a llama.cpp server).
    pub(crate) kv_events_replay: String,
}

/// A running fleet.
pub(crate) struct Fleet {
    pub(crate) engines: Vec<Engine>,
    pub(crate) proc: Proc,
}

/// Writes the bench's tokenizer to `dir/tokenizer.json`; returns its path.
///
/// A byte-level BPE pre-tokenized as Llama 3's, as real models' tokenizers are, whose every
/// bench word is one token: id `i + 1` is the word with the space before it (`Ġwaaa`, as
/// the word appears after another), id `VOCABULARY + i + 1` the word alone (as a prompt
/// starts), 0 is `<unk>`, and the merges that build each word, letter by letter, come after
/// (ids no engine emits: the mocker samples its output from ids `0..=VOCABULARY`).
pub(crate) fn write_tokenizer(dir: &Path) -> Result<PathBuf> {
    let words: Vec<String> = (0..VOCABULARY).map(word).collect();
    let mut vocab: Vec<String> = vec!["<unk>".to_owned()];
    vocab.extend(words.iter().map(|w| format!("\u{120}{w}")));
    vocab.extend(words.iter().cloned());
    vocab.extend(byte_level_alphabet().into_iter().map(String::from));
    // `Ġ` + `w` first, so that a spaced word never starts merging at its `w`.
    let mut merges = vec![("\u{120}".to_owned(), "w".to_owned())];
    for w in &words {
        for prefix in [format!("\u{120}{}", &w[..1]), w[..1].to_owned()] {
            let mut left = prefix;
            for c in w[1..].chars() {
                merges.push((left.clone(), c.to_string()));
                left.push(c);
            }
        }
    }
    let mut seen = std::collections::HashSet::new();
    merges.retain(|m| seen.insert(m.clone()));
    for (a, b) in &merges {
        vocab.push(format!("{a}{b}"));
    }
    let mut ids = serde_json::Map::new();
    for token in vocab {
        let id = ids.len();
        ids.entry(token).or_insert_with(|| json!(id));
    }
    let merges: Vec<String> = merges.iter().map(|(a, b)| format!("{a} {b}")).collect();
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [{
            "id": 0, "content": "<unk>", "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true
        }],
        "normalizer": null,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": LLAMA3_PATTERN}, "behavior": "Isolated",
             "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true,
             "use_regex": false}
        ]},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true,
                    "use_regex": true},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null,
            "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": false,
            "byte_fallback": false, "ignore_merges": false, "vocab": ids, "merges": merges
        }
    });
    let path = dir.join("tokenizer.json");
    std::fs::write(&path, tokenizer.to_string())
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}

/// GPT-2's byte-level alphabet: the character that stands for each byte (printable ones for
/// themselves, the others shifted past 255, a space as `Ġ`).
fn byte_level_alphabet() -> Vec<char> {
    let mut shifted = 0u32;
    (0u32..256)
        .map(|b| {
            let printable = (33..=126).contains(&b) || (161..=172).contains(&b) || b >= 174;
            if printable {
                char::from_u32(b)
            } else {
                shifted += 1;
                char::from_u32(255 + shifted)
            }
            .unwrap_or(char::REPLACEMENT_CHARACTER)
        })
        .collect()
}

/// Asks an engine to tokenize two words and checks the bench's tokenizer made each one token
/// with the ids [`write_tokenizer`] gave them (every router's and engine's tokens rest on it).
pub(crate) async fn check_tokenizer(http: &reqwest::Client, engine: &Engine) -> Result<()> {
    let (a, b) = (7, VOCABULARY - 1);
    let prompt = format!("{} {}", word(a), word(b));
    let reply: serde_json::Value = http
        .post(format!("{}/tokenize", engine.url))
        .json(&json!({"model": MODEL, "prompt": prompt}))
        .send()
        .await
        .and_then(reqwest::Response::error_for_status)
        .with_context(|| format!("tokenizing {prompt:?} on {}", engine.url))?
        .json()
        .await
        .context("reading /tokenize's reply")?;
    let expected = json!([VOCABULARY + a + 1, b + 1]);
    if reply["tokens"] != expected {
        bail!(
            "the bench's tokenizer gave {prompt:?} the ids {}, expected {expected}",
            reply["tokens"]
        );
    }
    Ok(())
}

/// Writes the engines' mocker config (`h100-8b` timing; capacity scaled with the prompts, so
/// that the cache holds as much of the workload as at full scale) to `dir/mocker.toml`.
pub(crate) fn write_mocker_config(dir: &Path, token_scale: f64, speedup: f64) -> Result<PathBuf> {
    let blocks = (FULL_SCALE_BLOCKS * token_scale).round().max(64.0) as u64;
    let mut text = String::new();
    let _ = writeln!(text, "block_size = {BLOCK_SIZE}");
    let _ = writeln!(text, "num_blocks = {blocks}");
    // Ids 1..=VOCABULARY are words after a space; 0 is `<unk>`.
    let _ = writeln!(text, "vocab_size = {}", VOCABULARY + 1);
    let _ = writeln!(text, "speedup = {speedup:?}");
    let path = dir.join("mocker.toml");
    std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}

/// Starts `engines` simulated engines in one `kvroute engine-sim` process.
pub(crate) async fn start(
    kvroute: &Path,
    engines: usize,
    tokenizer: &Path,
    mocker: &Path,
    log: &Path,
) -> Result<Fleet> {
    let mut cmd = Command::new(kvroute);
    cmd.args([
        "engine-sim",
        "--dialect",
        "vllm",
        "--kv-events",
        "--engines",
    ])
    .arg(engines.to_string())
    .args([
        "--model",
        MODEL,
        "--max-model-len",
        "1000000",
        "--tokenizer",
    ])
    .arg(tokenizer)
    .arg("--mocker-config")
    .arg(mocker)
    .env("RUST_LOG", "warn");
    let (proc, lines) =
        Proc::spawn_with_ready_lines("engine-sim", &mut cmd, log, engines, START_BOUND).await?;
    let engines = lines
        .iter()
        .map(|l| parse_line(l))
        .collect::<Result<Vec<_>>>()?;
    Ok(Fleet { engines, proc })
}

/// Parses `engine i=0 url=http://... kv_events=tcp://... kv_events_replay=tcp://...`.
pub(crate) fn parse_line(line: &str) -> Result<Engine> {
    let field = |key: &str| {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(key).and_then(|r| r.strip_prefix('=')))
            .map(str::to_owned)
            .with_context(|| format!("engine-sim's line has no `{key}=`: {line}"))
    };
    Ok(Engine {
        url: field("url")?,
        kv_events: field("kv_events")?,
        kv_events_replay: field("kv_events_replay")?,
    })
}

/// The engines' own prefix-cache hit rate: the sum of `vllm:prefix_cache_hits_total` over the
/// sum of `vllm:prefix_cache_queries_total` (tokens), over every engine.
pub(crate) async fn engine_hit_rate(http: &reqwest::Client, engines: &[Engine]) -> Result<f64> {
    let [hits, queries] = sum_counters(
        http,
        engines,
        [
            "vllm:prefix_cache_hits_total",
            "vllm:prefix_cache_queries_total",
        ],
    )
    .await?;
    if queries == 0.0 {
        bail!("the engines counted no prefix-cache query");
    }
    Ok(hits / queries)
}

/// Each of the counters `names`, summed over every engine's `/metrics`.
pub(crate) async fn sum_counters<const N: usize>(
    http: &reqwest::Client,
    engines: &[Engine],
    names: [&str; N],
) -> Result<[f64; N]> {
    let mut sums = [0.0; N];
    for engine in engines {
        let text = http
            .get(format!("{}/metrics", engine.url))
            .send()
            .await
            .and_then(reqwest::Response::error_for_status)
            .with_context(|| format!("reading {}/metrics", engine.url))?
            .text()
            .await
            .with_context(|| format!("reading {}/metrics", engine.url))?;
        for (sum, name) in sums.iter_mut().zip(names) {
            *sum += counter(&text, name)?;
        }
    }
    Ok(sums)
}

/// The engines' own mean time to first token in ms: the sum of
/// `vllm:time_to_first_token_seconds_sum` over the sum of its `_count`, over every engine.
pub(crate) async fn engine_ttft_mean_ms(http: &reqwest::Client, engines: &[Engine]) -> Result<f64> {
    let [sum, count] = sum_counters(
        http,
        engines,
        [
            "vllm:time_to_first_token_seconds_sum",
            "vllm:time_to_first_token_seconds_count",
        ],
    )
    .await?;
    if count == 0.0 {
        bail!("the engines counted no first token");
    }
    Ok(sum / count * 1000.0)
}

/// The sum of every sample of counter `name` in a Prometheus text.
pub(crate) fn counter(text: &str, name: &str) -> Result<f64> {
    let mut found = false;
    let mut sum = 0.0;
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        if !(rest.starts_with('{') || rest.starts_with(' ')) {
            continue;
        }
        let value = rest
            .rsplit(' ')
            .next()
            .and_then(|v| v.parse::<f64>().ok())
            .with_context(|| format!("a `{name}` sample without a number: {line}"))?;
        sum += value;
        found = true;
    }
    if !found {
        bail!("no `{name}` in the metrics");
    }
    Ok(sum)
}

/// CPU seconds (user and system, every thread) and peak resident memory (KiB, summed) of every
/// live process in process group `pgid`, from `/proc`.
pub(crate) fn group_usage(pgid: u32) -> (f64, u64) {
    let mut cpu_ticks = 0u64;
    let mut hwm_kib = 0u64;
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return (0.0, 0);
    };
    for entry in dir.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // The fields after the command name's closing parenthesis: state is the 1st, pgrp the
        // 3rd, utime the 12th and stime the 13th.
        let Some((_, rest)) = stat.rsplit_once(')') else {
            continue;
        };
        let fields: Vec<&str> = rest.split_whitespace().collect();
        if fields.get(2).and_then(|g| g.parse::<u32>().ok()) != Some(pgid) {
            continue;
        }
        let ticks = |i: usize| {
            fields
                .get(i)
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0)
        };
        cpu_ticks += ticks(11) + ticks(12);
        if let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) {
            hwm_kib += status
                .lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
                .unwrap_or(0);
        }
    }
    // Clock ticks are 100 a second on Linux.
    (cpu_ticks as f64 / 100.0, hwm_kib)
}
