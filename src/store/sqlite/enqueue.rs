//! Admission on the embedded store. The single writer connection serialises admissions,
//! which is what the destination row lock does on PostgreSQL; the decision itself is the
//! shared one in `plan.rs`.

use std::collections::HashMap;

use sqlx::types::Json;
use sqlx::QueryBuilder;
use uuid::Uuid;

use super::{now, refresh_due, Sqlite};
use crate::job::{JobState, NewJob};
use crate::store::plan::{
    check_url, decide_admission, field_name, run_at, AdmissionDecision, AdmissionDest,
};
use crate::store::types::{Admission, Admitted, EnqueueError};
use crate::store::{Error, Notice};

/// Rows per INSERT: 13 parameters each stays well under SQLite's 32,766 per statement.
const INSERT_CHUNK: usize = 1_000;

type DestinationRow = (i64, i64, i64, i64, i64, i32, i32, String, Option<i64>);

impl Sqlite {
    pub(crate) async fn enqueue(
        &self,
        name: &str,
        jobs: &[NewJob],
    ) -> Result<Vec<Admitted>, EnqueueError> {
        let at = now();
        let mut tx = self.pool.begin().await?;
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
            .map(|(i, j)| {
                check_url(
                    j,
                    &allowed,
                    field_name(jobs.len(), i, Admission::AllOrNothing),
                )
            })
            .collect();
        if let Some(e) = url_errors.iter().flatten().next() {
            return Err(Error::InvalidJob(e.clone()).into());
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
            Admission::AllOrNothing,
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
        let new_due = refresh_due(&mut tx, id).await?;
        tx.commit().await?;
        if new_due.is_some() && (old_due.is_none() || new_due < old_due) {
            self.notify(Notice::Wake);
        }
        results.into_iter().collect()
    }
}
