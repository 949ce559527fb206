//! Maintenance: lease rescue, expiry of overdue queued jobs, and retention.
//!
//! Every dispatcher process runs a [`Maintenance`] service, but only the one holding a
//! PostgreSQL session advisory lock ([`store::MAINTENANCE_LOCK_KEY`]) does the work (on
//! the embedded store, the one dispatching process leads). The lock
//! lives on a dedicated connection: when the leader dies, PostgreSQL sees its connection
//! close and releases the lock, and another process takes over on its next attempt
//! (within `maintenance.interval_ms`).

use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use crate::config::MaintenanceConfig;
use crate::store::{self, Store};

/// What one maintenance pass did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Report {
    /// Claims returned to the queue (or dead-lettered) after their lease expired.
    pub rescued: u64,
    /// Queued jobs expired at their deadline.
    pub expired: u64,
    /// Finished jobs deleted by retention.
    pub pruned: u64,
    /// Whether the pass vacuumed the jobs table.
    pub vacuumed: bool,
}

/// The maintenance service of one process.
#[derive(Debug, Clone)]
pub struct Maintenance {
    store: Store,
    config: MaintenanceConfig,
    /// After taking the lead (or after the database comes back) the leader waits this
    /// long before rescuing leases, so live dispatchers get to renew theirs first.
    rescue_grace: Duration,
    /// Rows pruned since the last VACUUM.
    pruned_since_vacuum: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

/// Share of the interval a pass may spend pruning. Batches are small statements, so the
/// hot path never waits behind a long delete; spending up to half the interval lets
/// retention keep pace with tens of thousands of jobs per second.
const PRUNE_SHARE_OF_INTERVAL: u32 = 2;

impl Maintenance {
    /// A service for `store`; `lease_margin` is the dispatchers' lease margin.
    pub fn new(store: Store, config: MaintenanceConfig, lease_margin: Duration) -> Self {
        Self {
            store,
            config,
            rescue_grace: lease_margin,
            pruned_since_vacuum: Default::default(),
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
        let budget = Duration::from_millis(self.config.interval_ms) / PRUNE_SHARE_OF_INTERVAL;
        let started = Instant::now();
        loop {
            let n = self.store.prune_finished(cutoff, batch).await?;
            report.pruned += n;
            if n < batch as u64 || started.elapsed() >= budget {
                break;
            }
            tokio::task::yield_now().await;
        }
        let since = self
            .pruned_since_vacuum
            .fetch_add(report.pruned, std::sync::atomic::Ordering::Relaxed)
            + report.pruned;
        if self.config.vacuum_after_rows > 0 && since >= self.config.vacuum_after_rows {
            self.store.vacuum().await?;
            self.pruned_since_vacuum
                .store(0, std::sync::atomic::Ordering::Relaxed);
            report.vacuumed = true;
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
                    if failures == 1 || failures.is_multiple_of(30) {
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
        let mut leadership = loop {
            if let Some(l) = self.store.try_lead().await? {
                break l;
            }
            tokio::select! {
                _ = cancel.cancelled() => return Ok(()),
                _ = tokio::time::sleep(interval) => {}
            }
        };
        tracing::info!("maintenance: this process is the leader");
        let since = Instant::now();
        let result = loop {
            // On PostgreSQL the lock is only ours while its connection lives.
            if let Err(e) = leadership.check().await {
                break Err(e);
            }
            let rescue = since.elapsed() >= self.rescue_grace;
            match self.run_once(rescue).await {
                Ok(r) if r != Report::default() => {
                    tracing::info!(
                        rescued = r.rescued,
                        expired = r.expired,
                        pruned = r.pruned,
                        vacuumed = r.vacuumed,
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
        leadership.release().await;
        tracing::info!("maintenance: leadership released");
        result
    }
}
