//! Maintenance: lease rescue, expiry of overdue queued jobs, and retention.
//!
//! Every dispatcher process runs a [`Maintenance`] service, but only the one holding a
//! PostgreSQL session advisory lock ([`MAINTENANCE_LOCK_KEY`]) does the work. The lock
//! lives on a dedicated connection: when the leader dies, PostgreSQL sees its connection
//! close and releases the lock, and another process takes over on its next attempt
//! (within `maintenance.interval_ms`).

use std::time::{Duration, Instant};

use sqlx::{Connection as _, PgConnection};
use tokio_util::sync::CancellationToken;

use crate::config::MaintenanceConfig;
use crate::store::{self, Store, MAINTENANCE_LOCK_KEY};

/// What one maintenance pass did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Report {
    /// Claims returned to the queue (or dead-lettered) after their lease expired.
    pub rescued: u64,
    /// Queued jobs expired at their deadline.
    pub expired: u64,
    /// Finished jobs deleted by retention.
    pub pruned: u64,
}

/// The maintenance service of one process.
#[derive(Debug, Clone)]
pub struct Maintenance {
    store: Store,
    config: MaintenanceConfig,
    /// After taking the lead (or after the database comes back) the leader waits this
    /// long before rescuing leases, so live dispatchers get to renew theirs first.
    rescue_grace: Duration,
}

/// Most batches pruned per pass: retention catches up over several passes instead of
/// holding the database in one long delete.
const PRUNE_BATCHES_PER_PASS: u32 = 10;

impl Maintenance {
    /// A service for `store`; `lease_margin` is the dispatchers' lease margin.
    pub fn new(store: Store, config: MaintenanceConfig, lease_margin: Duration) -> Self {
        Self {
            store,
            config,
            rescue_grace: lease_margin,
        }
    }

    /// One pass: rescue, expire, prune. The caller must hold the maintenance lock (or be
    /// a test); running it twice at once is safe (the statements skip locked rows) but
    /// wasteful.
    pub async fn run_once(&self, rescue: bool) -> store::Result<Report> {
        let batch = i64::from(self.config.batch);
        let mut report = Report::default();
        if rescue {
            report.rescued = self.store.rescue_expired_leases(batch).await?;
        }
        report.expired = self.store.expire_overdue(batch).await?;
        let retention_us = i64::try_from(self.config.retention_hours)
            .unwrap_or(i64::MAX / 3_600_000_000)
            .saturating_mul(3_600_000_000);
        let cutoff = self.store.now_us().await?.saturating_sub(retention_us);
        for _ in 0..PRUNE_BATCHES_PER_PASS {
            let n = self.store.prune_finished(cutoff, batch).await?;
            report.pruned += n;
            if n < batch as u64 {
                break;
            }
            tokio::task::yield_now().await;
        }
        Ok(report)
    }

    /// Competes for the maintenance lock until `cancel`; while holding it, runs a pass
    /// every `interval_ms`.
    pub async fn run(self, cancel: CancellationToken) {
        let interval = Duration::from_millis(self.config.interval_ms);
        let mut failures = 0u32;
        while !cancel.is_cancelled() {
            match self.lead(&cancel, interval).await {
                Ok(()) => failures = 0,
                Err(e) => {
                    failures += 1;
                    if failures == 1 || failures % 30 == 0 {
                        tracing::warn!(error = %e, "maintenance: database unavailable; retrying");
                    }
                }
            }
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(interval) => {}
            }
        }
    }

    /// Tries to take the lock; if it gets it, leads until the connection breaks or
    /// `cancel`. Returns `Ok` when another process holds the lock.
    async fn lead(&self, cancel: &CancellationToken, interval: Duration) -> store::Result<()> {
        let options = self.store.pool().connect_options();
        let mut conn = PgConnection::connect_with(&options).await?;
        loop {
            let got: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
                .bind(MAINTENANCE_LOCK_KEY)
                .fetch_one(&mut conn)
                .await?;
            if got {
                break;
            }
            tokio::select! {
                _ = cancel.cancelled() => return Ok(()),
                _ = tokio::time::sleep(interval) => {}
            }
        }
        tracing::info!("maintenance: this process is the leader");
        let since = Instant::now();
        let result = loop {
            // The lock is only ours while this connection lives.
            if let Err(e) = sqlx::query("SELECT 1").execute(&mut conn).await {
                break Err(e.into());
            }
            let rescue = since.elapsed() >= self.rescue_grace;
            match self.run_once(rescue).await {
                Ok(r) if r != Report::default() => {
                    tracing::info!(
                        rescued = r.rescued,
                        expired = r.expired,
                        pruned = r.pruned,
                        "maintenance pass"
                    );
                }
                Ok(_) => {}
                Err(e) => break Err(e),
            }
            tokio::select! {
                _ = cancel.cancelled() => break Ok(()),
                _ = tokio::time::sleep(interval) => {}
            }
        };
        // Closing the connection releases the lock for the next leader.
        let _ = conn.close().await;
        tracing::info!("maintenance: leadership released");
        result
    }
}
