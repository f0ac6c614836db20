//! Following a response as it passes through Envoy: output tokens (one per server-sent event
//! of a streamed response) and the engine's `usage.prompt_tokens_details.cached_tokens`, from
//! the last events of a stream or from a whole JSON body.

/// The longest line of a streamed response, or the largest whole body, read for `usage`; past
/// it the response still passes, unread.
const MAX_HELD: usize = 4 << 20;

/// What one piece of a response said.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Seen {
    /// Events with data (output tokens, one per event: engines stream a token per event).
    pub(crate) events: u64,
    /// The engine's cached prompt tokens, when this piece reported them.
    pub(crate) cached_tokens: Option<u64>,
}

/// Reads a response's body piece by piece.
#[derive(Debug)]
pub(crate) struct Follower {
    streamed: bool,
    held: Vec<u8>,
    overflowed: bool,
}

impl Follower {
    /// A follower for a response of `content_type` (`text/event-stream`: server-sent events).
    pub(crate) fn new(content_type: Option<&str>) -> Self {
        Self {
            streamed: content_type.is_some_and(|c| c.contains("text/event-stream")),
            held: Vec::new(),
            overflowed: false,
        }
    }

    /// The next piece of the body.
    pub(crate) fn feed(&mut self, piece: &[u8]) -> Seen {
        if self.overflowed {
            return Seen::default();
        }
        // A whole body, or (streamed) one unfinished line, this large is not read.
        if self.held.len() + piece.len() > MAX_HELD {
            self.overflowed = true;
            self.held = Vec::new();
            return Seen::default();
        }
        self.held.extend_from_slice(piece);
        if !self.streamed {
            return Seen::default();
        }
        let mut seen = Seen::default();
        let mut start = 0;
        while let Some(end) = self.held[start..].iter().position(|&b| b == b'\n') {
            let line = &self.held[start..start + end];
            start += end + 1;
            let Some(data) = line.strip_prefix(b"data:") else {
                continue;
            };
            let data = data.trim_ascii();
            if data.is_empty() || data == b"[DONE]" {
                continue;
            }
            seen.events += 1;
            if let Some(cached) = cached_tokens(data) {
                seen.cached_tokens = Some(cached);
            }
        }
        self.held.drain(..start);
        seen
    }

    /// The body ended: a whole JSON body's report.
    pub(crate) fn finish(&mut self) -> Seen {
        if self.streamed || self.overflowed {
            return Seen::default();
        }
        let held = std::mem::take(&mut self.held);
        Seen {
            events: 0,
            cached_tokens: cached_tokens(&held),
        }
    }
}

/// `usage.prompt_tokens_details.cached_tokens` of a JSON object, if it has one (only objects
/// that mention it are parsed).
fn cached_tokens(json: &[u8]) -> Option<u64> {
    const NEEDLE: &[u8] = b"cached_tokens";
    if !json.windows(NEEDLE.len()).any(|w| w == NEEDLE) {
        return None;
    }
    let value: serde_json::Value = serde_json::from_slice(json).ok()?;
    value
        .get("usage")?
        .get("prompt_tokens_details")?
        .get("cached_tokens")?
        .as_u64()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stream_counts_events_across_split_pieces_and_reads_the_usage() {
        let mut f = Follower::new(Some("text/event-stream; charset=utf-8"));
        let a = f.feed(b"data: {\"choices\":[{\"text\":\"a\"}]}\n\ndata: {\"choi");
        assert_eq!(a.events, 1);
        let b = f.feed(b"ces\":[{\"text\":\"b\"}]}\n\n");
        assert_eq!(b.events, 1);
        let c = f.feed(
            b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":40,\"prompt_tokens_details\":{\"cached_tokens\":32}}}\n\ndata: [DONE]\n\n",
        );
        assert_eq!(
            c,
            Seen {
                events: 1,
                cached_tokens: Some(32)
            }
        );
        assert_eq!(f.finish(), Seen::default());
    }

    #[test]
    fn a_whole_body_is_read_at_its_end() {
        let mut f = Follower::new(Some("application/json"));
        assert_eq!(
            f.feed(b"{\"usage\":{\"prompt_tokens_details\":"),
            Seen::default()
        );
        assert_eq!(f.feed(b"{\"cached_tokens\":16}}}"), Seen::default());
        assert_eq!(f.finish().cached_tokens, Some(16));
    }

    #[test]
    fn an_oversized_body_passes_unread() {
        let mut f = Follower::new(None);
        f.feed(&vec![b' '; MAX_HELD]);
        f.feed(b"{\"usage\":{\"prompt_tokens_details\":{\"cached_tokens\":1}}}");
        assert_eq!(f.finish(), Seen::default());
    }

    #[test]
    fn null_usage_and_garbage_report_nothing() {
        let mut f = Follower::new(Some("text/event-stream"));
        let seen = f.feed(
            b"data: {\"usage\":null,\"cached_tokens\":\"x\"}\n\ndata: not json cached_tokens\n\n",
        );
        assert_eq!(
            seen,
            Seen {
                events: 2,
                cached_tokens: None
            }
        );
    }
}
