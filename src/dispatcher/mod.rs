//! The dispatcher: claims jobs with release slots, releases each at its slot, delivers it,
//! and records the outcome.
//!
//! ```text
//!            NOTIFY / completions / timer
//!                       │ wake
//!  ┌────────────────────▼─────────────────┐   tickets   ┌──────────────────────┐
//!  │ claim loop: Store::claim(horizon)    │────────────▶│ release thread       │
//!  │ one task per claimed job, waiting    │◀────────────│ sleep, spin, Go(t)   │
//!  └───────────────┬──────────────────────┘   verdict   └──────────────────────┘
//!                  │ Go: Deliverer::send → retry::classify
//!                  ▼
//!          completer: Store::complete (batched)
//! ```
//!
//! Any number of dispatchers may run against one database: the destination row lock
//! serialises claims per destination and its `next_slot` carries the rate between them.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, Notify, Semaphore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use uuid::Uuid;

use crate::config::DispatcherConfig;
use crate::delivery::Deliverer;
use crate::metrics::Metrics;
use crate::rate::Micros;
use crate::store::{ClaimParams, ClaimedJob, Completion, Notice, Outcome, Store};

mod clock;
mod completer;
pub mod release;
pub mod retry;

pub use clock::DbClock;
use release::{Release, ReleaseTimer, Ticket};

/// A release as the dispatcher saw it, for observers (tests, benchmarks).
#[derive(Debug, Clone)]
pub struct ReleaseEvent {
    /// The job.
    pub job_id: Uuid,
    /// Its destination.
    pub destination: Arc<str>,
    /// The slot it was claimed for (database clock).
    pub slot_us: Micros,
    /// When the release thread let it go.
    pub at: Instant,
    /// How long after its slot (local clock mapping) the job went.
    pub late: Duration,
}

/// Destinations with intervals at least this long are released by a plain sleep (about
/// 0.1–0.3 ms late) instead of sleep-then-spin: the spin's CPU buys nothing measurable.
const SPIN_BELOW_INTERVAL: Duration = Duration::from_secs(1);

/// How long shutdown waits for outcomes to be written once requests are done.
const FLUSH_DEADLINE: Duration = Duration::from_secs(10);

/// How often the database/local clock mapping is refreshed.
const CLOCK_RESYNC: Duration = Duration::from_secs(15);

/// How late a release may be before it is abandoned: 2% of the interval, between 50 µs
/// and 1 ms. See [`release`] for why late releases are dropped rather than sent.
pub fn late_limit(interval_us: i64) -> Duration {
    Duration::from_micros((interval_us / 50).clamp(50, 1_000) as u64)
}

/// How far ahead of the database clock a claim must put its first slot: the time a claim
/// takes, plus a margin. Tracked as a slowly decaying maximum of recent claim durations,
/// so one slow claim raises it at once and it relaxes over the following claims.
#[derive(Debug)]
struct ClaimLead {
    recent_max_us: i64,
}

impl Default for ClaimLead {
    fn default() -> Self {
        // Until measured, assume a slow claim; it decays to the real figure within tens
        // of claims.
        Self {
            recent_max_us: 5_000,
        }
    }
}

impl ClaimLead {
    const MARGIN_US: i64 = 1_000;
    const CAP_US: i64 = 50_000;

    fn observe(&mut self, took: Duration) {
        let us = i64::try_from(took.as_micros()).unwrap_or(i64::MAX);
        self.recent_max_us = us.max(self.recent_max_us - self.recent_max_us / 8);
    }

    fn lead_us(&self) -> i64 {
        (self.recent_max_us + Self::MARGIN_US).min(Self::CAP_US)
    }
}

/// A dispatcher bound to a store. Build with [`Dispatcher::new`], start with
/// [`Dispatcher::run`].
pub struct Dispatcher {
    store: Store,
    config: DispatcherConfig,
    worker_id: Uuid,
    metrics: Arc<Metrics>,
    observer: Option<mpsc::UnboundedSender<ReleaseEvent>>,
}

impl Dispatcher {
    /// A dispatcher with a fresh worker id.
    pub fn new(store: Store, config: DispatcherConfig, metrics: Arc<Metrics>) -> Self {
        Self {
            store,
            config,
            worker_id: Uuid::now_v7(),
            metrics,
            observer: None,
        }
    }

    /// Reports every release to `tx` (tests and benchmarks measure spacing with it).
    pub fn with_observer(mut self, tx: mpsc::UnboundedSender<ReleaseEvent>) -> Self {
        self.observer = Some(tx);
        self
    }

    /// This dispatcher's id, recorded on the jobs it claims.
    pub fn worker_id(&self) -> Uuid {
        self.worker_id
    }

    /// Runs until `shutdown` is cancelled, then returns unreleased claims to the queue
    /// and waits for in-flight requests.
    pub async fn run(self, shutdown: CancellationToken) -> anyhow::Result<()> {
        let cfg = &self.config;
        let deliverer = Deliverer::new()?;
        let timer = ReleaseTimer::start(Duration::from_micros(cfg.spin_us))?;
        let wake = Arc::new(Notify::new());
        let background = TaskTracker::new();
        let jobs = TaskTracker::new();
        // Listener and heartbeat stop once in-flight work is done; the completer gets
        // its own token, fired only when the flush deadline passes.
        let stop_background = CancellationToken::new();
        let stop_completer = CancellationToken::new();
        let lease_margin = Duration::from_millis(cfg.lease_margin_ms);
        background.spawn(heartbeat(
            self.store.clone(),
            self.worker_id,
            lease_margin,
            stop_background.clone(),
        ));

        let (throttle_tx, mut throttle_rx) = mpsc::unbounded_channel::<(i64, Micros)>();
        background.spawn(listen(
            self.store.clone(),
            wake.clone(),
            throttle_tx,
            stop_background.clone(),
        ));
        let (done_tx, done_rx) = mpsc::unbounded_channel::<Completion>();
        background.spawn(completer::run(
            self.store.clone(),
            self.worker_id,
            done_rx,
            cfg.completion_batch,
            wake.clone(),
            self.metrics.clone(),
            stop_completer.clone(),
        ));

        let permits = Arc::new(Semaphore::new(cfg.max_concurrency));
        let horizon = Duration::from_millis(cfg.lookahead_ms);
        let poll = Duration::from_millis(cfg.poll_interval_ms);
        let params = ClaimParams {
            worker_id: self.worker_id,
            horizon_us: horizon.as_micros() as i64,
            lead_us: 0,
            max_destinations: i64::from(cfg.claim_destinations),
            max_jobs: 0,
            max_per_destination: cfg.claim_per_destination as usize,
            lease_margin_us: (cfg.lease_margin_ms as i64).saturating_mul(1_000),
        };
        let mut clock: Option<DbClock> = None;
        let mut lead = ClaimLead::default();
        let mut failures = 0u32;
        let mut last_claim = Instant::now() - horizon;
        tracing::info!(worker_id = %self.worker_id, "dispatcher started");

        while !shutdown.is_cancelled() {
            let step = async {
                let c = match clock {
                    Some(c) if c.taken.elapsed() < CLOCK_RESYNC => c,
                    _ => {
                        let c = DbClock::sync(&self.store).await?;
                        clock = Some(c);
                        c
                    }
                };
                let free = permits.available_permits();
                if free > 0 {
                    let started = Instant::now();
                    let claim = self
                        .store
                        .claim(&ClaimParams {
                            max_jobs: free,
                            lead_us: lead.lead_us(),
                            ..params.clone()
                        })
                        .await?;
                    last_claim = Instant::now();
                    if !claim.jobs.is_empty() {
                        // Empty claims are quicker than real ones; only real ones count.
                        lead.observe(last_claim - started);
                    }
                    Metrics::inc(&self.metrics.claims);
                    for job in claim.jobs {
                        let Ok(permit) = permits.clone().try_acquire_owned() else {
                            // Cannot happen (we claimed at most `free`); return it if it does.
                            let _ = done_tx.send(Completion::new(Arc::new(job), Outcome::Returned));
                            continue;
                        };
                        self.start_job(job, &c, &timer, &deliverer, &done_tx, permit, &jobs);
                    }
                }
                let next_due = self.store.next_due().await?;
                Ok::<_, crate::store::Error>((c, next_due))
            };
            let wake_at = match step.await {
                Ok((c, next_due)) => {
                    failures = 0;
                    let now = Instant::now();
                    match next_due {
                        // Claim again when the next slot comes within lead + horizon (so
                        // a backlogged destination's schedule never runs dry while the
                        // claim is in flight), but not more often than every half horizon
                        // while busy: each claim then covers many slots of fast
                        // destinations.
                        Some(due) => c
                            .instant_at(
                                due.saturating_sub(params.horizon_us)
                                    .saturating_sub(lead.lead_us()),
                            )
                            .max(last_claim + horizon / 2)
                            .min(now + poll),
                        None => now + poll,
                    }
                }
                Err(e) => {
                    failures += 1;
                    let backoff = Duration::from_millis(100 * 2u64.pow(failures.min(6)));
                    if failures == 1 || failures.is_multiple_of(20) {
                        tracing::warn!(error = %e, retry_in_ms = backoff.as_millis() as u64, "dispatcher cannot reach the database");
                    }
                    Instant::now() + backoff.min(poll.max(Duration::from_secs(1)))
                }
            };
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = wake.notified() => {}
                _ = tokio::time::sleep_until(wake_at.into()) => {}
                Some((destination, until_us)) = throttle_rx.recv() => {
                    // Another dispatcher (or this one) moved the destination's next_slot:
                    // give back every claim of ours that would go before it.
                    if let Some(c) = clock {
                        timer.revoke(destination, c.instant_at(until_us));
                    }
                }
            }
        }

        // Shutdown: unreleased claims go back at once (their slots too, where nobody
        // claimed after them); in-flight requests get the grace period to finish.
        tracing::info!(worker_id = %self.worker_id, in_flight = jobs.len(), "dispatcher stopping");
        timer.revoke_all();
        jobs.close();
        let grace = Duration::from_millis(cfg.shutdown_grace_ms);
        if tokio::time::timeout(grace, jobs.wait()).await.is_err() {
            tracing::warn!(abandoned = jobs.len(), grace_ms = cfg.shutdown_grace_ms,
                "in-flight requests outlived the grace period; their jobs will be retried after lease expiry");
        }
        drop(done_tx);
        stop_background.cancel();
        // Outcomes in hand are flushed; if the database is unreachable, give up after a
        // bounded wait rather than hang the shutdown.
        let flush = async {
            background.close();
            background.wait().await;
        };
        if tokio::time::timeout(FLUSH_DEADLINE, flush).await.is_err() {
            stop_completer.cancel();
            background.wait().await;
        }
        tracing::info!(worker_id = %self.worker_id, "dispatcher stopped");
        Ok(())
    }

    #[expect(
        clippy::too_many_arguments,
        reason = "internal plumbing of the claim loop"
    )]
    fn start_job(
        &self,
        job: ClaimedJob,
        clock: &DbClock,
        timer: &ReleaseTimer,
        deliverer: &Deliverer,
        done_tx: &mpsc::UnboundedSender<Completion>,
        permit: tokio::sync::OwnedSemaphorePermit,
        tracker: &TaskTracker,
    ) {
        let interval = Duration::from_micros(job.interval_us.max(1) as u64);
        let (reply, verdict) = tokio::sync::oneshot::channel();
        let slot = clock.instant_at(job.slot_us);
        timer.schedule(Ticket {
            slot,
            destination_id: job.destination_id,
            interval,
            tolerance: interval * job.burst.saturating_sub(1),
            late_limit: late_limit(job.interval_us),
            spin: interval < SPIN_BELOW_INTERVAL,
            shared: job.shared,
            reply,
        });
        let job = Arc::new(job);
        let timer = timer.clone();
        let deliverer = deliverer.clone();
        let done_tx = done_tx.clone();
        let metrics = self.metrics.clone();
        let observer = self.observer.clone();
        let clock = *clock;
        tracker.spawn(async move {
            let _permit = permit;
            let prepared = deliverer.prepare(&job);
            let (outcome, shift) = match verdict.await {
                Ok(Release::Go(at)) => {
                    Metrics::inc(&metrics.released);
                    if let Some(obs) = &observer {
                        let _ = obs.send(ReleaseEvent {
                            job_id: job.id,
                            destination: job.destination.clone(),
                            slot_us: job.slot_us,
                            at,
                            late: at.saturating_duration_since(slot),
                        });
                    }
                    if job.deadline_us.is_some_and(|d| d <= clock.us_at(at)) {
                        (Outcome::Expired, None)
                    } else {
                        let result = match prepared {
                            Ok(p) => deliverer.execute(p).await,
                            Err(e) => Err(e),
                        };
                        retry::classify(&job, result, std::time::SystemTime::now())
                    }
                }
                Ok(Release::Late(by)) => {
                    Metrics::inc(&metrics.late);
                    tracing::debug!(job = %job.id, late_us = by.as_micros() as u64, "release too late; returning the job");
                    (Outcome::Returned, None)
                }
                Ok(Release::Revoked) | Err(_) => (Outcome::Returned, None),
            };
            match &outcome {
                Outcome::Succeeded { .. } => Metrics::inc(&metrics.succeeded),
                Outcome::Retry { .. } => Metrics::inc(&metrics.retried),
                Outcome::Dead { .. } => Metrics::inc(&metrics.dead),
                Outcome::Expired => Metrics::inc(&metrics.expired),
                Outcome::Returned => Metrics::inc(&metrics.returned),
                Outcome::Throttled { .. } => Metrics::inc(&metrics.throttled),
            }
            let destination = job.destination_id;
            let hold = shift.map(|s| {
                let ms = s.delay_ms.unwrap_or(job.throttle.throttle_floor_ms).max(0);
                Instant::now() + Duration::from_millis(ms as u64)
            });
            if let Some(s) = &shift {
                tracing::info!(destination = %job.destination, job = %job.id, delay_ms = ?s.delay_ms, source = ?s.source, capped = s.capped, "downstream asked to slow down");
            }
            // Record the outcome before withdrawing other claims, so the shift of
            // next_slot is written no later than the claims it returns.
            let _ = done_tx.send(Completion { job, outcome, shift });
            if let Some(until) = hold {
                timer.revoke(destination, until);
            }
        });
    }
}

/// Renews the leases of this dispatcher's jobs every third of the lease margin, so only
/// a dispatcher that stopped (or lost the database for longer than the margin) has its
/// jobs rescued.
async fn heartbeat(store: Store, worker_id: Uuid, margin: Duration, stop: CancellationToken) {
    let every = margin / 3;
    let margin_us = i64::try_from(margin.as_micros()).unwrap_or(i64::MAX);
    let mut failing = false;
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(every) => {}
        }
        match store.extend_leases(worker_id, margin_us).await {
            Ok(_) => failing = false,
            Err(e) => {
                if !failing {
                    tracing::warn!(error = %e, "cannot renew leases");
                }
                failing = true;
            }
        }
    }
}

/// Forwards the store's notices to the claim loop: wake-ups to `wake`, throttle shifts
/// (a destination's next_slot moved) to `throttles`.
async fn listen(
    store: Store,
    wake: Arc<Notify>,
    throttles: mpsc::UnboundedSender<(i64, Micros)>,
    stop: CancellationToken,
) {
    let on = move |notice: Notice| match notice {
        Notice::Wake => wake.notify_one(),
        Notice::Throttle {
            destination,
            until_us,
        } => {
            let _ = throttles.send((destination, until_us));
        }
    };
    store.listen(&on, &stop).await;
}
