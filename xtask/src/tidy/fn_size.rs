//! No function in a crate's `src/` (unit tests apart) is longer than [`MAX_LINES`]: a function
//! that long does several things and wants helpers. A function's length runs from the line of its
//! `fn` keyword to the line of its closing brace. The functions still over the limit are named in
//! [`ALLOWED_LONG`], and the list can only shrink: a named function that is back under the limit
//! (or gone) fails too, so its entry is removed with the split.
//!
//! The scan is lexical, not a parser: comments and the contents of string and character literals
//! are blanked out, then each `fn NAME` is followed to the `{` that opens its body and the brace
//! that closes it. `#[cfg(test)]` modules are skipped, as are `tests.rs` files and `tests/`
//! directories (the same files as `file_size.rs` skips).

use std::path::{Path, PathBuf};

use cargo_metadata::Metadata;

/// Most lines a function may have.
pub(super) const MAX_LINES: usize = 120;

/// Functions over [`MAX_LINES`] today: (file relative to the workspace root, function name).
/// Split one and remove its entry; never add one.
const ALLOWED_LONG: &[(&str, &str)] = &[];

/// Crates outside the rule (tooling, not product code).
const EXEMPT: &[&str] = &["xtask"];

/// A function found by [`functions`]: its name, the line of its `fn` keyword (1-based) and its
/// length in lines.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Function {
    pub(super) name: String,
    pub(super) line: usize,
    pub(super) lines: usize,
}

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
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) => return vec![format!("{}: cannot read: {e}", path.display())],
        };
        let relative = path.strip_prefix(root).unwrap_or(&path);
        let relative = relative.to_string_lossy().replace('\\', "/");
        for f in functions(&text) {
            measured.push((relative.clone(), f));
        }
    }
    check_lengths(&measured, ALLOWED_LONG)
}

/// Every `.rs` file under `dir`, except unit tests (`tests.rs`, or anything under a `tests/`
/// directory).
pub(super) fn source_files(dir: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
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

/// Problems with `functions` (path relative to the root, function) given the allow-list.
fn check_lengths(functions: &[(String, Function)], allowed: &[(&str, &str)]) -> Vec<String> {
    let mut problems = Vec::new();
    for (path, f) in functions {
        let listed = allowed.contains(&(path.as_str(), f.name.as_str()));
        if f.lines > MAX_LINES && !listed {
            problems.push(format!(
                "{path}:{}: fn {} has {} lines, more than {MAX_LINES}: split it into helpers \
                 (xtask/src/tidy/fn_size.rs lists the functions still over, and takes no new ones)",
                f.line, f.name, f.lines
            ));
        }
    }
    for (path, name) in allowed {
        let over = functions
            .iter()
            .any(|(p, f)| p == path && f.name == *name && f.lines > MAX_LINES);
        if !over {
            problems.push(format!(
                "ALLOWED_LONG in xtask/src/tidy/fn_size.rs names fn {name} of {path}, which is \
                 not a function over {MAX_LINES} lines (any more): remove it"
            ));
        }
    }
    problems
}

/// The functions with a body in `source`, outside `#[cfg(test)]` items.
pub(super) fn functions(source: &str) -> Vec<Function> {
    let code = blank_comments_and_literals(source);
    let skipped = test_ranges(&code);
    let mut found = Vec::new();
    let mut words = Words::new(&code);
    while let Some((start, word)) = words.next() {
        if word != "fn" || skipped.iter().any(|r| r.contains(&start)) {
            continue;
        }
        let Some((_, name)) = words.peek() else {
            break;
        };
        // `fn(u32) -> u32` is a type, not a function.
        if !name.starts_with(|c: char| c.is_alphabetic() || c == '_') {
            continue;
        }
        let Some(open) = body_or_end(&code, start) else {
            break;
        };
        if code.as_bytes()[open] == b';' {
            continue;
        }
        let Some(close) = matching_brace(&code, open) else {
            break;
        };
        let line = line_of(&code, start);
        found.push(Function {
            name: name.to_owned(),
            line,
            lines: line_of(&code, close) - line + 1,
        });
    }
    found
}

/// The byte ranges of the braced items that follow a `#[cfg(test)]` attribute.
pub(super) fn test_ranges(code: &str) -> Vec<std::ops::Range<usize>> {
    let mut ranges = Vec::new();
    for (at, _) in code.match_indices("#[cfg(test)]") {
        let Some(open) = body_or_end(code, at) else {
            continue;
        };
        if code.as_bytes()[open] == b'{'
            && let Some(close) = matching_brace(code, open)
        {
            ranges.push(at..close + 1);
        }
    }
    ranges
}

/// The index of the first `{` or `;` from `from` outside parentheses and brackets: the body of
/// the item starting there, or the end of a declaration (`fn f(x: [u8; 4]);`).
fn body_or_end(code: &str, from: usize) -> Option<usize> {
    let mut depth = 0usize;
    for (i, b) in code.bytes().enumerate().skip(from) {
        match b {
            b'(' | b'[' => depth += 1,
            b')' | b']' => depth = depth.saturating_sub(1),
            b'{' | b';' if depth == 0 => return Some(i),
            _ => {}
        }
    }
    None
}

/// The index of the `}` closing the `{` at `open`.
pub(super) fn matching_brace(code: &str, open: usize) -> Option<usize> {
    let mut depth = 0usize;
    for (i, b) in code.bytes().enumerate().skip(open) {
        match b {
            b'{' => depth += 1,
            b'}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(i);
                }
            }
            _ => {}
        }
    }
    None
}

/// The 1-based line of byte `at`.
fn line_of(code: &str, at: usize) -> usize {
    code[..at].bytes().filter(|&b| b == b'\n').count() + 1
}

/// `source` with every comment and the contents of every string and character literal replaced
/// by spaces (newlines kept), so that braces in them do not count and lines stay where they were.
pub(super) fn blank_comments_and_literals(source: &str) -> String {
    let chars: Vec<char> = source.chars().collect();
    let mut out = String::with_capacity(source.len());
    let mut i = 0;
    // Everything from `from` to `to` (exclusive) becomes blanks, newlines kept.
    let blank = |out: &mut String, from: usize, to: usize| {
        for &c in chars.get(from..to.min(chars.len())).unwrap_or_default() {
            out.push(if c == '\n' { '\n' } else { ' ' });
        }
    };
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        let after_ident = i > 0 && is_ident(chars[i - 1]);
        if c == '/' && next == Some('/') {
            let end = (i..chars.len())
                .find(|&j| chars[j] == '\n')
                .unwrap_or(chars.len());
            blank(&mut out, i, end);
            i = end;
        } else if c == '/' && next == Some('*') {
            let end = block_comment_end(&chars, i);
            blank(&mut out, i, end);
            i = end;
        } else if let Some((quote, hashes)) = raw_string_start(&chars, i).filter(|_| !after_ident) {
            let end = raw_string_end(&chars, quote + 1, hashes);
            let close = end.saturating_sub(1 + hashes).max(quote + 1);
            out.extend(&chars[i..=quote]);
            blank(&mut out, quote + 1, close);
            out.extend(&chars[close..end]);
            i = end;
        } else if c == '"' {
            let end = quoted_end(&chars, i + 1, '"');
            out.push('"');
            blank(&mut out, i + 1, end - 1);
            out.push('"');
            i = end;
        } else if c == '\'' && char_literal(&chars, i) {
            let end = quoted_end(&chars, i + 1, '\'');
            out.push('\'');
            blank(&mut out, i + 1, end - 1);
            out.push('\'');
            i = end;
        } else {
            out.push(c);
            i += 1;
        }
    }
    out
}

fn is_ident(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// The index after the end of the (possibly nested) block comment starting at `start`.
fn block_comment_end(chars: &[char], start: usize) -> usize {
    let mut depth = 0;
    let mut i = start;
    while i < chars.len() {
        if chars[i] == '/' && chars.get(i + 1) == Some(&'*') {
            depth += 1;
            i += 2;
        } else if chars[i] == '*' && chars.get(i + 1) == Some(&'/') {
            depth -= 1;
            i += 2;
            if depth == 0 {
                return i;
            }
        } else {
            i += 1;
        }
    }
    chars.len()
}

/// For a raw string (`r"`, `r#"`, `br##"`...) starting at `i`: the index of its opening quote
/// and its number of `#`.
fn raw_string_start(chars: &[char], i: usize) -> Option<(usize, usize)> {
    let mut j = i;
    if chars.get(j) == Some(&'b') || chars.get(j) == Some(&'c') {
        j += 1;
    }
    if chars.get(j) != Some(&'r') {
        return None;
    }
    j += 1;
    let hashes = chars[j.min(chars.len())..]
        .iter()
        .take_while(|&&c| c == '#')
        .count();
    (chars.get(j + hashes) == Some(&'"')).then_some((j + hashes, hashes))
}

/// The index after a raw string's closing `"` and `hashes` `#`, its contents starting at `from`.
fn raw_string_end(chars: &[char], from: usize, hashes: usize) -> usize {
    let mut i = from;
    while i < chars.len() {
        if chars[i] == '"' && (1..=hashes).all(|k| chars.get(i + k) == Some(&'#')) {
            return i + 1 + hashes;
        }
        i += 1;
    }
    chars.len()
}

/// The index after the closing `quote` of a literal whose contents start at `from` (backslash
/// escapes skipped).
fn quoted_end(chars: &[char], from: usize, quote: char) -> usize {
    let mut i = from;
    while i < chars.len() {
        match chars[i] {
            '\\' => i += 2,
            c if c == quote => return i + 1,
            _ => i += 1,
        }
    }
    chars.len()
}

/// Whether the `'` at `i` opens a character literal (`'x'`, `'\n'`, `'\u{..}'`) rather than a
/// lifetime or label (`'a`, `'static`).
fn char_literal(chars: &[char], i: usize) -> bool {
    match chars.get(i + 1) {
        Some('\\') => true,
        Some(_) => chars.get(i + 2) == Some(&'\''),
        None => false,
    }
}

/// The words (identifiers and keywords) of blanked code, with their byte offsets; any other
/// character is a word of its own.
#[derive(Clone, Copy)]
pub(super) struct Words<'a> {
    code: &'a str,
    at: usize,
}

impl<'a> Words<'a> {
    pub(super) fn new(code: &'a str) -> Self {
        Self { code, at: 0 }
    }

    fn peek(&self) -> Option<(usize, &'a str)> {
        let mut ahead = *self;
        ahead.next()
    }
}

impl<'a> Iterator for Words<'a> {
    type Item = (usize, &'a str);

    fn next(&mut self) -> Option<Self::Item> {
        let rest = &self.code[self.at..];
        let start = self.at + rest.find(|c: char| !c.is_whitespace())?;
        let first = self.code[start..].chars().next()?;
        let len = if is_ident(first) {
            self.code[start..]
                .find(|c: char| !is_ident(c))
                .unwrap_or(self.code.len() - start)
        } else {
            first.len_utf8()
        };
        self.at = start + len;
        Some((start, &self.code[start..start + len]))
    }
}

#[cfg(test)]
mod tests;
