//! The embedded store as a user meets it: `sluice serve` with nothing configured, one
//! dispatching process per file, crash recovery and restarts, and `sluice demo`.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde_json::json;
use sluice::store::{Store, StoreOptions};

use crate::harness::{check_counters, count_state, wait_idle, Proc, Sink};

struct Dir(PathBuf);

impl Dir {
    fn new() -> Dir {
        let d =
            std::env::temp_dir().join(format!("sluice-embedded-{}", uuid::Uuid::now_v7().simple()));
        std::fs::create_dir_all(&d).expect("dir");
        Dir(d)
    }

    fn url(&self) -> String {
        format!("sqlite:{}", self.0.join("sluice.db").display())
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

async fn put(base: &str, name: &str, body: serde_json::Value) {
    let r = reqwest::Client::new()
        .put(format!("{base}/v1/destinations/{name}"))
        .json(&body)
        .send()
        .await
        .expect("put");
    assert_eq!(r.status().as_u16(), 200);
}

async fn batch(base: &str, name: &str, url: &str, n: usize) {
    let jobs: Vec<_> = (0..n)
        .map(|i| json!({"url": url, "json": {"i": i}}))
        .collect();
    let r = reqwest::Client::new()
        .post(format!("{base}/v1/destinations/{name}/jobs/batch"))
        .json(&json!({ "jobs": jobs }))
        .send()
        .await
        .expect("batch");
    assert_eq!(r.status().as_u16(), 202);
}

/// Nothing configured: serve says which store it uses and how to switch, creates
/// sluice.db in the working directory, and delivers; a second dispatching process on the
/// same file is refused with a clear error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_without_configuration_uses_the_embedded_store() {
    let dir = Dir::new();
    let sink = Sink::ok().await;
    let mut serve = Proc::spawn_in(&["serve"], None, &dir.0, &[]).await;
    let log = serve.log_text();
    let first = log.lines().next().unwrap_or_default();
    assert!(
        first.contains("embedded SQLite store") && first.contains("sluice.db"),
        "{first}"
    );
    assert!(first.contains("postgres://"), "says how to switch: {first}");
    assert!(dir.0.join("sluice.db").exists());
    let base = format!("http://{}", serve.addr.expect("address"));
    put(&base, "e", json!({"rate": "20/s", "capacity": 100})).await;
    batch(&base, "e", &sink.url("/e"), 10).await;
    let got = sink.wait_for("/e", 10, Duration::from_secs(10)).await;
    let span = got[9].at - got[0].at;
    assert!(span >= Duration::from_millis(430), "10 at 20/s in {span:?}");

    // A second dispatcher on the same file is refused, clearly.
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
        .arg("worker")
        .env_remove("SLUICE_DATABASE_URL")
        .env_remove("DATABASE_URL")
        .current_dir(&dir.0)
        .output()
        .await
        .expect("run");
    assert_ne!(out.status.code(), Some(0));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("already dispatching") && err.contains("PostgreSQL"),
        "{err}"
    );

    // The CLI still works alongside (it does not dispatch).
    let (code, out, err) = crate::harness::cli(&["destinations"], &dir.url()).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("20/s"), "{out}");

    serve.terminate(Duration::from_secs(10)).await;
}

/// The CLI writes to the file while the server admits and dispatches: neither side fails
/// with "database is locked", and every accepted job is delivered once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cli_and_server_write_the_same_file_at_once() {
    let dir = Dir::new();
    let sink = Sink::ok().await;
    let mut serve = Proc::spawn_in(&["serve"], None, &dir.0, &[]).await;
    let base = format!("http://{}", serve.addr.expect("address"));
    put(&base, "w", json!({"rate": "1000/s", "capacity": 100_000})).await;
    let target = sink.url("/w");

    let http = reqwest::Client::new();
    let producers: Vec<_> = (0..4)
        .map(|p| {
            let (http, base, target) = (http.clone(), base.clone(), target.clone());
            tokio::spawn(async move {
                let mut statuses = Vec::new();
                for i in 0..100 {
                    let r = http
                        .post(format!("{base}/v1/destinations/w/jobs"))
                        .json(&json!({"url": target, "json": {"p": p, "i": i}}))
                        .send()
                        .await
                        .expect("enqueue");
                    statuses.push(r.status().as_u16());
                }
                statuses
            })
        })
        .collect();
    for i in 0..15 {
        let (code, _, err) = crate::harness::cli(
            &["enqueue", "w", "--url", &target, "-d", &format!("cli {i}")],
            &dir.url(),
        )
        .await;
        assert_eq!(code, 0, "CLI enqueue while serving: {err}");
        let (code, _, err) = crate::harness::cli(
            &[
                "destination",
                "set",
                &format!("c{i}"),
                "--rate",
                "5/s",
                "--capacity",
                "10",
            ],
            &dir.url(),
        )
        .await;
        assert_eq!(code, 0, "CLI destination set while serving: {err}");
    }
    for p in producers {
        let statuses = p.await.expect("producer");
        assert!(statuses.iter().all(|s| *s == 202), "{statuses:?}");
    }
    let got = sink.wait_for("/w", 415, Duration::from_secs(30)).await;
    assert_eq!(got.len(), 415);
    let store = Store::connect(&dir.url(), &StoreOptions::default())
        .await
        .expect("open");
    wait_idle(&store, Duration::from_secs(10)).await;
    assert_eq!(count_state(&store, "succeeded").await, 415);
    check_counters(&store).await;
    assert!(
        !serve.log_text().contains("database is locked"),
        "{}",
        serve.log_text()
    );
    serve.terminate(Duration::from_secs(10)).await;
}

/// kill -9 mid-run, then restart: every job reaches the sink, only jobs in flight at the
/// kill twice; then SIGTERM and restart lose nothing either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_and_restart_lose_nothing() {
    let dir = Dir::new();
    let sink = Sink::ok().await;
    let env = [
        ("SLUICE_DISPATCHER__LEASE_MARGIN_MS", "1000"),
        ("SLUICE_MAINTENANCE__INTERVAL_MS", "200"),
    ];
    let url = dir.url();
    let first = Proc::spawn(&["serve"], &url, &env).await;
    let base = format!("http://{}", first.addr.expect("address"));
    put(
        &base,
        "c",
        json!({"rate": "25/s", "capacity": 500, "timeout_ms": 1000}),
    )
    .await;
    batch(&base, "c", &sink.url("/c"), 60).await;
    tokio::time::sleep(Duration::from_millis(800)).await;
    first.signal("KILL");
    let killed_at = Instant::now();
    drop(first);

    let second = Proc::spawn(&["serve"], &url, &env).await;
    let base = format!("http://{}", second.addr.expect("address"));
    // Queue more, then stop gracefully halfway through.
    batch(&base, "c", &sink.url("/c"), 20).await;
    tokio::time::sleep(Duration::from_millis(600)).await;
    let mut second = second;
    second.terminate(Duration::from_secs(15)).await;

    let third = Proc::spawn(&["serve"], &url, &env).await;
    let store = Store::connect(&url, &StoreOptions::default())
        .await
        .expect("store");
    wait_idle(&store, Duration::from_secs(30)).await;
    assert_eq!(count_state(&store, "succeeded").await, 80, "nothing lost");
    let mut per_key: HashMap<String, Vec<Instant>> = HashMap::new();
    for a in sink.arrivals() {
        per_key.entry(a.idempotency_key()).or_default().push(a.at);
    }
    assert_eq!(per_key.len(), 80, "every job reached the sink");
    for (key, at) in &per_key {
        if at.len() > 1 {
            assert!(
                at[0] < killed_at,
                "{key} was duplicated but not in flight at the kill"
            );
        }
    }
    check_counters(&store).await;
    store.close().await;
    third.signal("TERM");
}

/// `sluice demo` needs no setup and prints the comparison.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_runs_with_nothing_configured() {
    let dir = Dir::new();
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["demo", "--jobs", "30"])
        .env_remove("SLUICE_DATABASE_URL")
        .env_remove("DATABASE_URL")
        .current_dir(&dir.0)
        .output()
        .await
        .expect("run");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for needle in [
        "total time",
        "most requests in 100 ms",
        "minimum gap, as sent",
        "leaky",
        "bursty",
    ] {
        assert!(stdout.contains(needle), "{needle}: {stdout}");
    }
    let sent = stdout
        .lines()
        .find(|l| l.contains("minimum gap, as sent"))
        .and_then(|l| l.split_whitespace().nth(4))
        .and_then(|v| v.parse::<f64>().ok())
        .expect("leaky minimum gap");
    assert!(
        sent >= 20.0,
        "leaky lane released closer than 20 ms: {sent}"
    );
    assert!(
        !dir.0.join("sluice.db").exists(),
        "the demo leaves no files behind"
    );
}
