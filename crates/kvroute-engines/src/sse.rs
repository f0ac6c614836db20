//! A server-sent-events reader for engine streams.
//!
//! Engines send one JSON object per `data:` line, events separated by a blank line, and
//! `data: [DONE]` at the end (vLLM, SGLang, TensorRT-LLM). Older llama.cpp servers send a failure
//! as `error: {json}`, a field the SSE standard does not know and a standard parser drops
//! silently; that is why this small reader exists instead of a general SSE crate: it keeps that
//! field. Comments (`: ping`, llama.cpp's keep-alive) and `event:`/`id:`/`retry:` lines are
//! skipped; an `event: error` makes the event's data an error.

/// One event of an engine stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum SseEvent {
    /// The event's data (its `data:` lines joined by `\n`).
    Data(String),
    /// An `error:` field (llama.cpp) or the data of an `event: error`.
    Error(String),
}

/// Why the byte stream is not an event stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum SseError {
    /// A line is not UTF-8.
    NotUtf8,
    /// A line or an event grew past [`MAX_EVENT_BYTES`].
    TooLong,
}

impl std::fmt::Display for SseError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SseError::NotUtf8 => f.write_str("an event-stream line is not UTF-8"),
            SseError::TooLong => write!(
                f,
                "an event is longer than {MAX_EVENT_BYTES} bytes; expected one JSON chunk per event"
            ),
        }
    }
}

/// The longest event accepted. A vLLM chunk that echoes a long prompt's token ids is well under
/// this (a million ids is about 7 MiB of JSON).
pub(crate) const MAX_EVENT_BYTES: usize = 64 << 20;

/// Splits a byte stream into [`SseEvent`]s.
#[derive(Debug, Default)]
pub(crate) struct SseDecoder {
    /// Bytes not yet consumed (an incomplete line).
    buf: Vec<u8>,
    /// Where the next line starts in `buf`.
    pos: usize,
    /// How far past `pos` is known to hold no line break (so a long line arriving in many
    /// pieces is scanned once, not once per piece).
    scanned: usize,
    /// The event being read.
    event: PendingEvent,
}

/// The fields of an event whose closing blank line has not come yet.
#[derive(Debug, Default)]
struct PendingEvent {
    data: Option<String>,
    error: Option<String>,
    error_event: bool,
}

impl SseDecoder {
    /// Appends bytes received.
    pub(crate) fn push(&mut self, bytes: &[u8]) {
        if self.pos > 0 && self.pos == self.buf.len() {
            self.buf.clear();
            self.pos = 0;
            self.scanned = 0;
        }
        self.buf.extend_from_slice(bytes);
    }

    /// The next complete event, if the bytes so far hold one.
    pub(crate) fn next_event(&mut self) -> Option<Result<SseEvent, SseError>> {
        loop {
            let rest = &self.buf[self.pos..];
            let Some(nl) = memchr::memchr(b'\n', &rest[self.scanned..]).map(|at| self.scanned + at)
            else {
                if rest.len() > MAX_EVENT_BYTES {
                    return Some(Err(SseError::TooLong));
                }
                self.scanned = rest.len();
                // Reclaim consumed bytes so a long stream does not keep its whole history.
                if self.pos > 0 {
                    self.buf.drain(..self.pos);
                    self.pos = 0;
                }
                return None;
            };
            let mut line = &rest[..nl];
            self.pos += nl + 1;
            self.scanned = 0;
            if let Some(stripped) = line.strip_suffix(b"\r") {
                line = stripped;
            }
            let Ok(line) = std::str::from_utf8(line) else {
                return Some(Err(SseError::NotUtf8));
            };
            if line.is_empty() {
                if let Some(event) = self.event.dispatch() {
                    return Some(Ok(event));
                }
                continue;
            }
            if let Err(e) = self.event.field(line) {
                return Some(Err(e));
            }
        }
    }

    /// At the end of the body: the event left without its closing blank line, if any. Engines
    /// always close their events, so this is leniency, not protocol.
    pub(crate) fn finish(&mut self) -> Option<Result<SseEvent, SseError>> {
        if self.pos < self.buf.len() {
            self.buf.push(b'\n');
            if let Some(event) = self.next_event() {
                return Some(event);
            }
        }
        self.event.dispatch().map(Ok)
    }
}

impl PendingEvent {
    fn field(&mut self, line: &str) -> Result<(), SseError> {
        if line.starts_with(':') {
            return Ok(());
        }
        let (name, value) = match line.split_once(':') {
            Some((name, value)) => (name, value.strip_prefix(' ').unwrap_or(value)),
            None => (line, ""),
        };
        match name {
            "data" => append(&mut self.data, value)?,
            "error" => append(&mut self.error, value)?,
            "event" => self.error_event = value == "error",
            _ => {}
        }
        Ok(())
    }

    fn dispatch(&mut self) -> Option<SseEvent> {
        let data = self.data.take();
        let error = self.error.take();
        let error_event = std::mem::take(&mut self.error_event);
        match (error, data) {
            (Some(error), _) => Some(SseEvent::Error(error)),
            (None, Some(data)) if error_event => Some(SseEvent::Error(data)),
            (None, Some(data)) => Some(SseEvent::Data(data)),
            (None, None) => None,
        }
    }
}

fn append(slot: &mut Option<String>, value: &str) -> Result<(), SseError> {
    match slot {
        Some(s) => {
            if s.len() + value.len() + 1 > MAX_EVENT_BYTES {
                return Err(SseError::TooLong);
            }
            s.push('\n');
            s.push_str(value);
        }
        None => *slot = Some(value.to_owned()),
    }
    Ok(())
}

#[cfg(test)]
mod tests;
