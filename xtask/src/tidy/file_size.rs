//! No source file of a crate (its `src/`, tests and benches apart) is longer than [`MAX_LINES`]:
//! a file that long holds several concerns and wants splitting into modules. The files still over
//! the limit are named in [`ALLOWED_OVER`], and the list can only shrink: a named file that is
//! back under the limit (or gone) fails too, so its entry is removed with the split.

use std::path::{Path, PathBuf};

use cargo_metadata::Metadata;

/// Most lines a source file may have.
pub(super) const MAX_LINES: usize = 800;

/// Files over [`MAX_LINES`] today, relative to the workspace root. Split one and remove its entry;
/// never add one.
const ALLOWED_OVER: &[&str] = &[];

/// Crates outside the rule (tooling, not product code).
const EXEMPT: &[&str] = &["xtask"];

pub(super) fn check(metadata: &Metadata) -> Vec<String> {
    let root = metadata.workspace_root.as_std_path();
    let mut files = Vec::new();
    for package in metadata.workspace_packages() {
        if EXEMPT.contains(&package.name.as_str()) {
            continue;
        }
        let Some(dir) = package.manifest_path.as_std_path().parent() else {
            continue;
        };
        if let Err(e) = source_files(&dir.join("src"), &mut files) {
            return vec![format!("{}: cannot list: {e}", dir.display())];
        }
    }
    let mut measured = Vec::new();
    for path in files {
        match std::fs::read_to_string(&path) {
            Ok(text) => {
                let relative = path.strip_prefix(root).unwrap_or(&path);
                measured.push((
                    relative.to_string_lossy().into_owned(),
                    text.lines().count(),
                ));
            }
            Err(e) => return vec![format!("{}: cannot read: {e}", path.display())],
        }
    }
    check_sizes(&measured, ALLOWED_OVER)
}

/// Every `.rs` file under `dir`, except unit tests (`tests.rs`, or anything under a `tests/`
/// directory).
fn source_files(dir: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
    if !dir.is_dir() {
        return Ok(());
    }
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if path.is_dir() {
            if name != "tests" {
                source_files(&path, out)?;
            }
        } else if name.ends_with(".rs") && name != "tests.rs" {
            out.push(path);
        }
    }
    Ok(())
}

/// Problems with `files` (path relative to the root, lines) given the allow-list.
fn check_sizes(files: &[(String, usize)], allowed: &[&str]) -> Vec<String> {
    let mut problems = Vec::new();
    for (path, lines) in files {
        let listed = allowed.contains(&path.as_str());
        if *lines > MAX_LINES && !listed {
            problems.push(format!(
                "{path} has {lines} lines, more than {MAX_LINES}: split it into modules \
                 (xtask/src/tidy/file_size.rs lists the files still over, and takes no new ones)"
            ));
        } else if *lines <= MAX_LINES && listed {
            problems.push(format!(
                "{path} has {lines} lines, no more than {MAX_LINES}: remove it from \
                 ALLOWED_OVER in xtask/src/tidy/file_size.rs"
            ));
        }
    }
    for path in allowed {
        if !files.iter().any(|(p, _)| p == path) {
            problems.push(format!(
                "ALLOWED_OVER in xtask/src/tidy/file_size.rs names {path}, which is not a \
                 source file: remove it"
            ));
        }
    }
    problems
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_source_file_is_over_the_limit_but_the_listed_ones() {
        let problems = check(&crate::tidy::workspace_metadata());
        assert!(problems.is_empty(), "{problems:#?}");
    }

    #[test]
    fn long_files_fail_unless_listed_and_the_list_only_shrinks() {
        let files = [
            ("crates/a/src/short.rs".to_owned(), MAX_LINES),
            ("crates/a/src/long.rs".to_owned(), MAX_LINES + 1),
            ("crates/a/src/listed.rs".to_owned(), 2 * MAX_LINES),
            ("crates/a/src/split.rs".to_owned(), 10),
        ];
        assert_eq!(
            check_sizes(&files, &["crates/a/src/listed.rs"]),
            [
                "crates/a/src/long.rs has 801 lines, more than 800: split it into modules \
              (xtask/src/tidy/file_size.rs lists the files still over, and takes no new ones)"
            ]
        );
        let problems = check_sizes(
            &files,
            &[
                "crates/a/src/long.rs",
                "crates/a/src/listed.rs",
                "crates/a/src/split.rs",
                "crates/a/src/gone.rs",
            ],
        );
        assert_eq!(problems.len(), 2, "{problems:#?}");
        assert!(
            problems[0].starts_with("crates/a/src/split.rs has 10 lines, no more than 800"),
            "{problems:#?}"
        );
        assert!(
            problems[1].contains("names crates/a/src/gone.rs, which is not a source file"),
            "{problems:#?}"
        );
    }
}
