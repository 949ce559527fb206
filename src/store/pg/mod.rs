//! The PostgreSQL backend: the production store, shared by any number of dispatchers.
//! Claims lock destination rows with `FOR UPDATE SKIP LOCKED`; wake-ups travel by
//! `LISTEN/NOTIFY`; maintenance is led by whoever holds an advisory lock.

use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgListener, PgPoolOptions};
use sqlx::{Connection as _, PgConnection, PgPool};
use tokio_util::sync::CancellationToken;

use super::{Notice, Result, StoreOptions, MIGRATIONS_TABLE, THROTTLE_CHANNEL, WAKE_CHANNEL};
use crate::rate::Micros;

pub(super) mod destinations;
pub(super) mod dispatch;
pub(super) mod enqueue;
pub(super) mod jobs;
pub(super) mod maintenance;

/// Advisory-lock key under which one dispatcher at a time runs maintenance
/// (`'sluice-m'` as bytes).
pub const MAINTENANCE_LOCK_KEY: i64 = 0x736c_7569_6365_2d6d;

/// Recomputes `due_at_us` of `destinations` from the values their rows hold now.
pub(super) async fn refresh_due(conn: &mut PgConnection, destinations: &[i64]) -> Result<()> {
    sqlx::query(
        "UPDATE sluice_destinations
            SET due_at_us = sluice_due_at(id, next_slot_us, effective_interval_us, burst,
                                          in_flight, max_in_flight)
          WHERE id = ANY($1)",
    )
    .bind(destinations)
    .execute(conn)
    .await?;
    Ok(())
}

/// A pool on a PostgreSQL database.
#[derive(Clone, Debug)]
pub(crate) struct Pg {
    pub(crate) pool: PgPool,
}

impl Pg {
    pub(crate) fn connect_lazy(url: &str, opts: &StoreOptions) -> Result<Self> {
        let connect: PgConnectOptions = url.parse()?;
        let pool = PgPoolOptions::new()
            .max_connections(opts.max_connections)
            .acquire_timeout(opts.acquire_timeout)
            .connect_lazy_with(connect.application_name("sluice"));
        Ok(Self { pool })
    }

    pub(crate) async fn ping(&self) -> Result<()> {
        sqlx::query("SELECT 1").execute(&self.pool).await?;
        Ok(())
    }

    pub(crate) async fn migrate(&self) -> Result<()> {
        let mut migrator = sqlx::migrate!("./migrations/postgres");
        migrator.dangerous_set_table_name(MIGRATIONS_TABLE);
        migrator.run(&self.pool).await?;
        Ok(())
    }

    pub(crate) async fn now_us(&self) -> Result<Micros> {
        Ok(sqlx::query_scalar("SELECT sluice_now_us()")
            .fetch_one(&self.pool)
            .await?)
    }

    pub(crate) async fn close(&self) {
        self.pool.close().await;
    }

    /// Forwards NOTIFYs as [`Notice`]s until `stop`. On a lost connection it reports a
    /// wake-up (notifications may have been missed) and lets sqlx reconnect.
    pub(crate) async fn listen(
        &self,
        on: &(dyn Fn(Notice) + Send + Sync),
        stop: &CancellationToken,
    ) {
        let mut failures = 0u32;
        while !stop.is_cancelled() {
            let mut listener = match PgListener::connect_with(&self.pool).await {
                Ok(l) => l,
                Err(e) => {
                    failures += 1;
                    if failures == 1 {
                        tracing::warn!(error = %e, "cannot LISTEN; relying on polling until the database is back");
                    }
                    let backoff = Duration::from_millis(200 * u64::from(failures.min(10)));
                    tokio::select! {
                        _ = stop.cancelled() => return,
                        _ = tokio::time::sleep(backoff) => continue,
                    }
                }
            };
            if let Err(e) = listener.listen_all([WAKE_CHANNEL, THROTTLE_CHANNEL]).await {
                tracing::warn!(error = %e, "LISTEN failed");
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep(Duration::from_secs(1)) => continue,
                }
            }
            failures = 0;
            on(Notice::Wake);
            loop {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    msg = listener.try_recv() => match msg {
                        Ok(Some(n)) if n.channel() == THROTTLE_CHANNEL => {
                            if let Some(notice) = Notice::parse_throttle(n.payload()) {
                                on(notice);
                            }
                        }
                        Ok(Some(_)) | Ok(None) => on(Notice::Wake),
                        Err(_) => {
                            on(Notice::Wake);
                            break;
                        }
                    }
                }
            }
        }
    }

    /// Tries to take the maintenance lock on a dedicated connection.
    pub(crate) async fn try_lead(&self) -> Result<Option<PgConnection>> {
        let options = self.pool.connect_options();
        let mut conn = PgConnection::connect_with(&options).await?;
        let got: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
            .bind(MAINTENANCE_LOCK_KEY)
            .fetch_one(&mut conn)
            .await?;
        if got {
            Ok(Some(conn))
        } else {
            let _ = conn.close().await;
            Ok(None)
        }
    }
}
