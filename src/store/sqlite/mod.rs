//! The embedded backend: one SQLite file (WAL), one writer connection, one dispatching
//! process. It keeps the contract for a single process — spacing, bounded admission,
//! Retry-After, crash recovery, restart without loss — without a database server.
//!
//! Every statement runs on a single pooled connection, so transactions are serialised
//! in-process and never meet `SQLITE_BUSY` from each other. Other processes (the CLI) may
//! open the file too: every transaction that writes starts with `BEGIN IMMEDIATE`, so it
//! waits (up to the busy timeout) for another process's write to finish instead of failing
//! when its read snapshot goes stale, and a dispatcher picks their changes up within
//! `dispatcher.poll_interval_ms`. A second
//! *dispatching* process is refused: its slots would not be coordinated.

use std::fs::File;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{SqliteConnection, SqlitePool};
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;

use super::plan::EXPIRED_ERROR;
use super::{Error, Notice, Result, StoreOptions, MIGRATIONS_TABLE};
use crate::rate::Micros;

mod destinations;
mod dispatch;
mod enqueue;
mod jobs;
mod maintenance;

/// Whether `url` names an embedded store.
pub(crate) fn is_sqlite_url(url: &str) -> bool {
    url.starts_with("sqlite:")
}

/// An embedded store.
#[derive(Clone, Debug)]
pub(crate) struct Sqlite {
    pub(crate) pool: SqlitePool,
    path: PathBuf,
    notices: broadcast::Sender<Notice>,
    /// Held while this process dispatches from the file.
    dispatch_lock: Arc<Mutex<Option<File>>>,
}

/// The embedded store's clock: the local clock (one process reads and writes it).
pub(crate) fn now() -> Micros {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

impl Sqlite {
    /// Begins a transaction that will write. `BEGIN IMMEDIATE` takes the write lock up
    /// front: a deferred transaction that reads first cannot upgrade once another process
    /// has committed (`SQLITE_BUSY_SNAPSHOT`, which no busy timeout waits out).
    pub(crate) async fn write_tx(&self) -> Result<sqlx::Transaction<'static, sqlx::Sqlite>> {
        Ok(self.pool.begin_with("BEGIN IMMEDIATE").await?)
    }

    pub(crate) fn open(url: &str, opts: &StoreOptions) -> Result<Self> {
        let connect = SqliteConnectOptions::from_str(url)?
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            // Accepted jobs must survive a power cut, not just a process crash.
            .synchronous(SqliteSynchronous::Full)
            .busy_timeout(Duration::from_secs(5))
            .foreign_keys(true);
        let path = connect.get_filename().to_path_buf();
        let pool = SqlitePoolOptions::new()
            .max_connections(1)
            .acquire_timeout(opts.acquire_timeout)
            .connect_lazy_with(connect);
        let (notices, _) = broadcast::channel(1_024);
        Ok(Self {
            pool,
            path,
            notices,
            dispatch_lock: Arc::default(),
        })
    }

    pub(crate) async fn ping(&self) -> Result<()> {
        sqlx::query("SELECT 1").execute(&self.pool).await?;
        Ok(())
    }

    pub(crate) async fn migrate(&self) -> Result<()> {
        let mut migrator = sqlx::migrate!("./migrations/sqlite");
        migrator.dangerous_set_table_name(MIGRATIONS_TABLE);
        migrator.run(&self.pool).await?;
        Ok(())
    }

    pub(crate) async fn now_us(&self) -> Result<Micros> {
        Ok(now())
    }

    pub(crate) async fn close(&self) {
        self.pool.close().await;
    }

    /// Refuses a second dispatching process on the same file.
    pub(crate) fn lock_for_dispatch(&self) -> Result<()> {
        let mut held = self
            .dispatch_lock
            .lock()
            .map_err(|_| Error::Database(sqlx::Error::WorkerCrashed))?;
        if held.is_some() {
            return Ok(());
        }
        let mut lock_path = self.path.clone().into_os_string();
        lock_path.push(".dispatch-lock");
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(|e| Error::Database(sqlx::Error::Io(e)))?;
        match file.try_lock() {
            Ok(()) => {
                *held = Some(file);
                Ok(())
            }
            Err(std::fs::TryLockError::WouldBlock) => Err(Error::Embedded(format!(
                "another Sluice process is already dispatching from {}; the embedded store \
                 serves one process. Run several workers against PostgreSQL instead \
                 (set SLUICE_DATABASE_URL=postgres://...)",
                self.path.display()
            ))),
            Err(std::fs::TryLockError::Error(e)) => Err(Error::Database(sqlx::Error::Io(e))),
        }
    }

    /// Tells this process's dispatcher something changed.
    pub(crate) fn notify(&self, notice: Notice) {
        let _ = self.notices.send(notice);
    }

    pub(crate) async fn listen(
        &self,
        on: &(dyn Fn(Notice) + Send + Sync),
        stop: &CancellationToken,
    ) {
        let mut rx = self.notices.subscribe();
        on(Notice::Wake);
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                n = rx.recv() => match n {
                    Ok(n) => on(n),
                    Err(broadcast::error::RecvError::Lagged(_)) => on(Notice::Wake),
                    Err(broadcast::error::RecvError::Closed) => return,
                }
            }
        }
    }
}

/// Marks a queued job expired (its deadline passed before it could be released). The
/// caller adjusts the destination's backlog.
pub(crate) async fn expire_job(
    conn: &mut SqliteConnection,
    id: uuid::Uuid,
    at: Micros,
) -> Result<()> {
    sqlx::query(
        "UPDATE sluice_jobs
            SET state = 'expired', finished_at_us = ?2, updated_at_us = ?2, last_error = ?3
          WHERE id = ?1",
    )
    .bind(id)
    .bind(at)
    .bind(EXPIRED_ERROR)
    .execute(conn)
    .await?;
    Ok(())
}

/// Recomputes `due_at_us` for a destination from its row and its first queued job (the
/// embedded twin of PostgreSQL's `sluice_due_at`).
pub(crate) async fn refresh_due(
    conn: &mut SqliteConnection,
    destination: i64,
) -> Result<Option<Micros>> {
    Ok(sqlx::query_scalar(
        "UPDATE sluice_destinations
            SET due_at_us = CASE
                WHEN max_in_flight IS NOT NULL AND in_flight >= max_in_flight THEN NULL
                ELSE (SELECT max(sluice_destinations.next_slot_us
                                 - (sluice_destinations.burst - 1)
                                   * sluice_destinations.effective_interval_us,
                                 j.run_at_us)
                        FROM sluice_jobs j
                       WHERE j.destination_id = sluice_destinations.id AND j.state = 'queued'
                       ORDER BY j.run_at_us, j.id
                       LIMIT 1)
            END
          WHERE id = ?1
      RETURNING due_at_us",
    )
    .bind(destination)
    .fetch_one(&mut *conn)
    .await?)
}
