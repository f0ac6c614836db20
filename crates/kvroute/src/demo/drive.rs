//! Drives the workload through the real HTTP path: each conversation is a task that sends its
//! turns in order, streaming (server-sent events), each turn carrying the history so far.
//!
//! Time to first token is measured here, at the client, from sending the request to the first
//! chunk that carries generated text: it includes the HTTP frontend, tokenization, routing, the
//! request plane and the engine's queueing and prefill, as a user would see it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use indicatif::ProgressBar;
use serde_json::{Value, json};
use tokio::task::JoinSet;

use crate::demo::fleet::MODEL;
use crate::demo::workload::{Workload, messages};

/// What happened to one turn.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct TurnResult {
    /// The conversation.
    pub(crate) conversation: usize,
    /// The turn within it.
    pub(crate) turn: usize,
    /// Why it failed, if it did.
    pub(crate) error: Option<String>,
    /// Send to the first generated text.
    pub(crate) ttft: Option<Duration>,
    /// Send to the end of the stream.
    pub(crate) latency: Duration,
    /// The worker the router chose (`nvext.worker_id`).
    pub(crate) worker: Option<u64>,
    /// The router's predicted KV hit rate for it (`nvext.timing.kv_hit_rate`).
    pub(crate) predicted_hit_rate: Option<f64>,
    /// Text chunks received.
    pub(crate) chunks: usize,
}

/// How to drive a run.
#[derive(Debug, Clone)]
pub(crate) struct Driver {
    /// The HTTP client.
    pub(crate) client: reqwest::Client,
    /// `http://host:port` of the frontend.
    pub(crate) base: String,
    /// Modelled durations (arrivals, think times) are divided by this.
    pub(crate) speedup: f64,
}

impl Driver {
    /// Runs every conversation of `workload` (each as its own task, starting at its modelled
    /// start time) and returns every turn's result, in conversation and turn order.
    pub(crate) async fn run(
        &self,
        workload: &Arc<Workload>,
        progress: &ProgressBar,
    ) -> Vec<TurnResult> {
        let began = tokio::time::Instant::now();
        let mut tasks = JoinSet::new();
        for id in 0..workload.conversations.len() {
            let (driver, workload, progress) = (self.clone(), workload.clone(), progress.clone());
            tasks.spawn(async move {
                let conversation = &workload.conversations[id];
                tokio::time::sleep_until(began + conversation.start.div_f64(driver.speedup)).await;
                let mut replies: Vec<String> = Vec::new();
                let mut results = Vec::with_capacity(conversation.turns.len());
                for (t, turn) in conversation.turns.iter().enumerate() {
                    tokio::time::sleep(turn.think.div_f64(driver.speedup)).await;
                    let body = json!({
                        "model": MODEL,
                        "messages": messages(&workload, conversation, t, &replies),
                        "max_tokens": turn.max_tokens,
                        "stream": true,
                        "nvext": {"extra_fields": ["worker_id", "timing"]},
                    });
                    let (result, reply) = driver.turn(id, t, &body).await;
                    results.push(result);
                    // A failed turn still leaves a (short) reply, so later turns keep their shape.
                    replies.push(if reply.is_empty() {
                        "ok".to_owned()
                    } else {
                        reply
                    });
                    progress.inc(1);
                }
                results
            });
        }
        let mut all = Vec::with_capacity(workload.requests());
        while let Some(joined) = tasks.join_next().await {
            match joined {
                Ok(results) => all.extend(results),
                Err(e) => all.push(TurnResult {
                    conversation: usize::MAX,
                    turn: 0,
                    error: Some(format!("conversation task failed: {e}")),
                    ttft: None,
                    latency: Duration::ZERO,
                    worker: None,
                    predicted_hit_rate: None,
                    chunks: 0,
                }),
            }
        }
        all.sort_by_key(|r| (r.conversation, r.turn));
        all
    }

    /// Sends one turn and reads its stream; returns the result and the reply's text.
    async fn turn(&self, conversation: usize, turn: usize, body: &Value) -> (TurnResult, String) {
        let sent = Instant::now();
        let mut result = TurnResult {
            conversation,
            turn,
            error: None,
            ttft: None,
            latency: Duration::ZERO,
            worker: None,
            predicted_hit_rate: None,
            chunks: 0,
        };
        let mut reply = String::new();
        if let Err(e) = self.stream(body, sent, &mut result, &mut reply).await {
            result.error = Some(e);
        }
        result.latency = sent.elapsed();
        (result, reply)
    }

    async fn stream(
        &self,
        body: &Value,
        sent: Instant,
        result: &mut TurnResult,
        reply: &mut String,
    ) -> Result<(), String> {
        let resp = self
            .client
            .post(format!("{}/v1/chat/completions", self.base))
            .header("content-type", "application/json")
            .body(body.to_string())
            .send()
            .await
            .map_err(|e| format!("sending: {e}"))?;
        let status = resp.status();
        if !status.is_success() {
            let text = resp.text().await.unwrap_or_default();
            return Err(format!("HTTP {status}: {text}"));
        }
        let mut bytes = resp.bytes_stream();
        let mut buf = String::new();
        loop {
            while let Some(end) = buf.find("\n\n") {
                let event: String = buf.drain(..end + 2).collect();
                for data in event.lines().filter_map(|l| l.strip_prefix("data:")) {
                    let data = data.trim_start();
                    if data == "[DONE]" {
                        return Ok(());
                    }
                    on_chunk(data, sent, result, reply)?;
                }
            }
            match bytes.next().await {
                Some(Ok(chunk)) => buf.push_str(&String::from_utf8_lossy(&chunk)),
                Some(Err(e)) => return Err(format!("reading the stream: {e}")),
                None => return Err("the stream ended without [DONE]".to_owned()),
            }
        }
    }
}

/// Applies one SSE `data:` payload to the turn's result.
fn on_chunk(
    data: &str,
    sent: Instant,
    result: &mut TurnResult,
    reply: &mut String,
) -> Result<(), String> {
    let chunk: Value = serde_json::from_str(data)
        .map_err(|e| format!("an SSE chunk is not JSON ({e}): {data}"))?;
    if let Some(error) = chunk.get("error") {
        return Err(format!("the stream reported an error: {error}"));
    }
    if let Some(text) = chunk
        .pointer("/choices/0/delta/content")
        .and_then(Value::as_str)
        .filter(|t| !t.is_empty())
    {
        result.ttft.get_or_insert_with(|| sent.elapsed());
        result.chunks += 1;
        if !reply.is_empty() {
            reply.push(' ');
        }
        reply.push_str(text.trim());
    }
    if let Some(ext) = chunk.get("nvext") {
        if let Some(w) = ext
            .pointer("/worker_id/decode_worker_id")
            .and_then(Value::as_u64)
        {
            result.worker = Some(w);
        }
        if let Some(h) = ext.pointer("/timing/kv_hit_rate").and_then(Value::as_f64) {
            result.predicted_hit_rate = Some(h);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
