//! The HTML report: one self-contained file (inline SVG and CSS, no scripts, no external URLs)
//! with the results table, TTFT CDFs and load over time, one line per policy.

use std::fmt::Write as _;
use std::time::Duration;

use crate::replay::report::{PolicyReport, Setup, ms};

/// What the charts need from one policy's run.
pub(crate) struct PolicyCurves<'a> {
    pub(crate) report: &'a PolicyReport,
    /// Every request's TTFT, sorted.
    pub(crate) ttft_sorted: &'a [Duration],
    /// Mean requests in flight, `[worker][bucket]`.
    pub(crate) load: &'a [Vec<f64>],
    /// The bucket width of `load`.
    pub(crate) bucket: Duration,
}

/// Line colours, one per policy (or worker), cycled.
const COLORS: [&str; 8] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
];

/// Points per CDF line; enough to look smooth, few enough to keep the file small.
const CDF_POINTS: usize = 400;

/// The whole report.
pub(crate) fn render(setup: &Setup, table_md: &str, curves: &[PolicyCurves<'_>]) -> String {
    let mut out = String::new();
    out.push_str(
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\n\
         <title>kvroute replay</title>\n<style>\n\
         body{font-family:system-ui,sans-serif;margin:2em;color:#222;max-width:1100px}\n\
         table{border-collapse:collapse;font-size:14px}td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}\n\
         td:first-child,th:first-child{text-align:left}svg{background:#fff;border:1px solid #ddd;margin:8px 0}\n\
         .axis{font-size:11px;fill:#444}.title{font-size:14px;font-weight:600}\n\
         </style></head><body>\n<h1>kvroute replay</h1>\n",
    );
    let _ = writeln!(
        out,
        "<p>Trace <code>{}</code>: {} requests, {} workers, engine block {} tokens, trace block {} \
         tokens, {} cache blocks per worker, speed {}x, seed {}. Latencies are virtual time.</p>",
        escape(&setup.trace),
        setup.requests,
        setup.workers,
        setup.block_size,
        setup.trace_block_size,
        setup.cache_blocks,
        setup.speed,
        setup.seed
    );
    out.push_str(&table_html(table_md));

    let cdf: Vec<Series> = curves
        .iter()
        .enumerate()
        .map(|(i, c)| Series {
            name: c.report.policy.clone(),
            color: COLORS[i % COLORS.len()],
            points: cdf_points(c.ttft_sorted),
        })
        .collect();
    out.push_str("<h2>Time to first token (CDF)</h2>\n");
    out.push_str(&chart(
        &Chart {
            x_label: "TTFT (ms, log scale)",
            y_label: "fraction of requests",
            x_log: true,
        },
        &cdf,
    ));

    let imbalance: Vec<Series> = curves
        .iter()
        .enumerate()
        .map(|(i, c)| Series {
            name: c.report.policy.clone(),
            color: COLORS[i % COLORS.len()],
            points: imbalance_points(c.load, c.bucket),
        })
        .collect();
    out.push_str(
        "<h2>Load imbalance over time</h2>\n<p>Busiest worker's requests in flight divided by \
         the mean over workers, per time bucket (1.0 is perfect balance).</p>\n",
    );
    out.push_str(&chart(
        &Chart {
            x_label: "time (s)",
            y_label: "max / mean requests in flight",
            x_log: false,
        },
        &imbalance,
    ));

    out.push_str("<h2>Requests in flight per worker</h2>\n");
    for c in curves {
        let workers: Vec<Series> = c
            .load
            .iter()
            .enumerate()
            .map(|(w, row)| Series {
                name: format!("worker {w}"),
                color: COLORS[w % COLORS.len()],
                points: row
                    .iter()
                    .enumerate()
                    .map(|(b, &v)| (bucket_mid(b, c.bucket), v))
                    .collect(),
            })
            .collect();
        let _ = writeln!(out, "<h3>{}</h3>", escape(&c.report.policy));
        out.push_str(&chart(
            &Chart {
                x_label: "time (s)",
                y_label: "requests in flight",
                x_log: false,
            },
            &workers,
        ));
    }
    out.push_str("</body></html>\n");
    out
}

struct Series {
    name: String,
    color: &'static str,
    points: Vec<(f64, f64)>,
}

struct Chart {
    x_label: &'static str,
    y_label: &'static str,
    x_log: bool,
}

fn bucket_mid(index: usize, bucket: Duration) -> f64 {
    (index as f64 + 0.5) * bucket.as_secs_f64()
}

/// `(ttft_ms, fraction <= it)` at evenly spaced ranks.
fn cdf_points(sorted: &[Duration]) -> Vec<(f64, f64)> {
    let n = sorted.len();
    if n == 0 {
        return Vec::new();
    }
    let steps = CDF_POINTS.min(n);
    (1..=steps)
        .map(|i| {
            let rank = (i * n).div_ceil(steps);
            (ms(sorted[rank - 1]), rank as f64 / n as f64)
        })
        .collect()
}

/// `(time_s, max/mean)` per bucket; buckets where nobody was busy are skipped.
fn imbalance_points(load: &[Vec<f64>], bucket: Duration) -> Vec<(f64, f64)> {
    let buckets = load.first().map_or(0, Vec::len);
    (0..buckets)
        .filter_map(|b| {
            let column: Vec<f64> = load.iter().map(|row| row[b]).collect();
            let mean = column.iter().sum::<f64>() / column.len() as f64;
            let max = column.iter().copied().fold(0.0, f64::max);
            (mean > 0.0).then(|| (bucket_mid(b, bucket), max / mean))
        })
        .collect()
}

const W: f64 = 960.0;
const H: f64 = 360.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 150.0;
const TOP: f64 = 20.0;
const BOTTOM: f64 = 45.0;

/// An SVG line chart with axes, ticks and a legend.
fn chart(spec: &Chart, series: &[Series]) -> String {
    let all = || series.iter().flat_map(|s| s.points.iter());
    let tx = |x: f64| if spec.x_log { x.max(1e-3).log10() } else { x };
    let (mut x0, mut x1) = all().fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), p| {
        (a.min(tx(p.0)), b.max(tx(p.0)))
    });
    let mut y1 = all().fold(0.0_f64, |m, p| m.max(p.1));
    if !x0.is_finite() {
        (x0, x1) = (0.0, 1.0);
    }
    if spec.x_log {
        (x0, x1) = (x0.floor(), x1.ceil());
    } else {
        x0 = x0.min(0.0);
    }
    if x1 <= x0 {
        x1 = x0 + 1.0;
    }
    if y1 <= 0.0 {
        y1 = 1.0;
    }
    y1 *= 1.05;
    let pw = W - LEFT - RIGHT;
    let ph = H - TOP - BOTTOM;
    let px = |x: f64| LEFT + (tx(x) - x0) / (x1 - x0) * pw;
    let py = |y: f64| TOP + ph - y / y1 * ph;

    let mut svg = String::new();
    let _ = writeln!(
        svg,
        "<svg width=\"{W}\" height=\"{H}\" viewBox=\"0 0 {W} {H}\">"
    );
    let _ = writeln!(
        svg,
        "<rect x=\"{LEFT}\" y=\"{TOP}\" width=\"{pw}\" height=\"{ph}\" fill=\"none\" stroke=\"#999\"/>"
    );
    for (v, label) in x_ticks(spec.x_log, x0, x1) {
        let x = px(v);
        let _ = writeln!(
            svg,
            "<line x1=\"{x:.1}\" y1=\"{TOP}\" x2=\"{x:.1}\" y2=\"{:.1}\" stroke=\"#eee\"/>\
             <text class=\"axis\" x=\"{x:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{label}</text>",
            TOP + ph,
            TOP + ph + 15.0
        );
    }
    for v in nice_ticks(0.0, y1 / 1.05) {
        let y = py(v);
        let _ = writeln!(
            svg,
            "<line x1=\"{LEFT}\" y1=\"{y:.1}\" x2=\"{:.1}\" y2=\"{y:.1}\" stroke=\"#eee\"/>\
             <text class=\"axis\" x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\">{}</text>",
            LEFT + pw,
            LEFT - 5.0,
            y + 4.0,
            short(v)
        );
    }
    let _ = writeln!(
        svg,
        "<text class=\"axis\" x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text>\
         <text class=\"axis\" transform=\"translate(14,{:.1}) rotate(-90)\" text-anchor=\"middle\">{}</text>",
        LEFT + pw / 2.0,
        H - 8.0,
        spec.x_label,
        TOP + ph / 2.0,
        spec.y_label
    );
    for (i, s) in series.iter().enumerate() {
        if !s.points.is_empty() {
            let mut d = String::new();
            for (j, &(x, y)) in s.points.iter().enumerate() {
                let _ = write!(
                    d,
                    "{}{:.1},{:.1}",
                    if j == 0 { "M" } else { " L" },
                    px(x),
                    py(y)
                );
            }
            let _ = writeln!(
                svg,
                "<path d=\"{d}\" fill=\"none\" stroke=\"{}\" stroke-width=\"1.5\"/>",
                s.color
            );
        }
        let ly = TOP + 10.0 + 18.0 * i as f64;
        let lx = W - RIGHT + 12.0;
        let _ = writeln!(
            svg,
            "<line x1=\"{lx}\" y1=\"{ly}\" x2=\"{:.1}\" y2=\"{ly}\" stroke=\"{}\" stroke-width=\"3\"/>\
             <text class=\"axis\" x=\"{:.1}\" y=\"{:.1}\">{}</text>",
            lx + 20.0,
            s.color,
            lx + 26.0,
            ly + 4.0,
            escape(&s.name)
        );
    }
    svg.push_str("</svg>\n");
    svg
}

/// The x axis's ticks over `[x0, x1]` (in axis units: decades on a log axis), with labels:
/// decades on a log axis, five even steps otherwise.
fn x_ticks(log: bool, x0: f64, x1: f64) -> Vec<(f64, String)> {
    if log {
        (x0 as i32..=x1 as i32)
            .map(|e| {
                let v = 10f64.powi(e);
                (
                    v,
                    if v >= 1.0 {
                        format!("{v:.0}")
                    } else {
                        format!("{v}")
                    },
                )
            })
            .collect()
    } else {
        nice_ticks(x0, x1)
            .into_iter()
            .map(|v| (v, short(v)))
            .collect()
    }
}

/// Ticks at round numbers (1, 2 or 5 times a power of ten apart), about five over `[lo, hi]`.
fn nice_ticks(lo: f64, hi: f64) -> Vec<f64> {
    let raw = (hi - lo) / 5.0;
    if !(raw.is_finite() && raw > 0.0) {
        return vec![lo];
    }
    let magnitude = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * magnitude)
        .find(|&s| s >= raw)
        .unwrap_or(10.0 * magnitude);
    let first = (lo / step).ceil() as i64;
    let last = (hi / step).floor() as i64;
    (first..=last).map(|i| i as f64 * step).collect()
}

/// A compact axis label.
fn short(v: f64) -> String {
    if v == 0.0 {
        "0".to_owned()
    } else if v.abs() >= 100.0 {
        format!("{v:.0}")
    } else if v.abs() >= 1.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

/// The markdown table as an HTML table.
fn table_html(markdown: &str) -> String {
    let mut out = String::from("<table>\n");
    for (i, line) in markdown.lines().enumerate() {
        if i == 1 {
            continue; // the alignment row
        }
        let tag = if i == 0 { "th" } else { "td" };
        out.push_str("<tr>");
        for cell in line.trim().trim_matches('|').split('|') {
            let _ = write!(out, "<{tag}>{}</{tag}>", escape(cell.trim()));
        }
        out.push_str("</tr>\n");
    }
    out.push_str("</table>\n");
    out
}

/// Escapes text for HTML element content and attribute values.
fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            _ => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests;
