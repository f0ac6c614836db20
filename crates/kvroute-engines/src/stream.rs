//! Turning an engine's response body into response items: a synchronous state machine, fed
//! bytes, that says what to emit and when the stream ends. The HTTP side lives in
//! [`crate::engine`]; keeping this part free of I/O lets it be tested piece by piece.

use kvroute_protocols::{Annotated, CompletionUsage, LLMEngineOutput};
use kvroute_runtime::{EngineError, LlmResponse};

use crate::config::EngineKind;
use crate::dialect::{Parsed, Step, StreamParser, counted_usage};
use crate::error::Failure;
use crate::sse::{SseDecoder, SseEvent};

/// What the stream does next.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Action {
    /// Send this item (boxed: an item is ten times the size of the other actions).
    Emit(Box<LlmResponse>),
    /// Fail the request with this error ([`EngineError::Unavailable`] when the stream broke, so
    /// that the caller may migrate it).
    Fail(EngineError),
    /// End the stream (and drop the connection).
    End,
}

/// The state of one response stream.
pub(crate) struct StreamState {
    kind: EngineKind,
    decoder: SseDecoder,
    parser: Box<dyn StreamParser>,
    prompt_tokens: usize,
    /// Output ids streamed so far.
    emitted: usize,
    /// The latest usage reported.
    usage: Option<CompletionUsage>,
    /// The finishing output, held until the stream ends (vLLM and TensorRT-LLM send usage in a
    /// chunk of its own after the finish).
    pending: Option<LLMEngineOutput>,
    /// The body read so far when the response is one JSON document rather than an event
    /// stream (a vLLM prefill for remote decode); parsed as one event at its end.
    whole: Option<Vec<u8>>,
    ended: bool,
}

/// The largest whole (non-streamed) response body read: a one-token answer with its transfer
/// parameters is a few kilobytes.
const MAX_WHOLE_BODY: usize = 4 << 20;

impl StreamState {
    pub(crate) fn new(
        kind: EngineKind,
        parser: Box<dyn StreamParser>,
        prompt_tokens: usize,
    ) -> Self {
        Self {
            kind,
            decoder: SseDecoder::default(),
            parser,
            prompt_tokens,
            emitted: 0,
            usage: None,
            pending: None,
            whole: None,
            ended: false,
        }
    }

    /// The same state reading the body as one JSON document (a non-streamed response).
    pub(crate) fn whole(mut self) -> Self {
        self.whole = Some(Vec::new());
        self
    }

    /// Whether the body is read as one JSON document.
    pub(crate) fn reads_whole(&self) -> bool {
        self.whole.is_some()
    }

    /// Whether the stream has ended.
    pub(crate) fn is_ended(&self) -> bool {
        self.ended
    }

    /// Whether the engine has finished and only the end of its stream is awaited.
    pub(crate) fn is_finishing(&self) -> bool {
        self.pending.is_some()
    }

    /// Bytes of the body arrived.
    pub(crate) fn feed(&mut self, bytes: &[u8]) -> Vec<Action> {
        let mut out = Vec::new();
        if self.ended {
            return out;
        }
        if let Some(body) = self.whole.as_mut() {
            body.extend_from_slice(bytes);
            if body.len() > MAX_WHOLE_BODY {
                let message = format!(
                    "{} engine's response is over {MAX_WHOLE_BODY} bytes; expected one \
                     completion",
                    self.kind
                );
                self.refuse(message, &mut out);
            }
            return out;
        }
        self.decoder.push(bytes);
        while !self.ended {
            match self.decoder.next_event() {
                Some(Ok(event)) => self.event(event, &mut out),
                Some(Err(e)) => {
                    self.refuse(format!("malformed {} stream: {e}", self.kind), &mut out)
                }
                None => break,
            }
        }
        out
    }

    /// The body ended cleanly.
    pub(crate) fn end_of_body(&mut self) -> Vec<Action> {
        let mut out = Vec::new();
        if let Some(body) = self.whole.take() {
            // One document: its one event, then the end a stream's `[DONE]` would mark.
            let text = String::from_utf8_lossy(&body).into_owned();
            self.event(SseEvent::Data(text), &mut out);
            if !self.ended {
                self.event(SseEvent::Data("[DONE]".to_owned()), &mut out);
            }
            return out;
        }
        while !self.ended {
            match self.decoder.finish() {
                Some(Ok(event)) => self.event(event, &mut out),
                Some(Err(e)) => {
                    self.refuse(format!("malformed {} stream: {e}", self.kind), &mut out)
                }
                None => break,
            }
        }
        if !self.ended {
            let message = format!(
                "{} engine closed the stream before finishing, after {} tokens",
                self.kind, self.emitted
            );
            self.finish_or_fail(message, &mut out);
        }
        out
    }

    /// Reading the body failed (connection reset, cut mid-chunk, timed out).
    pub(crate) fn body_error(&mut self, message: String) -> Vec<Action> {
        let mut out = Vec::new();
        if self.ended {
            return out;
        }
        let message = format!(
            "lost the {} engine's stream after {} tokens: {message}",
            self.kind, self.emitted
        );
        self.finish_or_fail(message, &mut out);
        out
    }

    /// The body ended early: an output already finished (only its usage was still to come) goes
    /// out as it is; anything else fails with `message`.
    fn finish_or_fail(&mut self, message: String, out: &mut Vec<Action>) {
        if self.pending.is_some() {
            self.finish(out);
        } else {
            self.fail(message, out);
        }
    }

    /// The request was stopped: a finished output still goes out, anything else ends as
    /// cancelled.
    pub(crate) fn stopped(&mut self) -> Vec<Action> {
        let mut out = Vec::new();
        if self.ended {
            return out;
        }
        if self.pending.is_some() {
            self.finish(&mut out);
        } else {
            let cancelled = Annotated::from_data(LLMEngineOutput::cancelled());
            out.push(Action::Emit(Box::new(cancelled)));
            self.end(&mut out);
        }
        out
    }

    fn event(&mut self, event: SseEvent, out: &mut Vec<Action>) {
        match self.parser.parse(event) {
            Parsed::Nothing => {}
            Parsed::Done => {
                if self.pending.is_some() {
                    self.finish(out);
                } else {
                    let message = format!(
                        "{} engine ended the stream without a finish reason",
                        self.kind
                    );
                    self.refuse(message, out);
                }
            }
            Parsed::Step(step) => self.step(step, out),
            Parsed::Last(step) => {
                self.step(step, out);
                if self.pending.is_some() {
                    self.finish(out);
                }
            }
            // The output is complete; what went wrong after it does not undo it.
            Parsed::Failed(_) if self.pending.is_some() => self.finish(out),
            Parsed::Failed(Failure::Unavailable(message)) => self.fail(message, out),
            Parsed::Failed(Failure::Refused(message) | Failure::Malformed(message)) => {
                self.refuse(message, out);
            }
        }
    }

    fn step(&mut self, step: Step, out: &mut Vec<Action>) {
        // The latest usage wins: a running count beside the output is replaced by the final
        // one (vLLM and TensorRT-LLM send it in a chunk of its own, after the finish).
        if let Some(usage) = step.usage {
            self.usage = Some(usage);
        }
        if self.pending.is_some() {
            // After the finish only usage counts.
            return;
        }
        self.emitted += step.token_ids.len();
        let has_output = !step.token_ids.is_empty() || step.text.is_some();
        let output = LLMEngineOutput {
            token_ids: step.token_ids,
            text: step.text,
            log_probs: step.log_probs,
            finish_reason: step.finish,
            disaggregated_params: step.disaggregated_params,
            ..LLMEngineOutput::default()
        };
        if output.finish_reason.is_some() {
            // Held until the stream ends, for the usage that may follow.
            self.pending = Some(output);
        } else if has_output {
            out.push(Action::Emit(Box::new(Annotated::from_data(output))));
        }
    }

    /// Sends the finishing output with the usage, reported or counted.
    fn finish(&mut self, out: &mut Vec<Action>) {
        if let Some(mut output) = self.pending.take() {
            output.completion_usage = self.usage.take().or_else(|| {
                self.kind
                    .returns_token_ids()
                    .then(|| counted_usage(self.prompt_tokens, self.emitted))
            });
            out.push(Action::Emit(Box::new(Annotated::from_data(output))));
        }
        self.end(out);
    }

    fn refuse(&mut self, message: String, out: &mut Vec<Action>) {
        out.push(Action::Emit(Box::new(Annotated::from_error(message))));
        self.end(out);
    }

    fn fail(&mut self, message: String, out: &mut Vec<Action>) {
        out.push(Action::Fail(EngineError::Unavailable { message }));
        self.end(out);
    }

    fn end(&mut self, out: &mut Vec<Action>) {
        self.ended = true;
        out.push(Action::End);
    }
}

#[cfg(test)]
mod tests;
