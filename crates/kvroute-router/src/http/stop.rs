//! Stop strings, applied on the text the router streams back, whatever the engine: the text
//! ends before the first stop string (or after it, with `include_stop_str_in_output`), and the
//! request finishes with `stop`. A stop string can arrive split across pieces, so the tail of the
//! text that could still begin one is held back until the next piece tells (and sent when the
//! stream ends without a match).
//!
//! Engines that apply stop strings themselves (vLLM, SGLang) end before the router sees one; the
//! router's check matters for those that do not (the mocker) and for those that stream the stop
//! string's token ids (llama.cpp), whose text the router detokenizes itself.

/// Finds stop strings in a stream of text pieces.
#[derive(Debug, Default)]
pub(crate) struct StopMatcher {
    stops: Vec<String>,
    include: bool,
    /// Text received but not yet released: a suffix that may begin a stop string.
    pending: String,
    matched: bool,
}

impl StopMatcher {
    /// Matches `stops` (empty strings are ignored); with `include`, the stop string itself is
    /// part of the text sent.
    pub(crate) fn new(stops: &[String], include: bool) -> Self {
        Self {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            include,
            pending: String::new(),
            matched: false,
        }
    }

    /// The text of `piece` (and any held back before it) that may be sent now. Once a stop
    /// string is found, that is the text up to it and [`Self::matched`] holds; every later
    /// piece yields nothing.
    pub(crate) fn push(&mut self, piece: &str) -> String {
        if self.matched {
            return String::new();
        }
        if self.stops.is_empty() {
            return piece.to_owned();
        }
        self.pending.push_str(piece);
        // The earliest stop string wins; of two starting at once, the longer.
        let found = self
            .stops
            .iter()
            .filter_map(|s| self.pending.find(s.as_str()).map(|at| (at, s.len())))
            .min_by_key(|&(at, len)| (at, std::cmp::Reverse(len)));
        if let Some((at, len)) = found {
            let end = if self.include { at + len } else { at };
            self.pending.truncate(end);
            self.matched = true;
            return std::mem::take(&mut self.pending);
        }
        let keep = self.undecided_tail();
        let release = self.pending.len() - keep;
        self.pending.drain(..release).collect()
    }

    /// What is still held back, once the stream has ended without a match.
    pub(crate) fn finish(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }

    /// Whether a stop string was found.
    pub(crate) fn matched(&self) -> bool {
        self.matched
    }

    /// The length of the longest suffix of the pending text that is a proper prefix of a stop
    /// string (it may yet become one).
    fn undecided_tail(&self) -> usize {
        let longest = self.stops.iter().map(String::len).max().unwrap_or(0);
        let earliest = self.pending.len().saturating_sub(longest.saturating_sub(1));
        self.pending
            .char_indices()
            .map(|(at, _)| at)
            .filter(|&at| at >= earliest)
            .find(|&at| {
                let tail = &self.pending[at..];
                self.stops.iter().any(|s| s.starts_with(tail))
            })
            .map_or(0, |at| self.pending.len() - at)
    }
}

#[cfg(test)]
mod tests;
