//! The progress bar on stderr: shown only to a person watching a terminal, never in CI logs or
//! when stderr is redirected, so captured output stays clean.

use std::io::IsTerminal;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// A bar over `total` routed requests, or a hidden one when nobody is watching.
pub(crate) fn bar(total: u64) -> ProgressBar {
    let watched = std::io::stderr().is_terminal() && std::env::var_os("CI").is_none();
    if !watched {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
    if let Ok(style) = ProgressStyle::with_template(
        "{spinner} replaying [{elapsed_precise}] {wide_bar} {pos}/{len} requests (eta {eta})",
    ) {
        bar.set_style(style);
    }
    bar
}
