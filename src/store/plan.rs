//! Pure decisions shared by the store backends: which jobs a claim takes and at which
//! slots, and what a batch of outcomes does to each job and destination. Backends only
//! read and write rows; the arithmetic lives here once.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use uuid::Uuid;

use super::types::{
    Admission, Admitted, Candidate, Claim, ClaimParams, ClaimedJob, ClaimedRow, Completion,
    DueDestination, EnqueueError, Outcome,
};
use super::Error;
use crate::destination::{parse_job_url, url_allowed, FieldError};
use crate::job::{JobState, NewJob};
use crate::rate::{Gcra, Micros};
use crate::throttle::{ResetUnit, Source, ThrottlePolicy};

/// `last_error` of a job whose deadline passed while it waited: it was never sent.
pub(crate) const EXPIRED_ERROR: &str = "deadline passed before the job could be released";

/// Per-destination bookkeeping while planning a claim.
pub(crate) struct Plan {
    pub(crate) dest: DueDestination,
    pub(crate) name: Arc<str>,
    pub(crate) tat: i64,
    pub(crate) claimed: Vec<(Uuid, i64, i64, i64)>, // id, slot, tat_before, tat_after
    pub(crate) expired: i32,
}

pub(crate) fn gcra_of(d: &DueDestination) -> Gcra {
    Gcra {
        interval_us: d.interval_us,
        burst: d.burst.max(1) as u32,
    }
}

/// Per-destination effect of a batch of completions.
#[derive(Default)]
pub(crate) struct DestinationDelta {
    pub(crate) done: i32,
    pub(crate) finished: i32,
    pub(crate) successes: i32,
    pub(crate) throttles: i32,
    /// Returned claims: (earliest tat_before, latest tat_after) to give slots back.
    pub(crate) give_back: Option<(i64, i64)>,
    /// Largest explicit delay asked for, in microseconds.
    pub(crate) shift_us: Option<i64>,
    /// A 429 without a usable hint: apply the destination's growing backoff.
    pub(crate) backoff: bool,
    /// Largest hint seen, for the destination's record.
    pub(crate) retry_after_ms: Option<i64>,
}

/// The per-job columns a completion writes.
pub(crate) struct JobUpdate<'a> {
    pub(crate) state: JobState,
    pub(crate) attempt_delta: i32,
    pub(crate) throttle_delta: i32,
    pub(crate) delay_us: Option<i64>,
    pub(crate) status: Option<i32>,
    pub(crate) error: Option<&'a str>,
    pub(crate) snippet: Option<&'a str>,
    pub(crate) retry_after_ms: Option<i64>,
    pub(crate) touched: bool,
}

pub(crate) fn job_update(outcome: &Outcome) -> JobUpdate<'_> {
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
            error: Some(EXPIRED_ERROR),
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

/// Plans one claim: how many jobs to ask for per destination, then which of the
/// candidates get which slots (GCRA), which expire, and where each destination's
/// `next_slot` ends up.
pub(crate) struct ClaimPlanner<'p> {
    p: &'p ClaimParams,
    db_now: i64,
    horizon_end: i64,
}

/// The outcome of [`ClaimPlanner::assign`].
pub(crate) struct ClaimPlan {
    pub(crate) plans: BTreeMap<i64, Plan>,
    pub(crate) expired: Vec<Uuid>,
}

impl<'p> ClaimPlanner<'p> {
    pub(crate) fn new(p: &'p ClaimParams, dests: &[DueDestination], db_now: i64) -> Self {
        let max_lead = dests.iter().map(|d| lead_for(p, d)).max().unwrap_or(0);
        Self {
            p,
            db_now,
            horizon_end: db_now.saturating_add(max_lead).saturating_add(p.horizon_us),
        }
    }

    /// Claimed jobs' `run_at` must not be later than this.
    pub(crate) fn horizon_end(&self) -> i64 {
        self.horizon_end
    }

    /// Upper bound of jobs per destination: slots within the horizon, in-flight
    /// headroom, and the dispatcher's remaining budget.
    pub(crate) fn wants(&self, dests: &[DueDestination]) -> Vec<(i64, usize)> {
        let mut budget = self.p.max_jobs;
        dests
            .iter()
            .map(|d| {
                // Slot i is max(now, A + i*T - tolerance) with A = max(next_slot, now);
                // count those not after the horizon.
                let tolerance = gcra_of(d).tolerance_us();
                let now = self.db_now.saturating_add(lead_for(self.p, d));
                let a = d.next_slot_us.max(now);
                let reach = self.horizon_end.saturating_add(tolerance).saturating_sub(a);
                let slots = if reach < 0 {
                    0
                } else {
                    usize::try_from(reach / d.interval_us.max(1))
                        .unwrap_or(usize::MAX)
                        .saturating_add(1)
                };
                let headroom = d
                    .max_in_flight
                    .map_or(usize::MAX, |m| (m - d.in_flight).max(0) as usize);
                let k = slots
                    .min(headroom)
                    .min(self.p.max_per_destination)
                    .min(budget);
                budget -= k;
                (d.id, k)
            })
            .collect()
    }

    /// Assigns slots to `candidates` (grouped by destination, in `(run_at, id)` order).
    pub(crate) fn assign(
        &self,
        dests: Vec<DueDestination>,
        candidates: Vec<Candidate>,
    ) -> ClaimPlan {
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
        let mut stopped: HashSet<i64> = HashSet::new();
        let mut expired = Vec::new();
        for c in candidates {
            if stopped.contains(&c.destination_id) {
                continue;
            }
            let Some(plan) = plans.get_mut(&c.destination_id) else {
                continue;
            };
            let now = self.db_now.saturating_add(lead_for(self.p, &plan.dest));
            let a = gcra_of(&plan.dest).assign(plan.tat, now, c.run_at_us);
            if c.deadline_us.is_some_and(|dl| dl <= a.slot) {
                expired.push(c.id);
                plan.expired += 1;
                continue;
            }
            if a.slot > self.horizon_end {
                // Beyond the horizon: leave it (and everything behind it) queued.
                stopped.insert(c.destination_id);
                continue;
            }
            plan.claimed.push((c.id, a.slot, plan.tat, a.next_tat));
            plan.tat = a.next_tat;
        }
        ClaimPlan { plans, expired }
    }
}

/// On a destination another dispatcher also claims, slots start `lead_us` after the
/// clock reading (see [`ClaimParams::lead_us`]).
fn lead_for(p: &ClaimParams, d: &DueDestination) -> i64 {
    if d.last_claimer.is_some_and(|w| w != p.worker_id) {
        p.lead_us.max(0)
    } else {
        0
    }
}

impl ClaimPlan {
    /// `(job, slot, lease)` for every claimed job.
    pub(crate) fn leases(&self, p: &ClaimParams) -> Vec<(Uuid, i64, i64)> {
        let mut out = Vec::new();
        for plan in self.plans.values() {
            let tail = i64::from(plan.dest.timeout_ms)
                .saturating_mul(1_000)
                .saturating_add(p.lease_margin_us);
            for &(id, slot, _, _) in &plan.claimed {
                out.push((id, slot, slot.saturating_add(tail)));
            }
        }
        out
    }

    /// Joins the plan with the claimed rows into the dispatcher's view.
    pub(crate) fn into_claim(self, rows: Vec<ClaimedRow>, p: &ClaimParams, db_now: i64) -> Claim {
        let mut by_id: HashMap<Uuid, ClaimedRow> = rows.into_iter().map(|r| (r.id, r)).collect();
        let destinations = self.plans.len();
        let expired = self.expired.len();
        let mut jobs = Vec::new();
        for plan in self.plans.into_values() {
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
        Claim {
            now_us: db_now,
            jobs,
            expired,
            destinations,
        }
    }
}

/// What a batch of completions does to each destination, from the jobs whose rows
/// changed (`changed`: id and new state) and every signal in the batch.
pub(crate) fn destination_deltas(
    done: &[Completion],
    changed: &[(Uuid, String)],
) -> BTreeMap<i64, DestinationDelta> {
    let by_id: HashMap<Uuid, &Completion> = done.iter().map(|c| (c.job.id, c)).collect();
    let mut deltas: BTreeMap<i64, DestinationDelta> = BTreeMap::new();
    for (id, state) in changed {
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
                d.retry_after_ms = Some(d.retry_after_ms.map_or(ms, |x| x.max(ms)));
            }
        }
    }
    deltas
}

/// The rejection for `requested` more jobs on a full destination, with a Retry-After of
/// the time the backlog needs to drain enough room at the destination's rate.
pub(crate) fn full_error(dest: &AdmissionDest<'_>, requested: usize) -> EnqueueError {
    let gcra = Gcra {
        interval_us: dest.interval_us,
        burst: dest.burst.max(1) as u32,
    };
    let need = dest
        .backlog
        .saturating_add(requested as i64)
        .saturating_sub(dest.capacity)
        .max(1);
    let wait_us = gcra.drain_time_us(dest.next_slot_us, dest.now_us, need as u64);
    EnqueueError::Full {
        name: dest.name.to_owned(),
        capacity: dest.capacity,
        backlog: dest.backlog,
        requested,
        retry_after_secs: (wait_us.max(0) as u64).div_ceil(1_000_000).max(1),
    }
}

/// A dead job and its destination, read under their locks before a retry:
/// `(job state, destination id, name, capacity, backlog, next_slot_us,
/// effective_interval_us, burst)`.
pub(crate) type RetryRow = (String, i64, String, i64, i64, i64, i64, i32);

/// Whether a job may be put back in line: it must be dead, and its destination must have
/// room like any enqueue. Returns the destination id.
pub(crate) fn check_dead_job_retry(
    id: Uuid,
    row: Option<RetryRow>,
    now_us: i64,
) -> Result<i64, EnqueueError> {
    let Some((state, dest, name, capacity, backlog, next_slot_us, interval_us, burst)) = row else {
        return Err(Error::UnknownJob(id).into());
    };
    let state: JobState = state.parse().unwrap_or(JobState::Queued);
    if state != JobState::Dead {
        return Err(Error::WrongState {
            id,
            state,
            expected: "dead",
        }
        .into());
    }
    if backlog >= capacity {
        return Err(full_error(
            &AdmissionDest {
                name: &name,
                capacity,
                backlog,
                next_slot_us,
                interval_us,
                burst,
                now_us,
            },
            1,
        ));
    }
    Ok(dest)
}

/// The destination as admission sees it (under its lock).
#[derive(Clone, Copy)]
pub(crate) struct AdmissionDest<'a> {
    pub(crate) name: &'a str,
    pub(crate) capacity: i64,
    pub(crate) backlog: i64,
    pub(crate) next_slot_us: i64,
    pub(crate) interval_us: i64,
    pub(crate) burst: i32,
    pub(crate) now_us: i64,
}

/// Who is admitted: one result per job, the new jobs to insert, and how many were turned
/// away for lack of room.
pub(crate) struct AdmissionDecision<'j> {
    pub(crate) results: Vec<Result<Admitted, EnqueueError>>,
    pub(crate) fresh: Vec<(Uuid, &'j NewJob)>,
    pub(crate) rejected: i64,
}

/// Decides admission for `jobs` given the destination's state, each job's URL check and
/// the jobs already known under their idempotency keys.
pub(crate) fn decide_admission<'j>(
    dest: &AdmissionDest<'_>,
    jobs: &'j [NewJob],
    url_errors: Vec<Option<FieldError>>,
    mut known: HashMap<String, (Uuid, JobState)>,
    mode: Admission,
) -> AdmissionDecision<'j> {
    let name = dest.name;
    // Decide each job: existing (idempotent repeat), new, or over capacity.
    let room = dest.capacity.saturating_sub(dest.backlog).max(0);
    let mut keys_seen = std::collections::HashSet::new();
    let new_wanted = jobs
        .iter()
        .zip(&url_errors)
        .filter(|(j, e)| {
            e.is_none()
                && match &j.idempotency_key {
                    Some(k) => !known.contains_key(k) && keys_seen.insert(k.as_str()),
                    None => true,
                }
        })
        .count() as i64;
    let batch_fits = new_wanted <= room;
    let mut results: Vec<Result<Admitted, EnqueueError>> = Vec::with_capacity(jobs.len());
    let mut fresh: Vec<(Uuid, &NewJob)> = Vec::with_capacity(jobs.len());
    let mut rejected = 0i64;
    for (job, url_error) in jobs.iter().zip(url_errors) {
        if let Some(e) = url_error {
            results.push(Err(Error::InvalidJob(e).into()));
            continue;
        }
        if let Some(&(id, state)) = job.idempotency_key.as_ref().and_then(|k| known.get(k)) {
            results.push(Ok(Admitted {
                id,
                state,
                created: false,
            }));
            continue;
        }
        let fits = match mode {
            Admission::AllOrNothing => batch_fits,
            Admission::EachJob => (fresh.len() as i64) < room,
        };
        if !fits {
            rejected += 1;
            results.push(Err(EnqueueError::Full {
                name: name.to_owned(),
                capacity: dest.capacity,
                backlog: dest.backlog,
                requested: 1,
                retry_after_secs: 0, // filled in below
            }));
            continue;
        }
        let id = Uuid::now_v7();
        if let Some(key) = &job.idempotency_key {
            known.insert(key.clone(), (id, JobState::Queued));
        }
        fresh.push((id, job));
        results.push(Ok(Admitted {
            id,
            state: JobState::Queued,
            created: true,
        }));
    }
    if mode == Admission::AllOrNothing && !batch_fits {
        // Nothing goes in; the repeats found above are still reported as a rejection.
        fresh.clear();
        rejected = new_wanted;
    }

    if rejected > 0 {
        // Room is estimated after this request's admissions.
        let after = AdmissionDest {
            backlog: dest.backlog + fresh.len() as i64,
            ..*dest
        };
        if mode == Admission::AllOrNothing {
            return AdmissionDecision {
                results: jobs
                    .iter()
                    .map(|_| Err(full_error(&after, new_wanted as usize)))
                    .collect(),
                fresh: Vec::new(),
                rejected,
            };
        }
        for r in &mut results {
            if matches!(r, Err(EnqueueError::Full { .. })) {
                *r = Err(full_error(&after, 1));
            }
        }
    }
    AdmissionDecision {
        results,
        fresh,
        rejected,
    }
}

pub(crate) fn run_at(job: &NewJob, now: Micros) -> Micros {
    job.not_before_us.map_or(now, |nb| nb.max(now))
}

/// The job's URL against the destination's allow-list (`None` when it passes).
pub(crate) fn check_url(job: &NewJob, allowed: &[String], field: String) -> Option<FieldError> {
    if allowed.is_empty() {
        return None;
    }
    match parse_job_url(&job.url) {
        Err(m) => Some(FieldError { field, message: m }),
        Ok(url) if !url_allowed(&url, allowed) => Some(FieldError {
            field,
            message: format!(
                "{:?} is not under the destination's allowed_base_urls {allowed:?}",
                job.url
            ),
        }),
        Ok(_) => None,
    }
}

pub(crate) fn field_name(batch: usize, i: usize, mode: Admission) -> String {
    if batch == 1 || mode == Admission::EachJob {
        "url".to_owned()
    } else {
        format!("jobs[{i}].url")
    }
}

/// A destination's throttling state, as a completion batch reads it under the lock.
#[derive(Debug, Clone, sqlx::FromRow)]
pub(crate) struct DestinationState {
    pub(crate) id: i64,
    pub(crate) next_slot_us: i64,
    pub(crate) throttle_streak: i32,
    pub(crate) throttle_backoff_base_ms: i64,
    pub(crate) throttle_backoff_cap_ms: i64,
    pub(crate) adaptive_rate: bool,
    pub(crate) interval_us: i64,
    pub(crate) effective_interval_us: i64,
}

/// What a completion batch writes back to a destination.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DestinationChange {
    pub(crate) next_slot_us: i64,
    /// A throttle moved `next_slot` (dispatchers must give back earlier claims).
    pub(crate) shifted: bool,
    pub(crate) throttle_streak: i32,
    pub(crate) effective_interval_us: i64,
}

/// Applies a batch's delta to a destination at database time `now`:
///
/// * `next_slot` = max(next_slot — rolled back to the earliest returned claim's slot when
///   nobody claimed after it —, now + the largest throttle delay, now + the no-hint
///   backoff `min(cap, base × 2^streak)`);
/// * the throttle streak grows with each throttle and resets on a success;
/// * with adaptive rate, each throttle halves the effective rate (to 1/1024 of the
///   configured one at worst) and each success adds 1% of the configured rate back.
pub(crate) fn apply_delta(
    s: &DestinationState,
    d: &DestinationDelta,
    now: i64,
) -> DestinationChange {
    let base = match d.give_back {
        Some((back_to, back_if)) if s.next_slot_us == back_if => back_to,
        _ => s.next_slot_us,
    };
    let shift = d.shift_us.map(|us| now.saturating_add(us));
    let backoff = d.backoff.then(|| {
        let factor = 1i64 << s.throttle_streak.clamp(0, 30);
        let ms = s
            .throttle_backoff_base_ms
            .saturating_mul(factor)
            .min(s.throttle_backoff_cap_ms);
        now.saturating_add(ms.saturating_mul(1_000))
    });
    let next_slot_us = [Some(base), shift, backoff]
        .into_iter()
        .flatten()
        .max()
        .unwrap_or(base);
    let throttle_streak = if d.throttles > 0 || d.backoff {
        s.throttle_streak.saturating_add(d.throttles.max(1))
    } else if d.successes > 0 {
        0
    } else {
        s.throttle_streak
    };
    let effective_interval_us = if !s.adaptive_rate {
        s.interval_us
    } else if d.throttles > 0 {
        let factor = 1i64 << d.throttles.clamp(0, 10);
        s.effective_interval_us
            .saturating_mul(factor)
            .min(s.interval_us.saturating_mul(1_024))
    } else if d.successes > 0 {
        // Rate r' = r + k · r_cfg / 100, in intervals: i' = i·i_cfg·100 / (i_cfg·100 + i·k).
        let (i, cfg, k) = (
            i128::from(s.effective_interval_us),
            i128::from(s.interval_us),
            i128::from(d.successes),
        );
        let next = i * cfg * 100 / (cfg * 100 + i * k).max(1);
        i64::try_from(next).unwrap_or(i64::MAX).max(s.interval_us)
    } else {
        s.effective_interval_us
    };
    DestinationChange {
        next_slot_us,
        shifted: d.shift_us.is_some() || d.backoff,
        throttle_streak,
        effective_interval_us,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state() -> DestinationState {
        DestinationState {
            id: 1,
            next_slot_us: 1_000,
            throttle_streak: 0,
            throttle_backoff_base_ms: 100,
            throttle_backoff_cap_ms: 1_000,
            adaptive_rate: true,
            interval_us: 10_000,
            effective_interval_us: 10_000,
        }
    }

    #[test]
    fn throttle_moves_next_slot_forward_only() {
        let s = state();
        let d = DestinationDelta {
            shift_us: Some(2_000_000),
            throttles: 1,
            ..Default::default()
        };
        let c = apply_delta(&s, &d, 5_000);
        assert_eq!(c.next_slot_us, 2_005_000);
        assert!(c.shifted);
        assert_eq!(c.throttle_streak, 1);
        assert_eq!(c.effective_interval_us, 20_000, "adaptive: rate halved");
        // A shift into the past never moves next_slot back.
        let d = DestinationDelta {
            shift_us: Some(0),
            ..Default::default()
        };
        let s2 = DestinationState {
            next_slot_us: 9_000_000,
            ..state()
        };
        assert_eq!(apply_delta(&s2, &d, 5_000).next_slot_us, 9_000_000);
    }

    #[test]
    fn backoff_doubles_with_the_streak_and_caps() {
        let d = DestinationDelta {
            backoff: true,
            throttles: 1,
            ..Default::default()
        };
        let mut s = state();
        let mut waits = Vec::new();
        for _ in 0..6 {
            let c = apply_delta(&s, &d, 0);
            waits.push(c.next_slot_us / 1_000);
            s.throttle_streak = c.throttle_streak;
        }
        assert_eq!(waits, vec![100, 200, 400, 800, 1_000, 1_000]);
        let ok = DestinationDelta {
            successes: 1,
            ..Default::default()
        };
        assert_eq!(apply_delta(&s, &ok, 0).throttle_streak, 0, "success resets");
    }

    #[test]
    fn returned_claims_give_slots_back_only_at_the_tail() {
        let s = DestinationState {
            next_slot_us: 500,
            ..state()
        };
        let d = DestinationDelta {
            give_back: Some((300, 500)),
            ..Default::default()
        };
        assert_eq!(apply_delta(&s, &d, 0).next_slot_us, 300);
        let d = DestinationDelta {
            give_back: Some((300, 400)),
            ..Default::default()
        };
        assert_eq!(
            apply_delta(&s, &d, 0).next_slot_us,
            500,
            "someone claimed after"
        );
    }

    #[test]
    fn adaptive_rate_recovers_additively_never_above_configured() {
        let s = DestinationState {
            effective_interval_us: 80_000,
            ..state()
        };
        let d = DestinationDelta {
            successes: 10,
            ..Default::default()
        };
        // 12.5/s + 10 × 1/s = 22.5/s → 44,444 µs.
        assert_eq!(apply_delta(&s, &d, 0).effective_interval_us, 44_444);
        let d = DestinationDelta {
            successes: 10_000,
            ..Default::default()
        };
        assert_eq!(apply_delta(&s, &d, 0).effective_interval_us, 10_000);
        let fixed = DestinationState {
            adaptive_rate: false,
            effective_interval_us: 80_000,
            ..state()
        };
        assert_eq!(apply_delta(&fixed, &d, 0).effective_interval_us, 10_000);
    }
}
