//! Process wiring: open the store, apply migrations, upsert configured destinations, then
//! run the API and/or a dispatcher until shutdown. `main` and the tests both come here.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::api::{self, ApiState};
use crate::config::{redact, Config};
use crate::dispatcher::Dispatcher;
use crate::maintenance::Maintenance;
use crate::metrics::Metrics;
use crate::store::{Enqueuer, Store, StoreOptions};

/// Concurrent group-commit transactions for single enqueues (see `store::Enqueuer`).
const ENQUEUE_WORKERS: usize = 4;

/// Which parts of Sluice a process runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Roles {
    /// Serve the HTTP API.
    pub api: bool,
    /// Run a dispatcher.
    pub dispatcher: bool,
}

impl Roles {
    /// `sluice serve`: API and dispatcher in one process.
    pub const SERVE: Roles = Roles {
        api: true,
        dispatcher: true,
    };
    /// `sluice worker`: dispatcher only.
    pub const WORKER: Roles = Roles {
        api: false,
        dispatcher: true,
    };
}

/// The embedded store used when no database URL is configured.
pub const DEFAULT_DATABASE_URL: &str = "sqlite:sluice.db";

/// The configured database URL, or the embedded default.
pub fn database_url(config: &Config) -> &str {
    config
        .database_url
        .as_deref()
        .unwrap_or(DEFAULT_DATABASE_URL)
}

/// Opens the configured store without touching the schema.
pub fn open_store(config: &Config) -> anyhow::Result<Store> {
    let url = database_url(config);
    let opts = StoreOptions {
        max_connections: config.database.max_connections,
        acquire_timeout: config.acquire_timeout(),
    };
    Store::connect_lazy(url, &opts).with_context(|| format!("invalid database URL {}", redact(url)))
}

/// Applies migrations and upserts the destinations declared in config, retrying while
/// the database is unreachable (a service often starts before its database).
pub async fn prepare(
    config: &Config,
    store: &Store,
    shutdown: &CancellationToken,
) -> anyhow::Result<()> {
    let specs = config.destination_specs()?;
    let mut delay = Duration::from_millis(200);
    loop {
        let attempt = async {
            store.migrate().await?;
            for (name, spec) in &specs {
                store.upsert_destination(name, spec).await?;
            }
            Ok::<_, crate::store::Error>(())
        };
        match attempt.await {
            Ok(()) => return Ok(()),
            Err(e) if e.is_unavailable() => {
                tracing::warn!(error = %e, retry_in_ms = delay.as_millis() as u64, "database unavailable at start; retrying");
                tokio::select! {
                    _ = shutdown.cancelled() => anyhow::bail!("shutdown requested before the database became available"),
                    _ = tokio::time::sleep(delay) => {}
                }
                delay = (delay * 2).min(Duration::from_secs(5));
            }
            Err(e) => return Err(e).context("preparing the database"),
        }
    }
}

/// Runs the roles until `shutdown` fires. With `listener = None` the API binds
/// `config.listen`; tests pass a listener on port 0.
pub async fn run(
    config: Config,
    roles: Roles,
    listener: Option<TcpListener>,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let store = open_store(&config)?;
    run_with_store(store, config, roles, listener, shutdown).await
}

/// [`run`] on a store the caller opened (tests share it with in-process dispatchers,
/// which on the embedded store is how they hear about enqueues).
pub async fn run_with_store(
    store: Store,
    config: Config,
    roles: Roles,
    listener: Option<TcpListener>,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    if store.is_embedded() {
        tracing::info!(
            "using the embedded SQLite store at {} (one process; for several workers set \
             SLUICE_DATABASE_URL=postgres://user@host/db)",
            database_url(&config)
                .trim_start_matches("sqlite:")
                .trim_start_matches("//")
        );
    } else {
        tracing::info!(database = %redact(database_url(&config)), "using PostgreSQL");
    }
    if roles.dispatcher {
        store.lock_for_dispatch()?;
    }
    prepare(&config, &store, &shutdown).await?;
    let metrics = Arc::new(Metrics::default());
    let mut tasks = tokio::task::JoinSet::new();

    if roles.api {
        let listener = match listener {
            Some(l) => l,
            None => TcpListener::bind(config.listen)
                .await
                .with_context(|| format!("cannot listen on {}", config.listen))?,
        };
        let addr = listener.local_addr()?;
        tracing::info!(%addr, "listening on http://{addr}");
        let state = ApiState {
            enqueuer: Enqueuer::start(store.clone(), ENQUEUE_WORKERS),
            store: store.clone(),
            config: Arc::new(config.api.clone()),
            metrics: metrics.clone(),
        };
        let token = shutdown.child_token();
        tasks.spawn(async move {
            api::serve(listener, state, token)
                .await
                .context("API server failed")
        });
    }
    if roles.dispatcher {
        let dispatcher = Dispatcher::new(store.clone(), config.dispatcher.clone(), metrics.clone());
        let token = shutdown.child_token();
        tasks.spawn(async move { dispatcher.run(token).await });
        if config.maintenance.enabled {
            let maintenance = Maintenance::new(
                store.clone(),
                config.maintenance.clone(),
                Duration::from_millis(config.dispatcher.lease_margin_ms),
            );
            let token = shutdown.child_token();
            tasks.spawn(async move {
                maintenance.run(token).await;
                Ok(())
            });
        }
    }
    let mut result = Ok(());
    while let Some(joined) = tasks.join_next().await {
        let r = joined.context("task panicked").and_then(|r| r);
        if let Err(e) = r {
            tracing::error!(error = %format!("{e:#}"), "stopping");
            shutdown.cancel();
            result = Err(e);
        }
    }
    store.close().await;
    result
}
