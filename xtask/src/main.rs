//! Project automation for kvroute, run as `cargo xtask <command>`.
fn main() {}
