//! Housekeeping statements: lease renewal, rescue of abandoned claims, expiry of overdue
//! queued jobs, retention, and operator requeue. None of these runs on the hot path; the
//! bulk ones work in bounded batches.

use uuid::Uuid;

use super::destinations::notify_wake;
use super::Pg;
use crate::job::Job;
use crate::rate::Micros;
use crate::store::plan::{check_dead_job_retry, RetryRow, EXPIRED_ERROR};
use crate::store::types::EnqueueError;
use crate::store::{Error, Result};

impl Pg {
    /// Extends the leases of every job `worker_id` holds to at least `now + margin_us`:
    /// the heartbeat that keeps a live dispatcher's slow requests from being rescued.
    pub async fn extend_leases(&self, worker_id: Uuid, margin_us: i64) -> Result<u64> {
        Ok(sqlx::query(
            "UPDATE sluice_jobs
                SET lease_until_us = greatest(lease_until_us, sluice_now_us() + $2)
              WHERE worker_id = $1 AND state = 'running'",
        )
        .bind(worker_id)
        .bind(margin_us)
        .execute(&self.pool)
        .await?
        .rows_affected())
    }

    /// Returns up to `limit` running jobs whose lease expired (their dispatcher died or
    /// lost the database for longer than the lease) to the queue. They keep their
    /// `run_at`, so they go back to the head of their line; the attempt counts (the
    /// request may have been sent). A job that has used its last attempt becomes dead.
    pub async fn rescue_expired_leases(&self, limit: i64) -> Result<u64> {
        let mut tx = self.pool.begin().await?;
        let rescued: Vec<(i64, String)> = sqlx::query_as(
            "WITH lost AS (
                 SELECT id FROM sluice_jobs
                  WHERE state = 'running' AND lease_until_us < sluice_now_us()
                  ORDER BY lease_until_us
                  LIMIT $1
                    FOR UPDATE SKIP LOCKED)
             UPDATE sluice_jobs j
                SET state = CASE WHEN j.attempts >= j.max_attempts THEN 'dead' ELSE 'queued' END,
                    last_error = 'lease expired: the dispatcher holding the job stopped responding',
                    worker_id = NULL, lease_until_us = NULL, slot_us = NULL,
                    updated_at_us = sluice_now_us(),
                    finished_at_us = CASE WHEN j.attempts >= j.max_attempts
                                          THEN sluice_now_us() END
               FROM lost WHERE j.id = lost.id
           RETURNING j.destination_id, j.state",
        )
        .bind(limit)
        .fetch_all(&mut *tx)
        .await?;
        if rescued.is_empty() {
            tx.commit().await?;
            return Ok(0);
        }
        let mut per_dest: std::collections::BTreeMap<i64, (i32, i32)> = Default::default();
        for (d, state) in &rescued {
            let e = per_dest.entry(*d).or_default();
            e.0 += 1;
            if state == "dead" {
                e.1 += 1;
            }
        }
        adjust_destinations(&mut tx, &per_dest).await?;
        notify_wake(&mut tx).await?;
        tx.commit().await?;
        Ok(rescued.len() as u64)
    }

    /// Expires up to `limit` queued jobs whose deadline has passed. The claim path
    /// expires jobs it meets; this catches jobs of paused or stalled destinations.
    pub async fn expire_overdue(&self, limit: i64) -> Result<u64> {
        let mut tx = self.pool.begin().await?;
        let expired: Vec<(i64,)> = sqlx::query_as(
            "WITH overdue AS (
                 SELECT id FROM sluice_jobs
                  WHERE state = 'queued' AND deadline_us < sluice_now_us()
                  ORDER BY deadline_us
                  LIMIT $1
                    FOR UPDATE SKIP LOCKED)
             UPDATE sluice_jobs j
                SET state = 'expired', finished_at_us = sluice_now_us(),
                    updated_at_us = sluice_now_us(),
                    last_error = $2
               FROM overdue WHERE j.id = overdue.id
           RETURNING j.destination_id",
        )
        .bind(limit)
        .bind(EXPIRED_ERROR)
        .fetch_all(&mut *tx)
        .await?;
        let mut per_dest: std::collections::BTreeMap<i64, (i32, i32)> = Default::default();
        for (d,) in &expired {
            let e = per_dest.entry(*d).or_default();
            e.1 += 1;
        }
        if !per_dest.is_empty() {
            // Expired jobs were queued, not running: only the backlog shrinks.
            sqlx::query(
                "SELECT 1 FROM sluice_destinations WHERE id = ANY($1) ORDER BY id FOR UPDATE",
            )
            .bind(per_dest.keys().copied().collect::<Vec<_>>())
            .execute(&mut *tx)
            .await?;
            let ids: Vec<i64> = per_dest.keys().copied().collect();
            let n: Vec<i32> = per_dest.values().map(|v| v.1).collect();
            sqlx::query(
                "UPDATE sluice_destinations d SET backlog = d.backlog - u.n
                   FROM unnest($1::bigint[], $2::int[]) AS u(id, n) WHERE d.id = u.id",
            )
            .bind(&ids)
            .bind(&n)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(expired.len() as u64)
    }

    /// Deletes up to `limit` finished jobs (succeeded, dead, cancelled, expired) that
    /// finished before `before_us`.
    pub async fn prune_finished(&self, before_us: Micros, limit: i64) -> Result<u64> {
        Ok(sqlx::query(
            "DELETE FROM sluice_jobs WHERE id IN (
                 SELECT id FROM sluice_jobs
                  WHERE finished_at_us < $1
                    AND state IN ('succeeded', 'dead', 'cancelled', 'expired')
                  ORDER BY finished_at_us
                  LIMIT $2)",
        )
        .bind(before_us)
        .bind(limit)
        .execute(&self.pool)
        .await?
        .rows_affected())
    }

    /// Reclaims the space of deleted and updated job rows (and the hot destination
    /// rows). Runs alongside normal traffic; needed even with autovacuum on, since a queue
    /// table churns faster than autovacuum's defaults, and essential where it is off.
    pub async fn vacuum(&self) -> Result<()> {
        sqlx::query("VACUUM (ANALYZE) sluice_jobs, sluice_destinations")
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Puts a dead job back in line with a fresh set of attempts, subject to the
    /// destination's capacity like any enqueue.
    pub async fn retry_dead_job(&self, id: Uuid) -> Result<Job, EnqueueError> {
        let mut tx = self.pool.begin().await?;
        let row: Option<RetryRow> = sqlx::query_as(
            "SELECT j.state, d.id, d.name, d.capacity, d.backlog, d.next_slot_us,
                    d.effective_interval_us, d.burst
               FROM sluice_jobs j JOIN sluice_destinations d ON d.id = j.destination_id
              WHERE j.id = $1
                FOR UPDATE OF j, d",
        )
        .bind(id)
        .fetch_optional(&mut *tx)
        .await?;
        let now: i64 = sqlx::query_scalar("SELECT sluice_now_us()")
            .fetch_one(&mut *tx)
            .await?;
        let dest = check_dead_job_retry(id, row, now)?;
        sqlx::query(
            "UPDATE sluice_jobs
                SET state = 'queued', attempts = 0, throttles = 0, finished_at_us = NULL,
                    run_at_us = sluice_now_us(), updated_at_us = sluice_now_us()
              WHERE id = $1",
        )
        .bind(id)
        .execute(&mut *tx)
        .await?;
        sqlx::query(
            "UPDATE sluice_destinations
                SET backlog = backlog + 1,
                    due_at_us = sluice_due_at(id, next_slot_us, effective_interval_us, burst,
                                              in_flight, max_in_flight)
              WHERE id = $1",
        )
        .bind(dest)
        .execute(&mut *tx)
        .await?;
        notify_wake(&mut tx).await?;
        tx.commit().await?;
        self.get_job(id)
            .await?
            .ok_or_else(|| Error::UnknownJob(id).into())
    }
}

/// Applies rescued jobs to destination counters: all leave `running`
/// (`in_flight -= n`); the dead ones also leave the backlog.
async fn adjust_destinations(
    conn: &mut sqlx::PgConnection,
    per_dest: &std::collections::BTreeMap<i64, (i32, i32)>,
) -> Result<()> {
    let ids: Vec<i64> = per_dest.keys().copied().collect();
    let running: Vec<i32> = per_dest.values().map(|v| v.0).collect();
    let dead: Vec<i32> = per_dest.values().map(|v| v.1).collect();
    sqlx::query("SELECT 1 FROM sluice_destinations WHERE id = ANY($1) ORDER BY id FOR UPDATE")
        .bind(&ids)
        .execute(&mut *conn)
        .await?;
    sqlx::query(
        "UPDATE sluice_destinations d
            SET in_flight = d.in_flight - u.running, backlog = d.backlog - u.dead
           FROM unnest($1::bigint[], $2::int[], $3::int[]) AS u(id, running, dead)
          WHERE d.id = u.id",
    )
    .bind(&ids)
    .bind(&running)
    .bind(&dead)
    .execute(&mut *conn)
    .await?;
    super::refresh_due(conn, &ids).await?;
    Ok(())
}
