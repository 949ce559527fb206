//! Nothing lost (DESIGN invariant 5), in-process parts: downstream faults, requeue, and
//! the maintenance that makes crashes recoverable. Killing and restarting processes is
//! in `crash.rs`.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use serde_json::json;
use sluice::maintenance::Maintenance;
use sluice::store::{ClaimParams, Store, StoreOptions};
use tokio_util::sync::CancellationToken;

use crate::harness::{
    check_counters, count_state, execute, Backend, FaultSink, Reply, Sink, TestApp, TestDb,
};

const MS: Duration = Duration::from_millis(1);

crate::both_stores! {
    /// A downstream that resets connections, hangs, sends 10 MB, or alternates: every job
    /// ends in the right state, and another destination is not held up.
    async fn downstream_faults_end_in_correct_states(backend) {
        let faults = FaultSink::start().await;
        let sink = Sink::ok().await;
        let app = TestApp::with_dispatcher_on(backend).await;
        app.put_destination(
            "bad",
            json!({"rate": "200/s", "capacity": 100, "timeout_ms": 300, "max_attempts": 3,
                   "backoff_base_ms": 10, "backoff_cap_ms": 50}),
        )
        .await;
        app.put_destination("good", json!({"rate": "20/s", "capacity": 100}))
            .await;
        let mut ids: HashMap<&str, Vec<String>> = HashMap::new();
        for path in ["/ok", "/reset", "/hang", "/huge", "/flaky"] {
            for _ in 0..2 {
                let (s, b) = app.enqueue("bad", json!({"url": faults.url(path)})).await;
                assert_eq!(s, 202);
                ids.entry(path)
                    .or_default()
                    .push(b["id"].as_str().expect("id").to_owned());
            }
        }
        for _ in 0..2 {
            let (_, b) = app
                .enqueue("bad", json!({"url": "http://127.0.0.1:9/refused"}))
                .await;
            ids.entry("refused")
                .or_default()
                .push(b["id"].as_str().expect("id").to_owned());
        }
        let t0 = Instant::now();
        app.enqueue_many("good", &sink.url("/good"), 10).await;
        let good = sink.wait_for("/good", 10, Duration::from_secs(5)).await;
        let took = good[9].at - t0;
        assert!(
            took < 1_500 * MS,
            "the healthy destination was held up: {took:?}"
        );

        app.wait_idle(Duration::from_secs(20)).await;
        let state_of = |id: &str| {
            let store = app.store.clone();
            let id: uuid::Uuid = id.parse().expect("uuid");
            async move { store.get_job(id).await.expect("get").expect("exists") }
        };
        for (path, want, attempts, error) in [
            ("/ok", "succeeded", 1, ""),
            ("/huge", "succeeded", 1, ""),
            ("/reset", "dead", 3, "request failed"),
            ("/hang", "dead", 3, "timed out"),
            ("refused", "dead", 3, "connection failed"),
        ] {
            for id in &ids[path] {
                let j = state_of(id).await;
                assert_eq!(j.state.as_str(), want, "{path}: {j:?}");
                assert_eq!(j.attempts, attempts, "{path}: {j:?}");
                let err = j.last_error.clone().unwrap_or_default();
                assert!(err.contains(error), "{path}: error {err:?}");
                if path == "/huge" {
                    let snippet = j.response_snippet.unwrap_or_default();
                    assert!(
                        snippet.len() <= 2_048,
                        "read at most a snippet: {}",
                        snippet.len()
                    );
                }
            }
        }
        // /flaky resets every other connection (shared between its two jobs): both succeed,
        // at least one after a retry.
        let mut flaky_attempts = 0;
        for id in &ids["/flaky"] {
            let j = state_of(id).await;
            assert_eq!(j.state.as_str(), "succeeded", "{j:?}");
            flaky_attempts += j.attempts;
        }
        assert!(flaky_attempts >= 3, "a reset was retried: {flaky_attempts}");
        assert_eq!(faults.hits("/hang"), 6);
        check_counters(&app.store).await;
        app.stop().await;
    }
}

crate::both_stores! {
    /// A dead job can be put back in line (API and CLI), subject to capacity.
    async fn dead_jobs_can_be_retried(backend) {
        let sink = Sink::start(|_, n| {
            if n == 0 {
                Reply::status(404)
            } else {
                Reply::ok()
            }
        })
        .await;
        let app = TestApp::with_dispatcher_on(backend).await;
        app.put_destination("r", json!({"rate": "50/s", "capacity": 2}))
            .await;
        let (_, b) = app.enqueue("r", json!({"url": sink.url("/r")})).await;
        let id = b["id"].as_str().expect("id").to_owned();
        app.wait_idle(Duration::from_secs(5)).await;
        let retry = |id: String| {
            let app = &app;
            async move {
                let r = app
                    .http
                    .post(app.url(&format!("/v1/jobs/{id}/retry")))
                    .send()
                    .await
                    .expect("request");
                (
                    r.status().as_u16(),
                    r.json::<serde_json::Value>().await.unwrap_or_default(),
                )
            }
        };
        // Full: two more queued jobs on a paused destination fill it.
        app.put_destination("r", json!({"rate": "50/s", "capacity": 2, "paused": true}))
            .await;
        let (_, other) = app.enqueue("r", json!({"url": sink.url("/r")})).await;
        app.enqueue("r", json!({"url": sink.url("/r")})).await;
        let (status, body) = retry(id.clone()).await;
        assert_eq!(status, 429, "{body}");
        let (status, body) = retry(other["id"].as_str().expect("id").to_owned()).await;
        assert_eq!(status, 409, "only dead jobs: {body}");
        let (code, _, _) = crate::harness::cli(
            &["jobs", "cancel", other["id"].as_str().expect("id")],
            &app.db.url,
        )
        .await;
        assert_eq!(code, 0);
        let (code, out, err) = crate::harness::cli(&["jobs", "retry", &id], &app.db.url).await;
        assert_eq!(code, 0, "{out}{err}");
        assert!(out.contains("queued"), "{out}");
        app.put_destination("r", json!({"rate": "50/s", "capacity": 2, "paused": false}))
            .await;
        app.wait_idle(Duration::from_secs(5)).await;
        let j = app
            .store
            .get_job(id.parse().expect("uuid"))
            .await
            .expect("get")
            .expect("exists");
        assert_eq!(j.state.as_str(), "succeeded");
        assert_eq!(j.attempts, 1, "fresh attempts");
        let (status, _) = retry(uuid::Uuid::now_v7().to_string()).await;
        assert_eq!(status, 404);
        check_counters(&app.store).await;
        app.stop().await;
    }
}

async fn fresh_store() -> (TestDb, Store) {
    fresh_store_on(Backend::Postgres).await
}

async fn fresh_store_on(backend: Backend) -> (TestDb, Store) {
    let db = TestDb::create_on(backend).await;
    let store = Store::connect(&db.url, &StoreOptions::default())
        .await
        .expect("store");
    store.migrate().await.expect("migrate");
    (db, store)
}

fn spec(json: serde_json::Value) -> sluice::destination::DestinationSpec {
    serde_json::from_value::<sluice::destination::DestinationConfig>(json)
        .expect("config")
        .validate()
        .expect("valid")
}

fn job(url: &str) -> sluice::job::NewJob {
    sluice::job::JobRequest {
        url: url.to_owned(),
        ..Default::default()
    }
    .validate("")
    .expect("valid")
}

crate::both_stores! {
/// Claims whose lease ran out go back to the queue (or dead on their last attempt), with
/// the counters kept exact; queued jobs past their deadline expire; finished jobs are
/// pruned after the retention period.
async fn maintenance_rescues_expires_and_prunes(backend) {
    let (db, store) = fresh_store_on(backend).await;
    let name = sluice::destination::DestinationName::parse("m").expect("name");
    store
        .upsert_destination(
            &name,
            &spec(json!({"rate": "1000/s", "capacity": 100, "max_attempts": 2})),
        )
        .await
        .expect("upsert");
    let jobs: Vec<_> = (0..3).map(|_| job("http://127.0.0.1:9/")).collect();
    store.enqueue("m", &jobs).await.expect("enqueue");
    // A dispatcher claims them and dies: its leases are already in the past.
    let dead_worker = uuid::Uuid::now_v7();
    let claim = store
        .claim(&ClaimParams {
            worker_id: dead_worker,
            horizon_us: 50_000,
            lead_us: 0,
            max_destinations: 10,
            max_jobs: 10,
            max_per_destination: 10,
            lease_margin_us: -100_000_000,
        })
        .await
        .expect("claim");
    assert_eq!(claim.jobs.len(), 3);
    // One of them was on its last attempt.
    execute(
        &db,
        &store,
        "UPDATE sluice_jobs SET attempts = 2
          WHERE id = (SELECT id FROM sluice_jobs ORDER BY id LIMIT 1)",
    )
    .await;
    let config = sluice::config::MaintenanceConfig {
        retention_hours: 1,
        ..Default::default()
    };
    let m = Maintenance::new(store.clone(), config, Duration::from_secs(1));
    let r = m.run_once(true).await.expect("pass");
    assert_eq!(r.rescued, 3);
    assert_eq!(count_state(&store, "queued").await, 2);
    assert_eq!(count_state(&store, "dead").await, 1);
    check_counters(&store).await;
    let again = m.run_once(true).await.expect("pass");
    assert_eq!(again.rescued, 0, "nothing left to rescue");

    // Expiry on a paused destination.
    store.set_paused("m", true).await.expect("pause");
    let mut overdue = job("http://127.0.0.1:9/late");
    overdue.deadline_us = Some(store.now_us().await.expect("now") + 1_000);
    store.enqueue("m", &[overdue]).await.expect("enqueue");
    tokio::time::sleep(Duration::from_millis(20)).await;
    let r = m.run_once(false).await.expect("pass");
    assert_eq!(r.expired, 1);
    assert_eq!(count_state(&store, "expired").await, 1);
    check_counters(&store).await;

    // Retention: finished jobs older than the cutoff go, recent and open ones stay.
    execute(
        &db,
        &store,
        "UPDATE sluice_jobs SET finished_at_us = finished_at_us - 7200000000 WHERE state = 'dead'",
    )
    .await;
    let r = m.run_once(false).await.expect("pass");
    assert_eq!(r.pruned, 1);
    assert_eq!(count_state(&store, "dead").await, 0);
    assert_eq!(
        count_state(&store, "expired").await,
        1,
        "recent finished job kept"
    );
    assert_eq!(
        count_state(&store, "queued").await,
        2,
        "open jobs are never pruned"
    );
    check_counters(&store).await;
}
}

/// Exactly one process leads maintenance; when it stops, another takes over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn maintenance_has_one_leader_and_fails_over() {
    let (db, store) = fresh_store().await;
    let config = sluice::config::MaintenanceConfig {
        interval_ms: 100,
        ..Default::default()
    };
    let holders = || {
        let store = store.clone();
        let name = db.name.clone();
        async move {
            sqlx::query_scalar::<_, i32>(
                "SELECT l.pid FROM pg_locks l JOIN pg_database d ON d.oid = l.database
                  WHERE l.locktype = 'advisory' AND l.granted AND d.datname = $1",
            )
            .bind(name)
            .fetch_all(crate::harness::pg(&store))
            .await
            .expect("locks")
        }
    };
    let wait_for_leader = |not: Option<i32>| {
        let holders = &holders;
        async move {
            let deadline = Instant::now() + Duration::from_secs(5);
            loop {
                let h = holders().await;
                if h.len() == 1 && Some(h[0]) != not {
                    return h[0];
                }
                assert!(h.len() <= 1, "two leaders: {h:?}");
                assert!(Instant::now() < deadline, "no leader: {h:?}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    let a_token = CancellationToken::new();
    let a = Maintenance::new(store.clone(), config.clone(), Duration::from_secs(1));
    let a_task = tokio::spawn(a.run(a_token.clone()));
    let first = wait_for_leader(None).await;
    let b_token = CancellationToken::new();
    let b = Maintenance::new(store.clone(), config, Duration::from_secs(1));
    let b_task = tokio::spawn(b.run(b_token.clone()));
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(holders().await, vec![first], "still one leader");
    a_token.cancel();
    a_task.await.expect("a stops");
    let second = wait_for_leader(Some(first)).await;
    assert_ne!(first, second);
    b_token.cancel();
    b_task.await.expect("b stops");
}
