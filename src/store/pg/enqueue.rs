//! Admission: the enqueue path. Capacity is checked and the jobs inserted under the
//! destination's row lock, in one transaction, so waiting jobs never exceed capacity
//! whatever the concurrency (DESIGN invariant 3), and a repeated idempotency key finds the
//! earlier job even when the two requests race.

use std::collections::HashMap;

use sqlx::types::Json;
use sqlx::PgConnection;
use uuid::Uuid;

use super::destinations::notify_wake;
use super::Pg;
use crate::destination::FieldError;
use crate::job::{JobState, NewJob};
use crate::store::group::{unknown_destination, Group, GroupResults};
use crate::store::plan::{
    check_url, decide_admission, field_name, run_at, AdmissionDecision, AdmissionDest,
};
use crate::store::types::{Admission, Admitted, EnqueueError};
use crate::store::{Error, Result};

#[derive(sqlx::FromRow)]
struct LockedDestination {
    id: i64,
    capacity: i64,
    backlog: i64,
    next_slot_us: i64,
    interval_us: i64,
    burst: i32,
    max_attempts: i32,
    allowed_base_urls: Vec<String>,
    due_at_us: Option<i64>,
    now_us: i64,
}

impl Pg {
    /// Admits `jobs` to destination `name`, all or nothing, in its own transaction.
    pub async fn enqueue(
        &self,
        name: &str,
        jobs: &[NewJob],
    ) -> Result<Vec<Admitted>, EnqueueError> {
        let mut tx = self.pool.begin().await?;
        let result = enqueue_in(&mut tx, name, jobs).await;
        match &result {
            // A rejection still commits: it counted the rejection and wrote nothing else.
            Ok(_) | Err(EnqueueError::Full { .. }) => tx.commit().await?,
            Err(_) => tx.rollback().await?,
        }
        result
    }

    /// Admits a group of single enqueues in one transaction, each job on its own: the
    /// destinations are locked in id order first (like every multi-destination statement,
    /// so groups cannot deadlock), then admitted one after another.
    pub(crate) async fn admit_group(&self, group: &Group) -> Result<GroupResults, EnqueueError> {
        let mut tx = self.pool.begin().await?;
        let names: Vec<&str> = group.keys().map(String::as_str).collect();
        sqlx::query(
            "SELECT 1 FROM sluice_destinations WHERE name = ANY($1) ORDER BY id FOR UPDATE",
        )
        .bind(&names)
        .execute(&mut *tx)
        .await?;
        let mut results = Vec::with_capacity(group.len());
        for (name, jobs) in group {
            match admit(&mut tx, name, jobs, Admission::EachJob).await {
                Ok(r) => results.push(r),
                Err(EnqueueError::Store(Error::UnknownDestination(n))) => {
                    results.push(unknown_destination(&n, jobs))
                }
                Err(e) => return Err(e),
            }
        }
        tx.commit().await?;
        Ok(results)
    }
}

/// Admits `jobs` inside the caller's transaction: the jobs exist only if it commits.
/// All or nothing: if any job is invalid or the destination has no room for all of them,
/// nothing is admitted.
///
/// Holds the destination's row lock until the transaction ends, which serialises
/// admissions to that destination: keep the transaction short.
pub async fn enqueue_in(
    conn: &mut PgConnection,
    name: &str,
    jobs: &[NewJob],
) -> Result<Vec<Admitted>, EnqueueError> {
    admit(conn, name, jobs, Admission::AllOrNothing)
        .await?
        .into_iter()
        .collect()
}

/// Admits `jobs` to destination `name` under its row lock. Returns one result per job;
/// an `Err` for the whole call means nothing was decided (unknown destination, database
/// failure). With [`Admission::AllOrNothing`] the per-job results are either all `Ok` or
/// all the same error.
pub(crate) async fn admit(
    conn: &mut PgConnection,
    name: &str,
    jobs: &[NewJob],
    mode: Admission,
) -> Result<Vec<Result<Admitted, EnqueueError>>, EnqueueError> {
    let dest: LockedDestination = sqlx::query_as(
        "SELECT id, capacity, backlog, next_slot_us, effective_interval_us AS interval_us,
                burst, max_attempts,
                allowed_base_urls, due_at_us, sluice_now_us() AS now_us
           FROM sluice_destinations WHERE name = $1 FOR UPDATE",
    )
    .bind(name)
    .fetch_optional(&mut *conn)
    .await?
    .ok_or_else(|| Error::UnknownDestination(name.to_owned()))?;

    let url_errors: Vec<Option<FieldError>> = jobs
        .iter()
        .enumerate()
        .map(|(i, j)| check_url(j, &dest.allowed_base_urls, field_name(jobs.len(), i, mode)))
        .collect();
    if mode == Admission::AllOrNothing {
        if let Some(e) = url_errors.iter().flatten().next() {
            return Err(Error::InvalidJob(e.clone()).into());
        }
    }

    // Idempotency: existing jobs with these keys, then repeats within this request.
    let keys: Vec<&str> = jobs
        .iter()
        .zip(&url_errors)
        .filter(|(_, e)| e.is_none())
        .filter_map(|(j, _)| j.idempotency_key.as_deref())
        .collect();
    let mut known: HashMap<String, (Uuid, JobState)> = HashMap::new();
    if !keys.is_empty() {
        let rows: Vec<(String, Uuid, String)> = sqlx::query_as(
            "SELECT idempotency_key, id, state FROM sluice_jobs
              WHERE destination_id = $1 AND idempotency_key = ANY($2)",
        )
        .bind(dest.id)
        .bind(&keys)
        .fetch_all(&mut *conn)
        .await?;
        for (key, id, state) in rows {
            let state = state.parse().unwrap_or(JobState::Queued);
            known.insert(key, (id, state));
        }
    }

    let AdmissionDecision {
        results,
        fresh,
        rejected,
    } = decide_admission(
        &AdmissionDest {
            name,
            capacity: dest.capacity,
            backlog: dest.backlog,
            next_slot_us: dest.next_slot_us,
            interval_us: dest.interval_us,
            burst: dest.burst,
            now_us: dest.now_us,
        },
        jobs,
        url_errors,
        known,
        mode,
    );
    if rejected > 0 {
        sqlx::query(
            "UPDATE sluice_destinations SET rejected_total = rejected_total + $2 WHERE id = $1",
        )
        .bind(dest.id)
        .bind(rejected)
        .execute(&mut *conn)
        .await?;
    }
    if fresh.is_empty() {
        return Ok(results);
    }

    insert_jobs(conn, &dest, &fresh).await?;

    let earliest_run_at = fresh
        .iter()
        .map(|(_, j)| run_at(j, dest.now_us))
        .min()
        .unwrap_or(dest.now_us);
    let new_due: Option<i64> = sqlx::query_scalar(
        "UPDATE sluice_destinations
            SET backlog = backlog + $2,
                due_at_us = CASE
                    WHEN max_in_flight IS NOT NULL AND in_flight >= max_in_flight THEN NULL
                    ELSE least(due_at_us,
                               greatest(next_slot_us - (burst - 1) * effective_interval_us, $3))
                END
          WHERE id = $1
      RETURNING due_at_us",
    )
    .bind(dest.id)
    .bind(fresh.len() as i64)
    .bind(earliest_run_at)
    .fetch_one(&mut *conn)
    .await?;
    // Wake dispatchers only when the destination became due sooner than they knew.
    if new_due.is_some() && (dest.due_at_us.is_none() || new_due < dest.due_at_us) {
        notify_wake(conn).await?;
    }
    Ok(results)
}

async fn insert_jobs(
    conn: &mut PgConnection,
    dest: &LockedDestination,
    fresh: &[(Uuid, &NewJob)],
) -> Result<()> {
    let n = fresh.len();
    let mut ids = Vec::with_capacity(n);
    let mut methods = Vec::with_capacity(n);
    let mut urls = Vec::with_capacity(n);
    let mut headers = Vec::with_capacity(n);
    let mut bodies = Vec::with_capacity(n);
    let mut keys = Vec::with_capacity(n);
    let mut attempts = Vec::with_capacity(n);
    let mut run_ats = Vec::with_capacity(n);
    let mut deadlines = Vec::with_capacity(n);
    for (id, job) in fresh {
        ids.push(*id);
        methods.push(job.method.as_str());
        urls.push(job.url.as_str());
        headers.push(Json(&job.headers));
        bodies.push(job.body.as_deref());
        keys.push(job.idempotency_key.as_deref());
        attempts.push(job.max_attempts.unwrap_or(dest.max_attempts));
        run_ats.push(run_at(job, dest.now_us));
        deadlines.push(job.deadline_us);
    }
    sqlx::query(
        "INSERT INTO sluice_jobs
             (id, destination_id, state, method, url, headers, body, idempotency_key,
              max_attempts, run_at_us, deadline_us, created_at_us, updated_at_us)
         SELECT u.id, $1, 'queued', u.method, u.url, u.headers, u.body, u.key,
                u.max_attempts, u.run_at, u.deadline, $2, $2
           FROM unnest($3::uuid[], $4::text[], $5::text[], $6::jsonb[], $7::bytea[],
                       $8::text[], $9::int[], $10::bigint[], $11::bigint[])
             AS u(id, method, url, headers, body, key, max_attempts, run_at, deadline)",
    )
    .bind(dest.id)
    .bind(dest.now_us)
    .bind(&ids)
    .bind(&methods)
    .bind(&urls)
    .bind(&headers)
    .bind(&bodies)
    .bind(&keys)
    .bind(&attempts)
    .bind(&run_ats)
    .bind(&deadlines)
    .execute(&mut *conn)
    .await?;
    Ok(())
}
