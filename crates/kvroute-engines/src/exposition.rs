//! A reader for the Prometheus text exposition format (version 0.0.4), the body of an engine's
//! `/metrics`. It keeps samples only: `# HELP` and `# TYPE` lines are comments here, since load
//! reading asks for gauges by name.
//!
//! Written here rather than taken from a crate: `prometheus-parse` 0.2 matches metric names with
//! `\w+`, which drops every name with a colon (`vllm:num_requests_running`).

use std::borrow::Cow;
use std::fmt;

/// One sample line: `name{label="value",...} value [timestamp]`.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Sample<'a> {
    pub(crate) name: &'a str,
    pub(crate) labels: Vec<(&'a str, Cow<'a, str>)>,
    pub(crate) value: f64,
}

impl Sample<'_> {
    /// The value of label `name`, if the sample has it.
    pub(crate) fn label(&self, name: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.as_ref())
    }
}

/// The sample as it would be written, for messages: `name{a="1",b="2"}`.
impl fmt::Display for Sample<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name)?;
        if !self.labels.is_empty() {
            f.write_str("{")?;
            for (i, (name, value)) in self.labels.iter().enumerate() {
                if i > 0 {
                    f.write_str(",")?;
                }
                write!(f, "{name}={value:?}")?;
            }
            f.write_str("}")?;
        }
        Ok(())
    }
}

/// A line that is not Prometheus text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SyntaxError {
    /// 1-based.
    pub(crate) line: usize,
    pub(crate) message: String,
}

impl fmt::Display for SyntaxError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "line {}: {}", self.line, self.message)
    }
}

/// Every sample of `text`, in order, or the first line that is not Prometheus text.
pub(crate) fn parse(text: &str) -> Result<Vec<Sample<'_>>, SyntaxError> {
    let mut samples = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim_matches([' ', '\t']);
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let sample = parse_sample(line).map_err(|message| SyntaxError {
            line: i + 1,
            message: format!("{message} in `{}`", crate::error::excerpt(line)),
        })?;
        samples.push(sample);
    }
    Ok(samples)
}

fn parse_sample(line: &str) -> Result<Sample<'_>, String> {
    let mut rest = line;
    let name = take_name(&mut rest).ok_or("expected a metric name")?;
    let mut labels = Vec::new();
    if let Some(after) = rest.strip_prefix('{') {
        rest = after;
        loop {
            rest = rest.trim_start_matches([' ', '\t']);
            if let Some(after) = rest.strip_prefix('}') {
                rest = after;
                break;
            }
            let label = take_name(&mut rest).ok_or("expected a label name or `}`")?;
            rest = rest.trim_start_matches([' ', '\t']);
            rest = rest
                .strip_prefix('=')
                .ok_or_else(|| format!("expected `=` after label `{label}`"))?;
            rest = rest.trim_start_matches([' ', '\t']);
            let value = take_quoted(&mut rest)
                .ok_or_else(|| format!("expected a quoted value for label `{label}`"))?;
            labels.push((label, value));
            rest = rest.trim_start_matches([' ', '\t']);
            if let Some(after) = rest.strip_prefix(',') {
                rest = after;
            } else if !rest.starts_with('}') {
                return Err(format!("expected `,` or `}}` after label `{label}`"));
            }
        }
    }
    let mut fields = rest.split([' ', '\t']).filter(|f| !f.is_empty());
    let value = fields.next().ok_or("expected a value")?;
    let value = parse_value(value).ok_or_else(|| format!("`{value}` is not a number"))?;
    match fields.next() {
        None => {}
        // An OpenMetrics exemplar follows a `#`.
        Some(f) if f.starts_with('#') => {}
        Some(timestamp) => {
            timestamp
                .parse::<i64>()
                .map_err(|_| format!("`{timestamp}` is not a timestamp in milliseconds"))?;
            match fields.next() {
                None => {}
                Some(f) if f.starts_with('#') => {}
                Some(extra) => return Err(format!("unexpected `{extra}` after the timestamp")),
            }
        }
    }
    Ok(Sample {
        name,
        labels,
        value,
    })
}

/// A metric or label name (`[a-zA-Z_:][a-zA-Z0-9_:]*`) from the start of `rest`.
fn take_name<'a>(rest: &mut &'a str) -> Option<&'a str> {
    let s = *rest;
    let end = s
        .char_indices()
        .find(|&(i, c)| {
            !(c.is_ascii_alphabetic() || c == '_' || c == ':' || (i > 0 && c.is_ascii_digit()))
        })
        .map_or(s.len(), |(i, _)| i);
    if end == 0 {
        return None;
    }
    *rest = &s[end..];
    Some(&s[..end])
}

/// A double-quoted label value from the start of `rest`, unescaped (`\\`, `\"`, `\n`).
fn take_quoted<'a>(rest: &mut &'a str) -> Option<Cow<'a, str>> {
    let s = rest.strip_prefix('"')?;
    let mut owned: Option<String> = None;
    let mut chars = s.char_indices();
    while let Some((i, c)) = chars.next() {
        match c {
            '"' => {
                *rest = &s[i + 1..];
                return Some(match owned {
                    Some(o) => Cow::Owned(o),
                    None => Cow::Borrowed(&s[..i]),
                });
            }
            '\\' => {
                let o = owned.get_or_insert_with(|| s[..i].to_owned());
                match chars.next()?.1 {
                    'n' => o.push('\n'),
                    other => o.push(other),
                }
            }
            c => {
                if let Some(o) = &mut owned {
                    o.push(c);
                }
            }
        }
    }
    None
}

/// A sample value as Go's `ParseFloat` writes them: decimals, exponents, `NaN`, `+Inf`, `-Inf`.
fn parse_value(s: &str) -> Option<f64> {
    match s {
        "+Inf" | "Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        "NaN" => Some(f64::NAN),
        _ if s
            .bytes()
            .all(|b| b.is_ascii_digit() || b"+-.eE".contains(&b)) =>
        {
            s.parse().ok()
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests;
