//! The `sluice` command line.
//!
//! `serve`, `worker` and `migrate` run the service; the other commands talk to the
//! database directly (the same admission rules as the API apply), so they work with or
//! without a running server.

use std::io::Read as _;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context as _};
use clap::{Args, Parser, Subcommand};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::app::{self, Roles};
use crate::config::Config;
use crate::destination::{DestinationConfig, DestinationName};
use crate::job::{JobRequest, JobState};
use crate::rate::Rate;
use crate::store::{EnqueueError, JobFilter, Store};
use crate::timestamp::format_us;

/// Sluice: a rate-shaping job dispatcher.
#[derive(Debug, Parser)]
#[command(name = "sluice", version, about, long_about = None)]
pub struct Cli {
    /// Configuration file [default: config.toml, if present]
    #[arg(long, global = true, value_name = "PATH")]
    pub config: Option<PathBuf>,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the HTTP API and a dispatcher.
    Serve,
    /// Run a dispatcher only (scale out by running more).
    Worker,
    /// Apply database migrations and exit.
    Migrate,
    /// Enqueue one job; prints its id.
    Enqueue(EnqueueArgs),
    /// List destinations with live figures.
    Destinations {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Create, update, show, pause or resume a destination.
    #[command(subcommand)]
    Destination(DestinationCommand),
    /// List, show, cancel or retry jobs.
    #[command(subcommand)]
    Jobs(JobsCommand),
    /// Watch a leaky and a bursty destination side by side (nothing to set up).
    Demo {
        /// Jobs per destination.
        #[arg(long, default_value_t = 100)]
        jobs: usize,
        /// Rate of both destinations.
        #[arg(long, default_value = "50/s")]
        rate: Rate,
        /// Burst of the bursty destination.
        #[arg(long, default_value_t = 20)]
        burst: u32,
    },
}

/// `sluice enqueue`.
#[derive(Debug, Args)]
pub struct EnqueueArgs {
    /// Destination name.
    pub destination: String,
    /// Target URL.
    #[arg(long)]
    pub url: String,
    /// HTTP method.
    #[arg(short = 'X', long = "method", default_value = "POST")]
    pub method: String,
    /// Header, as 'Name: value' (repeatable).
    #[arg(short = 'H', long = "header", value_name = "NAME: VALUE")]
    pub headers: Vec<String>,
    /// Body; @FILE reads a file, @- reads stdin.
    #[arg(short = 'd', long = "data")]
    pub data: Option<String>,
    /// Deduplication key: a repeat returns the existing job.
    #[arg(long)]
    pub idempotency_key: Option<String>,
    /// RFC 3339 time before which the job is not sent.
    #[arg(long)]
    pub not_before: Option<String>,
    /// RFC 3339 time after which the job expires unsent.
    #[arg(long)]
    pub deadline: Option<String>,
    /// Attempts before the job is dead-lettered.
    #[arg(long)]
    pub max_attempts: Option<u32>,
}

/// `sluice destination ...`.
#[derive(Debug, Subcommand)]
pub enum DestinationCommand {
    /// Create or replace a destination's settings (unset options take their defaults).
    Set(Box<SetArgs>),
    /// Show one destination as JSON.
    Show {
        /// Destination name.
        name: String,
    },
    /// Hold the destination's jobs (enqueues are still accepted up to capacity).
    Pause {
        /// Destination name.
        name: String,
    },
    /// Release the destination's jobs again.
    Resume {
        /// Destination name.
        name: String,
    },
}

/// `sluice destination set`.
#[derive(Debug, Args)]
pub struct SetArgs {
    /// Destination name.
    pub name: String,
    /// Sustained rate, e.g. 50/s, 600/min, 1/5s.
    #[arg(long)]
    pub rate: Rate,
    /// Jobs admitted and unfinished at most; more are rejected.
    #[arg(long)]
    pub capacity: u64,
    /// Releases back to back after idleness [default: 1].
    #[arg(long)]
    pub burst: Option<u32>,
    /// Concurrent requests at most.
    #[arg(long)]
    pub max_in_flight: Option<u32>,
    /// URL prefix jobs may target (repeatable; none = any http(s) URL).
    #[arg(long = "allowed-base-url")]
    pub allowed_base_urls: Vec<String>,
    /// Request timeout in milliseconds [default: 10000].
    #[arg(long)]
    pub timeout_ms: Option<u64>,
    /// Attempts per job [default: 10].
    #[arg(long)]
    pub max_attempts: Option<u32>,
    /// Retry backoff base in milliseconds [default: 1000].
    #[arg(long)]
    pub backoff_base_ms: Option<u64>,
    /// Retry backoff cap in milliseconds [default: 300000].
    #[arg(long)]
    pub backoff_cap_ms: Option<u64>,
    /// Longest downstream wait hint honoured, ms [default: 3600000].
    #[arg(long)]
    pub retry_after_max_ms: Option<u64>,
    /// Least wait after a 429, ms [default: 1000].
    #[arg(long)]
    pub throttle_floor_ms: Option<u64>,
    /// First wait after a 429 without a hint, ms; doubles per consecutive 429 [default: 1000].
    #[arg(long)]
    pub throttle_backoff_base_ms: Option<u64>,
    /// Cap of that backoff, ms [default: 300000].
    #[arg(long)]
    pub throttle_backoff_cap_ms: Option<u64>,
    /// Throttles a job may take before it is dead [default: 100].
    #[arg(long)]
    pub max_throttles: Option<u32>,
    /// Read X-RateLimit-Reset as delta or epoch seconds [default: ignore those headers].
    #[arg(long, value_parser = ["delta", "epoch"])]
    pub ratelimit_reset: Option<String>,
    /// Lower the rate on repeated 429s, recover it on success.
    #[arg(long)]
    pub adaptive_rate: bool,
}

/// `sluice jobs ...`.
#[derive(Debug, Subcommand)]
pub enum JobsCommand {
    /// List jobs, newest first.
    List {
        /// Only this destination.
        #[arg(long)]
        destination: Option<String>,
        /// Only this state (queued, running, succeeded, dead, cancelled, expired).
        #[arg(long)]
        state: Option<JobState>,
        /// At most this many.
        #[arg(long, default_value_t = 50)]
        limit: u32,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Show one job as JSON.
    Show {
        /// Job id.
        id: Uuid,
    },
    /// Cancel a queued job.
    Cancel {
        /// Job id.
        id: Uuid,
    },
    /// Put a dead job back in line with fresh attempts.
    Retry {
        /// Job id.
        id: Uuid,
    },
}

/// Exit status when an enqueue is rejected because the destination is full
/// (`EX_TEMPFAIL`: try again later).
pub const EXIT_FULL: u8 = 75;

/// Runs the parsed command line.
pub async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    let (path, required) = match &cli.config {
        Some(p) => (p.clone(), true),
        None => (PathBuf::from("config.toml"), false),
    };
    let config = Config::load(&path, required)?;
    match cli.command {
        Command::Serve | Command::Worker => {
            let roles = if matches!(cli.command, Command::Serve) {
                Roles::SERVE
            } else {
                Roles::WORKER
            };
            let shutdown = crate::shutdown::install();
            app::run(config, roles, None, shutdown).await?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Migrate => {
            let store = app::open_store(&config)?;
            app::prepare(&config, &store, &CancellationToken::new()).await?;
            println!("migrations applied");
            Ok(ExitCode::SUCCESS)
        }
        Command::Enqueue(args) => enqueue(&config, args).await,
        Command::Destinations { json } => {
            let store = ready_store(&config).await?;
            let all = store.list_destinations().await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&all)?);
            } else {
                println!(
                    "{:<24} {:>10} {:>6} {:>9} {:>8} {:>9} {:>9} {:>8} {:>6}",
                    "NAME",
                    "RATE",
                    "BURST",
                    "CAPACITY",
                    "QUEUED",
                    "IN_FLIGHT",
                    "DELAY_MS",
                    "REJECTED",
                    "PAUSED"
                );
                for d in all {
                    println!(
                        "{:<24} {:>10} {:>6} {:>9} {:>8} {:>9} {:>9} {:>8} {:>6}",
                        d.name,
                        d.rate,
                        d.burst,
                        d.capacity,
                        d.queued,
                        d.in_flight,
                        d.delay_ms,
                        d.rejected_total,
                        d.paused
                    );
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Destination(cmd) => destination(&config, cmd).await,
        Command::Jobs(cmd) => jobs(&config, cmd).await,
        Command::Demo { jobs, rate, burst } => {
            if jobs == 0 || jobs > 100_000 || !(2..=10_000).contains(&burst) {
                bail!("--jobs must be 1 to 100000 and --burst 2 to 10000");
            }
            crate::demo::run(crate::demo::DemoOptions { jobs, rate, burst }).await?;
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// Opens the store and makes sure the schema exists (CLI commands may run first).
async fn ready_store(config: &Config) -> anyhow::Result<Store> {
    let store = app::open_store(config)?;
    store
        .migrate()
        .await
        .context("cannot reach or migrate the database")?;
    Ok(store)
}

async fn enqueue(config: &Config, args: EnqueueArgs) -> anyhow::Result<ExitCode> {
    let mut headers = std::collections::BTreeMap::new();
    for h in &args.headers {
        let Some((name, value)) = h.split_once(':') else {
            bail!("header {h:?} is not in 'Name: value' form");
        };
        headers.insert(name.trim().to_owned(), value.trim().to_owned());
    }
    let body = match args.data.as_deref() {
        None => None,
        Some("@-") => {
            let mut s = String::new();
            std::io::stdin()
                .read_to_string(&mut s)
                .context("reading the body from stdin")?;
            Some(s)
        }
        Some(d) if d.starts_with('@') => {
            Some(std::fs::read_to_string(&d[1..]).with_context(|| format!("reading {}", &d[1..]))?)
        }
        Some(d) => Some(d.to_owned()),
    };
    let req = JobRequest {
        url: args.url,
        method: Some(args.method),
        headers,
        body,
        json: None,
        idempotency_key: args.idempotency_key,
        not_before: args.not_before,
        deadline: args.deadline,
        max_attempts: args.max_attempts,
    };
    let job = req
        .validate("")
        .map_err(|e| anyhow::anyhow!("invalid job: {e}"))?;
    let name = DestinationName::parse(&args.destination)?;
    let store = ready_store(config).await?;
    match store
        .enqueue(name.as_str(), std::slice::from_ref(&job))
        .await
    {
        Ok(admitted) => {
            for a in admitted {
                println!("{}", a.id);
                if !a.created {
                    eprintln!("(existing job for this idempotency key; state {})", a.state);
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        Err(e @ EnqueueError::Full { .. }) => {
            eprintln!("sluice: {e}");
            Ok(ExitCode::from(EXIT_FULL))
        }
        Err(EnqueueError::Store(e)) => Err(e.into()),
    }
}

async fn destination(config: &Config, cmd: DestinationCommand) -> anyhow::Result<ExitCode> {
    let store = ready_store(config).await?;
    match cmd {
        DestinationCommand::Set(a) => {
            let a = *a;
            let name = DestinationName::parse(&a.name)?;
            let cfg = DestinationConfig {
                rate: a.rate,
                capacity: a.capacity,
                burst: a.burst,
                max_in_flight: a.max_in_flight,
                allowed_base_urls: a.allowed_base_urls,
                timeout_ms: a.timeout_ms,
                max_attempts: a.max_attempts,
                backoff_base_ms: a.backoff_base_ms,
                backoff_cap_ms: a.backoff_cap_ms,
                retry_after_max_ms: a.retry_after_max_ms,
                throttle_floor_ms: a.throttle_floor_ms,
                throttle_backoff_base_ms: a.throttle_backoff_base_ms,
                throttle_backoff_cap_ms: a.throttle_backoff_cap_ms,
                max_throttles: a.max_throttles,
                ratelimit_reset: a
                    .ratelimit_reset
                    .as_deref()
                    .and_then(crate::throttle::ResetUnit::parse),
                adaptive_rate: Some(a.adaptive_rate),
                paused: None,
            };
            let spec = cfg
                .validate()
                .map_err(|e| anyhow::anyhow!("invalid destination: {e}"))?;
            let d = store.upsert_destination(&name, &spec).await?;
            println!("{}", serde_json::to_string_pretty(&d)?);
        }
        DestinationCommand::Show { name } => match store.get_destination(&name).await? {
            Some(d) => println!("{}", serde_json::to_string_pretty(&d)?),
            None => bail!("destination {name:?} does not exist"),
        },
        DestinationCommand::Pause { name } => set_paused(&store, &name, true).await?,
        DestinationCommand::Resume { name } => set_paused(&store, &name, false).await?,
    }
    Ok(ExitCode::SUCCESS)
}

async fn set_paused(store: &Store, name: &str, paused: bool) -> anyhow::Result<()> {
    if !store.set_paused(name, paused).await? {
        bail!("destination {name:?} does not exist");
    }
    println!("{name} {}", if paused { "paused" } else { "resumed" });
    Ok(())
}

async fn jobs(config: &Config, cmd: JobsCommand) -> anyhow::Result<ExitCode> {
    let store = ready_store(config).await?;
    match cmd {
        JobsCommand::List {
            destination,
            state,
            limit,
            json,
        } => {
            let jobs = store
                .list_jobs(&JobFilter {
                    destination,
                    state,
                    limit: Some(limit),
                })
                .await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&jobs)?);
            } else {
                println!(
                    "{:<36} {:<20} {:<9} {:>8} {:>6} {:<27} URL",
                    "ID", "DESTINATION", "STATE", "ATTEMPTS", "STATUS", "UPDATED"
                );
                for j in jobs {
                    println!(
                        "{:<36} {:<20} {:<9} {:>8} {:>6} {:<27} {} {}",
                        j.id,
                        j.destination,
                        j.state,
                        format!("{}/{}", j.attempts, j.max_attempts),
                        j.last_status
                            .map(|s| s.to_string())
                            .unwrap_or_else(|| "-".into()),
                        format_us(j.updated_at),
                        j.method,
                        j.url
                    );
                }
            }
        }
        JobsCommand::Show { id } => match store.get_job(id).await? {
            Some(j) => println!("{}", serde_json::to_string_pretty(&j)?),
            None => bail!("job {id} does not exist"),
        },
        JobsCommand::Cancel { id } => {
            let j = store.cancel_job(id).await?;
            println!("{} {}", j.id, j.state);
        }
        JobsCommand::Retry { id } => match store.retry_dead_job(id).await {
            Ok(j) => println!("{} {}", j.id, j.state),
            Err(e @ EnqueueError::Full { .. }) => {
                eprintln!("sluice: {e}");
                return Ok(ExitCode::from(EXIT_FULL));
            }
            Err(EnqueueError::Store(e)) => return Err(e.into()),
        },
    }
    Ok(ExitCode::SUCCESS)
}
