//! Job lookups and operator actions on the embedded store.

use uuid::Uuid;

use super::{now, Sqlite};
use crate::job::{Job, JobState};
use crate::store::types::{JobFilter, JobRow};
use crate::store::{CounterAudit, Error, Result};

macro_rules! job_select {
    () => {
        "SELECT j.id, d.name AS destination, j.state, j.method, j.url, j.headers,
                coalesce(length(j.body), 0) AS body_bytes, j.idempotency_key,
                j.attempts, j.max_attempts, j.throttles, j.last_retry_after_ms, j.run_at_us,
                j.deadline_us, j.slot_us, j.last_status, j.last_error, j.response_snippet,
                j.created_at_us, j.updated_at_us, j.finished_at_us
           FROM sluice_jobs j JOIN sluice_destinations d ON d.id = j.destination_id "
    };
}

impl Sqlite {
    pub(crate) async fn get_job(&self, id: Uuid) -> Result<Option<Job>> {
        let row: Option<JobRow> = sqlx::query_as(concat!(job_select!(), "WHERE j.id = ?1"))
            .bind(id)
            .fetch_optional(&self.pool)
            .await?;
        Ok(row.map(Job::from))
    }

    pub(crate) async fn list_jobs(&self, filter: &JobFilter) -> Result<Vec<Job>> {
        let limit = i64::from(filter.limit.unwrap_or(100).min(1_000));
        let rows: Vec<JobRow> = sqlx::query_as(concat!(
            job_select!(),
            "WHERE (?1 IS NULL OR d.name = ?1) AND (?2 IS NULL OR j.state = ?2)
             ORDER BY j.id DESC LIMIT ?3"
        ))
        .bind(filter.destination.as_deref())
        .bind(filter.state.map(JobState::as_str))
        .bind(limit)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows.into_iter().map(Job::from).collect())
    }

    pub(crate) async fn cancel_job(&self, id: Uuid) -> Result<Job> {
        let at = now();
        let mut tx = self.write_tx().await?;
        let dest: Option<i64> = sqlx::query_scalar(
            "UPDATE sluice_jobs SET state = 'cancelled', finished_at_us = ?2, updated_at_us = ?2
              WHERE id = ?1 AND state = 'queued'
          RETURNING destination_id",
        )
        .bind(id)
        .bind(at)
        .fetch_optional(&mut *tx)
        .await?;
        if let Some(d) = dest {
            sqlx::query("UPDATE sluice_destinations SET backlog = backlog - 1 WHERE id = ?1")
                .bind(d)
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        let job = self.get_job(id).await?.ok_or(Error::UnknownJob(id))?;
        if dest.is_none() {
            return Err(Error::WrongState {
                id,
                state: job.state,
                expected: "queued",
            });
        }
        Ok(job)
    }

    pub(crate) async fn job_counts(&self) -> Result<Vec<(String, i64)>> {
        Ok(
            sqlx::query_as("SELECT state, count(*) FROM sluice_jobs GROUP BY state")
                .fetch_all(&self.pool)
                .await?,
        )
    }

    pub(crate) async fn audit(&self) -> Result<Vec<CounterAudit>> {
        Ok(sqlx::query_as(
            "SELECT * FROM (
                SELECT d.name, d.backlog,
                       (SELECT count(*) FROM sluice_jobs j WHERE j.destination_id = d.id
                           AND j.state IN ('queued', 'running')) AS open,
                       d.in_flight,
                       (SELECT count(*) FROM sluice_jobs j WHERE j.destination_id = d.id
                           AND j.state = 'running') AS running
                  FROM sluice_destinations d)
              WHERE backlog <> open OR in_flight <> running",
        )
        .fetch_all(&self.pool)
        .await?)
    }
}
