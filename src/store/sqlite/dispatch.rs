//! Claim and completion on the embedded store: the same plan as PostgreSQL's
//! (`plan.rs`), in multi-row statements on the single writer connection.

use sqlx::QueryBuilder;
use uuid::Uuid;

use super::{expire_job, now, refresh_due, Sqlite};
use crate::rate::Micros;
use crate::store::plan::{
    apply_delta, destination_deltas, job_update, ClaimPlanner, DestinationState,
};
use crate::store::types::{
    Candidate, Claim, ClaimParams, ClaimedRow, Completion, DueDestination, Outcome,
};
use crate::store::{Notice, Result};

/// Rows per multi-row statement: every statement is a round trip to the connection's
/// thread, so claims and completions go in batches, not row by row. At most 10
/// parameters a row keeps a statement well under SQLite's 32,766.
const BATCH: usize = 1_000;

impl Sqlite {
    pub(crate) async fn claim(&self, p: &ClaimParams) -> Result<Claim> {
        let db_now = now();
        let mut tx = self.write_tx().await?;
        let dests: Vec<DueDestination> = sqlx::query_as(
            "SELECT id, name, next_slot_us, effective_interval_us AS interval_us, burst,
                    max_in_flight, in_flight, timeout_ms, backoff_base_ms, backoff_cap_ms,
                    last_claimer, retry_after_max_ms, throttle_floor_ms, max_throttles,
                    ratelimit_reset, ?1 AS now_us
               FROM sluice_destinations
              WHERE due_at_us IS NOT NULL AND paused = 0 AND due_at_us <= ?1 + ?2
              ORDER BY due_at_us
              LIMIT ?3",
        )
        .bind(db_now)
        .bind(p.horizon_us)
        .bind(p.max_destinations)
        .fetch_all(&mut *tx)
        .await?;
        if dests.is_empty() {
            return Ok(Claim::default());
        }
        let planner = ClaimPlanner::new(p, &dests, db_now);
        let mut candidates: Vec<Candidate> = Vec::new();
        for (dest, k) in planner.wants(&dests) {
            if k == 0 {
                continue;
            }
            let found: Vec<Candidate> = sqlx::query_as(
                "SELECT id, destination_id, run_at_us, deadline_us FROM sluice_jobs
                  WHERE destination_id = ?1 AND state = 'queued' AND run_at_us <= ?2
                  ORDER BY run_at_us, id
                  LIMIT ?3",
            )
            .bind(dest)
            .bind(planner.horizon_end())
            .bind(i64::try_from(k).unwrap_or(i64::MAX))
            .fetch_all(&mut *tx)
            .await?;
            candidates.extend(found);
        }
        let plan = planner.assign(dests, candidates);
        let mut rows: Vec<ClaimedRow> = Vec::new();
        for chunk in plan.leases(p).chunks(BATCH) {
            let mut update =
                QueryBuilder::<sqlx::Sqlite>::new("WITH v(id, slot_us, lease_until_us) AS (");
            update.push_values(chunk, |mut row, &(id, slot, lease)| {
                row.push_bind(id).push_bind(slot).push_bind(lease);
            });
            update.push(
                ") UPDATE sluice_jobs
                     SET state = 'running', slot_us = v.slot_us, lease_until_us = v.lease_until_us,
                         attempts = attempts + 1, worker_id = ",
            );
            update.push_bind(p.worker_id);
            update.push(", updated_at_us = ");
            update.push_bind(db_now);
            update.push(
                " FROM v WHERE sluice_jobs.id = v.id
                  RETURNING sluice_jobs.id, method, url, headers, body, attempts, max_attempts,
                            throttles, deadline_us",
            );
            rows.extend(
                update
                    .build_query_as::<ClaimedRow>()
                    .fetch_all(&mut *tx)
                    .await?,
            );
        }
        for id in &plan.expired {
            expire_job(&mut tx, *id, db_now).await?;
        }
        for dp in plan.plans.values() {
            let claimed = dp.claimed.len() as i64;
            sqlx::query(
                "UPDATE sluice_destinations
                    SET next_slot_us = ?2, in_flight = in_flight + ?3, backlog = backlog - ?4,
                        last_claimer = CASE WHEN ?3 > 0 THEN ?5 ELSE last_claimer END
                  WHERE id = ?1",
            )
            .bind(dp.dest.id)
            .bind(dp.tat)
            .bind(claimed)
            .bind(i64::from(dp.expired))
            .bind(p.worker_id)
            .execute(&mut *tx)
            .await?;
            refresh_due(&mut tx, dp.dest.id).await?;
        }
        tx.commit().await?;
        Ok(plan.into_claim(rows, p, db_now))
    }

    pub(crate) async fn next_due(&self) -> Result<Option<Micros>> {
        Ok(sqlx::query_scalar(
            "SELECT min(due_at_us) FROM sluice_destinations WHERE due_at_us IS NOT NULL AND paused = 0",
        )
        .fetch_one(&self.pool)
        .await?)
    }

    pub(crate) async fn complete(&self, worker_id: Uuid, done: &[Completion]) -> Result<()> {
        let at = now();
        let mut tx = self.write_tx().await?;
        let mut changed: Vec<(Uuid, String)> = Vec::with_capacity(done.len());
        for chunk in done.chunks(BATCH) {
            let mut update = QueryBuilder::<sqlx::Sqlite>::new(
                "WITH v(id, state, attempt_delta, throttle_delta, delay_us, touched, status,
                        error, snippet, retry_after_ms) AS (",
            );
            update.push_values(chunk, |mut row, c| {
                let u = job_update(&c.outcome);
                row.push_bind(c.job.id)
                    .push_bind(u.state.as_str())
                    .push_bind(u.attempt_delta)
                    .push_bind(u.throttle_delta)
                    .push_bind(u.delay_us)
                    .push_bind(u.touched)
                    .push_bind(u.status)
                    .push_bind(u.error)
                    .push_bind(u.snippet)
                    .push_bind(u.retry_after_ms);
            });
            update.push(
                ") UPDATE sluice_jobs
                     SET state = v.state,
                         attempts = attempts + v.attempt_delta,
                         throttles = throttles + v.throttle_delta,
                         run_at_us = CASE WHEN v.delay_us IS NULL THEN run_at_us
                                          ELSE v.delay_us + ",
            );
            update.push_bind(at);
            update.push(
                " END,
                         slot_us = CASE WHEN v.touched THEN slot_us ELSE NULL END,
                         last_status = CASE WHEN v.touched THEN v.status ELSE last_status END,
                         last_error = CASE WHEN v.touched THEN v.error ELSE last_error END,
                         response_snippet = CASE WHEN v.touched THEN v.snippet
                                                 ELSE response_snippet END,
                         last_retry_after_ms = coalesce(v.retry_after_ms, last_retry_after_ms),
                         lease_until_us = NULL,
                         worker_id = NULL,
                         updated_at_us = ",
            );
            update.push_bind(at);
            update.push(
                ", finished_at_us = CASE WHEN v.state IN ('queued', 'running') THEN NULL ELSE ",
            );
            update.push_bind(at);
            update.push(
                " END
                    FROM v
                   WHERE sluice_jobs.id = v.id AND sluice_jobs.state = 'running'
                     AND sluice_jobs.worker_id = ",
            );
            update.push_bind(worker_id);
            update.push(" RETURNING sluice_jobs.id, sluice_jobs.state");
            changed.extend(
                update
                    .build_query_as::<(Uuid, String)>()
                    .fetch_all(&mut *tx)
                    .await?,
            );
        }
        let mut notices = Vec::new();
        for (dest, d) in destination_deltas(done, &changed) {
            let Some(s): Option<DestinationState> = sqlx::query_as(
                "SELECT id, next_slot_us, throttle_streak, throttle_backoff_base_ms,
                        throttle_backoff_cap_ms, adaptive_rate, interval_us, effective_interval_us
                   FROM sluice_destinations WHERE id = ?1",
            )
            .bind(dest)
            .fetch_optional(&mut *tx)
            .await?
            else {
                continue;
            };
            let change = apply_delta(&s, &d, at);
            sqlx::query(
                "UPDATE sluice_destinations
                    SET in_flight = in_flight - ?2,
                        backlog = backlog - ?3,
                        next_slot_us = ?4,
                        throttled_until_us = CASE WHEN ?5 THEN ?4 ELSE throttled_until_us END,
                        throttled_total = throttled_total + ?6,
                        last_retry_after_ms = coalesce(?7, last_retry_after_ms),
                        throttle_streak = ?8,
                        effective_interval_us = ?9
                  WHERE id = ?1",
            )
            .bind(dest)
            .bind(d.done)
            .bind(d.finished)
            .bind(change.next_slot_us)
            .bind(change.shifted)
            .bind(d.throttles)
            .bind(d.retry_after_ms)
            .bind(change.throttle_streak)
            .bind(change.effective_interval_us)
            .execute(&mut *tx)
            .await?;
            refresh_due(&mut tx, dest).await?;
            if change.shifted {
                notices.push(Notice::Throttle {
                    destination: dest,
                    until_us: change.next_slot_us,
                });
            }
        }
        tx.commit().await?;
        if done.iter().any(|c| c.outcome == Outcome::Returned) {
            notices.push(Notice::Wake);
        }
        for n in notices {
            self.notify(n);
        }
        Ok(())
    }
}
