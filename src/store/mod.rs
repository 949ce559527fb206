//! The storage layer: the only place SQL lives.
//!
//! A queue's correctness rests on a handful of hot statements (admission, claim,
//! completion); keeping them together lets them be reviewed as a set. Callers see typed
//! methods on [`Store`] and a typed [`Error`]; nothing above this module builds SQL.
//!
//! Two backends sit behind [`Store`]: PostgreSQL (`pg/`, production, any number of
//! dispatchers) and an embedded SQLite file (`sqlite/`, zero setup, one process). The
//! decisions both share — which jobs a claim takes at which slots, what a batch of
//! outcomes does to a destination, who is admitted — live once in `plan.rs`.
//!
//! | file | contents |
//! |---|---|
//! | `types.rs` | what callers see: statuses, claims, outcomes, errors |
//! | `plan.rs` | pure decisions shared by the backends |
//! | `pg/destinations.rs`, `sqlite/destinations.rs` | upsert, pause, list, live figures |
//! | `pg/enqueue.rs`, `sqlite/enqueue.rs` | atomic admission against capacity, idempotency |
//! | `group.rs` | group commit: concurrent single enqueues share a transaction |
//! | `pg/jobs.rs`, `sqlite/jobs.rs` | job lookups, cancel |
//! | `pg/dispatch.rs`, `sqlite/dispatch.rs` | claim with slots, completion, returning claims |
//! | `pg/maintenance.rs`, `sqlite/maintenance.rs` | leases, rescue, expiry, retention, requeue |

use std::time::Duration;

use std::collections::BTreeMap;

use serde::Serialize;
use sqlx::{PgConnection, PgPool};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::destination::{DestinationName, DestinationSpec, FieldError};
use crate::job::{Job, JobState, NewJob};
use crate::rate::Micros;

mod group;
mod pg;
mod plan;
mod sqlite;
mod types;

pub use group::Enqueuer;
pub use pg::enqueue::enqueue_in;
pub use pg::MAINTENANCE_LOCK_KEY;
pub use types::{
    Admission, Admitted, Claim, ClaimParams, ClaimedJob, Completion, DestinationStatus,
    EnqueueError, JobFilter, Outcome, THROTTLE_CHANNEL,
};

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
    /// The embedded store refused (for example, a second dispatching process).
    #[error("{0}")]
    Embedded(String),
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
            if e.code().is_some_and(|c| transient_code(&c)))
    }
}

/// Whether a database error code means "unavailable for now" rather than a bad request.
fn transient_code(code: &str) -> bool {
    // PostgreSQL (SQLSTATE): the server is shutting down, or connection trouble.
    code.starts_with("57P") || code.starts_with("08")
        // SQLite: another process held the file's write lock longer than the busy
        // timeout (SQLITE_BUSY and its extended codes).
        || matches!(code, "5" | "261" | "517" | "773")
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

/// Handle to the store. Cheap to clone (it wraps a pool).
#[derive(Clone, Debug)]
pub struct Store {
    pub(crate) backend: Backend,
}

#[derive(Clone, Debug)]
pub(crate) enum Backend {
    Postgres(pg::Pg),
    Sqlite(sqlite::Sqlite),
}

/// Runs `$body` with `$b` bound to whichever backend the store has.
macro_rules! backend {
    ($self:expr, $b:ident => $body:expr) => {
        match &$self.backend {
            Backend::Postgres($b) => $body,
            Backend::Sqlite($b) => $body,
        }
    };
}

/// Name of sluice's own migrations table, so it never collides with an application's
/// `_sqlx_migrations` when Sluice shares its database (enqueue inside your transaction).
pub const MIGRATIONS_TABLE: &str = "_sluice_migrations";

/// NOTIFY channel on which enqueues and config changes wake dispatchers.
pub const WAKE_CHANNEL: &str = "sluice_wake";

/// What a dispatcher hears from the store between its own queries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Notice {
    /// Something may have become due: look again.
    Wake,
    /// A destination's `next_slot` moved to `until_us` because a downstream throttled it:
    /// give back claims before it.
    Throttle {
        /// The destination.
        destination: i64,
        /// Its new `next_slot`.
        until_us: Micros,
    },
}

impl Notice {
    /// Parses a throttle payload `"<destination>:<next_slot_us>"`.
    pub(crate) fn parse_throttle(payload: &str) -> Option<Notice> {
        let (d, s) = payload.split_once(':')?;
        Some(Notice::Throttle {
            destination: d.parse().ok()?,
            until_us: s.parse().ok()?,
        })
    }
}

/// The right to run maintenance, held until dropped (PostgreSQL: an advisory lock on a
/// dedicated connection; embedded: the process already owns the file).
#[derive(Debug)]
pub struct Leadership {
    conn: Option<PgConnection>,
}

impl Leadership {
    /// Checks the leadership still holds (the lock lives only as long as its connection).
    pub async fn check(&mut self) -> Result<()> {
        if let Some(conn) = &mut self.conn {
            sqlx::query("SELECT 1").execute(conn).await?;
        }
        Ok(())
    }

    /// Gives leadership up.
    pub async fn release(self) {
        if let Some(conn) = self.conn {
            use sqlx::Connection as _;
            let _ = conn.close().await;
        }
    }
}

/// A destination whose counters disagree with its job rows (see [`Store::audit`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, sqlx::FromRow)]
pub struct CounterAudit {
    /// Destination.
    pub name: String,
    /// The admission counter.
    pub backlog: i64,
    /// Jobs actually queued or running.
    pub open: i64,
    /// The in-flight counter.
    pub in_flight: i64,
    /// Jobs actually running.
    pub running: i64,
}

impl Store {
    /// Opens the store at `url`: `postgres://…` or `sqlite:PATH` / `sqlite://PATH`.
    /// PostgreSQL connections are opened lazily, so this succeeds while the database is
    /// down; the first query reports the outage.
    pub fn connect_lazy(url: &str, opts: &StoreOptions) -> Result<Self> {
        let backend = if sqlite::is_sqlite_url(url) {
            Backend::Sqlite(sqlite::Sqlite::open(url, opts)?)
        } else {
            Backend::Postgres(pg::Pg::connect_lazy(url, opts)?)
        };
        Ok(Self { backend })
    }

    /// Opens the store and checks the database answers.
    pub async fn connect(url: &str, opts: &StoreOptions) -> Result<Self> {
        let store = Self::connect_lazy(url, opts)?;
        backend!(store, b => b.ping().await)?;
        Ok(store)
    }

    /// Wraps an existing PostgreSQL pool (for applications embedding Sluice).
    pub fn from_pool(pool: PgPool) -> Self {
        Self {
            backend: Backend::Postgres(pg::Pg { pool }),
        }
    }

    /// The PostgreSQL pool, for transactions that enqueue alongside business changes
    /// ([`enqueue_in`]); `None` for the embedded store.
    pub fn pg_pool(&self) -> Option<&PgPool> {
        match &self.backend {
            Backend::Postgres(pg) => Some(&pg.pool),
            Backend::Sqlite(_) => None,
        }
    }

    /// Whether this is the embedded single-process store.
    pub fn is_embedded(&self) -> bool {
        matches!(self.backend, Backend::Sqlite(_))
    }

    /// Claims the right to dispatch from this store. PostgreSQL allows any number of
    /// dispatchers; the embedded store allows one process, and refuses a second one with a
    /// clear error while the first runs.
    pub fn lock_for_dispatch(&self) -> Result<()> {
        match &self.backend {
            Backend::Postgres(_) => Ok(()),
            Backend::Sqlite(s) => s.lock_for_dispatch(),
        }
    }

    /// Applies pending migrations (idempotent; safe to run from several processes at
    /// once).
    pub async fn migrate(&self) -> Result<()> {
        backend!(self, b => b.migrate().await)
    }

    /// The database clock, in Unix microseconds. All slot arithmetic uses this clock.
    pub async fn now_us(&self) -> Result<Micros> {
        backend!(self, b => b.now_us().await)
    }

    /// Closes the pool, waiting for connections to be returned.
    pub async fn close(&self) {
        backend!(self, b => b.close().await)
    }

    /// Calls `on` for every [`Notice`] until `stop`.
    pub async fn listen(&self, on: &(dyn Fn(Notice) + Send + Sync), stop: &CancellationToken) {
        backend!(self, b => b.listen(on, stop).await)
    }

    /// Tries to become the maintenance leader.
    pub async fn try_lead(&self) -> Result<Option<Leadership>> {
        match &self.backend {
            Backend::Postgres(pg) => Ok(pg.try_lead().await?.map(|c| Leadership { conn: Some(c) })),
            Backend::Sqlite(_) => Ok(Some(Leadership { conn: None })),
        }
    }

    /// Creates or updates a destination. Runtime state (next_slot, counters) is kept;
    /// `spec.paused = None` keeps the paused flag. Wakes dispatchers.
    pub async fn upsert_destination(
        &self,
        name: &DestinationName,
        spec: &DestinationSpec,
    ) -> Result<DestinationStatus> {
        backend!(self, b => b.upsert_destination(name, spec).await)
    }

    /// Pauses or resumes a destination. Returns `false` when it does not exist.
    pub async fn set_paused(&self, name: &str, paused: bool) -> Result<bool> {
        backend!(self, b => b.set_paused(name, paused).await)
    }

    /// One destination with live figures.
    pub async fn get_destination(&self, name: &str) -> Result<Option<DestinationStatus>> {
        backend!(self, b => b.get_destination(name).await)
    }

    /// All destinations, by name.
    pub async fn list_destinations(&self) -> Result<Vec<DestinationStatus>> {
        backend!(self, b => b.list_destinations().await)
    }

    /// Admits `jobs` to destination `name`, all or nothing, in its own transaction.
    pub async fn enqueue(
        &self,
        name: &str,
        jobs: &[NewJob],
    ) -> Result<Vec<Admitted>, EnqueueError> {
        backend!(self, b => b.enqueue(name, jobs).await)
    }

    /// One job by id.
    pub async fn get_job(&self, id: Uuid) -> Result<Option<Job>> {
        backend!(self, b => b.get_job(id).await)
    }

    /// Jobs matching `filter`, newest first.
    pub async fn list_jobs(&self, filter: &JobFilter) -> Result<Vec<Job>> {
        backend!(self, b => b.list_jobs(filter).await)
    }

    /// Cancels a queued job, freeing its place in the destination's capacity.
    pub async fn cancel_job(&self, id: Uuid) -> Result<Job> {
        backend!(self, b => b.cancel_job(id).await)
    }

    /// Claims the jobs whose slots fall within the horizon, across due destinations.
    pub async fn claim(&self, p: &ClaimParams) -> Result<Claim> {
        backend!(self, b => b.claim(p).await)
    }

    /// The earliest instant any destination has claimable work, if any.
    pub async fn next_due(&self) -> Result<Option<Micros>> {
        backend!(self, b => b.next_due().await)
    }

    /// Records outcomes of claims held by `worker_id`; outcomes for jobs the worker no
    /// longer holds are ignored.
    pub async fn complete(&self, worker_id: Uuid, done: &[Completion]) -> Result<()> {
        if done.is_empty() {
            return Ok(());
        }
        backend!(self, b => b.complete(worker_id, done).await)
    }

    /// Extends the leases of every job `worker_id` holds to at least `now + margin_us`.
    pub async fn extend_leases(&self, worker_id: Uuid, margin_us: i64) -> Result<u64> {
        backend!(self, b => b.extend_leases(worker_id, margin_us).await)
    }

    /// Returns up to `limit` running jobs whose lease expired to the queue (dead on their
    /// last attempt).
    pub async fn rescue_expired_leases(&self, limit: i64) -> Result<u64> {
        backend!(self, b => b.rescue_expired_leases(limit).await)
    }

    /// Expires up to `limit` queued jobs whose deadline has passed.
    pub async fn expire_overdue(&self, limit: i64) -> Result<u64> {
        backend!(self, b => b.expire_overdue(limit).await)
    }

    /// Deletes up to `limit` finished jobs that finished before `before_us`.
    pub async fn prune_finished(&self, before_us: Micros, limit: i64) -> Result<u64> {
        backend!(self, b => b.prune_finished(before_us, limit).await)
    }

    /// Reclaims space after pruning.
    pub async fn vacuum(&self) -> Result<()> {
        backend!(self, b => b.vacuum().await)
    }

    /// Puts a dead job back in line with fresh attempts, subject to capacity.
    pub async fn retry_dead_job(&self, id: Uuid) -> Result<Job, EnqueueError> {
        backend!(self, b => b.retry_dead_job(id).await)
    }

    /// Admits a group of single enqueues (by destination) in one commit, each job on its
    /// own; see [`Enqueuer`].
    pub(crate) async fn admit_group(
        &self,
        group: &group::Group,
    ) -> Result<group::GroupResults, EnqueueError> {
        backend!(self, b => b.admit_group(group).await)
    }

    /// Jobs per state.
    pub async fn job_counts(&self) -> Result<BTreeMap<JobState, i64>> {
        let rows: Vec<(String, i64)> = backend!(self, b => b.job_counts().await)?;
        Ok(rows
            .into_iter()
            .filter_map(|(s, n)| s.parse().ok().map(|s| (s, n)))
            .collect())
    }

    /// Destinations whose counters (`backlog`, `in_flight`) disagree with their job rows.
    /// Empty when the store is consistent; tests assert it after every scenario.
    pub async fn audit(&self) -> Result<Vec<CounterAudit>> {
        backend!(self, b => b.audit().await)
    }
}

#[cfg(test)]
mod tests {
    use super::transient_code;

    #[test]
    fn transient_codes_of_both_stores() {
        for code in ["57P01", "57P03", "08006", "08001", "5", "517", "773"] {
            assert!(transient_code(code), "{code}");
        }
        // Constraint violations, syntax errors, SQLite's constraint and "no table".
        for code in ["23505", "42601", "55000", "19", "2067", "1"] {
            assert!(!transient_code(code), "{code}");
        }
    }
}
