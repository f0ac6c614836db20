//! Running the binary, and the fixture traces.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// A fresh directory for one test's files.
pub(crate) fn scratch(test: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("kvroute-it")
        .join(test);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create the test's scratch directory");
    dir
}

/// Runs `kvroute` with `args`.
pub(crate) fn kvroute(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(args)
        .env("CI", "1")
        .output()
        .expect("run the kvroute binary")
}

/// Stdout and stderr as text.
pub(crate) fn text(output: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// Tokens per hash id in the fixture (passed as `--trace-block-size`); small so that debug-mode
/// engines replay it quickly.
pub(crate) const FIXTURE_T: u32 = 64;

/// A multi-turn conversation trace in Mooncake format: every prompt starts with a shared
/// system-prompt block (id 0), each conversation's turn `t` repeats the conversation so far and
/// adds two blocks, and conversations interleave in time, so a router that follows the cache
/// keeps a conversation on one worker and round-robin scatters it.
pub(crate) fn conversation_trace(conversations: u64, turns: u64) -> String {
    let mut out = String::new();
    let mut lines: Vec<(u64, String)> = Vec::new();
    for c in 0..conversations {
        let base = 1 + c * 1000;
        for t in 0..turns {
            let mut ids = vec![0];
            ids.extend((0..2 * (t + 1)).map(|i| base + i));
            let input = ids.len() as u64 * u64::from(FIXTURE_T) - 10;
            let timestamp = t * 3000 + c * 40;
            let ids: Vec<String> = ids.iter().map(u64::to_string).collect();
            lines.push((
                timestamp,
                format!(
                    "{{\"timestamp\": {timestamp}, \"input_length\": {input}, \"output_length\": 12, \"hash_ids\": [{}]}}",
                    ids.join(", ")
                ),
            ));
        }
    }
    lines.sort_by_key(|(ts, _)| *ts);
    for (_, line) in lines {
        let _ = writeln!(out, "{line}");
    }
    out
}

/// Writes the standard fixture (25 conversations of 4 turns: 25 is not a multiple of the 4
/// workers, so round-robin moves every conversation to another worker at each turn) into `dir`
/// and returns its path.
pub(crate) fn write_fixture(dir: &Path) -> PathBuf {
    let path = dir.join("trace.jsonl");
    std::fs::write(&path, conversation_trace(25, 4)).expect("write the fixture trace");
    path
}

/// The common arguments of a fixture replay (everything but `--trace` and `--json`).
pub(crate) const FIXTURE_ARGS: &[&str] = &[
    "--workers",
    "4",
    "--block-size",
    "16",
    "--trace-block-size",
    "64",
    "--cache-blocks",
    "400",
];

/// Runs a replay of `trace` with the fixture arguments plus `extra`, writing JSON to `json`,
/// and returns the parsed JSON; panics with the binary's stderr if it fails.
pub(crate) fn replay_json(trace: &Path, json: &Path, extra: &[&str]) -> serde_json::Value {
    let mut args = vec![
        "replay",
        "--trace",
        trace.to_str().expect("utf-8 path"),
        "--json",
        json.to_str().expect("utf-8 path"),
    ];
    args.extend_from_slice(FIXTURE_ARGS);
    args.extend_from_slice(extra);
    let output = kvroute(&args);
    let (stdout, stderr) = text(&output);
    assert!(
        output.status.success(),
        "replay failed\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    let body = std::fs::read_to_string(json).expect("read the JSON report");
    serde_json::from_str(&body).expect("the JSON report parses")
}
