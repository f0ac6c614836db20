//! No source file of a crate's `src/` imports itself through others: the files and the paths
//! between them form no circle. A circle means two files each need something of the other, so
//! neither can be read, tested or moved alone; what both need belongs in one of them or in a third
//! module.
//!
//! The graph's nodes are a crate's files as module paths (`lib.rs`/`main.rs` the root, `a.rs` or
//! `a/mod.rs` is `a`, `a/b.rs` is `a::b`). File A has an edge to file B when A names a path
//! starting `crate::`, `super::` or `self::` (resolved from the module it is written in, inline
//! modules counted) whose longest prefix that is a file is B, grouped `use` trees
//! (`use crate::{a, b::c}`) expanded. A `mod child;` declaration is no edge (a parent declaring
//! its children is structure, not an import), nor is a path to the crate root (the root's
//! re-exports are the crate's facade). The scan is lexical, with `fn_size.rs`'s blanking:
//! comments (doc links included) and string contents do not count, nor `pub(in crate::a)`
//! visibilities, `#[cfg(test)]` items, `tests.rs` files and `tests/` directories.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::ops::Range;
use std::path::Path;

use cargo_metadata::Metadata;

use super::fn_size::{
    Words, blank_comments_and_literals, matching_brace, source_files, test_ranges,
};

/// Crates outside the rule.
const EXEMPT: &[&str] = &[];

/// A module path: empty for the crate root, `["a", "b"]` for `a::b`.
type ModPath = Vec<String>;

/// A word of blanked code and its byte offset.
type Token<'a> = (usize, &'a str);

pub(super) fn check(metadata: &Metadata) -> Vec<String> {
    let root = metadata.workspace_root.as_std_path();
    let mut problems = Vec::new();
    for package in metadata.workspace_packages() {
        if EXEMPT.contains(&package.name.as_str()) {
            continue;
        }
        let Some(dir) = package.manifest_path.as_std_path().parent() else {
            continue;
        };
        let src = dir.join("src");
        let mut paths = Vec::new();
        if let Err(e) = source_files(&src, &mut paths) {
            problems.push(format!("{}: cannot list: {e}", src.display()));
            continue;
        }
        let mut files = Vec::new();
        for path in paths {
            match std::fs::read_to_string(&path) {
                Ok(text) => files.push((relative(&path, &src), text)),
                Err(e) => problems.push(format!("{}: cannot read: {e}", path.display())),
            }
        }
        problems.extend(circle_problems(&relative(&src, root), &files));
    }
    problems
}

/// One problem for each circle among `files` (path relative to `src/`, text) of the crate whose
/// `src/` is `label`.
fn circle_problems(label: &str, files: &[(String, String)]) -> Vec<String> {
    cycles(files)
        .into_iter()
        .map(|cycle| {
            format!(
                "{label}: files import each other in a circle: {}; move what both need into one \
                 of them or a third module",
                cycle.join(" -> ")
            )
        })
        .collect()
}

/// `path` relative to `base`, with `/` separators.
fn relative(path: &Path, base: &Path) -> String {
    let relative = path.strip_prefix(base).unwrap_or(path);
    relative.to_string_lossy().replace('\\', "/")
}

/// The module path of a file given relative to its crate's `src/` (`a/b.rs`), or `None` for a
/// file that is not Rust.
fn module_path(file: &str) -> Option<ModPath> {
    let stem = file.strip_suffix(".rs")?;
    let mut parts: ModPath = stem.split('/').map(str::to_owned).collect();
    let last = parts.last().map(String::as_str);
    if (parts.len() == 1 && matches!(last, Some("lib" | "main"))) || last == Some("mod") {
        parts.pop();
    }
    Some(parts)
}

/// One circle for each group of files (given as path relative to `src/` and text) that import
/// each other: the files along it, the first repeated at the end. Sorted by first file.
fn cycles(files: &[(String, String)]) -> Vec<Vec<String>> {
    let mut nodes: Vec<(ModPath, &str)> = files
        .iter()
        .filter_map(|(path, _)| Some((module_path(path)?, path.as_str())))
        .collect();
    nodes.sort_by(|a, b| a.1.cmp(b.1));
    let index: BTreeMap<&ModPath, usize> =
        nodes.iter().enumerate().map(|(i, n)| (&n.0, i)).collect();
    let mut edges = vec![BTreeSet::new(); nodes.len()];
    for (path, text) in files {
        let Some(from) = module_path(path) else {
            continue;
        };
        let from_index = index[&from];
        for full in referenced_paths(text, &from) {
            // The longest prefix of the path that is a file; the root (length 0) is no edge.
            let target = (1..=full.len())
                .rev()
                .find_map(|k| index.get(&full[..k].to_vec()));
            if let Some(&to) = target
                && to != from_index
            {
                edges[from_index].insert(to);
            }
        }
    }
    let mut found: Vec<Vec<String>> = strongly_connected(&edges)
        .into_iter()
        .filter(|component| component.len() > 1)
        .map(|component| {
            circle(&edges, &component)
                .into_iter()
                .map(|i| nodes[i].1.to_owned())
                .collect()
        })
        .collect();
    found.sort();
    found
}

/// Every path starting `crate::`, `super::` or `self::` in `source`, a file whose module path is
/// `file`, resolved to a full path from the crate root (a `use` tree gives one path per leaf).
fn referenced_paths(source: &str, file: &ModPath) -> Vec<ModPath> {
    let code = blank_comments_and_literals(source);
    let skipped = test_ranges(&code);
    let tokens: Vec<Token<'_>> = Words::new(&code)
        .filter(|(at, _)| !skipped.iter().any(|r| r.contains(at)))
        .collect();
    let inline = inline_modules(&code, &tokens);
    let mut paths = Vec::new();
    for (i, &(at, word)) in tokens.iter().enumerate() {
        if !matches!(word, "crate" | "super" | "self") || !separator_at(&tokens, i + 1) {
            continue;
        }
        // Inside a longer path (`super::super::a`, `a::self`), or a visibility.
        let before = code[..at].trim_end();
        let visibility = i >= 2 && tokens[i - 1].1 == "in" && tokens[i - 2].1 == "(";
        if before.ends_with("::") || visibility {
            continue;
        }
        let mut base = if word == "crate" {
            ModPath::new()
        } else {
            let mut module = file.clone();
            module.extend(
                inline
                    .iter()
                    .filter(|(range, _)| range.contains(&at))
                    .map(|(_, name)| name.clone()),
            );
            module
        };
        let mut j = i + 3;
        if word == "super" {
            base.pop();
            while tokens.get(j).map(|t| t.1) == Some("super") && separator_at(&tokens, j + 1) {
                base.pop();
                j += 3;
            }
        }
        use_tree(&tokens, j, base, &mut paths);
    }
    paths
}

/// Whether tokens `i` and `i + 1` are the two colons of a `::`.
fn separator_at(tokens: &[Token<'_>], i: usize) -> bool {
    match (tokens.get(i), tokens.get(i + 1)) {
        (Some(&(a, ":")), Some(&(b, ":"))) => b == a + 1,
        _ => false,
    }
}

/// The inline modules (`mod name { ... }`) among `tokens`, outermost first: their byte range in
/// `code` and name.
fn inline_modules(code: &str, tokens: &[Token<'_>]) -> Vec<(Range<usize>, String)> {
    let mut modules = Vec::new();
    for window in tokens.windows(3) {
        if let [(at, "mod"), (_, name), (open, "{")] = *window
            && let Some(close) = matching_brace(code, open)
        {
            modules.push((at..close + 1, name.to_owned()));
        }
    }
    modules
}

/// Reads the path or `use` tree whose segments start at token `j`, below `prefix`, and pushes the
/// full path of each leaf to `out` (`self` in a group names the prefix; `*`, generics and the rest
/// end a path). Returns the index after it.
fn use_tree(
    tokens: &[Token<'_>],
    mut j: usize,
    mut prefix: ModPath,
    out: &mut Vec<ModPath>,
) -> usize {
    while let Some(&(_, word)) = tokens.get(j) {
        if word == "{" {
            return group(tokens, j + 1, &prefix, out);
        }
        if word == "*" {
            j += 1;
            break;
        }
        if !word.starts_with(|c: char| c.is_alphabetic() || c == '_') {
            break;
        }
        if word != "self" {
            prefix.push(word.to_owned());
        }
        j += 1;
        if !separator_at(tokens, j) {
            break;
        }
        j += 2;
    }
    out.push(prefix);
    j
}

/// Reads the members of a `{ ... }` group starting at token `j` (after the `{`), each below
/// `prefix`. Returns the index after the closing `}`.
fn group(tokens: &[Token<'_>], mut j: usize, prefix: &ModPath, out: &mut Vec<ModPath>) -> usize {
    while let Some(&(_, word)) = tokens.get(j) {
        match word {
            "}" => return j + 1,
            "," => j += 1,
            // `a as b`: the alias is no path.
            "as" => j += 2,
            _ => j = use_tree(tokens, j, prefix.clone(), out).max(j + 1),
        }
    }
    j
}

/// The strongly connected components of the graph (Tarjan's algorithm).
fn strongly_connected(edges: &[BTreeSet<usize>]) -> Vec<Vec<usize>> {
    struct Tarjan<'a> {
        edges: &'a [BTreeSet<usize>],
        index: Vec<Option<usize>>,
        low: Vec<usize>,
        stack: Vec<usize>,
        on_stack: Vec<bool>,
        next: usize,
        components: Vec<Vec<usize>>,
    }
    impl Tarjan<'_> {
        fn visit(&mut self, v: usize) {
            self.index[v] = Some(self.next);
            self.low[v] = self.next;
            self.next += 1;
            self.stack.push(v);
            self.on_stack[v] = true;
            for &w in self.edges[v].iter() {
                match self.index[w] {
                    None => {
                        self.visit(w);
                        self.low[v] = self.low[v].min(self.low[w]);
                    }
                    Some(index) if self.on_stack[w] => self.low[v] = self.low[v].min(index),
                    Some(_) => {}
                }
            }
            if Some(self.low[v]) == self.index[v] {
                let mut component = Vec::new();
                while let Some(w) = self.stack.pop() {
                    self.on_stack[w] = false;
                    component.push(w);
                    if w == v {
                        break;
                    }
                }
                self.components.push(component);
            }
        }
    }
    let n = edges.len();
    let mut tarjan = Tarjan {
        edges,
        index: vec![None; n],
        low: vec![0; n],
        stack: Vec::new(),
        on_stack: vec![false; n],
        next: 0,
        components: Vec::new(),
    };
    for v in 0..n {
        if tarjan.index[v].is_none() {
            tarjan.visit(v);
        }
    }
    tarjan.components
}

/// A shortest circle inside the component (the first found, trying its nodes in order): its
/// nodes, the first repeated at the end.
fn circle(edges: &[BTreeSet<usize>], component: &[usize]) -> Vec<usize> {
    let inside: BTreeSet<usize> = component.iter().copied().collect();
    let mut best: Vec<usize> = Vec::new();
    for &start in &inside {
        let found = circle_through(edges, &inside, start);
        if best.is_empty() || (!found.is_empty() && found.len() < best.len()) {
            best = found;
        }
    }
    best
}

/// A shortest circle through `start` staying `inside` (breadth first), or nothing.
fn circle_through(edges: &[BTreeSet<usize>], inside: &BTreeSet<usize>, start: usize) -> Vec<usize> {
    let mut came_from: BTreeMap<usize, usize> = BTreeMap::new();
    let mut queue = VecDeque::from([start]);
    while let Some(v) = queue.pop_front() {
        for &w in &edges[v] {
            if w == start {
                let mut path = vec![start, v];
                let mut at = v;
                while let Some(&previous) = came_from.get(&at) {
                    path.push(previous);
                    at = previous;
                }
                path.reverse();
                return path;
            }
            if inside.contains(&w) && !came_from.contains_key(&w) {
                came_from.insert(w, v);
                queue.push_back(w);
            }
        }
    }
    Vec::new()
}

#[cfg(test)]
mod tests;
