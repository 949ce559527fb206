//! Admission on the embedded store. The single writer connection serialises admissions,
//! which is what the destination row lock does on PostgreSQL; the decision itself is the
//! shared one in `plan.rs`.

use std::collections::HashMap;

use sqlx::types::Json;
use sqlx::{QueryBuilder, SqliteConnection};
use uuid::Uuid;

use super::{now, refresh_due, Sqlite};
use crate::job::{JobState, NewJob};
use crate::store::group::{unknown_destination, Group, GroupResults};
use crate::store::plan::{
    check_url, decide_admission, field_name, run_at, AdmissionDecision, AdmissionDest,
};
use crate::store::types::{Admission, Admitted, EnqueueError};
use crate::store::{Error, Notice};

/// Rows per INSERT: 13 parameters each stays well under SQLite's 32,766 per statement.
const INSERT_CHUNK: usize = 1_000;

type DestinationRow = (i64, i64, i64, i64, i64, i32, i32, String, Option<i64>);

impl Sqlite {
    /// Admits `jobs` to destination `name`, all or nothing, in its own transaction.
    pub(crate) async fn enqueue(
        &self,
        name: &str,
        jobs: &[NewJob],
    ) -> Result<Vec<Admitted>, EnqueueError> {
        let mut tx = self.write_tx().await?;
        let (results, wake) = admit(&mut tx, name, jobs, Admission::AllOrNothing, now()).await?;
        // A rejection still commits: it counted the rejection and wrote nothing else.
        tx.commit().await?;
        if wake {
            self.notify(Notice::Wake);
        }
        results.into_iter().collect()
    }

    /// Admits a group of single enqueues in one transaction (one fsync), each job on its
    /// own. The single writer connection serialises groups, as the destination row locks
    /// do on PostgreSQL.
    pub(crate) async fn admit_group(&self, group: &Group) -> Result<GroupResults, EnqueueError> {
        let at = now();
        let mut tx = self.write_tx().await?;
        let mut results = Vec::with_capacity(group.len());
        let mut wake = false;
        for (name, jobs) in group {
            match admit(&mut tx, name, jobs, Admission::EachJob, at).await {
                Ok((r, woke)) => {
                    results.push(r);
                    wake |= woke;
                }
                Err(EnqueueError::Store(Error::UnknownDestination(n))) => {
                    results.push(unknown_destination(&n, jobs))
                }
                Err(e) => return Err(e),
            }
        }
        tx.commit().await?;
        if wake {
            self.notify(Notice::Wake);
        }
        Ok(results)
    }
}

/// Admits `jobs` to destination `name` inside the caller's transaction: one result per
/// job (see PostgreSQL's `admit`), and whether the destination became due sooner, so the
/// dispatcher should be woken after the commit.
async fn admit(
    tx: &mut SqliteConnection,
    name: &str,
    jobs: &[NewJob],
    mode: Admission,
    at: i64,
) -> Result<(Vec<Result<Admitted, EnqueueError>>, bool), EnqueueError> {
    let row: Option<DestinationRow> = sqlx::query_as(
        "SELECT id, capacity, backlog, next_slot_us, effective_interval_us, burst,
                    max_attempts, allowed_base_urls, due_at_us
               FROM sluice_destinations WHERE name = ?1",
    )
    .bind(name)
    .fetch_optional(&mut *tx)
    .await?;
    let Some((id, capacity, backlog, next_slot, interval, burst, max_attempts, urls, old_due)) =
        row
    else {
        return Err(Error::UnknownDestination(name.to_owned()).into());
    };
    let allowed: Vec<String> = serde_json::from_str(&urls).unwrap_or_default();
    let url_errors: Vec<_> = jobs
        .iter()
        .enumerate()
        .map(|(i, j)| check_url(j, &allowed, field_name(jobs.len(), i, mode)))
        .collect();
    if mode == Admission::AllOrNothing {
        if let Some(e) = url_errors.iter().flatten().next() {
            return Err(Error::InvalidJob(e.clone()).into());
        }
    }
    let mut known: HashMap<String, (Uuid, JobState)> = HashMap::new();
    for key in jobs.iter().filter_map(|j| j.idempotency_key.as_deref()) {
        let existing: Option<(Uuid, String)> = sqlx::query_as(
            "SELECT id, state FROM sluice_jobs WHERE destination_id = ?1 AND idempotency_key = ?2",
        )
        .bind(id)
        .bind(key)
        .fetch_optional(&mut *tx)
        .await?;
        if let Some((job, state)) = existing {
            known.insert(
                key.to_owned(),
                (job, state.parse().unwrap_or(JobState::Queued)),
            );
        }
    }
    let AdmissionDecision {
        results,
        fresh,
        rejected,
    } = decide_admission(
        &AdmissionDest {
            name,
            capacity,
            backlog,
            next_slot_us: next_slot,
            interval_us: interval,
            burst,
            now_us: at,
        },
        jobs,
        url_errors,
        known,
        mode,
    );
    if rejected > 0 {
        sqlx::query(
            "UPDATE sluice_destinations SET rejected_total = rejected_total + ?2 WHERE id = ?1",
        )
        .bind(id)
        .bind(rejected)
        .execute(&mut *tx)
        .await?;
    }
    if !fresh.is_empty() {
        // One multi-row INSERT per chunk: every statement is a round trip to the
        // connection's thread, which per row would cost more than SQLite's own work.
        for chunk in fresh.chunks(INSERT_CHUNK) {
            let mut insert = QueryBuilder::<sqlx::Sqlite>::new(
                "INSERT INTO sluice_jobs
                         (id, destination_id, state, method, url, headers, body, idempotency_key,
                          max_attempts, run_at_us, deadline_us, created_at_us, updated_at_us) ",
            );
            insert.push_values(chunk, |mut row, (job_id, job)| {
                row.push_bind(*job_id)
                    .push_bind(id)
                    .push_bind("queued")
                    .push_bind(&job.method)
                    .push_bind(&job.url)
                    .push_bind(Json(&job.headers))
                    .push_bind(job.body.as_deref())
                    .push_bind(job.idempotency_key.as_deref())
                    .push_bind(job.max_attempts.unwrap_or(max_attempts))
                    .push_bind(run_at(job, at))
                    .push_bind(job.deadline_us)
                    .push_bind(at)
                    .push_bind(at);
            });
            insert.build().execute(&mut *tx).await?;
        }
        sqlx::query("UPDATE sluice_destinations SET backlog = backlog + ?2 WHERE id = ?1")
            .bind(id)
            .bind(fresh.len() as i64)
            .execute(&mut *tx)
            .await?;
    }
    let new_due = refresh_due(&mut *tx, id).await?;
    let wake = new_due.is_some() && (old_due.is_none() || new_due < old_due);
    Ok((results, wake))
}
