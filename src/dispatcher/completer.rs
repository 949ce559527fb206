//! Writes outcomes in batches: everything that finished while the previous batch was
//! being written goes into the next transaction, so completion cost per job falls as
//! throughput rises.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, Notify};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::metrics::Metrics;
use crate::store::{Completion, Store};

/// Runs until the channel closes (all job tasks finished) and the last batch is written.
/// A failed write is retried with backoff (the database may be restarting). After `stop`
/// (the shutdown's flush deadline) it makes one last attempt with what it holds and
/// exits; outcomes it could not write are recovered by lease expiry (at-least-once).
pub(super) async fn run(
    store: Store,
    worker_id: Uuid,
    mut rx: mpsc::UnboundedReceiver<Completion>,
    batch: usize,
    wake: Arc<Notify>,
    metrics: Arc<Metrics>,
    stop: CancellationToken,
) {
    let mut buf: Vec<Completion> = Vec::with_capacity(batch);
    loop {
        if buf.is_empty() {
            tokio::select! {
                c = rx.recv() => match c {
                    Some(c) => buf.push(c),
                    None => return,
                },
                _ = stop.cancelled() => {
                    while let Ok(c) = rx.try_recv() {
                        buf.push(c);
                    }
                    if buf.is_empty() {
                        return;
                    }
                }
            }
        }
        while buf.len() < batch {
            match rx.try_recv() {
                Ok(c) => buf.push(c),
                Err(_) => break,
            }
        }
        let mut backoff = Duration::from_millis(50);
        loop {
            match store.complete(worker_id, &buf).await {
                Ok(()) => break,
                Err(e) if stop.is_cancelled() => {
                    tracing::error!(error = %e, jobs = buf.len(),
                        "shutting down without recording these outcomes; their leases will expire and they will be retried");
                    return;
                }
                Err(e) => {
                    tracing::warn!(error = %e, jobs = buf.len(), retry_in_ms = backoff.as_millis() as u64,
                        "cannot record outcomes; retrying");
                    tokio::select! {
                        _ = stop.cancelled() => {}
                        _ = tokio::time::sleep(backoff) => {}
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                }
            }
        }
        Metrics::inc(&metrics.completion_batches);
        buf.clear();
        wake.notify_one();
    }
}
