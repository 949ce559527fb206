//! Types every store backend shares: what the API and the dispatcher see, and the rows
//! both backends decode.

use std::sync::Arc;

use serde::Serialize;
use sqlx::types::Json;
use sqlx::FromRow;
use uuid::Uuid;

use super::Error;
use crate::job::{Job, JobState};
use crate::rate::Micros;
use crate::throttle::{Shift, ThrottlePolicy};
use crate::timestamp::format_us;

/// A destination's configuration plus its live figures, as the API shows it.
#[derive(Debug, Clone, Serialize, FromRow)]
pub struct DestinationStatus {
    /// Name.
    pub name: String,
    /// Sustained rate as written.
    pub rate: String,
    /// Microseconds between releases.
    pub interval_us: i64,
    /// Releases back to back after idleness.
    pub burst: i32,
    /// Bound on admitted-but-unfinished jobs.
    pub capacity: i64,
    /// Cap on concurrent requests.
    pub max_in_flight: Option<i32>,
    /// URL prefixes jobs may target (empty: any http(s) URL).
    #[sqlx(json)]
    pub allowed_base_urls: Vec<String>,
    /// Per-request timeout.
    pub timeout_ms: i32,
    /// Default attempts per job.
    pub max_attempts: i32,
    /// Retry backoff base.
    pub backoff_base_ms: i64,
    /// Retry backoff cap.
    pub backoff_cap_ms: i64,
    /// Longest downstream wait hint honoured.
    pub retry_after_max_ms: i64,
    /// Least wait after a 429.
    pub throttle_floor_ms: i64,
    /// No-hint 429 backoff base.
    pub throttle_backoff_base_ms: i64,
    /// No-hint 429 backoff cap.
    pub throttle_backoff_cap_ms: i64,
    /// Throttles per job before it is dead.
    pub max_throttles: i32,
    /// How `X-RateLimit-Reset` is read (`delta`, `epoch`, or null: ignored).
    pub ratelimit_reset: Option<String>,
    /// Whether the rate adapts to repeated 429s.
    pub adaptive_rate: bool,
    /// The rate claims currently use, per second (the configured one unless adaptive
    /// rate has lowered it).
    pub effective_rate_per_second: f64,
    /// Interval behind `effective_rate_per_second`.
    pub effective_interval_us: i64,
    /// Whether the dispatcher holds this destination's jobs.
    pub paused: bool,
    /// Jobs waiting for a slot.
    pub queued: i64,
    /// Jobs claimed by a dispatcher (scheduled or in flight).
    pub in_flight: i32,
    /// Admitted and unfinished (`queued + in_flight`), compared against `capacity`.
    pub backlog: i64,
    /// Enqueues rejected because the destination was full.
    pub rejected_total: i64,
    /// Responses that throttled (429, 503 with Retry-After) or announced exhaustion.
    pub throttled_total: i64,
    /// Consecutive throttles (drives the no-hint backoff; reset by a success).
    pub throttle_streak: i32,
    /// The latest wait hint honoured, in milliseconds.
    pub last_retry_after_ms: Option<i64>,
    /// Until when the latest throttle holds the destination (null if never throttled).
    #[serde(serialize_with = "ser_opt_ts")]
    pub throttled_until: Option<Micros>,
    /// Whether a throttle holds the destination right now.
    pub throttled: bool,
    /// Earliest next release (GCRA theoretical arrival time).
    #[serde(serialize_with = "ser_ts")]
    pub next_slot: Micros,
    /// `next_slot - now` in milliseconds, 0 when a release could happen now.
    pub delay_ms: i64,
    /// Creation time.
    #[serde(serialize_with = "ser_ts")]
    pub created_at: Micros,
    /// Last configuration change.
    #[serde(serialize_with = "ser_ts")]
    pub updated_at: Micros,
}

fn ser_ts<S: serde::Serializer>(us: &Micros, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&format_us(*us))
}

fn ser_opt_ts<S: serde::Serializer>(us: &Option<Micros>, s: S) -> Result<S::Ok, S::Error> {
    match us {
        Some(us) => s.serialize_str(&format_us(*us)),
        None => s.serialize_none(),
    }
}

/// Filters for [`Store::list_jobs`](super::Store::list_jobs).
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
pub(crate) struct JobRow {
    pub(crate) id: Uuid,
    pub(crate) destination: String,
    pub(crate) state: String,
    pub(crate) method: String,
    pub(crate) url: String,
    pub(crate) headers: Json<Vec<(String, String)>>,
    pub(crate) body_bytes: i64,
    pub(crate) idempotency_key: Option<String>,
    pub(crate) attempts: i32,
    pub(crate) max_attempts: i32,
    pub(crate) throttles: i32,
    pub(crate) last_retry_after_ms: Option<i64>,
    pub(crate) run_at_us: i64,
    pub(crate) deadline_us: Option<i64>,
    pub(crate) slot_us: Option<i64>,
    pub(crate) last_status: Option<i32>,
    pub(crate) last_error: Option<String>,
    pub(crate) response_snippet: Option<String>,
    pub(crate) created_at_us: i64,
    pub(crate) updated_at_us: i64,
    pub(crate) finished_at_us: Option<i64>,
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

/// One job's admission result.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Admitted {
    /// The job's id (the existing one for a repeated idempotency key).
    pub id: Uuid,
    /// The job's current state.
    pub state: JobState,
    /// `false` when an earlier job with the same idempotency key was returned instead.
    pub created: bool,
}

/// Why an enqueue admitted nothing.
#[derive(Debug, thiserror::Error)]
pub enum EnqueueError {
    /// The destination has `capacity` jobs admitted and unfinished already.
    #[error("destination {name:?} is full: {backlog} of {capacity} jobs waiting, {requested} more requested; retry in about {retry_after_secs} s")]
    Full {
        /// Destination.
        name: String,
        /// Its capacity.
        capacity: i64,
        /// Jobs admitted and unfinished.
        backlog: i64,
        /// Jobs this request would have added.
        requested: usize,
        /// Whole seconds until enough room should have drained at the destination's rate.
        retry_after_secs: u64,
    },
    /// Anything else: unknown destination, bad job, database failure.
    #[error(transparent)]
    Store(#[from] Error),
}

impl From<sqlx::Error> for EnqueueError {
    fn from(e: sqlx::Error) -> Self {
        EnqueueError::Store(Error::Database(e))
    }
}

/// How a group of jobs is admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// The batch endpoint and [`enqueue_in`](super::enqueue_in): every job or none.
    AllOrNothing,
    /// Independent requests sharing one commit: each job is admitted on its own, in
    /// order, while there is room.
    EachJob,
}

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
pub(crate) struct DueDestination {
    pub(crate) id: i64,
    pub(crate) name: String,
    pub(crate) next_slot_us: i64,
    pub(crate) interval_us: i64,
    pub(crate) burst: i32,
    pub(crate) max_in_flight: Option<i32>,
    pub(crate) in_flight: i32,
    pub(crate) timeout_ms: i32,
    pub(crate) backoff_base_ms: i64,
    pub(crate) backoff_cap_ms: i64,
    pub(crate) last_claimer: Option<Uuid>,
    pub(crate) retry_after_max_ms: i64,
    pub(crate) throttle_floor_ms: i64,
    pub(crate) max_throttles: i32,
    pub(crate) ratelimit_reset: Option<String>,
    pub(crate) now_us: i64,
}

#[derive(FromRow)]
pub(crate) struct Candidate {
    pub(crate) id: Uuid,
    pub(crate) destination_id: i64,
    pub(crate) run_at_us: i64,
    pub(crate) deadline_us: Option<i64>,
}

#[derive(FromRow)]
pub(crate) struct ClaimedRow {
    pub(crate) id: Uuid,
    pub(crate) method: String,
    pub(crate) url: String,
    pub(crate) headers: Json<Vec<(String, String)>>,
    pub(crate) body: Option<Vec<u8>>,
    pub(crate) attempts: i32,
    pub(crate) max_attempts: i32,
    pub(crate) throttles: i32,
    pub(crate) deadline_us: Option<i64>,
}
