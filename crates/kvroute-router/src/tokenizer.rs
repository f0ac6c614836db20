//! Prompts to tokens and back: the [`Tokenizer`] trait, a `tokenizer.json` loaded with the
//! `tokenizers` crate ([`HfTokenizer`]), the built-in [`MockTokenizer`] of the mock model, chat
//! templates rendered with minijinja ([`ChatTemplate`]), and [`IncrementalDetokenizer`], which
//! turns a stream of token ids into text deltas.
//!
//! # The mock model's tokenizer
//!
//! The mock model needs no files, so that `kvroute demo` runs anywhere. [`MockTokenizer`] splits
//! text on Unicode whitespace and maps each word to `MOCK_FIRST_WORD_ID + xxh3_64(word) %
//! (MOCK_VOCAB_SIZE - MOCK_FIRST_WORD_ID)`: the same word always gives the same id, so two
//! prompts that share leading words share leading tokens (and KV blocks). Ids below
//! [`MOCK_FIRST_WORD_ID`] are reserved for special tokens ([`MOCK_EOS_TOKEN_ID`]).
//! Decoding renders each id as a pronounceable pseudo-word spelled from its digits in base 70
//! (one consonant-vowel syllable per digit), joined by single spaces; it is deterministic but not
//! the inverse of encoding (hashing forgets the word). [`MOCK_CHAT_TEMPLATE`] renders each message
//! as `<|role|> content` on its own line and ends with `<|assistant|>` when a generation prompt is
//! asked for.

pub(crate) mod chunked;
mod fast;
#[cfg(test)]
mod fixtures;

use std::path::{Path, PathBuf};

use serde::Serialize;
use xxhash_rust::xxh3::xxh3_64;

/// Vocabulary size of [`MockTokenizer`].
pub const MOCK_VOCAB_SIZE: u32 = 32_000;
/// The first id [`MockTokenizer`] gives a word; the ids below are special tokens.
pub const MOCK_FIRST_WORD_ID: u32 = 16;
/// The mock model's end-of-sequence token id.
pub const MOCK_EOS_TOKEN_ID: u32 = 2;
/// The mock model's chat template (see the module documentation).
pub const MOCK_CHAT_TEMPLATE: &str = "{% for m in messages %}<|{{ m.role }}|> {{ m.content }}\n\
    {% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}";

/// Why text could not become tokens, or tokens text.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TokenizerError {
    /// A tokenizer or template file could not be read or parsed.
    #[error("cannot load {path}: {message}")]
    Load {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
    /// The tokenizer failed on the text.
    #[error("tokenizing failed: {0}")]
    Encode(String),
    /// The tokenizer failed on the ids.
    #[error("detokenizing failed: {0}")]
    Decode(String),
    /// The chat template is invalid or failed on the messages.
    #[error("chat template: {0}")]
    Template(String),
}

/// Turns text into token ids and back. Implementations are shared across requests.
pub trait Tokenizer: Send + Sync + 'static {
    /// The token ids of `text`, as given (no special tokens added: a chat template adds its own).
    fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError>;

    /// The text of `ids` (special tokens skipped).
    fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError>;

    /// What encodes texts now, as `/metrics` names it (`tokenizer_encoder`): `"builtin"` (the
    /// default) for a tokenizer that is its own code, `"fastokens"` or `"tokenizers"` for a
    /// `tokenizer.json`.
    fn encoder(&self) -> &'static str {
        "builtin"
    }
}

/// The built-in tokenizer of the mock model; see the module documentation for its rules.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MockTokenizer;

const CONSONANTS: &[u8; 14] = b"bdfgklmnprstvz";
const VOWELS: &[u8; 5] = b"aeiou";

impl MockTokenizer {
    /// The id of one word.
    pub fn word_id(word: &str) -> u32 {
        let span = u64::from(MOCK_VOCAB_SIZE - MOCK_FIRST_WORD_ID);
        // The modulus keeps the value below MOCK_VOCAB_SIZE, so the cast cannot truncate.
        MOCK_FIRST_WORD_ID + (xxh3_64(word.as_bytes()) % span) as u32
    }

    /// The pseudo-word that renders `id`.
    pub fn render_id(id: u32) -> String {
        let base = (CONSONANTS.len() * VOWELS.len()) as u32;
        let mut digits = Vec::new();
        let mut n = id;
        loop {
            digits.push(n % base);
            n /= base;
            if n == 0 {
                break;
            }
        }
        let mut word = String::with_capacity(digits.len() * 2);
        for d in digits.iter().rev() {
            let d = *d as usize;
            word.push(char::from(CONSONANTS[d / VOWELS.len()]));
            word.push(char::from(VOWELS[d % VOWELS.len()]));
        }
        word
    }
}

impl Tokenizer for MockTokenizer {
    fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        Ok(text.split_whitespace().map(Self::word_id).collect())
    }

    fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        let words: Vec<String> = ids
            .iter()
            .filter(|&&id| id >= MOCK_FIRST_WORD_ID)
            .map(|&id| Self::render_id(id))
            .collect();
        Ok(words.join(" "))
    }
}

/// The text every [`HfTokenizer`] encodes once as it loads (see `HfTokenizer::warm_up`): words
/// in both cases, digits, punctuation, whitespace runs and non-ASCII letters, so that each
/// branch of a pre-tokenizer runs.
const WARM_UP_TEXT: &str = "You are a helpful assistant. Answer the user's questions \
    carefully; cite sources where you can.\n\nUser: What's 1234 + 5678, and why?\n\t- \
    Étape 2: « déjà vu » — naïve café, 東京 ｶﾀｶﾅ, emoji 🙂!\n    def f(x): return x ** 2  # ok\n";

/// A Hugging Face `tokenizer.json`, loaded with the `tokenizers` crate (pure Rust, no Python).
///
/// Texts are encoded with `fastokens` where it implements the tokenizer (BPE models: byte-level
/// ones such as Llama 3's and Qwen's, SentencePiece-style ones with byte fallback), checked
/// against the `tokenizers` crate on the first encodings and one in 256 after; other tokenizers,
/// and one whose check found a difference, are encoded with the `tokenizers` crate.
///
/// Long prompts are tokenized a chunk at a time with a cache of the chunks seen before, for
/// tokenizers where that gives the same ids (no normalizer, a pre-tokenizer that splits at
/// spaces, no added token holding or stripping whitespace; checked against whole encodings as
/// it runs): a prompt that repeats an earlier one's prefix costs its new chunks only.
pub struct HfTokenizer {
    inner: tokenizers::Tokenizer,
    /// `fastokens`, where it loads this tokenizer and is not turned off.
    fast: Option<fast::FastEncoder>,
    chunks: Option<chunked::ChunkCache>,
}

impl std::fmt::Debug for HfTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HfTokenizer")
            .field("vocab_size", &self.inner.get_vocab_size(true))
            .field("fastokens", &self.encodes_with_fastokens())
            .field("chunked", &self.tokenizes_in_chunks())
            .finish()
    }
}

impl HfTokenizer {
    /// Loads a `tokenizer.json` file.
    pub fn from_file(path: &Path) -> Result<Self, TokenizerError> {
        Self::from_file_with(path, true)
    }

    /// Loads a `tokenizer.json` file, with `fastokens` where it implements the tokenizer when
    /// `fastokens` is true, without ever loading it when false.
    pub fn from_file_with(path: &Path, fastokens: bool) -> Result<Self, TokenizerError> {
        let bytes = std::fs::read(path).map_err(|e| TokenizerError::Load {
            path: path.to_owned(),
            message: e.to_string(),
        })?;
        Self::parse(&bytes, path, fastokens)
    }

    /// Parses a `tokenizer.json` document.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, TokenizerError> {
        Self::parse(bytes, Path::new("<bytes>"), true)
    }

    fn parse(bytes: &[u8], path: &Path, fastokens: bool) -> Result<Self, TokenizerError> {
        let inner = tokenizers::Tokenizer::from_bytes(bytes).map_err(|e| TokenizerError::Load {
            path: path.to_owned(),
            message: e.to_string(),
        })?;
        // The `tokenizers` crate parsed it, so it is JSON.
        let fast = fastokens.then(|| {
            serde_json::from_slice(bytes)
                .map_err(|e| e.to_string())
                .and_then(fast::FastEncoder::load)
        });
        let fast = match fast {
            None => None,
            Some(Ok(fast)) => {
                tracing::debug!(path = %path.display(), "prompts are encoded with fastokens");
                Some(fast)
            }
            Some(Err(why)) => {
                tracing::debug!(
                    path = %path.display(),
                    "prompts are encoded with the tokenizers crate: fastokens cannot load this \
                     tokenizer: {why}"
                );
                None
            }
        };
        let chunks = serde_json::to_value(&inner)
            .map_err(|e| e.to_string())
            .and_then(|config| chunked::ChunkCache::supports(&config));
        let chunks = match chunks {
            Ok(()) => Some(chunked::ChunkCache::new(chunked::CAPACITY_IDS)),
            Err(why) => {
                tracing::debug!("prompts are tokenized whole: {why}");
                None
            }
        };
        let tokenizer = Self {
            inner,
            fast,
            chunks,
        };
        tokenizer.warm_up();
        Ok(tokenizer)
    }

    /// Encodes [`WARM_UP_TEXT`] once with each encoder, outside the checks and the chunk cache.
    /// A fresh tokenizer's first encoding builds what both encoders make lazily (`fastokens`'
    /// table of short pretokens, its merge tables brought into cache, the `tokenizers` crate's
    /// word cache and buffers) and faults in fresh memory: on the peers bench's byte-level BPE
    /// that put 25-45 ms on a new router's first request, and on a router with one core, on
    /// every request of a first burst queued behind it. Here it is paid while the model loads.
    fn warm_up(&self) {
        if let Some(fast) = &self.fast {
            fast.warm_up(WARM_UP_TEXT);
        }
        let _ = self.encode_reference(WARM_UP_TEXT);
    }

    /// This tokenizer with the chunk cache on or off: off tokenizes every prompt whole (no
    /// cache memory, up to 16 MiB, and every prompt's full tokenizing cost); on is the default
    /// where the tokenizer allows it, and changes nothing where it does not.
    pub fn with_chunk_cache(mut self, enabled: bool) -> Self {
        if !enabled {
            self.chunks = None;
        } else if self.chunks.is_none() && self.chunkable() {
            self.chunks = Some(chunked::ChunkCache::new(chunked::CAPACITY_IDS));
        }
        self
    }

    /// This tokenizer with `fastokens` kept or dropped: dropped encodes every text with the
    /// `tokenizers` crate and gives back `fastokens`' tables (about 20 MiB with its caches);
    /// kept is the default where `fastokens` loads the tokenizer, and changes nothing where it
    /// does not (nor once it was dropped).
    pub fn with_fastokens(mut self, enabled: bool) -> Self {
        if !enabled {
            self.fast = None;
        }
        self
    }

    fn chunkable(&self) -> bool {
        serde_json::to_value(&self.inner)
            .map_err(|e| e.to_string())
            .and_then(|config| chunked::ChunkCache::supports(&config))
            .is_ok()
    }

    /// Whether long prompts are tokenized a chunk at a time with a cache: false for tokenizers
    /// where that could give other ids, and once a check found it did.
    pub fn tokenizes_in_chunks(&self) -> bool {
        self.chunks.as_ref().is_some_and(|c| !c.disabled())
    }

    /// Whether texts are encoded with `fastokens`: false for tokenizers it does not implement,
    /// when turned off ([`HfTokenizer::with_fastokens`]) and once a check found its ids differ
    /// from the `tokenizers` crate's.
    pub fn encodes_with_fastokens(&self) -> bool {
        self.fast.as_ref().is_some_and(|f| !f.disabled())
    }

    /// `text`'s ids, tokenized whole.
    fn encode_whole(&self, text: &str) -> Result<Vec<u32>, String> {
        match &self.fast {
            Some(fast) => fast.encode(text, |t| self.encode_reference(t)),
            None => self.encode_reference(text),
        }
    }

    /// `text`'s ids from the `tokenizers` crate.
    fn encode_reference(&self, text: &str) -> Result<Vec<u32>, String> {
        // `encode_fast` skips the offsets nobody here reads; the ids are the same.
        self.inner
            .encode_fast(text, false)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| e.to_string())
    }

    /// The id of a token string (e.g. the end-of-sequence token named by a model config).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }
}

impl Tokenizer for HfTokenizer {
    fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        match &self.chunks {
            Some(chunks) => chunks.encode(text, |piece| self.encode_whole(piece)),
            None => self.encode_whole(text),
        }
        .map_err(TokenizerError::Encode)
    }

    fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        self.inner
            .decode(ids, true)
            .map_err(|e| TokenizerError::Decode(e.to_string()))
    }

    fn encoder(&self) -> &'static str {
        if self.encodes_with_fastokens() {
            "fastokens"
        } else {
            "tokenizers"
        }
    }
}

/// One chat message as a template sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TemplateMessage {
    /// `system`, `user`, `assistant`, `tool`, ...
    pub role: String,
    /// The message's text.
    pub content: String,
}

#[derive(Serialize)]
struct TemplateContext<'a> {
    messages: &'a [TemplateMessage],
    add_generation_prompt: bool,
    bos_token: &'a str,
    eos_token: &'a str,
}

const TEMPLATE_NAME: &str = "chat";

/// A chat template (Jinja, as in a model's `tokenizer_config.json`), compiled once.
#[derive(Debug)]
pub struct ChatTemplate {
    env: minijinja::Environment<'static>,
    bos_token: String,
    eos_token: String,
}

impl ChatTemplate {
    /// Compiles `source`; `bos_token` and `eos_token` are visible to it under those names.
    pub fn new(
        source: impl Into<String>,
        bos_token: impl Into<String>,
        eos_token: impl Into<String>,
    ) -> Result<Self, TokenizerError> {
        let mut env = minijinja::Environment::new();
        // Hugging Face templates signal bad conversations with `raise_exception(...)`.
        env.add_function(
            "raise_exception",
            |message: String| -> Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    message,
                ))
            },
        );
        env.add_template_owned(TEMPLATE_NAME, source.into())
            .map_err(|e| TokenizerError::Template(e.to_string()))?;
        Ok(Self {
            env,
            bos_token: bos_token.into(),
            eos_token: eos_token.into(),
        })
    }

    /// The mock model's template ([`MOCK_CHAT_TEMPLATE`]).
    pub fn mock() -> Self {
        // The built-in template is a constant known to compile (a unit test renders it).
        Self::new(MOCK_CHAT_TEMPLATE, "", "").unwrap_or_else(|_| Self {
            env: minijinja::Environment::new(),
            bos_token: String::new(),
            eos_token: String::new(),
        })
    }

    /// Loads a template from `path`: a Jinja file, or a `tokenizer_config.json` whose
    /// `chat_template` string (and `bos_token` / `eos_token` strings, when present) are used.
    pub fn from_file(path: &Path) -> Result<Self, TokenizerError> {
        let load = |message: String| TokenizerError::Load {
            path: path.to_owned(),
            message,
        };
        let text = std::fs::read_to_string(path).map_err(|e| load(e.to_string()))?;
        if path.extension().is_some_and(|e| e == "json") {
            let config: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| load(e.to_string()))?;
            let source = config
                .get("chat_template")
                .and_then(|t| t.as_str())
                .ok_or_else(|| load("expected a string field `chat_template`".to_owned()))?;
            let token = |key: &str| {
                config
                    .get(key)
                    .and_then(|t| t.as_str().or_else(|| t.get("content")?.as_str()))
                    .unwrap_or_default()
                    .to_owned()
            };
            return Self::new(source, token("bos_token"), token("eos_token"));
        }
        Self::new(text, "", "")
    }

    /// Renders `messages`, ending with the assistant's turn opener when
    /// `add_generation_prompt`.
    pub fn render(
        &self,
        messages: &[TemplateMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TokenizerError> {
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| TokenizerError::Template(e.to_string()))?;
        let ctx = TemplateContext {
            messages,
            add_generation_prompt,
            bos_token: &self.bos_token,
            eos_token: &self.eos_token,
        };
        template
            .render(minijinja::value::Serde(&ctx))
            .map_err(|e| TokenizerError::Template(e.to_string()))
    }
}

/// Turns a growing sequence of token ids into text deltas, re-decoding only a short window so
/// that multi-token characters and tokenizers that merge across tokens come out right (the
/// prefix-offset scheme of vLLM and Dynamo).
#[derive(Debug, Default)]
pub struct IncrementalDetokenizer {
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
}

impl IncrementalDetokenizer {
    /// A detokenizer that has seen nothing.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `new` ids; returns the text they complete (possibly empty while a character is
    /// still partial).
    pub fn push(
        &mut self,
        tokenizer: &dyn Tokenizer,
        new: &[u32],
    ) -> Result<String, TokenizerError> {
        self.ids.extend_from_slice(new);
        let prefix = tokenizer.decode(&self.ids[self.prefix_offset..self.read_offset])?;
        let full = tokenizer.decode(&self.ids[self.prefix_offset..])?;
        if full.len() > prefix.len()
            && !full.ends_with('\u{FFFD}')
            && full.is_char_boundary(prefix.len())
        {
            let delta = full[prefix.len()..].to_owned();
            self.prefix_offset = self.read_offset;
            self.read_offset = self.ids.len();
            Ok(delta)
        } else {
            Ok(String::new())
        }
    }

    /// Records `ids` whose text the engine rendered itself (vLLM), without decoding them: they
    /// are the context for ids that may come later without text (a request moved to an engine
    /// that returns ids alone), so that those decode as they would have in place.
    pub fn skip(&mut self, ids: &[u32]) {
        if ids.is_empty() {
            return;
        }
        self.ids.extend_from_slice(ids);
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
    }
}

#[cfg(test)]
mod tests;
