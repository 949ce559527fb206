//! What every scenario needs: a fresh database, a fast recording sink, Sluice dispatchers
//! in-process or as worker processes, and CPU accounting.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use sluice::config::Config;
use sluice::destination::{DestinationConfig, DestinationName};
use sluice::dispatcher::{Dispatcher, ReleaseEvent};
use sluice::job::{JobRequest, JobState, NewJob};
use sluice::metrics::Metrics;
use sluice::store::{Store, StoreOptions};
use sqlx::Connection as _;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// The PostgreSQL server benchmarks create their databases on.
pub fn admin_url() -> String {
    std::env::var("SLUICE_BENCH_ADMIN_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned())
}

/// Which store a scenario runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A fresh database on the local PostgreSQL (the production store).
    Postgres,
    /// A fresh embedded SQLite file in a temporary directory.
    Sqlite,
}

/// A database for one scenario, dropped afterwards.
pub struct BenchDb {
    pub name: String,
    pub url: String,
    pub store: Store,
    pub kind: Kind,
    /// PostgreSQL only: the pool, for setup and statistics queries.
    pool: Option<sqlx::PgPool>,
    /// SQLite only: the directory holding the file.
    dir: Option<std::path::PathBuf>,
}

impl BenchDb {
    /// A fresh PostgreSQL database.
    pub async fn create(max_connections: u32) -> anyhow::Result<BenchDb> {
        BenchDb::create_on(Kind::Postgres, max_connections).await
    }

    pub async fn create_on(kind: Kind, max_connections: u32) -> anyhow::Result<BenchDb> {
        let name = format!("sluice_bench_{}", uuid::Uuid::now_v7().simple());
        if kind == Kind::Sqlite {
            let dir = std::env::temp_dir().join(&name);
            std::fs::create_dir_all(&dir)?;
            let url = format!("sqlite:{}", dir.join("sluice.db").display());
            let store = Store::connect(&url, &StoreOptions::default()).await?;
            store.migrate().await?;
            return Ok(BenchDb {
                name,
                url,
                store,
                kind,
                pool: None,
                dir: Some(dir),
            });
        }
        let mut admin = sqlx::PgConnection::connect(&admin_url())
            .await
            .context("connect to PostgreSQL (set SLUICE_BENCH_ADMIN_URL)")?;
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .execute(&mut admin)
            .await?;
        let base = admin_url();
        let url = format!("{}/{name}", &base[..base.rfind('/').unwrap_or(base.len())]);
        let store = Store::connect(
            &url,
            &StoreOptions {
                max_connections,
                ..Default::default()
            },
        )
        .await?;
        store.migrate().await?;
        let pool = store.pg_pool().cloned();
        Ok(BenchDb {
            name,
            url,
            store,
            kind,
            pool,
            dir: None,
        })
    }

    /// The PostgreSQL pool, for setup and statistics queries.
    pub fn pool(&self) -> anyhow::Result<&sqlx::PgPool> {
        self.pool
            .as_ref()
            .context("this scenario runs on PostgreSQL only")
    }

    pub async fn drop_db(self) {
        self.store.close().await;
        if let Some(dir) = &self.dir {
            let _ = std::fs::remove_dir_all(dir);
            return;
        }
        if let Ok(mut admin) = sqlx::PgConnection::connect(&admin_url()).await {
            let _ = sqlx::query(sqlx::AssertSqlSafe(format!(
                "DROP DATABASE IF EXISTS {} WITH (FORCE)",
                self.name
            )))
            .execute(&mut admin)
            .await;
        }
    }

    pub async fn destination(&self, name: &str, cfg: serde_json::Value) -> anyhow::Result<()> {
        let cfg: DestinationConfig = serde_json::from_value(cfg)?;
        let spec = cfg.validate().map_err(|e| anyhow::anyhow!("{e}"))?;
        self.store
            .upsert_destination(&DestinationName::parse(name)?, &spec)
            .await?;
        Ok(())
    }

    /// Enqueues `n` small JSON jobs to `url` in batches (all or nothing per batch).
    pub async fn fill(&self, dest: &str, url: &str, n: usize) -> anyhow::Result<()> {
        let mut left = n;
        while left > 0 {
            let k = left.min(1_000);
            let jobs: Vec<NewJob> = (0..k).map(|i| small_job(url, i)).collect();
            self.store
                .enqueue(dest, &jobs)
                .await
                .map_err(|e| anyhow::anyhow!("{e}"))?;
            left -= k;
        }
        Ok(())
    }

    /// Waits until no job is open; returns false on timeout.
    pub async fn wait_idle(&self, timeout: Duration) -> anyhow::Result<bool> {
        let deadline = Instant::now() + timeout;
        loop {
            let open: i64 = self
                .store
                .job_counts()
                .await?
                .iter()
                .filter(|(state, _)| matches!(state, JobState::Queued | JobState::Running))
                .map(|(_, n)| n)
                .sum();
            if open == 0 {
                return Ok(true);
            }
            if Instant::now() > deadline {
                return Ok(false);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// A small job like a webhook: a JSON body of a few dozen bytes.
pub fn small_job(url: &str, i: usize) -> NewJob {
    let req = JobRequest {
        url: url.to_owned(),
        json: Some(serde_json::json!({"event": "bench", "n": i})),
        ..Default::default()
    };
    // The request is well-formed by construction.
    req.validate("")
        .unwrap_or_else(|e| panic!("bench job: {e}"))
}

/// One request at the sink.
#[derive(Clone, Debug)]
pub struct Arrival {
    pub at: Instant,
    pub path: String,
}

/// A recording HTTP sink on its own runtime (threads named `bench-sink`, so CPU
/// accounting can tell it apart from Sluice).
pub struct Sink {
    pub addr: SocketAddr,
    arrivals: Arc<Mutex<Vec<Arrival>>>,
    stop: CancellationToken,
}

impl Sink {
    pub fn start() -> anyhow::Result<Sink> {
        let arrivals: Arc<Mutex<Vec<Arrival>>> = Arc::default();
        let stop = CancellationToken::new();
        let (tx, rx) = std::sync::mpsc::channel();
        let (a, token) = (arrivals.clone(), stop.clone());
        std::thread::Builder::new()
            .name("bench-sink".into())
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(1)
                    .thread_name("bench-sink")
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = tx.send(Err(e.to_string()));
                        return;
                    }
                };
                rt.block_on(async move {
                    let listener = match tokio::net::TcpListener::bind("127.0.0.1:0").await {
                        Ok(l) => l,
                        Err(e) => {
                            let _ = tx.send(Err(e.to_string()));
                            return;
                        }
                    };
                    let _ = tx.send(listener.local_addr().map_err(|e| e.to_string()));
                    let app = axum::Router::new().fallback(move |uri: axum::http::Uri| {
                        let a = a.clone();
                        async move {
                            let at = Instant::now();
                            if let Ok(mut v) = a.lock() {
                                v.push(Arrival {
                                    at,
                                    path: uri.path().to_owned(),
                                });
                            }
                            "ok"
                        }
                    });
                    let _ = axum::serve(listener, app)
                        .with_graceful_shutdown(async move { token.cancelled().await })
                        .await;
                });
            })?;
        let addr = rx
            .recv()
            .context("sink thread")?
            .map_err(|e| anyhow::anyhow!("sink: {e}"))?;
        Ok(Sink {
            addr,
            arrivals,
            stop,
        })
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    pub fn take(&self) -> Vec<Arrival> {
        self.arrivals
            .lock()
            .map(|mut v| std::mem::take(&mut *v))
            .unwrap_or_default()
    }

    pub fn count(&self) -> usize {
        self.arrivals.lock().map(|v| v.len()).unwrap_or(0)
    }

    /// Arrival instants per path, sorted.
    pub fn by_path(arrivals: &[Arrival]) -> HashMap<String, Vec<Instant>> {
        let mut m: HashMap<String, Vec<Instant>> = HashMap::new();
        for a in arrivals {
            m.entry(a.path.clone()).or_default().push(a.at);
        }
        for v in m.values_mut() {
            v.sort();
        }
        m
    }
}

impl Drop for Sink {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Dispatchers running in this process, with their releases observed.
pub struct InProcess {
    pub releases: mpsc::UnboundedReceiver<ReleaseEvent>,
    pub metrics: Vec<Arc<Metrics>>,
    token: CancellationToken,
    tasks: Vec<tokio::task::JoinHandle<anyhow::Result<()>>>,
}

impl InProcess {
    pub fn start(store: &Store, config: &Config, n: usize) -> InProcess {
        let (tx, releases) = mpsc::unbounded_channel();
        let token = CancellationToken::new();
        let mut tasks = Vec::new();
        let mut metrics = Vec::new();
        for _ in 0..n {
            let m = Arc::new(Metrics::default());
            let d = Dispatcher::new(store.clone(), config.dispatcher.clone(), m.clone())
                .with_observer(tx.clone());
            tasks.push(tokio::spawn(d.run(token.child_token())));
            metrics.push(m);
        }
        InProcess {
            releases,
            metrics,
            token,
            tasks,
        }
    }

    pub fn drain_releases(&mut self) -> Vec<ReleaseEvent> {
        let mut v = Vec::new();
        while let Ok(e) = self.releases.try_recv() {
            v.push(e);
        }
        v
    }

    pub async fn stop(self) {
        self.token.cancel();
        for t in self.tasks {
            let _ = t.await;
        }
    }
}

/// `bench worker` processes (this executable, re-run as a dispatcher).
pub struct Workers {
    children: Vec<tokio::process::Child>,
}

impl Workers {
    pub async fn start(db_url: &str, n: usize, env: &[(&str, String)]) -> anyhow::Result<Workers> {
        let exe = std::env::current_exe()?;
        let mut children = Vec::new();
        for _ in 0..n {
            let mut cmd = tokio::process::Command::new(&exe);
            cmd.arg("worker")
                .env("SLUICE_DATABASE_URL", db_url)
                .env("RUST_LOG", "warn")
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .kill_on_drop(true);
            for (k, v) in env {
                cmd.env(k, v);
            }
            let mut child = cmd.spawn()?;
            let stdout = child.stdout.take().context("worker stdout")?;
            let mut lines = BufReader::new(stdout).lines();
            let ready = tokio::time::timeout(Duration::from_secs(30), lines.next_line()).await;
            anyhow::ensure!(
                matches!(ready, Ok(Ok(Some(ref l))) if l == "ready"),
                "worker did not start"
            );
            children.push(child);
        }
        Ok(Workers { children })
    }

    pub fn pids(&self) -> Vec<u32> {
        self.children.iter().filter_map(|c| c.id()).collect()
    }

    pub async fn stop(mut self) {
        for c in &self.children {
            if let Some(pid) = c.id() {
                let _ = std::process::Command::new("kill")
                    .args(["-TERM", &pid.to_string()])
                    .status();
            }
        }
        for c in &mut self.children {
            let _ = tokio::time::timeout(Duration::from_secs(10), c.wait()).await;
        }
    }
}

/// CPU seconds used so far (user + system) by a set of threads or processes, read from
/// /proc. Clock ticks are 1/100 s on Linux.
pub mod cpu {
    use std::fs;

    const TICKS_PER_SEC: f64 = 100.0;

    fn stat_ticks(path: &str) -> Option<(String, u64)> {
        let s = fs::read_to_string(path).ok()?;
        let open = s.find('(')?;
        let close = s.rfind(')')?;
        let comm = s[open + 1..close].to_owned();
        let fields: Vec<&str> = s[close + 2..].split_whitespace().collect();
        // utime and stime are fields 14 and 15; after "pid (comm) " they are at 11, 12.
        let ut: u64 = fields.get(11)?.parse().ok()?;
        let st: u64 = fields.get(12)?.parse().ok()?;
        Some((comm, ut + st))
    }

    /// This process's threads, excluding those whose name starts with `exclude`.
    pub fn self_threads(exclude: &str) -> f64 {
        let Ok(dir) = fs::read_dir("/proc/self/task") else {
            return 0.0;
        };
        dir.filter_map(|e| e.ok())
            .filter_map(|e| stat_ticks(&format!("{}/stat", e.path().display())))
            .filter(|(comm, _)| !comm.starts_with(exclude))
            .map(|(_, t)| t as f64 / TICKS_PER_SEC)
            .sum()
    }

    /// Processes by pid.
    pub fn pids(pids: &[u32]) -> f64 {
        pids.iter()
            .filter_map(|p| stat_ticks(&format!("/proc/{p}/stat")))
            .map(|(_, t)| t as f64 / TICKS_PER_SEC)
            .sum()
    }

    /// Every PostgreSQL process on the machine (server and backends).
    pub fn postgres() -> f64 {
        let Ok(dir) = fs::read_dir("/proc") else {
            return 0.0;
        };
        dir.filter_map(|e| e.ok())
            .filter(|e| {
                e.file_name()
                    .to_string_lossy()
                    .bytes()
                    .all(|b| b.is_ascii_digit())
            })
            .filter_map(|e| stat_ticks(&format!("{}/stat", e.path().display())))
            .filter(|(comm, _)| comm.starts_with("postgres"))
            .map(|(_, t)| t as f64 / TICKS_PER_SEC)
            .sum()
    }
}

/// Gap statistics in microseconds.
pub struct Gaps {
    pub min: f64,
    pub p1: f64,
    pub max_in_100ms: usize,
    pub span_s: f64,
}

pub fn gaps(times: &[Instant]) -> Gaps {
    let mut g: Vec<f64> = times
        .windows(2)
        .map(|w| (w[1] - w[0]).as_secs_f64() * 1e6)
        .collect();
    g.sort_by(|a, b| a.total_cmp(b));
    let pick = |q: f64| {
        g.get(((g.len() as f64 - 1.0) * q) as usize)
            .copied()
            .unwrap_or(0.0)
    };
    Gaps {
        min: g.first().copied().unwrap_or(0.0),
        p1: pick(0.01),
        max_in_100ms: sluice::demo::max_in_window(times, Duration::from_millis(100)),
        span_s: match (times.first(), times.last()) {
            (Some(a), Some(b)) => (*b - *a).as_secs_f64(),
            _ => 0.0,
        },
    }
}

/// Percentile of a sample (sorted in place).
pub fn percentile(v: &mut [f64], q: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(((v.len() as f64 - 1.0) * q).round() as usize)
        .copied()
        .unwrap_or(0.0)
}
