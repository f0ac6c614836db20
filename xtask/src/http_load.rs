//! What the benches that drive an OpenAI-compatible server over HTTP share: the HTTP client, a
//! scanner of streamed (server-sent event) answers, and nearest-rank percentiles.

use std::time::Duration;

use anyhow::{Context, Result, bail};
use serde_json::Value;

/// An HTTP client for a load generator: keep-alive connections, no Nagle delay, requests bounded
/// by `timeout`.
pub(crate) fn client(timeout: Duration) -> Result<reqwest::Client> {
    reqwest::Client::builder()
        .timeout(timeout)
        .connect_timeout(Duration::from_secs(5))
        .pool_max_idle_per_host(1024)
        .tcp_nodelay(true)
        .build()
        .context("building the HTTP client")
}

/// Scans a server-sent event stream as it arrives: whether a chunk with a choice has come,
/// the last `usage` seen, the text of the first choice, and whether `data: [DONE]` has come.
///
/// A skimming scan ([`SseScan::skimming`]) does not gather the text: an event that names no
/// `usage`, `error` or `timings` is only looked at for a non-empty `choices` list, not parsed.
/// A load generator replaying hundreds of streams a second on the same two cores as the fleet
/// and the router then takes a small share of them instead of the largest (every token's JSON
/// parsed into a tree, in the xtask's unoptimized build).
#[derive(Debug, Default)]
pub(crate) struct SseScan {
    partial: Vec<u8>,
    skim: bool,
    pub(crate) first_choice: bool,
    pub(crate) usage: Option<Value>,
    /// The first choice's text so far (`delta.content` of a chat stream, `text` of a
    /// completion's); empty when skimming.
    pub(crate) content: String,
    /// The last `timings` object seen (llama.cpp's own, with `cache_n`).
    pub(crate) timings: Option<Value>,
    pub(crate) done: bool,
}

impl SseScan {
    /// A scan that gathers no text (see the type's documentation).
    pub(crate) fn skimming() -> Self {
        Self {
            skim: true,
            ..Self::default()
        }
    }

    /// Takes the next bytes of the stream; an error for an event that reports an error.
    pub(crate) fn feed(&mut self, bytes: &[u8]) -> Result<()> {
        self.partial.extend_from_slice(bytes);
        let mut partial = std::mem::take(&mut self.partial);
        let mut start = 0;
        let mut outcome = Ok(());
        while let Some(len) = partial[start..].iter().position(|&b| b == b'\n') {
            let line = &partial[start..start + len];
            start += len + 1;
            outcome = self.line(line);
            if outcome.is_err() {
                break;
            }
        }
        partial.drain(..start);
        self.partial = partial;
        outcome
    }

    /// One line of the stream.
    fn line(&mut self, line: &[u8]) -> Result<()> {
        let line = String::from_utf8_lossy(line);
        let Some(data) = line.trim_end().strip_prefix("data:") else {
            return Ok(());
        };
        let data = data.trim_start();
        if data == "[DONE]" {
            self.done = true;
            return Ok(());
        }
        if self.skim
            && data.starts_with('{')
            && !["\"usage\"", "\"error\"", "\"timings\""]
                .iter()
                .any(|key| data.contains(key))
        {
            self.first_choice |= has_a_choice(data);
            return Ok(());
        }
        let event: Value =
            serde_json::from_str(data).with_context(|| format!("an event is not JSON: {data}"))?;
        if !event["error"].is_null() {
            bail!("an error event: {data}");
        }
        if let Some(first) = event["choices"].as_array().and_then(|c| c.first()) {
            self.first_choice = true;
            if !self.skim {
                let piece = first["delta"]["content"]
                    .as_str()
                    .or(first["text"].as_str());
                self.content.push_str(piece.unwrap_or_default());
            }
        }
        if event["usage"].is_object() {
            self.usage = Some(event["usage"].clone());
        }
        if event["timings"].is_object() {
            self.timings = Some(event["timings"].clone());
        }
        Ok(())
    }
}

/// Whether a JSON event's `choices` list is not empty: `"choices"`, a colon and `[` followed by
/// anything but `]` (whitespace allowed between them).
fn has_a_choice(data: &str) -> bool {
    let Some(at) = data.find("\"choices\"") else {
        return false;
    };
    let rest = data[at + "\"choices\"".len()..].trim_start();
    let Some(rest) = rest.strip_prefix(':') else {
        return false;
    };
    let Some(list) = rest.trim_start().strip_prefix('[') else {
        return false;
    };
    !list.trim_start().starts_with(']')
}

/// The nearest-rank percentile `p` (0 to 100) of sorted values.
pub(crate) fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = (p / 100.0 * sorted.len() as f64).ceil() as usize;
    Some(sorted[rank.clamp(1, sorted.len()) - 1])
}
