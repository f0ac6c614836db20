//! Side-by-side tables the reference benches print: Markdown, names left, figures right.

use std::fmt::Write as _;

/// `lines` (the header first) as a Markdown table whose first `names` columns are left-aligned
/// and the rest right-aligned, each column as wide as its widest cell.
pub(crate) fn markdown<const N: usize>(lines: &[[String; N]], names: usize) -> String {
    let widths: Vec<usize> = (0..N)
        .map(|c| {
            lines
                .iter()
                .map(|l| l[c].chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    for (i, line) in lines.iter().enumerate() {
        out.push('|');
        for (c, cell) in line.iter().enumerate() {
            if c < names {
                let _ = write!(out, " {cell:<w$} |", w = widths[c]);
            } else {
                let _ = write!(out, " {cell:>w$} |", w = widths[c]);
            }
        }
        out.push('\n');
        if i == 0 {
            out.push('|');
            for (c, w) in widths.iter().enumerate() {
                let dashes = "-".repeat(*w);
                if c < names {
                    let _ = write!(out, " {dashes} |");
                } else {
                    let _ = write!(out, " {}: |", &dashes[..w.saturating_sub(1)]);
                }
            }
            out.push('\n');
        }
    }
    out
}
