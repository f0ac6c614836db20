//! Every crate root (`lib.rs`, `main.rs`) opens with a `//!` paragraph saying what the crate is
//! for, its entry types and what it must not depend on.

use cargo_metadata::Metadata;

pub(super) fn check(metadata: &Metadata) -> Vec<String> {
    let mut problems = Vec::new();
    for package in metadata.workspace_packages() {
        for target in &package.targets {
            let is_root = target.is_lib() || target.is_bin() || target.is_proc_macro();
            if !is_root {
                continue;
            }
            let path = target.src_path.as_std_path();
            match std::fs::read_to_string(path) {
                Ok(text) => {
                    if let Err(why) = check_text(&text) {
                        problems.push(format!("{}: {why}", path.display()));
                    }
                }
                Err(e) => problems.push(format!("{}: cannot read: {e}", path.display())),
            }
        }
    }
    problems
}

/// The first non-blank line must be a `//!` doc line with some words in it.
fn check_text(text: &str) -> Result<(), String> {
    let first = text.lines().map(str::trim).find(|line| !line.is_empty());
    match first {
        Some(line) if line.starts_with("//!") && line.len() > "//!".len() + 1 => Ok(()),
        Some(line) => Err(format!(
            "must start with a `//!` paragraph describing the crate, found {line:?}"
        )),
        None => Err("is empty: expected a `//!` paragraph describing the crate".to_owned()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_crate_root_has_a_doc_paragraph() {
        let problems = check(&crate::tidy::workspace_metadata());
        assert!(problems.is_empty(), "{problems:#?}");
    }

    #[test]
    fn rejects_roots_without_a_doc_paragraph() {
        let check_one = |text: &str, expect_ok: bool| {
            assert_eq!(check_text(text).is_ok(), expect_ok, "{text:?}");
        };
        check_one("//! The crate.\nfn main() {}\n", true);
        check_one("\n\n//! After blank lines.\n", true);
        check_one("// A plain comment.\n", false);
        check_one("use std::io;\n//! Too late.\n", false);
        check_one("//!\n", false);
        check_one("", false);
    }
}
