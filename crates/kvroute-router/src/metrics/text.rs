//! The text formats of `/metrics`: an OpenMetrics text in the Prometheus text format 0.0.4
//! ([`prometheus_text`]), and the texts of two routers as one ([`merge_families`]).

/// An OpenMetrics text in the Prometheus text format 0.0.4: no `# EOF`, no `# UNIT` lines, no
/// `_created` samples, and a counter's `# HELP` and `# TYPE` lines naming its `_total` samples
/// (OpenMetrics names the family without the suffix).
pub(crate) fn prometheus_text(openmetrics: &str) -> String {
    let mut counters = std::collections::HashSet::new();
    let mut created = std::collections::HashSet::new();
    for line in openmetrics.lines() {
        let Some(rest) = line.strip_prefix("# TYPE ") else {
            continue;
        };
        let mut parts = rest.split(' ');
        let (Some(name), Some(kind)) = (parts.next(), parts.next()) else {
            continue;
        };
        if kind == "counter" {
            counters.insert(name);
        }
        if matches!(kind, "counter" | "histogram" | "summary" | "gaugehistogram") {
            created.insert(name);
        }
    }
    let mut out = String::with_capacity(openmetrics.len());
    for line in openmetrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let meta = ["# HELP ", "# TYPE "]
            .into_iter()
            .find_map(|p| line.strip_prefix(p).map(|rest| (p, rest)));
        if let Some((prefix, rest)) = meta {
            let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
            if counters.contains(name) && !name.ends_with("_total") {
                out.push_str(&format!("{prefix}{name}_total {tail}\n"));
                continue;
            }
        } else if !line.starts_with('#') {
            let name = line.split(['{', ' ']).next().unwrap_or("");
            if name
                .strip_suffix("_created")
                .is_some_and(|family| created.contains(family))
            {
                continue;
            }
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}

/// One metric family of an OpenMetrics text: its name (from `# HELP`, else `# TYPE`), its
/// metadata lines and its samples.
struct Family<'a> {
    name: &'a str,
    meta: Vec<&'a str>,
    samples: Vec<&'a str>,
}

/// The families of an OpenMetrics text, in order (up to `# EOF`). A family starts at a `# HELP`
/// or `# TYPE` line naming a family other than the current one.
fn families(text: &str) -> Vec<Family<'_>> {
    let mut out: Vec<Family<'_>> = Vec::new();
    for line in text.lines() {
        if line == "# EOF" {
            break;
        }
        let named = ["# HELP ", "# TYPE ", "# UNIT "]
            .iter()
            .find_map(|p| line.strip_prefix(p))
            .map(|rest| rest.split(' ').next().unwrap_or(""));
        match (named, out.last_mut()) {
            (Some(name), Some(f)) if f.name == name => f.meta.push(line),
            (Some(name), _) => out.push(Family {
                name,
                meta: vec![line],
                samples: Vec::new(),
            }),
            (None, Some(f)) => f.samples.push(line),
            // Samples before any metadata: a family of their own, without a name.
            (None, None) => out.push(Family {
                name: "",
                meta: Vec::new(),
                samples: vec![line],
            }),
        }
    }
    out
}

/// Two OpenMetrics texts (both routers' when serving disaggregated, whose samples carry
/// distinct `router` labels) as one: each family of `first` with its metadata once and
/// `second`'s samples of the same family right after `first`'s, so that every family stays
/// contiguous; families only `second` has follow, then a single `# EOF`.
pub(crate) fn merge_families(first: &str, second: &str) -> String {
    let first = families(first);
    let second = families(second);
    let mut out = String::new();
    let mut push = |line: &str| {
        out.push_str(line);
        out.push('\n');
    };
    for f in &first {
        f.meta.iter().chain(&f.samples).for_each(|l| push(l));
        for s in second.iter().filter(|s| s.name == f.name) {
            s.samples.iter().for_each(|l| push(l));
        }
    }
    for s in second
        .iter()
        .filter(|s| !first.iter().any(|f| f.name == s.name))
    {
        s.meta.iter().chain(&s.samples).for_each(|l| push(l));
    }
    push("# EOF");
    out
}

#[cfg(test)]
mod tests;
