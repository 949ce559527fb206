//! Destination rows on the embedded store.

use super::{now, refresh_due, Sqlite};
use crate::destination::{DestinationName, DestinationSpec};
use crate::store::types::DestinationStatus;
use crate::store::{Error, Notice, Result};

/// Columns of [`DestinationStatus`]; `?1` is the clock.
macro_rules! status_columns {
    () => {
        "name, rate, interval_us, burst, capacity, max_in_flight, allowed_base_urls, timeout_ms,
         max_attempts, backoff_base_ms, backoff_cap_ms, retry_after_max_ms, throttle_floor_ms,
         throttle_backoff_base_ms, throttle_backoff_cap_ms, max_throttles, ratelimit_reset,
         adaptive_rate, 1000000.0 / effective_interval_us AS effective_rate_per_second,
         effective_interval_us, paused,
         backlog - in_flight AS queued, in_flight, backlog, rejected_total, throttled_total,
         throttle_streak, last_retry_after_ms, throttled_until_us AS throttled_until,
         coalesce(throttled_until_us > ?1, 0) AS throttled,
         next_slot_us AS next_slot, max(0, (next_slot_us - ?1) / 1000) AS delay_ms,
         created_at_us AS created_at, updated_at_us AS updated_at"
    };
}

impl Sqlite {
    pub(crate) async fn upsert_destination(
        &self,
        name: &DestinationName,
        spec: &DestinationSpec,
    ) -> Result<DestinationStatus> {
        let at = now();
        let urls = serde_json::to_string(&spec.allowed_base_urls)
            .map_err(|e| Error::Database(sqlx::Error::Encode(Box::new(e))))?;
        let mut tx = self.write_tx().await?;
        let id: i64 = sqlx::query_scalar(
            "INSERT INTO sluice_destinations
                 (name, rate, interval_us, burst, capacity, max_in_flight, allowed_base_urls,
                  timeout_ms, max_attempts, backoff_base_ms, backoff_cap_ms, paused,
                  retry_after_max_ms, throttle_floor_ms, throttle_backoff_base_ms,
                  throttle_backoff_cap_ms, max_throttles, ratelimit_reset, adaptive_rate,
                  effective_interval_us, created_at_us, updated_at_us)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, coalesce(?12, 0),
                     ?13, ?14, ?15, ?16, ?17, ?18, ?19, ?3, ?20, ?20)
             ON CONFLICT (name) DO UPDATE SET
                 rate = excluded.rate,
                 interval_us = excluded.interval_us,
                 burst = excluded.burst,
                 capacity = excluded.capacity,
                 max_in_flight = excluded.max_in_flight,
                 allowed_base_urls = excluded.allowed_base_urls,
                 timeout_ms = excluded.timeout_ms,
                 max_attempts = excluded.max_attempts,
                 backoff_base_ms = excluded.backoff_base_ms,
                 backoff_cap_ms = excluded.backoff_cap_ms,
                 paused = coalesce(?12, paused),
                 retry_after_max_ms = excluded.retry_after_max_ms,
                 throttle_floor_ms = excluded.throttle_floor_ms,
                 throttle_backoff_base_ms = excluded.throttle_backoff_base_ms,
                 throttle_backoff_cap_ms = excluded.throttle_backoff_cap_ms,
                 max_throttles = excluded.max_throttles,
                 ratelimit_reset = excluded.ratelimit_reset,
                 effective_interval_us = CASE
                     WHEN excluded.adaptive_rate AND adaptive_rate
                          AND excluded.interval_us = interval_us
                         THEN effective_interval_us
                     ELSE excluded.interval_us END,
                 adaptive_rate = excluded.adaptive_rate,
                 updated_at_us = ?20
             RETURNING id",
        )
        .bind(name.as_str())
        .bind(spec.rate.as_str())
        .bind(spec.rate.interval_us())
        .bind(spec.burst as i32)
        .bind(spec.capacity)
        .bind(spec.max_in_flight)
        .bind(urls)
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
        .bind(at)
        .fetch_one(&mut *tx)
        .await?;
        refresh_due(&mut tx, id).await?;
        tx.commit().await?;
        self.notify(Notice::Wake);
        self.get_destination(name.as_str())
            .await?
            .ok_or_else(|| Error::UnknownDestination(name.to_string()))
    }

    pub(crate) async fn set_paused(&self, name: &str, paused: bool) -> Result<bool> {
        let found = sqlx::query(
            "UPDATE sluice_destinations SET paused = ?2, updated_at_us = ?3 WHERE name = ?1",
        )
        .bind(name)
        .bind(paused)
        .bind(now())
        .execute(&self.pool)
        .await?
        .rows_affected()
            > 0;
        if found && !paused {
            self.notify(Notice::Wake);
        }
        Ok(found)
    }

    pub(crate) async fn get_destination(&self, name: &str) -> Result<Option<DestinationStatus>> {
        Ok(sqlx::query_as(concat!(
            "SELECT ",
            status_columns!(),
            " FROM sluice_destinations WHERE name = ?2"
        ))
        .bind(now())
        .bind(name)
        .fetch_optional(&self.pool)
        .await?)
    }

    pub(crate) async fn list_destinations(&self) -> Result<Vec<DestinationStatus>> {
        Ok(sqlx::query_as(concat!(
            "SELECT ",
            status_columns!(),
            " FROM sluice_destinations ORDER BY name"
        ))
        .bind(now())
        .fetch_all(&self.pool)
        .await?)
    }
}
