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
#[derive(Debug, Default)]
pub(crate) struct SseScan {
    partial: Vec<u8>,
    pub(crate) first_choice: bool,
    pub(crate) usage: Option<Value>,
    /// The first choice's text so far (`delta.content` of a chat stream, `text` of a
    /// completion's).
    pub(crate) content: String,
    /// The last `timings` object seen (llama.cpp's own, with `cache_n`).
    pub(crate) timings: Option<Value>,
    pub(crate) done: bool,
}

impl SseScan {
    /// Takes the next bytes of the stream; an error for an event that reports an error.
    pub(crate) fn feed(&mut self, bytes: &[u8]) -> Result<()> {
        self.partial.extend_from_slice(bytes);
        while let Some(end) = self.partial.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = self.partial.drain(..=end).collect();
            let line = String::from_utf8_lossy(&line);
            let Some(data) = line.trim_end().strip_prefix("data:") else {
                continue;
            };
            let data = data.trim_start();
            if data == "[DONE]" {
                self.done = true;
                continue;
            }
            let event: Value = serde_json::from_str(data)
                .with_context(|| format!("an event is not JSON: {data}"))?;
            if !event["error"].is_null() {
                bail!("an error event: {data}");
            }
            if let Some(first) = event["choices"].as_array().and_then(|c| c.first()) {
                self.first_choice = true;
                let piece = first["delta"]["content"]
                    .as_str()
                    .or(first["text"].as_str());
                self.content.push_str(piece.unwrap_or_default());
            }
            if event["usage"].is_object() {
                self.usage = Some(event["usage"].clone());
            }
            if event["timings"].is_object() {
                self.timings = Some(event["timings"].clone());
            }
        }
        Ok(())
    }
}

/// The nearest-rank percentile `p` (0 to 100) of sorted values.
pub(crate) fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = (p / 100.0 * sorted.len() as f64).ceil() as usize;
    Some(sorted[rank.clamp(1, sorted.len()) - 1])
}
