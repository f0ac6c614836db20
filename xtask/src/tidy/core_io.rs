//! The routing core does no I/O, as a fact of the dependency graph: the full closure of
//! [`CORE`]'s normal dependencies (every package cargo resolves for it, through every crate
//! below it) holds none of [`NO_IO`]. The layering table says which kvroute crates the core may
//! use; this says what none of them may bring into it.

use std::collections::{BTreeMap, BTreeSet};

use cargo_metadata::{DependencyKind, Metadata};

/// The sans-IO routing core.
pub(super) const CORE: &str = "kvroute-router-core";

/// Packages that mean an async runtime, the network, HTTP or tokenization: none may be in the
/// core's dependency closure.
pub(super) const NO_IO: &[&str] = &[
    "tokio",
    "axum",
    "hyper",
    "reqwest",
    "async-nats",
    "zeromq",
    "zmq",
    "tokenizers",
    "fastokens",
    "minijinja",
];

/// Resolved packages (by id) -> (name, the ids of their normal dependencies).
type Resolved = BTreeMap<String, (String, BTreeSet<String>)>;

pub(super) fn check(metadata: &Metadata) -> Vec<String> {
    let Some(resolve) = &metadata.resolve else {
        return vec!["cargo metadata returned no resolve graph".to_owned()];
    };
    let Some(core) = metadata
        .workspace_packages()
        .into_iter()
        .find(|p| p.name.as_str() == CORE)
    else {
        return vec![format!("`{CORE}` is not a workspace member")];
    };
    let names: BTreeMap<String, String> = metadata
        .packages
        .iter()
        .map(|p| (p.id.repr.clone(), p.name.to_string()))
        .collect();
    let resolved: Resolved = resolve
        .nodes
        .iter()
        .map(|node| {
            let deps = node
                .deps
                .iter()
                .filter(|d| d.dep_kinds.iter().any(|k| k.kind == DependencyKind::Normal))
                .map(|d| d.pkg.repr.clone())
                .collect();
            let name = names.get(&node.id.repr).cloned().unwrap_or_default();
            (node.id.repr.clone(), (name, deps))
        })
        .collect();
    check_closure(&resolved, &core.id.repr, NO_IO)
}

/// One problem for each package of `forbidden` reachable from `root`, naming the path to it.
fn check_closure(resolved: &Resolved, root: &str, forbidden: &[&str]) -> Vec<String> {
    // Breadth-first, remembering how each package was reached, so the path shown is a shortest.
    let mut via: BTreeMap<&str, &str> = BTreeMap::new();
    let mut queue = std::collections::VecDeque::from([root]);
    let mut problems = Vec::new();
    while let Some(id) = queue.pop_front() {
        let Some((name, deps)) = resolved.get(id) else {
            continue;
        };
        if id != root && forbidden.contains(&name.as_str()) {
            let mut path = vec![name.as_str()];
            let mut at = id;
            while let Some(&parent) = via.get(at) {
                path.push(resolved.get(parent).map_or(parent, |(n, _)| n.as_str()));
                at = parent;
            }
            path.reverse();
            problems.push(format!(
                "`{}` must do no I/O, but its dependencies bring in `{name}` ({}); the core may \
                 depend only on kvroute's sans-IO crates and plain data crates",
                path[0],
                path.join(" -> ")
            ));
            continue;
        }
        for dep in deps {
            if dep != root && !via.contains_key(dep.as_str()) {
                via.insert(dep, id);
                queue.push_back(dep);
            }
        }
    }
    problems
}

#[cfg(test)]
mod tests {
    use super::*;

    fn resolved(edges: &[(&str, &[&str])]) -> Resolved {
        edges
            .iter()
            .map(|(k, deps)| {
                (
                    (*k).to_owned(),
                    (
                        (*k).to_owned(),
                        deps.iter().map(|d| (*d).to_owned()).collect(),
                    ),
                )
            })
            .collect()
    }

    #[test]
    fn the_core_crate_pulls_in_no_io() {
        let problems = check(&crate::tidy::workspace_metadata());
        assert!(problems.is_empty(), "{problems:#?}");
    }

    #[test]
    fn a_closure_of_plain_crates_passes() {
        let graph = resolved(&[
            ("core", &["indexer", "rand"]),
            ("indexer", &["protocols", "serde"]),
            ("protocols", &["serde"]),
            ("rand", &[]),
            ("serde", &[]),
        ]);
        assert_eq!(check_closure(&graph, "core", NO_IO), Vec::<String>::new());
    }

    #[test]
    fn io_anywhere_in_the_closure_fails_with_its_path() {
        // tokio reached two hops down (through a lower crate) is as much a violation as a direct
        // dependency; each forbidden package is reported once, by a shortest path.
        let graph = resolved(&[
            ("core", &["indexer", "tokenizers"]),
            ("indexer", &["protocols"]),
            ("protocols", &["tokio"]),
            ("tokenizers", &[]),
            ("tokio", &[]),
        ]);
        let problems = check_closure(&graph, "core", NO_IO);
        assert_eq!(problems.len(), 2, "{problems:#?}");
        assert!(
            problems[0].contains("`tokenizers` (core -> tokenizers)"),
            "{problems:#?}"
        );
        assert!(
            problems[1].contains("(core -> indexer -> protocols -> tokio)"),
            "{problems:#?}"
        );
    }

    #[test]
    fn the_root_itself_is_not_judged() {
        // A crate named like a forbidden one is only a problem as a dependency.
        let graph = resolved(&[("tokio", &["serde"]), ("serde", &[])]);
        assert_eq!(check_closure(&graph, "tokio", NO_IO), Vec::<String>::new());
    }
}
