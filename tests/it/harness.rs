//! Test harness: a fresh PostgreSQL database per test, Sluice in-process or as real
//! processes, and a recording HTTP sink on loopback.

use std::net::SocketAddr;
use std::process::Stdio;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::Request;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use sluice::app::{self, Roles};
use sluice::config::Config;
use sluice::dispatcher::{Dispatcher, ReleaseEvent};
use sluice::job::JobState;
use sluice::metrics::Metrics;
use sluice::store::{Store, StoreOptions};
use sqlx::Connection as _;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// The server every test database lives on.
pub fn admin_url() -> String {
    std::env::var("SLUICE_TEST_ADMIN_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned())
}

/// Which store a test runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// A fresh database on the test PostgreSQL.
    Postgres,
    /// A fresh embedded SQLite file in a temporary directory.
    Sqlite,
}

/// A database created for one test and dropped afterwards.
pub struct TestDb {
    pub name: String,
    pub url: String,
    dir: Option<std::path::PathBuf>,
}

impl TestDb {
    pub async fn create() -> TestDb {
        Self::create_on(Backend::Postgres).await
    }

    pub async fn create_on(backend: Backend) -> TestDb {
        let name = format!("sluice_test_{}", uuid::Uuid::now_v7().simple());
        if backend == Backend::Sqlite {
            let dir = std::env::temp_dir().join(&name);
            std::fs::create_dir_all(&dir).expect("temp dir");
            let url = format!("sqlite:{}", dir.join("sluice.db").display());
            return TestDb {
                name,
                url,
                dir: Some(dir),
            };
        }
        let mut conn = sqlx::PgConnection::connect(&admin_url())
            .await
            .expect("connect to the test PostgreSQL (is it running? see README)");
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .execute(&mut conn)
            .await
            .expect("create test database");
        let base = admin_url();
        let url = match base.rfind('/') {
            Some(i) => format!("{}/{name}", &base[..i]),
            None => panic!("admin URL has no database path"),
        };
        TestDb {
            name,
            url,
            dir: None,
        }
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        if let Some(dir) = &self.dir {
            let _ = std::fs::remove_dir_all(dir);
            return;
        }
        let name = self.name.clone();
        // Drop from a separate thread with its own runtime: Drop cannot await.
        let _ = std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            rt.block_on(async {
                if let Ok(mut conn) = sqlx::PgConnection::connect(&admin_url()).await {
                    let _ = sqlx::query(sqlx::AssertSqlSafe(format!(
                        "DROP DATABASE IF EXISTS {name} WITH (FORCE)"
                    )))
                    .execute(&mut conn)
                    .await;
                }
            });
        })
        .join();
    }
}

/// Defines a test that runs once on each store: `NAME::postgres` and `NAME::sqlite`.
#[macro_export]
macro_rules! both_stores {
    ($(#[doc = $doc:literal])* async fn $name:ident($backend:ident) $body:block) => {
        $(#[doc = $doc])*
        mod $name {
            #[allow(unused_imports)]
            use super::*;

            async fn run($backend: $crate::harness::Backend) $body

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn postgres() {
                run($crate::harness::Backend::Postgres).await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn sqlite() {
                run($crate::harness::Backend::Sqlite).await
            }
        }
    };
}

/// A config for tests: the given database, port 0, fast polling.
pub fn test_config(db_url: &str) -> Config {
    let mut c = Config {
        database_url: Some(db_url.to_owned()),
        ..Config::default()
    };
    c.listen = "127.0.0.1:0".parse().expect("addr");
    c.dispatcher.poll_interval_ms = 500;
    c
}

/// Sluice running in-process: the API, plus any number of in-process dispatchers whose
/// releases are reported on `releases`.
pub struct TestApp {
    pub db: TestDb,
    pub addr: SocketAddr,
    pub store: Store,
    pub http: reqwest::Client,
    pub shutdown: CancellationToken,
    pub releases: mpsc::UnboundedReceiver<ReleaseEvent>,
    release_tx: mpsc::UnboundedSender<ReleaseEvent>,
    pub config: Config,
    tasks: tokio::task::JoinSet<()>,
}

impl TestApp {
    /// The API only (nothing drains).
    pub async fn api_only() -> TestApp {
        Self::start(|_| {}, 0).await
    }

    /// The API with config tweaks and `dispatchers` in-process dispatchers, on
    /// PostgreSQL.
    pub async fn start(tweak: impl FnOnce(&mut Config), dispatchers: usize) -> TestApp {
        Self::start_on(Backend::Postgres, tweak, dispatchers).await
    }

    /// The API only, on `backend`.
    pub async fn api_only_on(backend: Backend) -> TestApp {
        Self::start_on(backend, |_| {}, 0).await
    }

    /// The API and one dispatcher, on `backend`.
    pub async fn with_dispatcher_on(backend: Backend) -> TestApp {
        Self::start_on(backend, |_| {}, 1).await
    }

    /// The API with config tweaks and `dispatchers` in-process dispatchers, on `backend`.
    pub async fn start_on(
        backend: Backend,
        tweak: impl FnOnce(&mut Config),
        dispatchers: usize,
    ) -> TestApp {
        if std::env::var_os("TEST_LOG").is_some() {
            sluice::telemetry::init();
        }
        let db = TestDb::create_on(backend).await;
        let mut config = test_config(&db.url);
        tweak(&mut config);
        let shutdown = CancellationToken::new();
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let mut tasks = tokio::task::JoinSet::new();
        // One store for the API and the in-process dispatchers: on the embedded store
        // that is how they hear about enqueues.
        let store = Store::connect(&db.url, &StoreOptions::default())
            .await
            .expect("store");
        {
            let config = config.clone();
            let token = shutdown.clone();
            let roles = Roles {
                api: true,
                dispatcher: false,
            };
            let store = store.clone();
            tasks.spawn(async move {
                if let Err(e) =
                    app::run_with_store(store, config, roles, Some(listener), token).await
                {
                    panic!("app failed: {e:#}");
                }
            });
        }
        let http = reqwest::Client::new();
        // Wait for migrations and the listener.
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(r) = http.get(format!("http://{addr}/healthz")).send().await {
                if r.status().is_success() {
                    break;
                }
            }
            assert!(Instant::now() < deadline, "app did not become healthy");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let (release_tx, releases) = mpsc::unbounded_channel();
        let mut app = TestApp {
            db,
            addr,
            store,
            http,
            shutdown,
            releases,
            release_tx,
            config,
            tasks,
        };
        for _ in 0..dispatchers {
            app.add_dispatcher();
        }
        app
    }

    /// Starts one more in-process dispatcher.
    pub fn add_dispatcher(&mut self) -> CancellationToken {
        let d = Dispatcher::new(
            self.store.clone(),
            self.config.dispatcher.clone(),
            Arc::new(Metrics::default()),
        )
        .with_observer(self.release_tx.clone());
        let token = self.shutdown.child_token();
        let t = token.clone();
        self.tasks.spawn(async move {
            if let Err(e) = d.run(t).await {
                panic!("dispatcher failed: {e:#}");
            }
        });
        token
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// `PUT /v1/destinations/{name}` with `body`, asserting success.
    pub async fn put_destination(&self, name: &str, body: serde_json::Value) {
        let r = self
            .http
            .put(self.url(&format!("/v1/destinations/{name}")))
            .json(&body)
            .send()
            .await
            .expect("request");
        let status = r.status();
        let text = r.text().await.unwrap_or_default();
        assert!(status.is_success(), "PUT destination: {status} {text}");
    }

    /// Enqueues a job, returning (status, body).
    pub async fn enqueue(&self, dest: &str, job: serde_json::Value) -> (u16, serde_json::Value) {
        let r = self
            .http
            .post(self.url(&format!("/v1/destinations/{dest}/jobs")))
            .json(&job)
            .send()
            .await
            .expect("request");
        let status = r.status().as_u16();
        (status, r.json().await.unwrap_or(serde_json::Value::Null))
    }

    /// Enqueues `n` jobs to `url` in one batch, asserting they were accepted.
    pub async fn enqueue_many(&self, dest: &str, url: &str, n: usize) -> Vec<String> {
        let jobs: Vec<_> = (0..n)
            .map(|i| serde_json::json!({"url": url, "json": {"n": i}}))
            .collect();
        let r = self
            .http
            .post(self.url(&format!("/v1/destinations/{dest}/jobs/batch")))
            .json(&serde_json::json!({ "jobs": jobs }))
            .send()
            .await
            .expect("request");
        assert_eq!(r.status().as_u16(), 202, "batch enqueue");
        let body: serde_json::Value = r.json().await.expect("json");
        body["jobs"]
            .as_array()
            .expect("jobs")
            .iter()
            .map(|j| j["id"].as_str().expect("id").to_owned())
            .collect()
    }

    /// Waits until no job is queued or running (all final), or panics after `timeout`.
    pub async fn wait_idle(&self, timeout: Duration) {
        wait_idle(&self.store, timeout).await;
    }

    /// Asserts the destination counters agree with the job rows.
    pub async fn check_counters(&self) {
        check_counters(&self.store).await;
    }

    /// Stops everything and waits for it.
    pub async fn stop(mut self) {
        self.shutdown.cancel();
        while let Some(r) = self.tasks.join_next().await {
            if let Err(e) = r {
                if e.is_panic() {
                    std::panic::resume_unwind(e.into_panic());
                }
            }
        }
    }
}

/// Waits until every job is final.
pub async fn wait_idle(store: &Store, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    loop {
        let counts = store.job_counts().await.expect("counts");
        let open: i64 = [JobState::Queued, JobState::Running]
            .iter()
            .map(|s| counts.get(s).copied().unwrap_or(0))
            .sum();
        if open == 0 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{open} jobs still open after {timeout:?}"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// Counters on destination rows must equal what the job rows say.
pub async fn check_counters(store: &Store) {
    let drift = store.audit().await.expect("audit");
    assert!(
        drift.is_empty(),
        "destination counters disagree with job rows: {drift:?}"
    );
}

/// Counts jobs in a state.
pub async fn count_state(store: &Store, state: &str) -> i64 {
    let state: JobState = state.parse().expect("state");
    store
        .job_counts()
        .await
        .expect("counts")
        .get(&state)
        .copied()
        .unwrap_or(0)
}

/// The PostgreSQL pool of a store (for tests that only run on PostgreSQL).
pub fn pg(store: &Store) -> &sqlx::PgPool {
    store.pg_pool().expect("this test runs on PostgreSQL")
}

/// Runs one statement written in the SQL both stores understand, to arrange a state the
/// API cannot reach (an aged job, a last attempt). On the embedded store it goes through a
/// second connection to the same file, as another process would.
pub async fn execute(db: &TestDb, store: &Store, sql: &str) {
    let sql_safe = || sqlx::AssertSqlSafe(sql.to_owned());
    match store.pg_pool() {
        Some(pool) => sqlx::query(sql_safe()).execute(pool).await.map(drop),
        None => {
            let mut conn = sqlx::SqliteConnection::connect(&db.url)
                .await
                .expect("open the SQLite file");
            sqlx::query(sql_safe()).execute(&mut conn).await.map(drop)
        }
    }
    .unwrap_or_else(|e| panic!("{sql}: {e}"));
}

/// One request the sink received.
#[derive(Debug, Clone)]
pub struct Arrival {
    pub at: Instant,
    pub method: String,
    pub path: String,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Arrival {
    pub fn idempotency_key(&self) -> String {
        self.headers
            .get("idempotency-key")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned()
    }
}

/// What the sink answers.
#[derive(Debug, Clone)]
pub struct Reply {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub delay: Duration,
    pub body: Vec<u8>,
}

impl Reply {
    pub fn ok() -> Reply {
        Reply::status(200)
    }

    pub fn status(status: u16) -> Reply {
        Reply {
            status,
            headers: Vec::new(),
            delay: Duration::ZERO,
            body: b"ok".to_vec(),
        }
    }

    pub fn delay(mut self, d: Duration) -> Reply {
        self.delay = d;
        self
    }

    pub fn header(mut self, name: &str, value: &str) -> Reply {
        self.headers.push((name.to_owned(), value.to_owned()));
        self
    }
}

type Behaviour = Arc<dyn Fn(&Arrival, usize) -> Reply + Send + Sync>;

/// A recording HTTP server on loopback.
pub struct Sink {
    pub addr: SocketAddr,
    arrivals: Arc<Mutex<Vec<Arrival>>>,
    max_in_flight: Arc<AtomicUsize>,
    stop: CancellationToken,
}

impl Sink {
    /// A sink answering 200 to everything.
    pub async fn ok() -> Sink {
        Self::start(|_, _| Reply::ok()).await
    }

    /// A sink whose answer to the n-th request (0-based, across paths) is `f(req, n)`.
    pub async fn start(f: impl Fn(&Arrival, usize) -> Reply + Send + Sync + 'static) -> Sink {
        let behaviour: Behaviour = Arc::new(f);
        let arrivals: Arc<Mutex<Vec<Arrival>>> = Arc::default();
        let in_flight = Arc::new(AtomicUsize::new(0));
        let max_in_flight = Arc::new(AtomicUsize::new(0));
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind sink");
        let addr = listener.local_addr().expect("addr");
        let stop = CancellationToken::new();
        let (a, fl, mx) = (arrivals.clone(), in_flight.clone(), max_in_flight.clone());
        let app = axum::Router::new().fallback(move |req: Request| {
            let (a, fl, mx, behaviour) = (a.clone(), fl.clone(), mx.clone(), behaviour.clone());
            async move {
                let at = Instant::now();
                let now = fl.fetch_add(1, Ordering::SeqCst) + 1;
                mx.fetch_max(now, Ordering::SeqCst);
                let (parts, body) = req.into_parts();
                let body = axum::body::to_bytes(body, usize::MAX)
                    .await
                    .unwrap_or_default();
                let arrival = Arrival {
                    at,
                    method: parts.method.to_string(),
                    path: parts.uri.path().to_owned(),
                    headers: parts.headers,
                    body,
                };
                let n = {
                    let mut v = a.lock().expect("lock");
                    v.push(arrival.clone());
                    v.len() - 1
                };
                let reply = behaviour(&arrival, n);
                if !reply.delay.is_zero() {
                    tokio::time::sleep(reply.delay).await;
                }
                fl.fetch_sub(1, Ordering::SeqCst);
                let mut resp: Response = (
                    StatusCode::from_u16(reply.status).expect("status"),
                    reply.body,
                )
                    .into_response();
                for (k, v) in reply.headers {
                    resp.headers_mut().append(
                        axum::http::HeaderName::from_bytes(k.as_bytes()).expect("name"),
                        axum::http::HeaderValue::from_str(&v).expect("value"),
                    );
                }
                resp
            }
        });
        let token = stop.clone();
        tokio::spawn(async move {
            let _ = axum::serve(listener, app)
                .with_graceful_shutdown(async move { token.cancelled().await })
                .await;
        });
        Sink {
            addr,
            arrivals,
            max_in_flight,
            stop,
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    pub fn arrivals(&self) -> Vec<Arrival> {
        self.arrivals.lock().expect("lock").clone()
    }

    /// Arrivals whose path is `path`.
    pub fn arrivals_at(&self, path: &str) -> Vec<Arrival> {
        self.arrivals()
            .into_iter()
            .filter(|a| a.path == path)
            .collect()
    }

    pub fn max_in_flight(&self) -> usize {
        self.max_in_flight.load(Ordering::SeqCst)
    }

    /// Waits until `n` requests arrived at `path`.
    pub async fn wait_for(&self, path: &str, n: usize, timeout: Duration) -> Vec<Arrival> {
        let deadline = Instant::now() + timeout;
        loop {
            let got = self.arrivals_at(path);
            if got.len() >= n {
                return got;
            }
            assert!(
                Instant::now() < deadline,
                "only {} of {n} requests reached {path} within {timeout:?}",
                got.len()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

impl Drop for Sink {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Gaps between consecutive instants.
pub fn gaps(times: &[Instant]) -> Vec<Duration> {
    times
        .windows(2)
        .map(|w| w[1].duration_since(w[0]))
        .collect()
}

pub use sluice::demo::max_in_window;

/// A `sluice` process (the real binary).
pub struct Proc {
    pub child: tokio::process::Child,
    pub addr: Option<SocketAddr>,
    pub log: Arc<Mutex<Vec<String>>>,
}

impl Proc {
    /// Starts `sluice <args>` against `db_url`; for `serve`, waits for the listen address.
    pub async fn spawn(args: &[&str], db_url: &str, env: &[(&str, &str)]) -> Proc {
        Self::spawn_in(args, Some(db_url), &std::env::temp_dir(), env).await
    }

    /// Starts `sluice <args>` in `dir`, against `db_url` or, with `None`, whatever the
    /// defaults give (the embedded store in `dir`).
    pub async fn spawn_in(
        args: &[&str],
        db_url: Option<&str>,
        dir: &std::path::Path,
        env: &[(&str, &str)],
    ) -> Proc {
        let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_sluice"));
        match db_url {
            Some(url) => cmd.env("SLUICE_DATABASE_URL", url),
            None => cmd
                .env_remove("SLUICE_DATABASE_URL")
                .env_remove("DATABASE_URL"),
        };
        cmd.args(args)
            .env("SLUICE_LISTEN", "127.0.0.1:0")
            .env("SLUICE_DISPATCHER__POLL_INTERVAL_MS", "500")
            .env("RUST_LOG", "info")
            .current_dir(dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawn sluice");
        let stderr = child.stderr.take().expect("stderr");
        let log: Arc<Mutex<Vec<String>>> = Arc::default();
        let (addr_tx, mut addr_rx) = mpsc::unbounded_channel();
        let started_tx = addr_tx.clone();
        let l = log.clone();
        tokio::spawn(async move {
            let mut lines = BufReader::new(stderr).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                if let Some(rest) = line.split("listening on http://").nth(1) {
                    if let Ok(a) = rest
                        .split_whitespace()
                        .next()
                        .unwrap_or("")
                        .parse::<SocketAddr>()
                    {
                        let _ = addr_tx.send(Some(a));
                    }
                }
                if line.contains("dispatcher started") {
                    let _ = started_tx.send(None);
                }
                l.lock().expect("lock").push(line);
            }
        });
        let want_addr = args.first() == Some(&"serve");
        let mut addr = None;
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut started = false;
        while (want_addr && addr.is_none()) || !started {
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, addr_rx.recv()).await {
                Ok(Some(Some(a))) => addr = Some(a),
                Ok(Some(None)) => started = true,
                _ => panic!(
                    "sluice {args:?} did not start; log:\n{}",
                    log.lock().expect("lock").join("\n")
                ),
            }
        }
        Proc { child, addr, log }
    }

    pub fn pid(&self) -> i32 {
        self.child.id().map(|p| p as i32).unwrap_or_default()
    }

    /// Sends a signal (e.g. "TERM", "KILL").
    /// Sends SIGTERM and asserts the process exits cleanly within `within`.
    pub async fn terminate(&mut self, within: Duration) {
        self.signal("TERM");
        let status = tokio::time::timeout(within, self.child.wait())
            .await
            .unwrap_or_else(|_| panic!("no exit within {within:?} of SIGTERM"))
            .expect("wait");
        assert!(
            status.success(),
            "exit {status:?}; log:\n{}",
            self.log_text()
        );
    }

    pub fn signal(&self, sig: &str) {
        let status = std::process::Command::new("kill")
            .arg(format!("-{sig}"))
            .arg(self.pid().to_string())
            .status()
            .expect("kill");
        assert!(status.success(), "kill -{sig} failed");
    }

    pub fn log_text(&self) -> String {
        self.log.lock().expect("lock").join("\n")
    }
}

/// Runs the CLI to completion, returning (exit code, stdout, stderr).
pub async fn cli(args: &[&str], db_url: &str) -> (i32, String, String) {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(args)
        .env("SLUICE_DATABASE_URL", db_url)
        .current_dir(std::env::temp_dir())
        .output()
        .await
        .expect("run sluice");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A raw TCP server for downstream faults, by path: `/ok` answers 200, `/reset` drops the
/// connection without answering, `/hang` never answers, `/huge` answers 200 with a 10 MB
/// body, `/flaky` alternates between reset and 200. Counts requests per path.
pub struct FaultSink {
    pub addr: SocketAddr,
    hits: Arc<Mutex<std::collections::HashMap<String, usize>>>,
    stop: CancellationToken,
}

impl FaultSink {
    pub async fn start() -> FaultSink {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let hits: Arc<Mutex<std::collections::HashMap<String, usize>>> = Arc::default();
        let stop = CancellationToken::new();
        let (h, token) = (hits.clone(), stop.clone());
        tokio::spawn(async move {
            loop {
                let accepted = tokio::select! {
                    _ = token.cancelled() => return,
                    a = listener.accept() => a,
                };
                let Ok((mut sock, _)) = accepted else {
                    continue;
                };
                let (h, token) = (h.clone(), token.clone());
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    let mut chunk = [0u8; 4096];
                    let path = loop {
                        match sock.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                        if buf.windows(4).any(|w| w == b"\r\n\r\n") {
                            let head = String::from_utf8_lossy(&buf).into_owned();
                            break head.split(' ').nth(1).unwrap_or("/").to_owned();
                        }
                    };
                    let n = {
                        let mut m = h.lock().expect("lock");
                        let e = m.entry(path.clone()).or_default();
                        *e += 1;
                        *e
                    };
                    let ok = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok";
                    match path.as_str() {
                        "/reset" => {
                            let _ = sock.set_zero_linger();
                        }
                        "/flaky" if n % 2 == 1 => {
                            let _ = sock.set_zero_linger();
                        }
                        "/hang" => token.cancelled().await,
                        "/huge" => {
                            let len = 10 * 1024 * 1024;
                            let head = format!("HTTP/1.1 200 OK\r\ncontent-length: {len}\r\n\r\n");
                            if sock.write_all(head.as_bytes()).await.is_err() {
                                return;
                            }
                            let block = vec![b'x'; 64 * 1024];
                            for _ in 0..(len / block.len()) {
                                if sock.write_all(&block).await.is_err() {
                                    return;
                                }
                            }
                        }
                        _ => {
                            let _ = sock.write_all(ok).await;
                        }
                    }
                });
            }
        });
        FaultSink { addr, hits, stop }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    pub fn hits(&self, path: &str) -> usize {
        self.hits
            .lock()
            .expect("lock")
            .get(path)
            .copied()
            .unwrap_or(0)
    }
}

impl Drop for FaultSink {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// A private PostgreSQL cluster (Debian's postgresql-common) that a test may stop and
/// start without disturbing other tests. Dropped with the guard.
pub struct PrivateCluster {
    pub version: String,
    pub name: String,
    pub port: u16,
}

impl PrivateCluster {
    pub fn create() -> PrivateCluster {
        let version = std::fs::read_dir("/etc/postgresql")
            .ok()
            .and_then(|d| {
                d.filter_map(|e| e.ok())
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .max()
            })
            .expect("this test needs Debian's PostgreSQL (pg_createcluster); see README");
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").expect("free port");
            l.local_addr().expect("addr").port()
        };
        let name = format!("sluice{port}");
        let status = std::process::Command::new("pg_createcluster")
            .args([
                &version,
                &name,
                "-p",
                &port.to_string(),
                "--",
                "--auth=trust",
            ])
            .stdout(Stdio::null())
            .status()
            .expect("pg_createcluster");
        assert!(status.success(), "pg_createcluster failed");
        let c = PrivateCluster {
            version,
            name,
            port,
        };
        c.ctl("start");
        c
    }

    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    pub fn ctl(&self, action: &str) {
        let status = std::process::Command::new("pg_ctlcluster")
            .args([
                "--skip-systemctl-redirect",
                &self.version,
                &self.name,
                action,
            ])
            .stdout(Stdio::null())
            .status()
            .expect("pg_ctlcluster");
        assert!(status.success(), "pg_ctlcluster {action} failed");
    }
}

impl Drop for PrivateCluster {
    fn drop(&mut self) {
        let _ = std::process::Command::new("pg_dropcluster")
            .args(["--stop", &self.version, &self.name])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}
