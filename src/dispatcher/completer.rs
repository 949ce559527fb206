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
/// A failed write is retried with backoff (the database may be restarting); only `stop`
/// (a hard shutdown) gives up, leaving those jobs to lease expiry.
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
            match rx.recv().await {
                Some(c) => buf.push(c),
                None => return,
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
                Err(e) => {
                    tracing::warn!(error = %e, jobs = buf.len(), retry_in_ms = backoff.as_millis() as u64,
                        "cannot record outcomes; retrying");
                    tokio::select! {
                        // The channel closing is not a reason to give up: the outcomes
                        // in hand must still be written. Only a hard stop is.
                        _ = stop.cancelled(), if rx.is_closed() => {
                            tracing::error!(jobs = buf.len(), "giving up on outcomes; their leases will expire and they will be retried");
                            return;
                        }
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
