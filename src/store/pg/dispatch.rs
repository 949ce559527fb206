//! The dispatcher's statements: claim jobs with release slots, record outcomes, return
//! claims. These are the hot path; each runs a fixed number of statements per batch, not
//! per job.
//!
//! Claim (one transaction, any number of destinations and jobs):
//! 1. lock due destinations (`due_at_us <= now + horizon`, `FOR UPDATE SKIP LOCKED`, so
//!    dispatchers share destinations without waiting on each other);
//! 2. lock their first queued jobs in `(run_at, id)` order;
//! 3. assign GCRA slots in Rust ([`Gcra::assign`]) up to the horizon;
//! 4. mark those jobs running with slot and lease; expire those past their deadline;
//! 5. advance each destination's `next_slot` and counters, and recompute `due_at`.

use sqlx::PgConnection;
use uuid::Uuid;

use super::Pg;
use crate::rate::Micros;
use crate::store::plan::{
    apply_delta, destination_deltas, job_update, ClaimPlanner, DestinationState, EXPIRED_ERROR,
};
use crate::store::types::{
    Candidate, Claim, ClaimParams, ClaimedRow, Completion, DueDestination, Outcome,
    THROTTLE_CHANNEL,
};
use crate::store::Result;

impl Pg {
    /// Claims the jobs whose slots fall within the horizon, across due destinations.
    pub async fn claim(&self, p: &ClaimParams) -> Result<Claim> {
        let mut tx = self.pool.begin().await?;
        let claim = claim_in(&mut tx, p).await?;
        tx.commit().await?;
        Ok(claim)
    }

    /// The earliest instant any destination has claimable work, if any.
    pub async fn next_due(&self) -> Result<Option<Micros>> {
        Ok(sqlx::query_scalar(
            "SELECT min(due_at_us) FROM sluice_destinations
              WHERE due_at_us IS NOT NULL AND NOT paused",
        )
        .fetch_one(&self.pool)
        .await?)
    }

    /// Records outcomes of claims held by `worker_id`. Outcomes for jobs the worker no
    /// longer holds (its lease expired and the job moved on) are ignored, so a slow
    /// worker can never overwrite a newer attempt.
    pub async fn complete(&self, worker_id: Uuid, done: &[Completion]) -> Result<()> {
        if done.is_empty() {
            return Ok(());
        }
        let mut tx = self.pool.begin().await?;
        complete_in(&mut tx, worker_id, done).await?;
        tx.commit().await?;
        Ok(())
    }
}

async fn claim_in(conn: &mut PgConnection, p: &ClaimParams) -> Result<Claim> {
    let dests: Vec<DueDestination> = sqlx::query_as(
        "SELECT d.id, d.name, d.next_slot_us, d.effective_interval_us AS interval_us, d.burst,
                d.max_in_flight, d.in_flight, d.timeout_ms, d.backoff_base_ms, d.backoff_cap_ms,
                d.last_claimer, d.retry_after_max_ms, d.throttle_floor_ms, d.max_throttles,
                d.ratelimit_reset, c.now AS now_us
           FROM (SELECT sluice_now_us() AS now) c, sluice_destinations d
          WHERE d.due_at_us IS NOT NULL AND NOT d.paused AND d.due_at_us <= c.now + $1
          ORDER BY d.due_at_us
          LIMIT $2
            FOR UPDATE OF d SKIP LOCKED",
    )
    .bind(p.horizon_us)
    .bind(p.max_destinations)
    .fetch_all(&mut *conn)
    .await?;
    let Some(db_now) = dests.first().map(|d| d.now_us) else {
        return Ok(Claim::default());
    };
    let planner = ClaimPlanner::new(p, &dests, db_now);
    let (want_ids, want_k): (Vec<i64>, Vec<i32>) = planner
        .wants(&dests)
        .into_iter()
        .map(|(id, k)| (id, k as i32))
        .unzip();
    let candidates: Vec<Candidate> = sqlx::query_as(
        "SELECT j.id, j.destination_id, j.run_at_us, j.deadline_us
           FROM unnest($1::bigint[], $2::int[]) AS w(dest, k)
          CROSS JOIN LATERAL (
                SELECT id, destination_id, run_at_us, deadline_us
                  FROM sluice_jobs
                 WHERE destination_id = w.dest AND state = 'queued' AND run_at_us <= $3
                 ORDER BY run_at_us, id
                 LIMIT w.k
                   FOR UPDATE SKIP LOCKED) j",
    )
    .bind(&want_ids)
    .bind(&want_k)
    .bind(planner.horizon_end())
    .fetch_all(&mut *conn)
    .await?;
    let plan = planner.assign(dests, candidates);

    let (ids, slots, leases): (Vec<Uuid>, Vec<i64>, Vec<i64>) = plan.leases(p).into_iter().fold(
        (Vec::new(), Vec::new(), Vec::new()),
        |(mut a, mut b, mut c), (id, slot, lease)| {
            a.push(id);
            b.push(slot);
            c.push(lease);
            (a, b, c)
        },
    );
    let rows: Vec<ClaimedRow> = if ids.is_empty() {
        Vec::new()
    } else {
        sqlx::query_as(
            "UPDATE sluice_jobs j
                SET state = 'running', slot_us = u.slot, lease_until_us = u.lease,
                    worker_id = $1, attempts = j.attempts + 1, updated_at_us = $2
               FROM unnest($3::uuid[], $4::bigint[], $5::bigint[]) AS u(id, slot, lease)
              WHERE j.id = u.id
          RETURNING j.id, j.method, j.url, j.headers, j.body, j.attempts, j.max_attempts,
                    j.throttles, j.deadline_us",
        )
        .bind(p.worker_id)
        .bind(db_now)
        .bind(&ids)
        .bind(&slots)
        .bind(&leases)
        .fetch_all(&mut *conn)
        .await?
    };
    if !plan.expired.is_empty() {
        sqlx::query(
            "UPDATE sluice_jobs
                SET state = 'expired', finished_at_us = $2, updated_at_us = $2,
                    last_error = $3
              WHERE id = ANY($1)",
        )
        .bind(&plan.expired)
        .bind(db_now)
        .bind(EXPIRED_ERROR)
        .execute(&mut *conn)
        .await?;
    }

    let mut d_ids = Vec::with_capacity(plan.plans.len());
    let mut d_tats = Vec::with_capacity(plan.plans.len());
    let mut d_claimed = Vec::with_capacity(plan.plans.len());
    let mut d_expired = Vec::with_capacity(plan.plans.len());
    for dp in plan.plans.values() {
        d_ids.push(dp.dest.id);
        d_tats.push(dp.tat);
        d_claimed.push(dp.claimed.len() as i32);
        d_expired.push(dp.expired);
    }
    sqlx::query(
        "UPDATE sluice_destinations d
            SET next_slot_us = u.tat,
                in_flight = d.in_flight + u.claimed,
                backlog = d.backlog - u.expired,
                last_claimer = CASE WHEN u.claimed > 0 THEN $5 ELSE d.last_claimer END,
                due_at_us = sluice_due_at(d.id, u.tat, d.effective_interval_us, d.burst,
                                          d.in_flight + u.claimed, d.max_in_flight)
           FROM unnest($1::bigint[], $2::bigint[], $3::int[], $4::int[])
             AS u(id, tat, claimed, expired)
          WHERE d.id = u.id",
    )
    .bind(&d_ids)
    .bind(&d_tats)
    .bind(&d_claimed)
    .bind(&d_expired)
    .bind(p.worker_id)
    .execute(&mut *conn)
    .await?;
    Ok(plan.into_claim(rows, p, db_now))
}

/// A destination's state and the database clock, read under the completion's lock.
#[derive(sqlx::FromRow)]
struct StateRow {
    #[sqlx(flatten)]
    state: DestinationState,
    now_us: i64,
}

async fn complete_in(conn: &mut PgConnection, worker_id: Uuid, done: &[Completion]) -> Result<()> {
    let n = done.len();
    let mut ids = Vec::with_capacity(n);
    let mut states = Vec::with_capacity(n);
    let mut d_attempts = Vec::with_capacity(n);
    let mut d_throttles = Vec::with_capacity(n);
    let mut delays: Vec<Option<i64>> = Vec::with_capacity(n);
    let mut statuses: Vec<Option<i32>> = Vec::with_capacity(n);
    let mut errors: Vec<Option<&str>> = Vec::with_capacity(n);
    let mut snippets: Vec<Option<&str>> = Vec::with_capacity(n);
    let mut hints: Vec<Option<i64>> = Vec::with_capacity(n);
    let mut touched = Vec::with_capacity(n);
    for c in done {
        let u = job_update(&c.outcome);
        ids.push(c.job.id);
        states.push(u.state.as_str());
        d_attempts.push(u.attempt_delta);
        d_throttles.push(u.throttle_delta);
        delays.push(u.delay_us);
        statuses.push(u.status);
        errors.push(u.error);
        snippets.push(u.snippet);
        hints.push(u.retry_after_ms);
        touched.push(u.touched);
    }
    let changed: Vec<(Uuid, String)> = sqlx::query_as(
        "UPDATE sluice_jobs j
            SET state = u.state,
                attempts = j.attempts + u.d_attempts,
                throttles = j.throttles + u.d_throttles,
                run_at_us = CASE WHEN u.delay IS NULL THEN j.run_at_us
                                 ELSE sluice_now_us() + u.delay END,
                slot_us = CASE WHEN u.touched THEN j.slot_us ELSE NULL END,
                last_status = CASE WHEN u.touched THEN u.status ELSE j.last_status END,
                last_error = CASE WHEN u.touched THEN u.error ELSE j.last_error END,
                response_snippet = CASE WHEN u.touched THEN u.snippet
                                        ELSE j.response_snippet END,
                last_retry_after_ms = coalesce(u.hint, j.last_retry_after_ms),
                lease_until_us = NULL,
                worker_id = NULL,
                updated_at_us = sluice_now_us(),
                finished_at_us = CASE WHEN u.state IN ('queued', 'running') THEN NULL
                                      ELSE sluice_now_us() END
           FROM unnest($2::uuid[], $3::text[], $4::int[], $5::int[], $6::bigint[], $7::int[],
                       $8::text[], $9::text[], $10::bigint[], $11::bool[])
             AS u(id, state, d_attempts, d_throttles, delay, status, error, snippet, hint,
                  touched)
          WHERE j.id = u.id AND j.state = 'running' AND j.worker_id = $1
      RETURNING j.id, j.state",
    )
    .bind(worker_id)
    .bind(&ids)
    .bind(&states)
    .bind(&d_attempts)
    .bind(&d_throttles)
    .bind(&delays)
    .bind(&statuses)
    .bind(&errors)
    .bind(&snippets)
    .bind(&hints)
    .bind(&touched)
    .fetch_all(&mut *conn)
    .await?;

    let deltas = destination_deltas(done, &changed);
    if deltas.is_empty() {
        return Ok(());
    }
    let d_ids: Vec<i64> = deltas.keys().copied().collect();
    // Lock in id order so concurrent completions never deadlock on destination rows.
    let states: Vec<(DestinationState, i64)> = sqlx::query_as::<_, StateRow>(
        "SELECT id, next_slot_us, throttle_streak, throttle_backoff_base_ms,
                throttle_backoff_cap_ms, adaptive_rate, interval_us, effective_interval_us,
                sluice_now_us() AS now_us
           FROM sluice_destinations WHERE id = ANY($1) ORDER BY id FOR UPDATE",
    )
    .bind(&d_ids)
    .fetch_all(&mut *conn)
    .await?
    .into_iter()
    .map(|r| (r.state, r.now_us))
    .collect();
    let len = states.len();
    let mut u_ids = Vec::with_capacity(len);
    let mut u_done = Vec::with_capacity(len);
    let mut u_finished = Vec::with_capacity(len);
    let mut u_next = Vec::with_capacity(len);
    let mut u_shifted = Vec::with_capacity(len);
    let mut u_throttles = Vec::with_capacity(len);
    let mut u_hint = Vec::with_capacity(len);
    let mut u_streak = Vec::with_capacity(len);
    let mut u_interval = Vec::with_capacity(len);
    let mut shifted = Vec::new();
    for (state, now) in &states {
        let Some(d) = deltas.get(&state.id) else {
            continue;
        };
        let change = apply_delta(state, d, *now);
        u_ids.push(state.id);
        u_done.push(d.done);
        u_finished.push(d.finished);
        u_next.push(change.next_slot_us);
        u_shifted.push(change.shifted);
        u_throttles.push(d.throttles);
        u_hint.push(d.retry_after_ms);
        u_streak.push(change.throttle_streak);
        u_interval.push(change.effective_interval_us);
        if change.shifted {
            shifted.push((state.id, change.next_slot_us));
        }
    }
    sqlx::query(
        "UPDATE sluice_destinations d
            SET in_flight = d.in_flight - u.done,
                backlog = d.backlog - u.finished,
                next_slot_us = u.next_slot,
                throttled_until_us = CASE WHEN u.shifted THEN u.next_slot
                                          ELSE d.throttled_until_us END,
                throttled_total = d.throttled_total + u.throttles,
                last_retry_after_ms = coalesce(u.hint, d.last_retry_after_ms),
                throttle_streak = u.streak,
                effective_interval_us = u.interval
           FROM unnest($1::bigint[], $2::int[], $3::int[], $4::bigint[], $5::bool[],
                       $6::int[], $7::bigint[], $8::int[], $9::bigint[])
             AS u(id, done, finished, next_slot, shifted, throttles, hint, streak, interval)
          WHERE d.id = u.id",
    )
    .bind(&u_ids)
    .bind(&u_done)
    .bind(&u_finished)
    .bind(&u_next)
    .bind(&u_shifted)
    .bind(&u_throttles)
    .bind(&u_hint)
    .bind(&u_streak)
    .bind(&u_interval)
    .execute(&mut *conn)
    .await?;
    // due_at from the values just written.
    super::refresh_due(conn, &u_ids).await?;
    // Claims given back are due now: wake the other dispatchers for them (a shutting
    // down dispatcher's claims are delivered by the others at once, not after a poll).
    if done.iter().any(|c| c.outcome == Outcome::Returned) {
        super::destinations::notify_wake(conn).await?;
    }
    if !shifted.is_empty() {
        let payloads: Vec<String> = shifted.iter().map(|(id, s)| format!("{id}:{s}")).collect();
        sqlx::query("SELECT pg_notify($1, p) FROM unnest($2::text[]) AS p")
            .bind(THROTTLE_CHANNEL)
            .bind(&payloads)
            .execute(&mut *conn)
            .await?;
    }
    Ok(())
}
