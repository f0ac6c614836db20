//! Every member takes its dependency versions and lints from the workspace, so each version is
//! stated once (in the root `[workspace.dependencies]`) and every crate is held to the same lints.

use cargo_metadata::Metadata;
use toml::{Table, Value};

const DEPENDENCY_TABLES: &[&str] = &["dependencies", "dev-dependencies", "build-dependencies"];
const INHERITED_PACKAGE_FIELDS: &[&str] = &["version", "edition", "rust-version", "license"];

pub(super) fn check(metadata: &Metadata) -> Vec<String> {
    let mut problems = Vec::new();
    for package in metadata.workspace_packages() {
        let path = package.manifest_path.as_std_path();
        let text = match std::fs::read_to_string(path) {
            Ok(text) => text,
            Err(e) => {
                problems.push(format!("{}: cannot read: {e}", path.display()));
                continue;
            }
        };
        for problem in check_manifest(&text) {
            problems.push(format!("{}: {problem}", path.display()));
        }
    }
    problems
}

fn check_manifest(text: &str) -> Vec<String> {
    let manifest: Table = match text.parse() {
        Ok(table) => table,
        Err(e) => return vec![format!("is not valid TOML: {e}")],
    };
    let mut problems = Vec::new();

    if !inherits(manifest.get("lints")) {
        problems.push("must have `[lints] workspace = true`".to_owned());
    }
    let package = manifest.get("package").and_then(Value::as_table);
    for field in INHERITED_PACKAGE_FIELDS {
        if !inherits(package.and_then(|p| p.get(*field))) {
            problems.push(format!(
                "`package.{field}` must be `{field}.workspace = true`"
            ));
        }
    }

    let mut tables: Vec<(String, &Table)> = Vec::new();
    for name in DEPENDENCY_TABLES {
        if let Some(table) = manifest.get(*name).and_then(Value::as_table) {
            tables.push(((*name).to_owned(), table));
        }
    }
    if let Some(targets) = manifest.get("target").and_then(Value::as_table) {
        for (cfg, target) in targets {
            for name in DEPENDENCY_TABLES {
                if let Some(table) = target.get(*name).and_then(Value::as_table) {
                    tables.push((format!("target.{cfg}.{name}"), table));
                }
            }
        }
    }
    for (section, table) in tables {
        for (dep, spec) in table {
            if !inherits(Some(spec)) {
                problems.push(format!(
                    "`[{section}] {dep}` must be `{dep}.workspace = true` (state its version once \
                     in the root `[workspace.dependencies]`)"
                ));
            }
        }
    }
    problems
}

/// `x.workspace = true`, i.e. a table whose `workspace` key is `true`.
fn inherits(value: Option<&Value>) -> bool {
    value
        .and_then(Value::as_table)
        .and_then(|t| t.get("workspace"))
        .and_then(Value::as_bool)
        == Some(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_member_inherits_dependencies_and_lints() {
        let problems = check(&crate::tidy::workspace_metadata());
        assert!(problems.is_empty(), "{problems:#?}");
    }

    const GOOD: &str = r#"
[package]
name = "x"
version.workspace = true
edition.workspace = true
rust-version.workspace = true
license.workspace = true

[dependencies]
serde = { workspace = true, features = ["derive"] }

[target.'cfg(loom)'.dependencies]
loom.workspace = true

[lints]
workspace = true
"#;

    fn check_case(text: &str, expect: &[&str]) {
        let problems = check_manifest(text);
        assert_eq!(problems.len(), expect.len(), "{problems:#?}");
        for (problem, needle) in problems.iter().zip(expect) {
            assert!(
                problem.contains(needle),
                "{problem:?} should mention {needle:?}"
            );
        }
    }

    #[test]
    fn accepts_inherited_manifest() {
        check_case(GOOD, &[]);
    }

    #[test]
    fn rejects_own_versions_and_missing_lints() {
        check_case(
            &GOOD.replace("serde = { workspace = true,", "serde = { version = \"1\","),
            &["`[dependencies] serde`"],
        );
        check_case(
            &GOOD.replace("loom.workspace = true", "loom = \"0.7\""),
            &["`[target.cfg(loom).dependencies] loom`"],
        );
        check_case(&GOOD.replace("[lints]\nworkspace = true", ""), &["[lints]"]);
        check_case(
            &GOOD.replace("edition.workspace = true", "edition = \"2024\""),
            &["package.edition"],
        );
    }
}
