//! The dependency graph between kvroute's crates, written down once, and checked against what
//! `cargo metadata` says. The table is exact: an edge a crate has but the table lacks is a layering
//! violation, and an edge the table grants but the crate does not use is a stale table (the table
//! is documentation, so it must stay true). Dev-dependencies may reach any crate the table puts
//! below, so tests can use lower layers freely but never higher ones. What the routing core may
//! not pull in from outside kvroute is checked beside this, in `core_io`.

use std::collections::{BTreeMap, BTreeSet};

use cargo_metadata::{DependencyKind, Metadata};

/// Every kvroute crate and the kvroute crates it may (and does) depend on, bottom-up.
/// This is the one place the architecture's layering is written; docs/ARCHITECTURE.md explains it.
pub(super) const ALLOWED: &[(&str, &[&str])] = &[
    ("kvroute-protocols", &[]),
    ("kvroute-indexer", &["kvroute-protocols"]),
    (
        "kvroute-workloads",
        &["kvroute-protocols", "kvroute-indexer"],
    ),
    ("kvroute-scheduler", &["kvroute-protocols"]),
    ("kvroute-sessions", &["kvroute-protocols"]),
    ("kvroute-runtime", &["kvroute-protocols"]),
    (
        "kvroute-mocker",
        &[
            "kvroute-protocols",
            "kvroute-indexer",
            "kvroute-workloads",
            "kvroute-runtime",
        ],
    ),
    ("kvroute-prefill", &["kvroute-protocols", "kvroute-runtime"]),
    ("kvroute-engines", &["kvroute-protocols", "kvroute-runtime"]),
    (
        "kvroute-nats",
        &["kvroute-protocols", "kvroute-runtime", "kvroute-sessions"],
    ),
    (
        "kvroute-router-core",
        &[
            "kvroute-protocols",
            "kvroute-indexer",
            "kvroute-scheduler",
            "kvroute-sessions",
        ],
    ),
    (
        "kvroute-router",
        &[
            "kvroute-protocols",
            "kvroute-indexer",
            "kvroute-scheduler",
            "kvroute-sessions",
            "kvroute-router-core",
            "kvroute-runtime",
            "kvroute-prefill",
        ],
    ),
    (
        "kvroute-epp",
        &["kvroute-protocols", "kvroute-runtime", "kvroute-router"],
    ),
    (
        "kvroute",
        &[
            "kvroute-protocols",
            "kvroute-indexer",
            "kvroute-workloads",
            "kvroute-runtime",
            "kvroute-mocker",
            "kvroute-engines",
            "kvroute-nats",
            "kvroute-router-core",
            "kvroute-router",
            "kvroute-epp",
        ],
    ),
];

/// Crates outside the layering (they drive the others through cargo, not as dependencies).
const EXEMPT: &[&str] = &["xtask"];

/// A graph of crate name -> kvroute crates it depends on.
type Graph = BTreeMap<String, BTreeSet<String>>;

pub(super) fn check(metadata: &Metadata) -> Vec<String> {
    let (normal, dev) = graphs(metadata);
    check_graph(&normal, &dev, ALLOWED)
}

/// Splits the workspace's internal edges into normal (incl. build) and dev edges.
fn graphs(metadata: &Metadata) -> (Graph, Graph) {
    let members: BTreeSet<String> = metadata
        .workspace_packages()
        .iter()
        .map(|p| p.name.to_string())
        .collect();
    let mut normal = Graph::new();
    let mut dev = Graph::new();
    for package in metadata.workspace_packages() {
        let name = package.name.to_string();
        if EXEMPT.contains(&name.as_str()) {
            continue;
        }
        normal.entry(name.clone()).or_default();
        dev.entry(name.clone()).or_default();
        for dep in &package.dependencies {
            if !members.contains(&dep.name) {
                continue;
            }
            let graph = match dep.kind {
                DependencyKind::Development => &mut dev,
                _ => &mut normal,
            };
            graph
                .entry(name.clone())
                .or_default()
                .insert(dep.name.clone());
        }
    }
    (normal, dev)
}

fn check_graph(normal: &Graph, dev: &Graph, allowed: &[(&str, &[&str])]) -> Vec<String> {
    let allowed: Graph = allowed
        .iter()
        .map(|(k, deps)| {
            (
                (*k).to_owned(),
                deps.iter().map(|d| (*d).to_owned()).collect(),
            )
        })
        .collect();
    let mut problems = Vec::new();
    for (krate, deps) in normal {
        let Some(granted) = allowed.get(krate) else {
            problems.push(format!(
                "crate `{krate}` is not in the layering table (xtask/src/tidy/layering.rs): \
                 add it with the crates it may depend on"
            ));
            continue;
        };
        for dep in deps.difference(granted) {
            problems.push(format!(
                "forbidden dependency `{krate}` -> `{dep}`: the layering allows `{krate}` only \
                 {}",
                describe(granted)
            ));
        }
        for dep in granted.difference(deps) {
            problems.push(format!(
                "stale layering entry `{krate}` -> `{dep}`: `{krate}` does not depend on `{dep}`; \
                 remove the edge from xtask/src/tidy/layering.rs"
            ));
        }
    }
    for krate in allowed.keys() {
        if !normal.contains_key(krate) {
            problems.push(format!(
                "layering table names `{krate}`, which is not a workspace member: remove it"
            ));
        }
    }
    for (krate, deps) in dev {
        let below = closure(&allowed, krate);
        for dep in deps.iter().filter(|d| *d != krate && !below.contains(*d)) {
            problems.push(format!(
                "forbidden dev-dependency `{krate}` -> `{dep}`: tests of `{krate}` may only use \
                 crates below it ({})",
                describe(&below)
            ));
        }
    }
    problems
}

/// Every crate reachable from `krate` through allowed edges.
fn closure(allowed: &Graph, krate: &str) -> BTreeSet<String> {
    let mut seen = BTreeSet::new();
    let mut stack: Vec<&str> = vec![krate];
    while let Some(next) = stack.pop() {
        for dep in allowed.get(next).into_iter().flatten() {
            if seen.insert(dep.clone()) {
                stack.push(dep);
            }
        }
    }
    seen
}

fn describe(set: &BTreeSet<String>) -> String {
    if set.is_empty() {
        "no kvroute crate".to_owned()
    } else {
        set.iter()
            .map(|s| format!("`{s}`"))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn graph(edges: &[(&str, &[&str])]) -> Graph {
        edges
            .iter()
            .map(|(k, deps)| {
                (
                    (*k).to_owned(),
                    deps.iter().map(|d| (*d).to_owned()).collect(),
                )
            })
            .collect()
    }

    const TABLE: &[(&str, &[&str])] = &[("p", &[]), ("i", &["p"]), ("r", &["i"])];

    #[test]
    fn the_workspace_follows_the_layering() {
        let problems = check(&crate::tidy::workspace_metadata());
        assert!(problems.is_empty(), "{problems:#?}");
    }

    #[test]
    fn exact_graph_passes() {
        let normal = graph(TABLE);
        let dev = graph(&[("p", &[]), ("i", &[]), ("r", &["p"])]);
        assert_eq!(check_graph(&normal, &dev, TABLE), Vec::<String>::new());
    }

    #[test]
    fn forbidden_edge_fails() {
        // The protocols crate reaching up into the indexer is exactly what the table forbids.
        let normal = graph(&[("p", &["i"]), ("i", &["p"]), ("r", &["i"])]);
        let problems = check_graph(&normal, &graph(&[]), TABLE);
        assert_eq!(problems.len(), 1, "{problems:#?}");
        assert!(
            problems[0].starts_with("forbidden dependency `p` -> `i`"),
            "{problems:#?}"
        );
    }

    #[test]
    fn stale_and_unknown_entries_fail() {
        let normal = graph(&[("p", &[]), ("i", &[]), ("r", &["i"]), ("new", &[])]);
        let problems = check_graph(&normal, &graph(&[]), TABLE);
        assert_eq!(problems.len(), 2, "{problems:#?}");
        assert!(
            problems[0].starts_with("stale layering entry `i` -> `p`"),
            "{problems:#?}"
        );
        assert!(
            problems[1].contains("`new` is not in the layering table"),
            "{problems:#?}"
        );
    }

    #[test]
    fn dev_dependencies_may_only_point_down() {
        let dev = graph(&[("p", &["r"]), ("r", &["p"])]);
        let problems = check_graph(&graph(TABLE), &dev, TABLE);
        assert_eq!(problems.len(), 1, "{problems:#?}");
        assert!(
            problems[0].starts_with("forbidden dev-dependency `p` -> `r`"),
            "{problems:#?}"
        );
    }
}
