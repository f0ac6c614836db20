//! kvroute against a real engine nobody on the project wrote: llama.cpp's own HTTP server, on
//! the CPU, through the `xllamacpp` wheel, serving a tiny random-weight model made on the spot
//! (`tests/python/llamacpp/make_model.py`: nothing is downloaded from a model hub).
//!
//! - The router's tokenizer and chat template (the `tokenizers` crate over the model's
//!   `tokenizer.json`, minijinja over its `template.jinja`) must cut and render exactly as
//!   llama.cpp does with the GGUF's vocabulary and template: checked text by text against the
//!   server's `/tokenize`, `/detokenize` and `/apply-template`.
//! - `tests/python/llamacpp/e2e.py` runs `kvroute serve` and `kvroute worker --engine llamacpp`
//!   sidecars (and a static fleet) in front of three servers and asserts, from the engines' own
//!   cached-token reports, that KV routing beats round-robin; that streams, cancellation and a
//!   killed engine behave; that the router's load returns to zero and its prediction error is
//!   small.
//! - `tests/python/llamacpp/faults.py` freezes, kills and restarts servers under the router and
//!   misconfigures it: first-byte and idle timeouts (requests move, the worker is ejected and let
//!   back in), a dead engine in a static fleet, an engine's 400 for a prompt over its context,
//!   the wrong engine dialect, a fleet without a tokenizer; the client's answers, the router's
//!   failure and ejection metrics, and zero load after each.
//!
//! The Python environment is required, never skipped: `cargo xtask ci` creates it; see [`SETUP`]
//! for doing it by hand.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use kvroute_router::tokenizer::{ChatTemplate, HfTokenizer, TemplateMessage, Tokenizer};
use kvroute_router::{Model, ModelConfig};
use serde_json::{Value, json};

use crate::support::scratch;

/// How to get the Python environment these tests need.
const SETUP: &str = "set KVROUTE_PYTHON to a python with tests/python/requirements.txt \
    installed (xllamacpp, gguf, numpy, openai): `cargo xtask ci` creates \
    ~/.cache/kvroute/venv and sets it; by hand: `python3 -m venv ~/.cache/kvroute/venv && \
    ~/.cache/kvroute/venv/bin/pip install -r tests/python/requirements.txt && \
    export KVROUTE_PYTHON=~/.cache/kvroute/venv/bin/python`";

/// A bound on each step (model, server start); the whole e2e script has [`E2E_TIMEOUT`].
const BOUND: Duration = Duration::from_secs(60);
const E2E_TIMEOUT: Duration = Duration::from_secs(240);
/// The bound on the whole fault suite (`faults.py`; about a minute on two busy cores).
const FAULTS_TIMEOUT: Duration = Duration::from_secs(240);

fn scripts() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/python/llamacpp")
}

/// `$KVROUTE_PYTHON`, checked once to import the engine; fails the test otherwise.
pub(crate) fn python() -> String {
    static CHECKED: std::sync::OnceLock<Result<String, String>> = std::sync::OnceLock::new();
    CHECKED
        .get_or_init(|| {
            let python = std::env::var("KVROUTE_PYTHON")
                .map_err(|_| format!("KVROUTE_PYTHON is not set: {SETUP}"))?;
            let out = Command::new(&python)
                .args(["-c", "import xllamacpp, gguf, numpy, openai"])
                .output()
                .map_err(|e| format!("cannot run KVROUTE_PYTHON={python}: {e}; {SETUP}"))?;
            if !out.status.success() {
                return Err(format!(
                    "KVROUTE_PYTHON={python} lacks the llama.cpp test packages: {}; {SETUP}",
                    String::from_utf8_lossy(&out.stderr).trim()
                ));
            }
            Ok(python)
        })
        .clone()
        .unwrap_or_else(|e| panic!("{e}"))
}

/// Writes the tiny model (seed 0) into `dir`.
fn make_model(dir: &Path) {
    let out = Command::new(python())
        .arg(scripts().join("make_model.py"))
        .arg(dir)
        .args(["--seed", "0"])
        .output()
        .expect("run make_model.py");
    assert!(
        out.status.success(),
        "make_model.py failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `servers.py` and its llama.cpp children; all of them stop when this is dropped (the script
/// stops its servers when its standard input closes, and each server when the script's pipe
/// to it closes, so even a kill leaves no server behind).
struct Servers {
    child: Child,
    urls: Vec<String>,
}

impl Servers {
    fn start(model: &Path, n: usize, log_dir: &Path) -> Servers {
        let mut child = Command::new(python())
            .arg(scripts().join("servers.py"))
            .arg(model)
            .args(["-n", &n.to_string(), "--log-dir"])
            .arg(log_dir)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("run servers.py");
        let stdout = child.stdout.take().expect("stdout piped");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut servers = Servers {
            child,
            urls: Vec::new(),
        };
        for _ in 0..n {
            let line = rx.recv_timeout(BOUND).unwrap_or_else(|_| {
                panic!("servers.py printed no `llamacpp i=.. url=..` line; logs in {log_dir:?}")
            });
            let url = line
                .split_whitespace()
                .find_map(|w| w.strip_prefix("url="))
                .unwrap_or_else(|| panic!("no url= in {line:?}"));
            servers.urls.push(url.to_owned());
        }
        servers
    }
}

impl Drop for Servers {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn post(http: &reqwest::Client, url: String, body: Value) -> Value {
    let response = http.post(&url).json(&body).send().await.expect("POST");
    assert!(
        response.status().is_success(),
        "{url}: {}",
        response.status()
    );
    response.json().await.expect("JSON body")
}

/// Texts that exercise the vocabulary: merges, byte fallback (newlines, tabs, non-ASCII),
/// spaces in runs, the special tokens inside text, and pseudo-random strings (fixed seed).
fn texts() -> Vec<String> {
    let mut texts: Vec<String> = [
        "",
        " ",
        "  leading and trailing  ",
        "You are a careful assistant. Answer the question of the user in a short way.",
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
        "<s>x</s><unk>",
        "<|im_start",
        "caf\u{e9} \u{65e5}\u{672c} \u{1f642} tab\there\nnew line",
        "numbers 0 1 2 16 64 128 256 and punctuation, commas; periods.",
        "\u{2581}visible\u{2581}space",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    let words: Vec<&str> = "the router sends each request to the worker that holds the longest \
        prefix of its prompt in the key value cache conversation turn answer family question \
        system user assistant token tokens blocks streaming cancelling slot engine"
        .split_whitespace()
        .collect();
    let alphabet: Vec<String> = (0x20u8..0x7f)
        .map(|b| char::from(b).to_string())
        .chain(["\n", "\t", "\u{e9}", "\u{65e5}\u{672c}", "\u{1f642}", "  "].map(String::from))
        .collect();
    let mut state = 0x9e37_79b9_7f4a_7c15_u64;
    let mut next = move |n: usize| {
        // xorshift64*: a fixed sequence, no dependency.
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        (state.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 33) as usize % n
    };
    for i in 0..300 {
        let text = if i % 2 == 0 {
            (0..1 + next(30))
                .map(|_| words[next(words.len())])
                .collect::<Vec<_>>()
                .join(" ")
        } else {
            (0..1 + next(40))
                .map(|_| alphabet[next(alphabet.len())].as_str())
                .collect()
        };
        texts.push(text);
    }
    texts
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_router_tokenizer_and_template_agree_with_llamacpp() {
    let dir = scratch("llamacpp-tokenizer");
    let model_dir = dir.join("model");
    make_model(&model_dir);
    let servers = Servers::start(&model_dir.join("model.gguf"), 1, &dir);
    let base = &servers.urls[0];
    let http = reqwest::Client::builder()
        .timeout(BOUND)
        .build()
        .expect("client");

    // The router's default encoder (fastokens) and the tokenizers crate's, each against
    // llama.cpp's own tokenizer.
    let tokenizer = HfTokenizer::from_file(&model_dir.join("tokenizer.json")).expect("tokenizer");
    assert!(
        tokenizer.encodes_with_fastokens(),
        "fastokens should load the model's BPE tokenizer"
    );
    let reference = HfTokenizer::from_file(&model_dir.join("tokenizer.json"))
        .expect("tokenizer")
        .with_fastokens(false);
    let mut mismatches = Vec::new();
    let texts = texts();
    for text in &texts {
        let ours = tokenizer.encode(text).expect("encode");
        let theirs: Vec<u32> = serde_json::from_value(
            post(&http, format!("{base}/tokenize"), json!({"content": text})).await["tokens"]
                .clone(),
        )
        .expect("token ids");
        let reference_ids = reference.encode(text).expect("encode");
        if reference_ids != theirs {
            mismatches.push(format!(
                "{text:?}: tokenizers crate {reference_ids:?}, llama.cpp {theirs:?}"
            ));
        }
        if ours != theirs {
            mismatches.push(format!("{text:?}: router {ours:?}, llama.cpp {theirs:?}"));
            continue;
        }
        // Decoding (the router skips special tokens; compare where there are none).
        if !text.contains("<s>") && !text.contains("<|im_") && !text.contains("</s>") {
            let ours = tokenizer.decode(&theirs).expect("decode");
            let theirs = post(
                &http,
                format!("{base}/detokenize"),
                json!({"tokens": theirs}),
            )
            .await["content"]
                .as_str()
                .expect("content")
                .to_owned();
            if ours != theirs {
                mismatches.push(format!(
                    "decode of {text:?}: router {ours:?}, llama.cpp {theirs:?}"
                ));
            }
        }
    }
    assert!(
        mismatches.is_empty(),
        "{} of {} texts differ:\n{}",
        mismatches.len(),
        texts.len(),
        mismatches.join("\n")
    );
    assert!(
        tokenizer.encodes_with_fastokens(),
        "fastokens was turned off: its ids differed from the tokenizers crate's"
    );

    // The chat template, in both of the forms kvroute reads.
    let messages = [
        ("system", "You are a careful assistant."),
        ("user", "Tell me about caches and routing."),
        ("assistant", "Caches keep the prefix."),
        ("user", "And the router?"),
    ];
    let theirs = post(
        &http,
        format!("{base}/apply-template"),
        json!({"messages": messages.iter().map(|(r, c)| json!({"role": r, "content": c})).collect::<Vec<_>>()}),
    )
    .await["prompt"]
        .as_str()
        .expect("prompt")
        .to_owned();
    let messages: Vec<TemplateMessage> = messages
        .iter()
        .map(|(role, content)| TemplateMessage {
            role: (*role).to_owned(),
            content: (*content).to_owned(),
        })
        .collect();
    for file in ["template.jinja", "tokenizer_config.json"] {
        let template = ChatTemplate::from_file(&model_dir.join(file)).expect("template");
        let ours = template.render(&messages, true).expect("render");
        assert_eq!(ours, theirs, "{file} renders differently from llama.cpp");
    }

    // The model's end tokens, as the router finds them: llama.cpp's EOS is <|im_end|> (id 4).
    let model = Model::load(&ModelConfig {
        name: "tiny".to_owned(),
        tokenizer: Some(model_dir.join("tokenizer.json")),
        chat_template: Some(model_dir.join("template.jinja")),
        ..ModelConfig::default()
    })
    .expect("model");
    assert!(
        model.eos_token_ids.contains(&4),
        "{:?}",
        model.eos_token_ids
    );
}

#[test]
fn kvroute_serves_real_llamacpp_engines() {
    let dir = scratch("llamacpp-e2e");
    let mut child = Command::new(python())
        .arg(scripts().join("e2e.py"))
        .arg(env!("CARGO_BIN_EXE_kvroute"))
        .env("KVROUTE_E2E_LOGS", &dir)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(dir.join("e2e.out")).expect("create e2e.out"))
        .stderr(std::fs::File::create(dir.join("e2e.err")).expect("create e2e.err"))
        .spawn()
        .expect("run e2e.py");
    let deadline = Instant::now() + E2E_TIMEOUT;
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break Some(status);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let out = std::fs::read_to_string(dir.join("e2e.out")).unwrap_or_default();
    let err = std::fs::read_to_string(dir.join("e2e.err")).unwrap_or_default();
    match status {
        Some(s) if s.success() => eprintln!("{out}"),
        Some(s) => panic!("e2e.py failed ({s}); logs in {dir:?}\nstdout:\n{out}\nstderr:\n{err}"),
        None => panic!(
            "e2e.py ran over {E2E_TIMEOUT:?}; logs in {dir:?}\nstdout:\n{out}\nstderr:\n{err}"
        ),
    }
}

/// Runs `tests/python/llamacpp/SCRIPT KVROUTE_BINARY` with its logs in `dir`, for at most
/// `timeout`; fails the test with the script's output (and where its logs are) unless it
/// succeeds.
fn run_script(script: &str, dir: &Path, timeout: Duration) {
    run_python(&scripts().join(script), dir, timeout);
}

/// Runs the Python script at `path` with the kvroute binary as its argument and its logs in
/// `dir`, within `timeout` (SIGTERM, then SIGKILL, past it); fails with its output unless it
/// exits 0.
pub(crate) fn run_python(path: &Path, dir: &Path, timeout: Duration) {
    let script = path
        .file_name()
        .map_or_else(|| "script".into(), |n| n.to_string_lossy().into_owned());
    let out_path = dir.join(format!("{script}.out"));
    let err_path = dir.join(format!("{script}.err"));
    let mut child = Command::new(python())
        .arg(path)
        .arg(env!("CARGO_BIN_EXE_kvroute"))
        .env("KVROUTE_E2E_LOGS", dir)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out_path).expect("create the script's stdout file"))
        .stderr(std::fs::File::create(&err_path).expect("create the script's stderr file"))
        .spawn()
        .unwrap_or_else(|e| panic!("run {script}: {e}"));
    let deadline = Instant::now() + timeout;
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break Some(status);
        }
        if Instant::now() > deadline {
            // SIGTERM first: the script then stops its servers and kvroute processes itself.
            let _ = Command::new("kill")
                .args(["-TERM", &child.id().to_string()])
                .status();
            let grace = Instant::now() + Duration::from_secs(15);
            while Instant::now() < grace && matches!(child.try_wait(), Ok(None)) {
                std::thread::sleep(Duration::from_millis(100));
            }
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let out = std::fs::read_to_string(&out_path).unwrap_or_default();
    let err = std::fs::read_to_string(&err_path).unwrap_or_default();
    match status {
        Some(s) if s.success() => eprintln!("{out}"),
        Some(s) => panic!("{script} failed ({s}); logs in {dir:?}\nstdout:\n{out}\nstderr:\n{err}"),
        None => {
            panic!("{script} ran over {timeout:?}; logs in {dir:?}\nstdout:\n{out}\nstderr:\n{err}")
        }
    }
}

#[test]
fn llamacpp_faults() {
    let dir = scratch("llamacpp-faults");
    run_script("faults.py", &dir, FAULTS_TIMEOUT);
}
