//! What the reference benches share: their Markdown tables (names left, figures right), number
//! formatting, and where cargo builds.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{Context as _, Result};

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

/// Rounded to a whole number with thousands separators: `2,048`.
pub(crate) fn thousands(v: f64) -> String {
    let digits = format!("{:.0}", v.max(0.0));
    let mut out = String::new();
    for (i, ch) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(ch);
    }
    out
}

/// Where cargo puts build outputs for this workspace (`CARGO_TARGET_DIR`, config or default).
pub(crate) fn target_directory(root: &Path) -> Result<PathBuf> {
    let metadata = cargo_metadata::MetadataCommand::new()
        .manifest_path(root.join("Cargo.toml"))
        .no_deps()
        .exec()
        .context("running cargo metadata to find the target directory")?;
    Ok(metadata.target_directory.into_std_path_buf())
}
