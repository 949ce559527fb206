//! Job lookups and operator actions on single jobs.

use sqlx::types::Json;
use sqlx::FromRow;
use uuid::Uuid;

use super::{Error, Result, Store};
use crate::job::{Job, JobState};

/// Filters for [`Store::list_jobs`].
#[derive(Debug, Clone, Default)]
pub struct JobFilter {
    /// Only jobs of this destination.
    pub destination: Option<String>,
    /// Only jobs in this state.
    pub state: Option<JobState>,
    /// At most this many (newest first); capped at 1000.
    pub limit: Option<u32>,
}

#[derive(FromRow)]
struct JobRow {
    id: Uuid,
    destination: String,
    state: String,
    method: String,
    url: String,
    headers: Json<Vec<(String, String)>>,
    body_bytes: i64,
    idempotency_key: Option<String>,
    attempts: i32,
    max_attempts: i32,
    throttles: i32,
    last_retry_after_ms: Option<i64>,
    run_at_us: i64,
    deadline_us: Option<i64>,
    slot_us: Option<i64>,
    last_status: Option<i32>,
    last_error: Option<String>,
    response_snippet: Option<String>,
    created_at_us: i64,
    updated_at_us: i64,
    finished_at_us: Option<i64>,
}

impl From<JobRow> for Job {
    fn from(r: JobRow) -> Self {
        Job {
            id: r.id,
            destination: r.destination,
            // The CHECK constraint admits only known states.
            state: r.state.parse().unwrap_or(JobState::Queued),
            method: r.method,
            url: r.url,
            headers: r.headers.0,
            body_bytes: r.body_bytes,
            idempotency_key: r.idempotency_key,
            attempts: r.attempts,
            max_attempts: r.max_attempts,
            throttles: r.throttles,
            last_retry_after_ms: r.last_retry_after_ms,
            run_at: r.run_at_us,
            deadline: r.deadline_us,
            slot: r.slot_us,
            last_status: r.last_status,
            last_error: r.last_error,
            response_snippet: r.response_snippet,
            created_at: r.created_at_us,
            updated_at: r.updated_at_us,
            finished_at: r.finished_at_us,
        }
    }
}

macro_rules! job_select {
    () => {
        "SELECT j.id, d.name AS destination, j.state, j.method, j.url, j.headers,
                coalesce(octet_length(j.body), 0)::bigint AS body_bytes, j.idempotency_key,
                j.attempts, j.max_attempts, j.throttles, j.last_retry_after_ms, j.run_at_us, j.deadline_us, j.slot_us,
                j.last_status, j.last_error, j.response_snippet, j.created_at_us,
                j.updated_at_us, j.finished_at_us
           FROM sluice_jobs j JOIN sluice_destinations d ON d.id = j.destination_id "
    };
}

impl Store {
    /// One job by id.
    pub async fn get_job(&self, id: Uuid) -> Result<Option<Job>> {
        let row: Option<JobRow> = sqlx::query_as(concat!(job_select!(), "WHERE j.id = $1"))
            .bind(id)
            .fetch_optional(&self.pool)
            .await?;
        Ok(row.map(Job::from))
    }

    /// Jobs matching `filter`, newest first.
    pub async fn list_jobs(&self, filter: &JobFilter) -> Result<Vec<Job>> {
        let limit = i64::from(filter.limit.unwrap_or(100).min(1_000));
        let rows: Vec<JobRow> = sqlx::query_as(concat!(
            job_select!(),
            "WHERE ($1::text IS NULL OR d.name = $1)
               AND ($2::text IS NULL OR j.state = $2)
             ORDER BY j.id DESC LIMIT $3"
        ))
        .bind(filter.destination.as_deref())
        .bind(filter.state.map(JobState::as_str))
        .bind(limit)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows.into_iter().map(Job::from).collect())
    }

    /// Cancels a queued job, freeing its place in the destination's capacity.
    /// Fails with [`Error::WrongState`] once the job was claimed or finished.
    pub async fn cancel_job(&self, id: Uuid) -> Result<Job> {
        let cancelled: Option<i64> = sqlx::query_scalar(
            "WITH c AS (
                 UPDATE sluice_jobs
                    SET state = 'cancelled', finished_at_us = sluice_now_us(),
                        updated_at_us = sluice_now_us()
                  WHERE id = $1 AND state = 'queued'
              RETURNING destination_id)
             UPDATE sluice_destinations d SET backlog = backlog - 1
               FROM c WHERE d.id = c.destination_id
             RETURNING d.id",
        )
        .bind(id)
        .fetch_optional(&self.pool)
        .await?;
        let job = self.get_job(id).await?.ok_or(Error::UnknownJob(id))?;
        if cancelled.is_none() {
            return Err(Error::WrongState {
                id,
                state: job.state,
                expected: "queued",
            });
        }
        Ok(job)
    }
}
