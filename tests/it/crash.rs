//! Nothing lost (DESIGN invariant 5) with real processes: kill -9 of a worker, a
//! PostgreSQL restart under a running server, SIGTERM. These run in the serial group
//! (see .config/nextest.toml) because they start and stop processes and measure rates.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use serde_json::json;
use sluice::store::{Store, StoreOptions};

use crate::harness::{
    check_counters, count_state, max_in_window, PrivateCluster, Proc, Reply, Sink, TestApp,
};

const MS: Duration = Duration::from_millis(1);

fn per_key(sink: &Sink) -> HashMap<String, Vec<Instant>> {
    let mut m: HashMap<String, Vec<Instant>> = HashMap::new();
    for a in sink.arrivals() {
        m.entry(a.idempotency_key()).or_default().push(a.at);
    }
    m
}

/// kill -9 one of two workers while 1,000 jobs flow to 3 destinations.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_a_worker_and_the_survivor_delivers_everything() {
    let sink = Sink::ok().await;
    let app = TestApp::api_only().await;
    let env = [
        ("SLUICE_DISPATCHER__LEASE_MARGIN_MS", "2000"),
        ("SLUICE_MAINTENANCE__INTERVAL_MS", "200"),
    ];
    let dests = ["k0", "k1", "k2"];
    for d in dests {
        app.put_destination(
            d,
            json!({"rate": "50/s", "capacity": 1000, "timeout_ms": 1000, "paused": true}),
        )
        .await;
    }
    let victim = Proc::spawn(&["worker"], &app.db.url, &env).await;
    let _survivor = Proc::spawn(&["worker"], &app.db.url, &env).await;
    let mut total = 0;
    for (i, d) in dests.iter().enumerate() {
        let n = if i == 0 { 334 } else { 333 };
        app.enqueue_many(d, &sink.url(&format!("/{d}")), n).await;
        total += n;
    }
    for d in dests {
        app.put_destination(
            d,
            json!({"rate": "50/s", "capacity": 1000, "timeout_ms": 1000, "paused": false}),
        )
        .await;
    }
    tokio::time::sleep(Duration::from_millis(2_000)).await;
    let before_kill = sink.arrivals().len();
    victim.signal("KILL");
    let killed_at = Instant::now();
    assert!(before_kill > 100, "jobs were flowing: {before_kill}");

    app.wait_idle(Duration::from_secs(30)).await;
    assert_eq!(count_state(&app.store, "succeeded").await, total as i64);
    let keys = per_key(&sink);
    assert_eq!(keys.len(), total, "every job reached the sink");
    let dupes: Vec<_> = keys.iter().filter(|(_, at)| at.len() > 1).collect();
    eprintln!("{} of {total} jobs delivered twice", dupes.len());
    for (key, at) in &dupes {
        assert!(
            at[0] < killed_at,
            "job {key} was duplicated but first sent after the kill"
        );
        assert_eq!(at.len(), 2, "job {key} delivered {} times", at.len());
    }
    assert!(
        dupes.len() <= 20,
        "more duplicates than jobs in flight: {}",
        dupes.len()
    );
    for d in dests {
        let mut at: Vec<Instant> = sink
            .arrivals_at(&format!("/{d}"))
            .iter()
            .map(|a| a.at)
            .collect();
        at.sort();
        let peak = max_in_window(&at, 100 * MS);
        assert!(peak <= 6, "{d}: {peak} requests in 100 ms at 50/s");
    }
    check_counters(&app.store).await;
    app.stop().await;
}

/// Stop and restart PostgreSQL under a running `sluice serve`: the API answers 503 while
/// it is down, everything resumes by itself, nothing is lost, the rate holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_restart_mid_run() {
    let cluster = PrivateCluster::create();
    let sink = Sink::ok().await;
    let serve = Proc::spawn(
        &["serve"],
        &cluster.url(),
        &[("SLUICE_DATABASE__ACQUIRE_TIMEOUT_MS", "1000")],
    )
    .await;
    let base = format!("http://{}", serve.addr.expect("address"));
    let http = reqwest::Client::new();
    let r = http
        .put(format!("{base}/v1/destinations/db"))
        .json(&json!({"rate": "20/s", "capacity": 500}))
        .send()
        .await
        .expect("put");
    assert_eq!(r.status().as_u16(), 200);
    let jobs: Vec<_> = (0..100)
        .map(|i| json!({"url": sink.url("/db"), "json": {"i": i}}))
        .collect();
    let r = http
        .post(format!("{base}/v1/destinations/db/jobs/batch"))
        .json(&json!({ "jobs": jobs }))
        .send()
        .await
        .expect("batch");
    assert_eq!(r.status().as_u16(), 202);
    tokio::time::sleep(Duration::from_millis(1_500)).await;

    cluster.ctl("stop");
    let down_at = Instant::now();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let t = Instant::now();
    let r = http
        .post(format!("{base}/v1/destinations/db/jobs"))
        .json(&json!({"url": sink.url("/db")}))
        .send()
        .await
        .expect("the API still answers");
    let answered_in = t.elapsed();
    assert_eq!(r.status().as_u16(), 503);
    assert!(r.headers().contains_key("retry-after"));
    let body: serde_json::Value = r.json().await.expect("json body");
    assert_eq!(body["error"]["code"], "database_unavailable");
    assert!(
        answered_in < Duration::from_secs(3),
        "503 took {answered_in:?}"
    );
    let health = http
        .get(format!("{base}/healthz"))
        .send()
        .await
        .expect("health");
    assert_eq!(health.status().as_u16(), 503);
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    let sent_while_down = sink.arrivals().len();
    cluster.ctl("start");
    eprintln!(
        "database down for {:?}; {sent_while_down} delivered by then",
        down_at.elapsed()
    );

    // Recovers without a restart: the remaining jobs flow and a new enqueue works.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let r = http
            .post(format!("{base}/v1/destinations/db/jobs"))
            .json(&json!({"url": sink.url("/db"), "idempotency_key": "after-restart"}))
            .send()
            .await
            .expect("request");
        if r.status().is_success() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "API did not recover: {}",
            r.status()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let store = Store::connect(&cluster.url(), &StoreOptions::default())
        .await
        .expect("store");
    crate::harness::wait_idle(&store, Duration::from_secs(30)).await;
    assert_eq!(count_state(&store, "succeeded").await, 101, "nothing lost");
    let keys = per_key(&sink);
    assert_eq!(keys.len(), 101);
    let dupes = keys.values().filter(|v| v.len() > 1).count();
    assert!(dupes <= 2, "{dupes} duplicates across a restart");
    let mut at: Vec<Instant> = sink.arrivals().iter().map(|a| a.at).collect();
    at.sort();
    assert!(
        max_in_window(&at, 50 * MS) <= 2,
        "rate broken across the restart"
    );
    check_counters(&store).await;
    store.close().await;
    serve.signal("TERM");
}

/// SIGTERM: the worker exits within its grace period, its in-flight requests complete
/// (nothing is sent twice), and the jobs it had claimed go to the other worker at once,
/// not after lease expiry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_finishes_in_flight_and_hands_back_claims() {
    let sink = Sink::start(|_, _| Reply::ok().delay(Duration::from_millis(400))).await;
    let app = TestApp::api_only().await;
    app.put_destination("g", json!({"rate": "5/s", "capacity": 100, "paused": true}))
        .await;
    // The leaving worker claims two seconds ahead, so it holds claims when told to stop.
    let mut leaving = Proc::spawn(
        &["worker"],
        &app.db.url,
        &[
            ("SLUICE_DISPATCHER__LOOKAHEAD_MS", "2000"),
            ("SLUICE_DISPATCHER__SHUTDOWN_GRACE_MS", "5000"),
        ],
    )
    .await;
    app.enqueue_many("g", &sink.url("/g"), 20).await;
    app.put_destination(
        "g",
        json!({"rate": "5/s", "capacity": 100, "paused": false}),
    )
    .await;
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    let _staying = Proc::spawn(&["worker"], &app.db.url, &[]).await;
    let held: i64 = sqlx::query_scalar("SELECT count(*) FROM sluice_jobs WHERE state = 'running'")
        .fetch_one(crate::harness::pg(&app.store))
        .await
        .expect("count");
    assert!(held >= 2, "the leaving worker holds claims: {held}");
    let t = Instant::now();
    leaving.terminate(Duration::from_secs(8)).await;
    eprintln!("worker exited {:?} after SIGTERM", t.elapsed());
    // 20 jobs at 5/s: about 4 s of schedule; lease expiry would add 30 s.
    app.wait_idle(Duration::from_secs(12)).await;
    assert_eq!(count_state(&app.store, "succeeded").await, 20);
    let keys = per_key(&sink);
    assert_eq!(keys.len(), 20);
    assert!(
        keys.values().all(|v| v.len() == 1),
        "an in-flight request was cut and resent"
    );
    check_counters(&app.store).await;
    app.stop().await;
}
