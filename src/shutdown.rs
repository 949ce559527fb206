//! Signals → a `CancellationToken`.
//!
//! The first SIGINT or SIGTERM cancels the root token: every subsystem holds a child
//! token and stops gracefully. A second signal exits at once; whatever was in flight is
//! recovered later by lease expiry.

use tokio_util::sync::CancellationToken;

/// Exit status after a second signal (128 + SIGINT, as shells report it).
pub const FORCED_EXIT_CODE: i32 = 130;

/// Spawns the signal watcher and returns the root token it cancels.
pub fn install() -> CancellationToken {
    let root = CancellationToken::new();
    let token = root.clone();
    tokio::spawn(async move {
        wait_for_signal().await;
        tracing::info!("shutdown requested; finishing in-flight work (signal again to exit now)");
        token.cancel();
        wait_for_signal().await;
        tracing::warn!("second signal: exiting now");
        std::process::exit(FORCED_EXIT_CODE);
    });
    root
}

async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
