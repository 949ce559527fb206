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

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use sqlx::types::Json;
use sqlx::{FromRow, PgConnection};
use uuid::Uuid;

use super::{Result, Store};
use crate::job::JobState;
use crate::rate::{Gcra, Micros};
use crate::throttle::{ResetUnit, Shift, Source, ThrottlePolicy};

/// NOTIFY channel announcing that a destination's `next_slot` moved because of a
/// downstream throttle; payload `"<destination id>:<next_slot_us>"`.
pub const THROTTLE_CHANNEL: &str = "sluice_throttle";

/// Limits for one claim.
#[derive(Debug, Clone)]
pub struct ClaimParams {
    /// The dispatcher claiming; completions are only accepted from the holder.
    pub worker_id: Uuid,
    /// Claim the slots falling within this long after `now + lead_us`.
    pub horizon_us: i64,
    /// On a destination another dispatcher also claims, no slot is earlier than
    /// `now + lead_us`: the time from reading the clock to the job waiting on the release
    /// thread. A slot the dispatcher cannot keep would be released late, and the other
    /// dispatcher may release the next slot on time. A destination only this dispatcher
    /// claims needs no lead: a late first release just starts its schedule that late.
    pub lead_us: i64,
    /// Destinations locked per claim.
    pub max_destinations: i64,
    /// Jobs claimed in total (the dispatcher's free concurrency).
    pub max_jobs: usize,
    /// Jobs claimed per destination.
    pub max_per_destination: usize,
    /// Lease granted beyond `slot + timeout`; a claim whose lease runs out is presumed
    /// abandoned (crashed worker) and returned to the queue.
    pub lease_margin_us: i64,
}

/// A job claimed for release at `slot_us`.
#[derive(Debug, Clone)]
pub struct ClaimedJob {
    /// Job id, also sent as `Idempotency-Key`.
    pub id: Uuid,
    /// Destination row id.
    pub destination_id: i64,
    /// Destination name (shared by its jobs).
    pub destination: Arc<str>,
    /// Release slot, database clock.
    pub slot_us: Micros,
    /// The destination's `next_slot` before and after this job's slot was assigned; a
    /// returned claim can give its slot back when nobody claimed after it.
    pub tat_before_us: Micros,
    /// See `tat_before_us`.
    pub tat_after_us: Micros,
    /// Minimum spacing the dispatcher enforces between this destination's releases.
    pub interval_us: i64,
    /// Whether another dispatcher made the previous claim on this destination, so the
    /// slots around these may be released by someone else.
    pub shared: bool,
    /// Releases allowed back to back after idleness.
    pub burst: u32,
    /// Request timeout.
    pub timeout_ms: i32,
    /// Retry backoff base.
    pub backoff_base_ms: i64,
    /// Retry backoff cap.
    pub backoff_cap_ms: i64,
    /// HTTP method.
    pub method: String,
    /// Target URL.
    pub url: String,
    /// Headers.
    pub headers: Vec<(String, String)>,
    /// Body.
    pub body: Option<Vec<u8>>,
    /// Attempts including this one.
    pub attempts: i32,
    /// Attempts allowed.
    pub max_attempts: i32,
    /// Times the downstream throttled this job so far.
    pub throttles: i32,
    /// Throttles allowed before the job is dead-lettered.
    pub max_throttles: i32,
    /// How the destination reads throttling signals.
    pub throttle: ThrottlePolicy,
    /// Deadline, if any.
    pub deadline_us: Option<Micros>,
}

/// Result of one claim.
#[derive(Debug, Clone, Default)]
pub struct Claim {
    /// Database clock when the claim ran.
    pub now_us: Micros,
    /// Claimed jobs, ordered by slot within each destination.
    pub jobs: Vec<ClaimedJob>,
    /// Jobs expired instead of claimed (deadline before their slot).
    pub expired: usize,
    /// Destinations locked; when it equals the limit, more may be due.
    pub destinations: usize,
}

/// What happened to a claimed job.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// 2xx.
    Succeeded {
        /// Response status.
        status: u16,
        /// Start of the response body.
        snippet: Option<String>,
    },
    /// A retryable failure; the job waits `delay_us` before its next attempt.
    Retry {
        /// Response status, if a response arrived.
        status: Option<u16>,
        /// What went wrong.
        error: String,
        /// Start of the response body.
        snippet: Option<String>,
        /// Backoff before the next attempt.
        delay_us: i64,
    },
    /// Permanent failure or out of attempts.
    Dead {
        /// Response status, if a response arrived.
        status: Option<u16>,
        /// What went wrong.
        error: String,
        /// Start of the response body.
        snippet: Option<String>,
    },
    /// The deadline passed before the job could be released; it was not sent.
    Expired,
    /// Not sent (shutdown, or the release came too late to keep the spacing): back to
    /// the head of the queue, attempt not spent.
    Returned,
    /// The downstream throttled it (429, or 503 with Retry-After): back to the head of
    /// the queue, attempt not spent, throttle counted.
    Throttled {
        /// Response status.
        status: u16,
        /// What the downstream asked for, for the job's record.
        error: String,
        /// Start of the response body.
        snippet: Option<String>,
        /// The hint honoured, in milliseconds (after floor and cap).
        retry_after_ms: Option<i64>,
    },
}

/// A claimed job's outcome, reported by the dispatcher that holds the claim.
#[derive(Debug, Clone)]
pub struct Completion {
    /// The claim.
    pub job: Arc<ClaimedJob>,
    /// Its outcome.
    pub outcome: Outcome,
    /// How the response moves the destination's `next_slot` (throttling, or rate-limit
    /// headers announcing exhaustion), independent of the job's outcome.
    pub shift: Option<Shift>,
}

impl Completion {
    /// A completion that does not move the destination.
    pub fn new(job: Arc<ClaimedJob>, outcome: Outcome) -> Self {
        Self {
            job,
            outcome,
            shift: None,
        }
    }
}

#[derive(FromRow)]
struct DueDestination {
    id: i64,
    name: String,
    next_slot_us: i64,
    interval_us: i64,
    burst: i32,
    max_in_flight: Option<i32>,
    in_flight: i32,
    timeout_ms: i32,
    backoff_base_ms: i64,
    backoff_cap_ms: i64,
    last_claimer: Option<Uuid>,
    retry_after_max_ms: i64,
    throttle_floor_ms: i64,
    max_throttles: i32,
    ratelimit_reset: Option<String>,
    now_us: i64,
}

#[derive(FromRow)]
struct Candidate {
    id: Uuid,
    destination_id: i64,
    run_at_us: i64,
    deadline_us: Option<i64>,
}

#[derive(FromRow)]
struct ClaimedRow {
    id: Uuid,
    method: String,
    url: String,
    headers: Json<Vec<(String, String)>>,
    body: Option<Vec<u8>>,
    attempts: i32,
    max_attempts: i32,
    throttles: i32,
    deadline_us: Option<i64>,
}

/// Per-destination bookkeeping while planning a claim.
struct Plan {
    dest: DueDestination,
    name: Arc<str>,
    tat: i64,
    claimed: Vec<(Uuid, i64, i64, i64)>, // id, slot, tat_before, tat_after
    expired: i32,
}

impl Store {
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
    // GCRA runs from the earliest instant a claimed job can actually be released.
    let lead_for = |d: &DueDestination| {
        if d.last_claimer.is_some_and(|w| w != p.worker_id) {
            p.lead_us.max(0)
        } else {
            0
        }
    };
    let max_lead = dests.iter().map(lead_for).max().unwrap_or(0);
    let horizon_end = db_now.saturating_add(max_lead).saturating_add(p.horizon_us);

    // Upper bound of jobs per destination: slots within the horizon, in-flight headroom,
    // and the dispatcher's remaining budget.
    let mut budget = p.max_jobs;
    let mut want_ids = Vec::with_capacity(dests.len());
    let mut want_k = Vec::with_capacity(dests.len());
    for d in &dests {
        // Slot i is max(now, A + i*T - tolerance) with A = max(next_slot, now); count
        // those not after the horizon.
        let tolerance = gcra_of(d).tolerance_us();
        let now = db_now.saturating_add(lead_for(d));
        let a = d.next_slot_us.max(now);
        let reach = horizon_end.saturating_add(tolerance).saturating_sub(a);
        let slots = if reach < 0 {
            0
        } else {
            usize::try_from(reach / d.interval_us)
                .unwrap_or(usize::MAX)
                .saturating_add(1)
        };
        let headroom = d
            .max_in_flight
            .map_or(usize::MAX, |m| (m - d.in_flight).max(0) as usize);
        let k = slots.min(headroom).min(p.max_per_destination).min(budget);
        budget -= k.min(budget);
        want_ids.push(d.id);
        want_k.push(k as i32);
    }

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
    .bind(horizon_end)
    .fetch_all(&mut *conn)
    .await?;

    let mut plans: BTreeMap<i64, Plan> = dests
        .into_iter()
        .map(|d| {
            let name: Arc<str> = Arc::from(d.name.as_str());
            let tat = d.next_slot_us;
            (
                d.id,
                Plan {
                    dest: d,
                    name,
                    tat,
                    claimed: Vec::new(),
                    expired: 0,
                },
            )
        })
        .collect();
    let mut stopped: HashMap<i64, bool> = HashMap::new();
    let mut expired_ids = Vec::new();
    // Candidates arrive grouped by destination in (run_at, id) order.
    for c in candidates {
        let Some(plan) = plans.get_mut(&c.destination_id) else {
            continue;
        };
        if stopped.get(&c.destination_id).copied().unwrap_or(false) {
            continue;
        }
        let gcra = gcra_of(&plan.dest);
        let now = db_now.saturating_add(lead_for(&plan.dest));
        let a = gcra.assign(plan.tat, now, c.run_at_us);
        if c.deadline_us.is_some_and(|dl| dl <= a.slot) {
            expired_ids.push(c.id);
            plan.expired += 1;
            continue;
        }
        if a.slot > horizon_end {
            // Beyond the horizon: leave it (and everything behind it) queued.
            stopped.insert(c.destination_id, true);
            continue;
        }
        plan.claimed.push((c.id, a.slot, plan.tat, a.next_tat));
        plan.tat = a.next_tat;
    }

    for plan in plans.values() {
        if let Some(&(_, first, _, _)) = plan.claimed.first() {
            let behind = first - plan.dest.next_slot_us;
            if behind > 0 && plan.dest.next_slot_us > 0 {
                tracing::debug!(
                    destination = %plan.name,
                    behind_us = behind,
                    lead_us = p.lead_us,
                    "claim started behind the destination's schedule"
                );
            }
        }
    }
    let mut ids = Vec::new();
    let mut slots = Vec::new();
    let mut leases = Vec::new();
    for plan in plans.values() {
        let lease_tail = i64::from(plan.dest.timeout_ms).saturating_mul(1_000) + p.lease_margin_us;
        for &(id, slot, _, _) in &plan.claimed {
            ids.push(id);
            slots.push(slot);
            leases.push(slot.saturating_add(lease_tail));
        }
    }
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
    if !expired_ids.is_empty() {
        sqlx::query(
            "UPDATE sluice_jobs
                SET state = 'expired', finished_at_us = $2, updated_at_us = $2,
                    last_error = 'deadline passed before the job could be released'
              WHERE id = ANY($1)",
        )
        .bind(&expired_ids)
        .bind(db_now)
        .execute(&mut *conn)
        .await?;
    }

    let mut d_ids = Vec::with_capacity(plans.len());
    let mut d_tats = Vec::with_capacity(plans.len());
    let mut d_claimed = Vec::with_capacity(plans.len());
    let mut d_expired = Vec::with_capacity(plans.len());
    for plan in plans.values() {
        d_ids.push(plan.dest.id);
        d_tats.push(plan.tat);
        d_claimed.push(plan.claimed.len() as i32);
        d_expired.push(plan.expired);
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

    let mut by_id: HashMap<Uuid, ClaimedRow> = rows.into_iter().map(|r| (r.id, r)).collect();
    let destinations = plans.len();
    let mut jobs = Vec::with_capacity(ids.len());
    for plan in plans.into_values() {
        let d = &plan.dest;
        for (id, slot, tat_before, tat_after) in plan.claimed {
            let Some(row) = by_id.remove(&id) else {
                continue;
            };
            jobs.push(ClaimedJob {
                id,
                destination_id: d.id,
                destination: plan.name.clone(),
                slot_us: slot,
                tat_before_us: tat_before,
                tat_after_us: tat_after,
                interval_us: d.interval_us,
                shared: d.last_claimer.is_some_and(|w| w != p.worker_id),
                burst: d.burst.max(1) as u32,
                timeout_ms: d.timeout_ms,
                backoff_base_ms: d.backoff_base_ms,
                backoff_cap_ms: d.backoff_cap_ms,
                method: row.method,
                url: row.url,
                headers: row.headers.0,
                body: row.body,
                attempts: row.attempts,
                max_attempts: row.max_attempts,
                throttles: row.throttles,
                max_throttles: d.max_throttles,
                throttle: ThrottlePolicy {
                    retry_after_max_ms: d.retry_after_max_ms,
                    throttle_floor_ms: d.throttle_floor_ms,
                    ratelimit_reset: d.ratelimit_reset.as_deref().and_then(ResetUnit::parse),
                },
                deadline_us: row.deadline_us,
            });
        }
    }
    Ok(Claim {
        now_us: db_now,
        jobs,
        expired: expired_ids.len(),
        destinations,
    })
}

fn gcra_of(d: &DueDestination) -> Gcra {
    Gcra {
        interval_us: d.interval_us,
        burst: d.burst.max(1) as u32,
    }
}

/// Per-destination effect of a batch of completions.
#[derive(Default)]
struct DestinationDelta {
    done: i32,
    finished: i32,
    successes: i32,
    throttles: i32,
    /// Returned claims: (earliest tat_before, latest tat_after) to give slots back.
    give_back: Option<(i64, i64)>,
    /// Largest explicit delay asked for, in microseconds.
    shift_us: Option<i64>,
    /// A 429 without a usable hint: apply the destination's growing backoff.
    backoff: bool,
    /// Largest hint seen, for the destination's record.
    retry_after_ms: Option<i64>,
}

/// The per-job columns a completion writes.
struct JobUpdate<'a> {
    state: JobState,
    attempt_delta: i32,
    throttle_delta: i32,
    delay_us: Option<i64>,
    status: Option<i32>,
    error: Option<&'a str>,
    snippet: Option<&'a str>,
    retry_after_ms: Option<i64>,
    touched: bool,
}

fn job_update(outcome: &Outcome) -> JobUpdate<'_> {
    let base = JobUpdate {
        state: JobState::Queued,
        attempt_delta: 0,
        throttle_delta: 0,
        delay_us: None,
        status: None,
        error: None,
        snippet: None,
        retry_after_ms: None,
        touched: true,
    };
    match outcome {
        Outcome::Succeeded { status, snippet } => JobUpdate {
            state: JobState::Succeeded,
            status: Some(i32::from(*status)),
            snippet: snippet.as_deref(),
            ..base
        },
        Outcome::Retry {
            status,
            error,
            snippet,
            delay_us,
        } => JobUpdate {
            delay_us: Some(*delay_us),
            status: status.map(i32::from),
            error: Some(error),
            snippet: snippet.as_deref(),
            ..base
        },
        Outcome::Dead {
            status,
            error,
            snippet,
        } => JobUpdate {
            state: JobState::Dead,
            status: status.map(i32::from),
            error: Some(error),
            snippet: snippet.as_deref(),
            ..base
        },
        Outcome::Expired => JobUpdate {
            state: JobState::Expired,
            attempt_delta: -1,
            error: Some("deadline passed before the job could be released"),
            ..base
        },
        Outcome::Returned => JobUpdate {
            attempt_delta: -1,
            touched: false,
            ..base
        },
        Outcome::Throttled {
            status,
            error,
            snippet,
            retry_after_ms,
        } => JobUpdate {
            attempt_delta: -1,
            throttle_delta: 1,
            status: Some(i32::from(*status)),
            error: Some(error),
            snippet: snippet.as_deref(),
            retry_after_ms: *retry_after_ms,
            ..base
        },
    }
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

    let by_id: HashMap<Uuid, &Completion> = done.iter().map(|c| (c.job.id, c)).collect();
    let mut deltas: BTreeMap<i64, DestinationDelta> = BTreeMap::new();
    for (id, state) in &changed {
        let Some(c) = by_id.get(id) else { continue };
        let d = deltas.entry(c.job.destination_id).or_default();
        d.done += 1;
        if state != "queued" {
            d.finished += 1;
        }
        match &c.outcome {
            Outcome::Succeeded { .. } => d.successes += 1,
            Outcome::Throttled { .. } => d.throttles += 1,
            Outcome::Dead {
                status: Some(429 | 503),
                ..
            } if c.shift.is_some() => d.throttles += 1,
            Outcome::Returned => {
                let (lo, hi) = d.give_back.unwrap_or((i64::MAX, i64::MIN));
                d.give_back = Some((lo.min(c.job.tat_before_us), hi.max(c.job.tat_after_us)));
            }
            _ => {}
        }
    }
    // Signals move the destination even when the job itself was not updated (a stale
    // claim still carries the downstream's word about the destination).
    for c in done {
        let Some(shift) = c.shift else { continue };
        let d = deltas.entry(c.job.destination_id).or_default();
        match (shift.source, shift.delay_ms) {
            (Source::Backoff, _) | (_, None) => d.backoff = true,
            (_, Some(ms)) => {
                let us = ms.saturating_mul(1_000);
                d.shift_us = Some(d.shift_us.map_or(us, |x| x.max(us)));
                if shift.source == Source::RetryAfter
                    || shift.source == Source::RateLimit
                    || shift.source == Source::XRateLimit
                {
                    d.retry_after_ms = Some(d.retry_after_ms.map_or(ms, |x| x.max(ms)));
                }
            }
        }
    }
    if deltas.is_empty() {
        return Ok(());
    }
    let len = deltas.len();
    let mut d_ids = Vec::with_capacity(len);
    let mut d_done = Vec::with_capacity(len);
    let mut d_finished = Vec::with_capacity(len);
    let mut d_successes = Vec::with_capacity(len);
    let mut d_throttle_n = Vec::with_capacity(len);
    let mut d_back_to = Vec::with_capacity(len);
    let mut d_back_if = Vec::with_capacity(len);
    let mut d_shift = Vec::with_capacity(len);
    let mut d_backoff = Vec::with_capacity(len);
    let mut d_hint = Vec::with_capacity(len);
    for (id, d) in &deltas {
        d_ids.push(*id);
        d_done.push(d.done);
        d_finished.push(d.finished);
        d_successes.push(d.successes);
        d_throttle_n.push(d.throttles);
        d_back_to.push(d.give_back.map(|g| g.0));
        d_back_if.push(d.give_back.map(|g| g.1));
        d_shift.push(d.shift_us);
        d_backoff.push(d.backoff);
        d_hint.push(d.retry_after_ms);
    }
    // Lock in id order so concurrent completions never deadlock on destination rows.
    sqlx::query("SELECT 1 FROM sluice_destinations WHERE id = ANY($1) ORDER BY id FOR UPDATE")
        .bind(&d_ids)
        .execute(&mut *conn)
        .await?;
    // next_slot: a returned claim gives its slots back only when nobody claimed a later
    // slot (next_slot still equals the tat after our last returned slot), so rolling back
    // cannot put a release closer than one interval to another; a throttle moves it to
    // max(next_slot, now + delay). GREATEST ignores the NULLs of absent signals.
    let shifted: Vec<(i64, i64)> = sqlx::query_as(
        "UPDATE sluice_destinations d
            SET in_flight = d.in_flight - c.done,
                backlog = d.backlog - c.finished,
                next_slot_us = c.next_slot,
                throttled_until_us = CASE WHEN c.shifted THEN c.next_slot
                                          ELSE d.throttled_until_us END,
                throttled_total = d.throttled_total + c.throttles,
                last_retry_after_ms = coalesce(c.hint, d.last_retry_after_ms),
                throttle_streak = CASE WHEN c.throttles > 0 OR c.backoff
                                           THEN d.throttle_streak + greatest(c.throttles, 1)
                                       WHEN c.successes > 0 THEN 0
                                       ELSE d.throttle_streak END,
                effective_interval_us = CASE
                    WHEN NOT d.adaptive_rate THEN d.interval_us
                    WHEN c.throttles > 0
                        THEN least(d.effective_interval_us
                                   * (2 ^ least(c.throttles, 10))::bigint,
                                   d.interval_us * 1024)
                    WHEN c.successes > 0
                        THEN greatest(d.interval_us, (d.effective_interval_us::numeric
                             * d.interval_us * 100
                             / (d.interval_us * 100
                                + d.effective_interval_us::numeric * c.successes))::bigint)
                    ELSE d.effective_interval_us END
           FROM (SELECT d2.id, u.done, u.finished, u.successes, u.throttles, u.backoff, u.hint,
                        (u.shift IS NOT NULL OR u.backoff) AS shifted,
                        greatest(
                            CASE WHEN d2.next_slot_us = u.back_if THEN u.back_to
                                 ELSE d2.next_slot_us END,
                            sluice_now_us() + u.shift,
                            CASE WHEN u.backoff THEN sluice_now_us()
                                 + least(d2.throttle_backoff_cap_ms,
                                         d2.throttle_backoff_base_ms
                                         * (2 ^ least(d2.throttle_streak, 30))::bigint)
                                 * 1000 END
                        ) AS next_slot
                   FROM unnest($1::bigint[], $2::int[], $3::int[], $4::int[], $5::int[],
                               $6::bigint[], $7::bigint[], $8::bigint[], $9::bool[],
                               $10::bigint[])
                     AS u(id, done, finished, successes, throttles, back_to, back_if, shift,
                          backoff, hint)
                   JOIN sluice_destinations d2 ON d2.id = u.id) c
          WHERE d.id = c.id
      RETURNING d.id, CASE WHEN c.shifted THEN d.next_slot_us END",
    )
    .bind(&d_ids)
    .bind(&d_done)
    .bind(&d_finished)
    .bind(&d_successes)
    .bind(&d_throttle_n)
    .bind(&d_back_to)
    .bind(&d_back_if)
    .bind(&d_shift)
    .bind(&d_backoff)
    .bind(&d_hint)
    .fetch_all(&mut *conn)
    .await?
    .into_iter()
    .filter_map(|(id, slot): (i64, Option<i64>)| slot.map(|s| (id, s)))
    .collect();
    // due_at from the values just written.
    sqlx::query(
        "UPDATE sluice_destinations
            SET due_at_us = sluice_due_at(id, next_slot_us, effective_interval_us, burst,
                                          in_flight, max_in_flight)
          WHERE id = ANY($1)",
    )
    .bind(&d_ids)
    .execute(&mut *conn)
    .await?;
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
