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
        if !(record.timestamp.is_finite() && record.timestamp >= 0.0) {
            return Err(TraceError::BadTimestamp {
                line: i + 1,
                got: record.timestamp,
            });
        }
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
