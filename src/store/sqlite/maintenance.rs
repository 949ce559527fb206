//! Housekeeping on the embedded store: leases, rescue after a crash (the only way a
//! single process loses claims), expiry, retention, requeue.

use uuid::Uuid;

use super::{expire_job, now, refresh_due, Sqlite};
use crate::job::Job;
use crate::rate::Micros;
use crate::store::plan::{check_dead_job_retry, RetryRow};
use crate::store::types::EnqueueError;
use crate::store::{Error, Notice, Result};

/// A dead job's state and its destination's admission figures.
impl Sqlite {
    pub(crate) async fn extend_leases(&self, worker_id: Uuid, margin_us: i64) -> Result<u64> {
        Ok(sqlx::query(
            "UPDATE sluice_jobs SET lease_until_us = max(lease_until_us, ?2 + ?3)
              WHERE worker_id = ?1 AND state = 'running'",
        )
        .bind(worker_id)
        .bind(now())
        .bind(margin_us)
        .execute(&self.pool)
        .await?
        .rows_affected())
    }

    pub(crate) async fn rescue_expired_leases(&self, limit: i64) -> Result<u64> {
        let at = now();
        let mut tx = self.write_tx().await?;
        let lost: Vec<(Uuid, i64, i32, i32)> = sqlx::query_as(
            "SELECT id, destination_id, attempts, max_attempts FROM sluice_jobs
              WHERE state = 'running' AND lease_until_us < ?1
              ORDER BY lease_until_us LIMIT ?2",
        )
        .bind(at)
        .bind(limit)
        .fetch_all(&mut *tx)
        .await?;
        let mut touched = std::collections::BTreeSet::new();
        for (id, dest, attempts, max_attempts) in &lost {
            let dead = attempts >= max_attempts;
            sqlx::query(
                "UPDATE sluice_jobs
                    SET state = ?2,
                        last_error = 'lease expired: the dispatcher holding the job stopped responding',
                        worker_id = NULL, lease_until_us = NULL, slot_us = NULL, updated_at_us = ?3,
                        finished_at_us = CASE WHEN ?2 = 'dead' THEN ?3 END
                  WHERE id = ?1",
            )
            .bind(id)
            .bind(if dead { "dead" } else { "queued" })
            .bind(at)
            .execute(&mut *tx)
            .await?;
            sqlx::query(
                "UPDATE sluice_destinations SET in_flight = in_flight - 1, backlog = backlog - ?2
                  WHERE id = ?1",
            )
            .bind(dest)
            .bind(i64::from(dead))
            .execute(&mut *tx)
            .await?;
            touched.insert(*dest);
        }
        for dest in touched {
            refresh_due(&mut tx, dest).await?;
        }
        tx.commit().await?;
        if !lost.is_empty() {
            self.notify(Notice::Wake);
        }
        Ok(lost.len() as u64)
    }

    pub(crate) async fn expire_overdue(&self, limit: i64) -> Result<u64> {
        let at = now();
        let mut tx = self.write_tx().await?;
        let overdue: Vec<(Uuid, i64)> = sqlx::query_as(
            "SELECT id, destination_id FROM sluice_jobs
              WHERE state = 'queued' AND deadline_us < ?1 ORDER BY deadline_us LIMIT ?2",
        )
        .bind(at)
        .bind(limit)
        .fetch_all(&mut *tx)
        .await?;
        for (id, dest) in &overdue {
            expire_job(&mut tx, *id, at).await?;
            sqlx::query("UPDATE sluice_destinations SET backlog = backlog - 1 WHERE id = ?1")
                .bind(dest)
                .execute(&mut *tx)
                .await?;
            refresh_due(&mut tx, *dest).await?;
        }
        tx.commit().await?;
        Ok(overdue.len() as u64)
    }

    pub(crate) async fn prune_finished(&self, before_us: Micros, limit: i64) -> Result<u64> {
        Ok(sqlx::query(
            "DELETE FROM sluice_jobs WHERE id IN (
                 SELECT id FROM sluice_jobs
                  WHERE finished_at_us < ?1
                    AND state IN ('succeeded', 'dead', 'cancelled', 'expired')
                  ORDER BY finished_at_us LIMIT ?2)",
        )
        .bind(before_us)
        .bind(limit)
        .execute(&self.pool)
        .await?
        .rows_affected())
    }

    /// Checkpoints the write-ahead log so the file does not grow between automatic
    /// checkpoints; SQLite reuses freed pages by itself.
    pub(crate) async fn vacuum(&self) -> Result<()> {
        sqlx::query("PRAGMA wal_checkpoint(TRUNCATE)")
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    pub(crate) async fn retry_dead_job(&self, id: Uuid) -> Result<Job, EnqueueError> {
        let at = now();
        let mut tx = self.write_tx().await?;
        let row: Option<RetryRow> = sqlx::query_as(
            "SELECT j.state, d.id, d.name, d.capacity, d.backlog, d.next_slot_us,
                    d.effective_interval_us, d.burst
               FROM sluice_jobs j JOIN sluice_destinations d ON d.id = j.destination_id
              WHERE j.id = ?1",
        )
        .bind(id)
        .fetch_optional(&mut *tx)
        .await?;
        let dest = check_dead_job_retry(id, row, at)?;
        sqlx::query(
            "UPDATE sluice_jobs
                SET state = 'queued', attempts = 0, throttles = 0, finished_at_us = NULL,
                    run_at_us = ?2, updated_at_us = ?2
              WHERE id = ?1",
        )
        .bind(id)
        .bind(at)
        .execute(&mut *tx)
        .await?;
        sqlx::query("UPDATE sluice_destinations SET backlog = backlog + 1 WHERE id = ?1")
            .bind(dest)
            .execute(&mut *tx)
            .await?;
        refresh_due(&mut tx, dest).await?;
        tx.commit().await?;
        self.notify(Notice::Wake);
        self.get_job(id)
            .await?
            .ok_or_else(|| Error::UnknownJob(id).into())
    }
}
