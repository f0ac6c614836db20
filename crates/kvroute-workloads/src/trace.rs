//! Mooncake-format traces, the shape production request traces are published in: one JSON
//! object a line with `timestamp` (ms since the trace's start), `input_length`, `output_length`
//! and `hash_ids`, each hash id standing for one 512-token block of a prompt (and, through the ids
//! before it, for the whole prefix up to that block).
//!
//! Only the file format lives here; how a record becomes tokens is the consumer's business (the
//! mocker synthesizes prompts, the indexer bench engine blocks).

use serde::Deserialize;

/// Tokens per hash id in Mooncake traces.
pub const MOONCAKE_BLOCK_TOKENS: usize = 512;

/// One request of a trace.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct TraceRecord {
    /// Arrival time in milliseconds since the start of the trace.
    pub timestamp: f64,
    /// Prompt length in tokens.
    pub input_length: u32,
    /// Output length in tokens.
    pub output_length: u32,
    /// One id per 512-token prompt block.
    pub hash_ids: Vec<u64>,
}

/// A trace line that could not be read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TraceError {
    /// The line is not a valid record.
    #[error(
        "trace line {line}: expected a JSON object with timestamp, input_length, output_length and hash_ids: {source}"
    )]
    Json {
        /// 1-based line number.
        line: usize,
        /// The parse error.
        source: serde_json::Error,
    },
    /// The timestamp is negative or not finite.
    #[error("trace line {line}: timestamp must be a finite number >= 0, got {got}")]
    BadTimestamp {
        /// 1-based line number.
        line: usize,
        /// The value found.
        got: f64,
    },
}

/// A trace line's optional `session_id`: a number or a string, as traces write it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Deserialize)]
#[serde(untagged)]
pub enum SessionId {
    /// A numeric id (what [`crate::synth::to_jsonl`] writes).
    Number(u64),
    /// A textual id.
    Text(String),
}

impl std::fmt::Display for SessionId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Number(n) => write!(f, "{n}"),
            Self::Text(t) => f.write_str(t),
        }
    }
}

/// A record with the session it belongs to, if its line names one.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct SessionRecord {
    /// The request.
    #[serde(flatten)]
    pub record: TraceRecord,
    /// The line's `session_id`, when present (and not null).
    #[serde(default)]
    pub session_id: Option<SessionId>,
}

/// Parses a JSONL trace as [`parse_jsonl`] does, keeping each line's optional `session_id`.
pub fn parse_jsonl_with_sessions(text: &str) -> Result<Vec<SessionRecord>, TraceError> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let record: SessionRecord =
            serde_json::from_str(line).map_err(|source| TraceError::Json {
                line: i + 1,
                source,
            })?;
        check_timestamp(i + 1, &record.record)?;
        out.push(record);
    }
    Ok(out)
}

fn check_timestamp(line: usize, record: &TraceRecord) -> Result<(), TraceError> {
    if record.timestamp.is_finite() && record.timestamp >= 0.0 {
        Ok(())
    } else {
        Err(TraceError::BadTimestamp {
            line,
            got: record.timestamp,
        })
    }
}

/// Parses a JSONL trace, skipping blank lines.
pub fn parse_jsonl(text: &str) -> Result<Vec<TraceRecord>, TraceError> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let record: TraceRecord =
            serde_json::from_str(line).map_err(|source| TraceError::Json {
                line: i + 1,
                source,
            })?;
        check_timestamp(i + 1, &record)?;
        out.push(record);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_parse_in_file_order_and_blank_lines_are_skipped() {
        let text = "{\"timestamp\": 5, \"input_length\": 700, \"output_length\": 3, \"hash_ids\": [0, 1]}\n\
                    \n   \n\
                    {\"timestamp\": 0.5, \"input_length\": 10, \"output_length\": 0, \"hash_ids\": []}\n";
        let records = parse_jsonl(text).expect("valid trace");
        assert_eq!(
            records,
            [
                TraceRecord {
                    timestamp: 5.0,
                    input_length: 700,
                    output_length: 3,
                    hash_ids: vec![0, 1],
                },
                TraceRecord {
                    timestamp: 0.5,
                    input_length: 10,
                    output_length: 0,
                    hash_ids: vec![],
                },
            ]
        );
    }

    #[test]
    fn session_ids_are_numbers_or_strings_and_optional() {
        let text = "{\"timestamp\": 1, \"input_length\": 3, \"output_length\": 1, \"hash_ids\": [4], \"session_id\": 7}\n\
                    {\"timestamp\": 2, \"input_length\": 3, \"output_length\": 1, \"hash_ids\": [4], \"session_id\": \"chat-a\"}\n\
                    {\"timestamp\": 3, \"input_length\": 3, \"output_length\": 1, \"hash_ids\": [4]}\n\
                    {\"timestamp\": 4, \"input_length\": 3, \"output_length\": 1, \"hash_ids\": [4], \"session_id\": null}\n";
        let parsed = parse_jsonl_with_sessions(text).expect("valid trace");
        let sessions: Vec<Option<SessionId>> =
            parsed.iter().map(|r| r.session_id.clone()).collect();
        assert_eq!(
            sessions,
            [
                Some(SessionId::Number(7)),
                Some(SessionId::Text("chat-a".into())),
                None,
                None
            ]
        );
        let records: Vec<TraceRecord> = parsed.into_iter().map(|r| r.record).collect();
        assert_eq!(records, parse_jsonl(text).expect("valid trace"));
        let err = parse_jsonl_with_sessions(
            "{\"timestamp\": -2, \"input_length\": 3, \"output_length\": 1, \"hash_ids\": [4]}",
        )
        .expect_err("negative timestamp");
        assert_eq!(
            err.to_string(),
            "trace line 1: timestamp must be a finite number >= 0, got -2"
        );
    }

    #[test]
    fn errors_name_the_line_and_what_was_expected() {
        let good =
            "{\"timestamp\": 0, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [1]}";
        let err =
            parse_jsonl(&format!("{good}\n\n{{\"timestamp\": 0}}")).expect_err("missing fields");
        let message = err.to_string();
        assert!(
            message.starts_with("trace line 3: expected a JSON object with timestamp"),
            "{message}"
        );
        assert!(message.contains("input_length"), "{message}");

        let err = parse_jsonl(&good.replace("\"timestamp\": 0", "\"timestamp\": -1"))
            .expect_err("negative timestamp");
        assert_eq!(
            err.to_string(),
            "trace line 1: timestamp must be a finite number >= 0, got -1"
        );
        assert!(
            parse_jsonl(&good.replace("[1]", "[-1]")).is_err(),
            "hash ids are unsigned"
        );
    }
}
