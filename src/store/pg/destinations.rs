//! Destination rows: upsert from config or the API, pause/resume, live figures.

use super::Pg;
use crate::destination::{DestinationName, DestinationSpec};
use crate::store::types::DestinationStatus;
use crate::store::{Error, Result, WAKE_CHANNEL};

/// Columns of [`DestinationStatus`], as a literal so statements stay `&'static str`.
macro_rules! status_columns {
    () => {
        "name, rate, interval_us, burst, capacity, max_in_flight,
    to_jsonb(allowed_base_urls) AS allowed_base_urls, timeout_ms,
    max_attempts, backoff_base_ms, backoff_cap_ms, retry_after_max_ms, throttle_floor_ms,
    throttle_backoff_base_ms, throttle_backoff_cap_ms, max_throttles, ratelimit_reset,
    adaptive_rate, 1000000.0::float8 / effective_interval_us AS effective_rate_per_second,
    effective_interval_us, paused,
    backlog - in_flight AS queued, in_flight, backlog, rejected_total, throttled_total,
    throttle_streak, last_retry_after_ms, throttled_until_us AS throttled_until,
    coalesce(throttled_until_us > sluice_now_us(), false) AS throttled,
    next_slot_us AS next_slot,
    greatest(0, (next_slot_us - sluice_now_us()) / 1000) AS delay_ms,
    created_at_us AS created_at, updated_at_us AS updated_at"
    };
}

impl Pg {
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
                  timeout_ms, max_attempts, backoff_base_ms, backoff_cap_ms, paused,
                  retry_after_max_ms, throttle_floor_ms, throttle_backoff_base_ms,
                  throttle_backoff_cap_ms, max_throttles, ratelimit_reset, adaptive_rate,
                  effective_interval_us)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, coalesce($12, false),
                     $13, $14, $15, $16, $17, $18, $19, $3)
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
                 retry_after_max_ms = EXCLUDED.retry_after_max_ms,
                 throttle_floor_ms = EXCLUDED.throttle_floor_ms,
                 throttle_backoff_base_ms = EXCLUDED.throttle_backoff_base_ms,
                 throttle_backoff_cap_ms = EXCLUDED.throttle_backoff_cap_ms,
                 max_throttles = EXCLUDED.max_throttles,
                 ratelimit_reset = EXCLUDED.ratelimit_reset,
                 adaptive_rate = EXCLUDED.adaptive_rate,
                 -- A new rate (or switching adaptation off) starts from the configured
                 -- interval; otherwise keep what adaptation has learned.
                 effective_interval_us = CASE
                     WHEN EXCLUDED.adaptive_rate AND d.adaptive_rate
                          AND EXCLUDED.interval_us = d.interval_us
                         THEN d.effective_interval_us
                     ELSE EXCLUDED.interval_us END,
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
        .bind(spec.throttle.retry_after_max_ms)
        .bind(spec.throttle.throttle_floor_ms)
        .bind(spec.throttle_backoff_base_ms)
        .bind(spec.throttle_backoff_cap_ms)
        .bind(spec.max_throttles)
        .bind(spec.throttle.ratelimit_reset.map(|u| u.as_str()))
        .bind(spec.adaptive_rate)
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
