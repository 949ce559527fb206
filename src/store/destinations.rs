//! Destination rows: upsert from config or the API, pause/resume, live figures.

use serde::Serialize;
use sqlx::FromRow;

use super::{Error, Result, Store, WAKE_CHANNEL};
use crate::destination::{DestinationName, DestinationSpec};
use crate::rate::Micros;
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
    pub allowed_base_urls: Vec<String>,
    /// Per-request timeout.
    pub timeout_ms: i32,
    /// Default attempts per job.
    pub max_attempts: i32,
    /// Retry backoff base.
    pub backoff_base_ms: i64,
    /// Retry backoff cap.
    pub backoff_cap_ms: i64,
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

/// Columns of [`DestinationStatus`], as a literal so statements stay `&'static str`.
macro_rules! status_columns {
    () => {
        "name, rate, interval_us, burst, capacity, max_in_flight, allowed_base_urls, timeout_ms,
    max_attempts, backoff_base_ms, backoff_cap_ms, paused,
    backlog - in_flight AS queued, in_flight, backlog, rejected_total,
    next_slot_us AS next_slot,
    greatest(0, (next_slot_us - sluice_now_us()) / 1000) AS delay_ms,
    created_at_us AS created_at, updated_at_us AS updated_at"
    };
}

impl Store {
    /// Creates or updates a destination. Runtime state (next_slot, counters) is kept;
    /// `spec.paused = None` keeps the paused flag. Wakes dispatchers, since a new rate,
    /// burst or in-flight cap can make the destination due sooner.
    pub async fn upsert_destination(
        &self,
        name: &DestinationName,
        spec: &DestinationSpec,
    ) -> Result<DestinationStatus> {
        let mut tx = self.pool.begin().await?;
        sqlx::query(
            "INSERT INTO sluice_destinations AS d
                 (name, rate, interval_us, burst, capacity, max_in_flight, allowed_base_urls,
                  timeout_ms, max_attempts, backoff_base_ms, backoff_cap_ms, paused)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, coalesce($12, false))
             ON CONFLICT (name) DO UPDATE SET
                 rate = EXCLUDED.rate,
                 interval_us = EXCLUDED.interval_us,
                 burst = EXCLUDED.burst,
                 capacity = EXCLUDED.capacity,
                 max_in_flight = EXCLUDED.max_in_flight,
                 allowed_base_urls = EXCLUDED.allowed_base_urls,
                 timeout_ms = EXCLUDED.timeout_ms,
                 max_attempts = EXCLUDED.max_attempts,
                 backoff_base_ms = EXCLUDED.backoff_base_ms,
                 backoff_cap_ms = EXCLUDED.backoff_cap_ms,
                 paused = coalesce($12, d.paused),
                 due_at_us = sluice_due_at(d.id, d.next_slot_us, EXCLUDED.interval_us,
                                           EXCLUDED.burst, d.in_flight, EXCLUDED.max_in_flight),
                 updated_at_us = sluice_now_us()",
        )
        .bind(name.as_str())
        .bind(spec.rate.as_str())
        .bind(spec.rate.interval_us())
        .bind(spec.burst as i32)
        .bind(spec.capacity)
        .bind(spec.max_in_flight)
        .bind(&spec.allowed_base_urls)
        .bind(spec.timeout_ms)
        .bind(spec.max_attempts)
        .bind(spec.backoff_base_ms)
        .bind(spec.backoff_cap_ms)
        .bind(spec.paused)
        .execute(&mut *tx)
        .await?;
        notify_wake(&mut tx).await?;
        tx.commit().await?;
        self.get_destination(name.as_str())
            .await?
            .ok_or_else(|| Error::UnknownDestination(name.to_string()))
    }

    /// Pauses or resumes a destination. Returns `false` when it does not exist.
    pub async fn set_paused(&self, name: &str, paused: bool) -> Result<bool> {
        let mut tx = self.pool.begin().await?;
        let found = sqlx::query(
            "UPDATE sluice_destinations SET paused = $2, updated_at_us = sluice_now_us()
              WHERE name = $1",
        )
        .bind(name)
        .bind(paused)
        .execute(&mut *tx)
        .await?
        .rows_affected()
            > 0;
        if found && !paused {
            notify_wake(&mut tx).await?;
        }
        tx.commit().await?;
        Ok(found)
    }

    /// One destination with live figures.
    pub async fn get_destination(&self, name: &str) -> Result<Option<DestinationStatus>> {
        Ok(sqlx::query_as(concat!(
            "SELECT ",
            status_columns!(),
            " FROM sluice_destinations WHERE name = $1"
        ))
        .bind(name)
        .fetch_optional(&self.pool)
        .await?)
    }

    /// All destinations, by name.
    pub async fn list_destinations(&self) -> Result<Vec<DestinationStatus>> {
        Ok(sqlx::query_as(concat!(
            "SELECT ",
            status_columns!(),
            " FROM sluice_destinations ORDER BY name"
        ))
        .fetch_all(&self.pool)
        .await?)
    }
}

/// Tells dispatchers to re-read due destinations when this transaction commits.
pub(super) async fn notify_wake(conn: &mut sqlx::PgConnection) -> Result<()> {
    sqlx::query("SELECT pg_notify($1, '')")
        .bind(WAKE_CHANNEL)
        .execute(conn)
        .await?;
    Ok(())
}
