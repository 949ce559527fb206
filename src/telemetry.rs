//! Logging setup: human-readable lines on stderr, filtered by `RUST_LOG`
//! (default `info`, with sqlx's per-statement logs kept at `warn`).

use std::io::IsTerminal as _;

use tracing_subscriber::EnvFilter;

/// Installs the global subscriber. Safe to call more than once (later calls are no-ops).
pub fn init() {
    init_with_default("info,sqlx=warn,hyper=warn,reqwest=warn");
}

/// Like [`init`], with another default filter when `RUST_LOG` is unset.
pub fn init_with_default(default: &str) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .with_ansi(std::io::stderr().is_terminal())
        .try_init();
}
