//! The storage layer: the only place SQL lives.
//!
//! A queue's correctness rests on a handful of hot statements (admission, claim,
//! completion); keeping them together lets them be reviewed as a set. Callers see typed
//! methods on [`Store`] and a typed [`Error`]; nothing above this module builds SQL.
//!
//! | file | statements |
//! |---|---|
//! | `destinations.rs` | upsert, pause, list, live figures |
//! | `enqueue.rs` | atomic admission against capacity, idempotency |
//! | `group.rs` | group commit: concurrent single enqueues share a transaction |
//! | `jobs.rs` | job lookups, cancel |
//! | `dispatch.rs` | claim with slots, completion, returning claims |
//! | `maintenance.rs` | lease renewal and rescue, expiry, retention, requeue |

use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::PgPool;
use uuid::Uuid;

use crate::destination::FieldError;
use crate::job::JobState;
use crate::rate::Micros;

mod destinations;
mod dispatch;
mod enqueue;
mod group;
mod jobs;
mod maintenance;

pub use destinations::DestinationStatus;
pub use dispatch::{Claim, ClaimParams, ClaimedJob, Completion, Outcome, THROTTLE_CHANNEL};
pub use enqueue::{enqueue_in, Admitted, EnqueueError};
pub use group::Enqueuer;
pub use jobs::JobFilter;
pub use maintenance::MAINTENANCE_LOCK_KEY;

/// Errors from the store. Callers react to the domain variants; `Database` and `Migrate`
/// are infrastructure failures (the API maps them to 500/503 and never echoes them).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// No destination has that name.
    #[error("destination {0:?} does not exist")]
    UnknownDestination(String),
    /// No job has that id.
    #[error("job {0} does not exist")]
    UnknownJob(Uuid),
    /// The job is not in a state the operation applies to.
    #[error("job {id} is {state}, not {expected}")]
    WrongState {
        /// The job.
        id: Uuid,
        /// Its current state.
        state: JobState,
        /// What the operation needed.
        expected: &'static str,
    },
    /// A job failed a check that needs the destination (e.g. its URL allow-list).
    #[error("{0}")]
    InvalidJob(FieldError),
    /// The database could not be reached or rejected a statement.
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
    /// Applying migrations failed.
    #[error("migration failed: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
}

impl Error {
    /// Whether the error means the database is unreachable (as opposed to a bad request or
    /// a bug), so callers can answer 503 and retry instead of failing hard.
    pub fn is_unavailable(&self) -> bool {
        matches!(
            self,
            Error::Database(
                sqlx::Error::PoolTimedOut
                    | sqlx::Error::Io(_)
                    | sqlx::Error::Tls(_)
                    | sqlx::Error::PoolClosed
                    | sqlx::Error::WorkerCrashed
            )
        ) || matches!(self, Error::Database(sqlx::Error::Database(e))
            if e.code().is_some_and(|c| c.starts_with("57P") || c.starts_with("08")))
    }
}

/// Result alias for store operations.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Connection settings for [`Store::connect`].
#[derive(Debug, Clone)]
pub struct StoreOptions {
    /// Largest number of pooled connections.
    pub max_connections: u32,
    /// How long a caller waits for a connection before getting [`Error::Database`]
    /// (`PoolTimedOut`): bounded so the API answers 503 during an outage instead of
    /// hanging.
    pub acquire_timeout: Duration,
}

impl Default for StoreOptions {
    fn default() -> Self {
        Self {
            max_connections: 16,
            acquire_timeout: Duration::from_secs(5),
        }
    }
}

/// Handle to the PostgreSQL store. Cheap to clone (it wraps a pool).
#[derive(Clone, Debug)]
pub struct Store {
    pool: PgPool,
}

/// Name of sluice's own migrations table, so it never collides with an application's
/// `_sqlx_migrations` when Sluice shares its database (enqueue inside your transaction).
pub const MIGRATIONS_TABLE: &str = "_sluice_migrations";

/// NOTIFY channel on which enqueues and config changes wake dispatchers.
pub const WAKE_CHANNEL: &str = "sluice_wake";

impl Store {
    /// Connects to PostgreSQL at `url`. Connections are opened lazily, so this succeeds
    /// while the database is down; the first query reports the outage.
    pub fn connect_lazy(url: &str, opts: &StoreOptions) -> Result<Self> {
        let connect: PgConnectOptions = url.parse()?;
        let pool = PgPoolOptions::new()
            .max_connections(opts.max_connections)
            .acquire_timeout(opts.acquire_timeout)
            .connect_lazy_with(connect.application_name("sluice"));
        Ok(Self { pool })
    }

    /// Connects and checks the database answers.
    pub async fn connect(url: &str, opts: &StoreOptions) -> Result<Self> {
        let store = Self::connect_lazy(url, opts)?;
        sqlx::query("SELECT 1").execute(&store.pool).await?;
        Ok(store)
    }

    /// Wraps an existing pool (for applications embedding Sluice).
    pub fn from_pool(pool: PgPool) -> Self {
        Self { pool }
    }

    /// The underlying pool, for transactions that enqueue alongside business changes.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Applies pending migrations (idempotent; safe to run from several processes at
    /// once, they serialise on an advisory lock).
    pub async fn migrate(&self) -> Result<()> {
        let mut migrator = sqlx::migrate!("./migrations");
        migrator.dangerous_set_table_name(MIGRATIONS_TABLE);
        migrator.run(&self.pool).await?;
        Ok(())
    }

    /// The database clock, in Unix microseconds. All slot arithmetic uses this clock.
    pub async fn now_us(&self) -> Result<Micros> {
        Ok(sqlx::query_scalar("SELECT sluice_now_us()")
            .fetch_one(&self.pool)
            .await?)
    }

    /// Closes the pool, waiting for connections to be returned.
    pub async fn close(&self) {
        self.pool.close().await;
    }
}
