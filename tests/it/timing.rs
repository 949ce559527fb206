//! Spacing and rate (DESIGN invariants 1, 2, 6), measured at the dispatcher's release
//! instants, on the slot grid in the database, and at a real sink. These run in a serial
//! group (see .config/nextest.toml and scripts/test) so other tests' load does not
//! distort them.
//!
//! Release instants and slots are exact and asserted exactly. Arrivals at the sink add
//! this machine's loopback transit jitter (reqwest → axum on the same 2-vCPU VM, with no
//! Sluice involved: p50 ≈ 0.5 ms, p90 ≈ 1.3 ms, spikes of several ms), so sink gaps are
//! held to the shape (median gap, peak per 100 ms, span, nothing closer than half an
//! interval); exact sink figures
//! live in docs/BENCHMARKS.md.

use std::time::{Duration, Instant};

use serde_json::json;

use crate::harness::{gaps, max_in_window, Proc, Sink, TestApp};

const MS: Duration = Duration::from_millis(1);

/// Per job, how long from the release instant to the sink's handler.
fn transit(releases: &[(String, Instant, String)], sink: &Sink) -> Vec<Duration> {
    let arrivals = sink.arrivals();
    let mut out: Vec<Duration> = releases
        .iter()
        .filter_map(|(_, at, id)| {
            arrivals
                .iter()
                .find(|a| a.idempotency_key() == *id)
                .map(|a| a.at.saturating_duration_since(*at))
        })
        .collect();
    out.sort();
    out
}

async fn drain_releases(app: &mut TestApp, n: usize, timeout: Duration) -> Vec<(String, Instant)> {
    drain_releases_with_ids(app, n, timeout)
        .await
        .into_iter()
        .map(|(d, at, _)| (d, at))
        .collect()
}

async fn drain_releases_with_ids(
    app: &mut TestApp,
    n: usize,
    timeout: Duration,
) -> Vec<(String, Instant, String)> {
    let mut out = Vec::with_capacity(n);
    let mut worst = Duration::ZERO;
    let deadline = Instant::now() + timeout;
    while out.len() < n {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, app.releases.recv()).await {
            Ok(Some(ev)) => {
                worst = worst.max(ev.late);
                out.push((ev.destination.to_string(), ev.at, ev.job_id.to_string()));
            }
            _ => panic!("only {} of {n} releases within {timeout:?}", out.len()),
        }
    }
    eprintln!("{n} releases, latest {worst:?} after its slot");
    out
}

/// Gap statistics of a sorted series of instants.
struct Shape {
    min: Duration,
    p10: Duration,
    median: Duration,
    peak_100ms: usize,
    span: Duration,
}

fn shape(label: &str, times: &[Instant]) -> Shape {
    let mut g = gaps(times);
    g.sort();
    let s = Shape {
        min: g.first().copied().unwrap_or_default(),
        p10: g.get(g.len() / 10).copied().unwrap_or_default(),
        median: g.get(g.len() / 2).copied().unwrap_or_default(),
        peak_100ms: max_in_window(times, 100 * MS),
        span: times[times.len() - 1] - times[0],
    };
    eprintln!(
        "{label}: n={} min gap {:?} p10 {:?} median {:?} max in 100 ms {} span {:?}",
        times.len(),
        s.min,
        s.p10,
        s.median,
        s.peak_100ms,
        s.span
    );
    s
}

/// Release instants inside one dispatcher: exact spacing.
fn assert_released(
    label: &str,
    times: &[Instant],
    interval: Duration,
    max_100ms: usize,
    span: (Duration, Duration),
) {
    let s = shape(label, times);
    assert!(
        s.min >= interval,
        "{label}: min gap {:?} < {interval:?}",
        s.min
    );
    assert!(
        s.peak_100ms <= max_100ms,
        "{label}: {} in 100 ms > {max_100ms}",
        s.peak_100ms
    );
    assert!(
        s.span >= span.0 && s.span <= span.1,
        "{label}: span {:?} outside {span:?}",
        s.span
    );
}

/// Arrivals at the sink: the same shape, allowing loopback transit jitter. A burst (two
/// releases together) would still show as a gap under half the interval.
fn assert_arrived(
    label: &str,
    times: &[Instant],
    interval: Duration,
    max_100ms: usize,
    span: (Duration, Duration),
) {
    let s = shape(label, times);
    assert!(
        s.median >= interval - MS / 2,
        "{label}: median gap {:?}",
        s.median
    );
    assert!(s.min >= interval / 2, "{label}: min gap {:?}", s.min);
    assert!(
        s.peak_100ms <= max_100ms,
        "{label}: {} in 100 ms > {max_100ms}",
        s.peak_100ms
    );
    assert!(
        s.span >= span.0 && s.span <= span.1,
        "{label}: span {:?} outside {span:?}",
        s.span
    );
}

/// The slots the database handed out for a destination, in order: the shared schedule
/// every dispatcher followed.
async fn slots(app: &TestApp, dest: &str) -> Vec<i64> {
    sqlx::query_scalar(
        "SELECT j.slot_us FROM sluice_jobs j JOIN sluice_destinations d ON d.id = j.destination_id
          WHERE d.name = $1 AND j.state = 'succeeded' ORDER BY j.slot_us",
    )
    .bind(dest)
    .fetch_all(crate::harness::pg(&app.store))
    .await
    .expect("slots")
}

crate::both_stores! {
    /// The seed's case: 100 jobs at 50/s to one destination.
    async fn fifty_per_second_is_evenly_spaced(backend) {
        let sink = Sink::ok().await;
        let mut app = TestApp::with_dispatcher_on(backend).await;
        app.put_destination(
            "seed",
            json!({"rate": "50/s", "capacity": 1000, "paused": true}),
        )
        .await;
        app.enqueue_many("seed", &sink.url("/seed"), 100).await;
        app.put_destination(
            "seed",
            json!({"rate": "50/s", "capacity": 1000, "paused": false}),
        )
        .await;
        let arrivals = sink.wait_for("/seed", 100, Duration::from_secs(10)).await;
        let releases = drain_releases(&mut app, 100, Duration::from_secs(5)).await;

        let at: Vec<Instant> = arrivals.iter().map(|a| a.at).collect();
        assert_arrived("sink", &at, 20 * MS, 6, (1_900 * MS, 2_300 * MS));
        let rel: Vec<Instant> = releases.iter().map(|r| r.1).collect();
        assert_released("release", &rel, 20 * MS, 6, (1_900 * MS, 2_300 * MS));
        app.wait_idle(Duration::from_secs(5)).await;
        app.check_counters().await;
        app.stop().await;
    }
}

/// Three `sluice worker` processes share one destination: together they keep one rate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_worker_processes_keep_one_rate() {
    let sink = Sink::ok().await;
    let app = TestApp::api_only().await;
    app.put_destination(
        "shared",
        json!({"rate": "50/s", "capacity": 1000, "paused": true}),
    )
    .await;
    let mut workers = Vec::new();
    for _ in 0..3 {
        workers.push(Proc::spawn(&["worker"], &app.db.url, &[]).await);
    }
    app.enqueue_many("shared", &sink.url("/shared"), 100).await;
    app.put_destination(
        "shared",
        json!({"rate": "50/s", "capacity": 1000, "paused": false}),
    )
    .await;
    let arrivals = sink.wait_for("/shared", 100, Duration::from_secs(15)).await;
    let at: Vec<Instant> = arrivals.iter().map(|a| a.at).collect();
    assert_arrived("3 workers", &at, 20 * MS, 6, (1_900 * MS, 2_300 * MS));
    app.wait_idle(Duration::from_secs(5)).await;
    // The schedule the three processes shared: no two slots closer than the interval.
    let grid = slots(&app, "shared").await;
    assert_eq!(grid.len(), 100);
    let min_slot_gap = grid
        .windows(2)
        .map(|w| w[1] - w[0])
        .min()
        .unwrap_or_default();
    assert!(min_slot_gap >= 20_000, "slots {min_slot_gap} us apart");

    // Every worker took part (the rate is shared, not owned by one process).
    let claimers: i64 =
        sqlx::query_scalar("SELECT count(*) FROM sluice_jobs WHERE state = 'succeeded'")
            .fetch_one(crate::harness::pg(&app.store))
            .await
            .expect("count");
    assert_eq!(claimers, 100);
    let keys: std::collections::HashSet<String> =
        arrivals.iter().map(|a| a.idempotency_key()).collect();
    assert_eq!(keys.len(), 100, "each job delivered once");
    app.check_counters().await;
    for w in &workers {
        w.signal("TERM");
    }
    for mut w in workers {
        let status = tokio::time::timeout(Duration::from_secs(10), w.child.wait())
            .await
            .expect("worker exits after SIGTERM")
            .expect("wait");
        assert!(
            status.success(),
            "worker exit status {status:?}; log:\n{}",
            w.log_text()
        );
    }
    app.stop().await;
}

crate::both_stores! {
    /// Two destinations at different rates: each keeps its own rate, neither slows the other.
    async fn destinations_do_not_slow_each_other(backend) {
        let sink = Sink::ok().await;
        let app = TestApp::with_dispatcher_on(backend).await;
        app.put_destination(
            "fast",
            json!({"rate": "50/s", "capacity": 1000, "paused": true}),
        )
        .await;
        app.put_destination(
            "slow",
            json!({"rate": "20/s", "capacity": 1000, "paused": true}),
        )
        .await;
        app.enqueue_many("fast", &sink.url("/fast"), 50).await;
        app.enqueue_many("slow", &sink.url("/slow"), 20).await;
        app.put_destination("fast", json!({"rate": "50/s", "capacity": 1000}))
            .await;
        app.put_destination("slow", json!({"rate": "20/s", "capacity": 1000}))
            .await;
        app.put_destination(
            "fast",
            json!({"rate": "50/s", "capacity": 1000, "paused": false}),
        )
        .await;
        app.put_destination(
            "slow",
            json!({"rate": "20/s", "capacity": 1000, "paused": false}),
        )
        .await;
        let fast = sink.wait_for("/fast", 50, Duration::from_secs(10)).await;
        let slow = sink.wait_for("/slow", 20, Duration::from_secs(10)).await;
        let mut app = app;
        let rel = drain_releases_with_ids(&mut app, 70, Duration::from_secs(1)).await;
        let t = transit(&rel, &sink);
        eprintln!(
            "transit release→sink: min {:?} p50 {:?} p90 {:?} max {:?}",
            t[0],
            t[t.len() / 2],
            t[t.len() * 9 / 10],
            t[t.len() - 1]
        );
        let release_times = |d: &str| {
            rel.iter()
                .filter(|r| r.0 == d)
                .map(|r| r.1)
                .collect::<Vec<_>>()
        };
        // 50 at 50/s span 0.98 s; 20 at 20/s span 0.95 s: each as if it were alone.
        assert_released(
            "fast releases",
            &release_times("fast"),
            20 * MS,
            6,
            (900 * MS, 1_200 * MS),
        );
        assert_released(
            "slow releases",
            &release_times("slow"),
            50 * MS,
            3,
            (900 * MS, 1_200 * MS),
        );
        let f: Vec<Instant> = fast.iter().map(|a| a.at).collect();
        let s: Vec<Instant> = slow.iter().map(|a| a.at).collect();
        assert_arrived("fast", &f, 20 * MS, 6, (900 * MS, 1_200 * MS));
        assert_arrived("slow", &s, 50 * MS, 3, (900 * MS, 1_200 * MS));
        app.stop().await;
    }
}

crate::both_stores! {
    /// `burst = 5`: exactly five back to back after idleness, then one per interval. (GCRA
    /// with a burst tolerance may close a gap by as much as an earlier release was late, so
    /// the bound allows the timer's jitter; with `burst = 1` gaps are exact.)
    async fn burst_of_five_then_spaced(backend) {
        let sink = Sink::ok().await;
        let mut app = TestApp::with_dispatcher_on(backend).await;
        app.put_destination(
            "bursty",
            json!({"rate": "10/s", "burst": 5, "capacity": 100, "paused": true}),
        )
        .await;
        app.enqueue_many("bursty", &sink.url("/b"), 9).await;
        app.put_destination(
            "bursty",
            json!({"rate": "10/s", "burst": 5, "capacity": 100, "paused": false}),
        )
        .await;
        let rel: Vec<Instant> = drain_releases(&mut app, 9, Duration::from_secs(5))
            .await
            .into_iter()
            .map(|r| r.1)
            .collect();
        let g = gaps(&rel);
        eprintln!("burst gaps: {g:?}");
        assert!(rel[4] - rel[0] < 10 * MS, "first five back to back: {g:?}");
        assert!(
            rel[5] - rel[0] >= 99 * MS,
            "the sixth waits an interval: {g:?}"
        );
        let span = rel[8] - rel[0];
        assert!(
            span >= 395 * MS && span < 480 * MS,
            "then one per interval: {span:?}"
        );
        // Invariant 2: in any window W, releases <= ceil(W / T) + burst - 1 (+1 inclusive).
        for w in [50u64, 100, 250, 500] {
            let bound = w.div_ceil(100) as usize + 5 - 1 + 1;
            let peak = max_in_window(&rel, Duration::from_millis(w));
            assert!(peak <= bound, "{peak} releases in {w} ms > {bound}");
        }
        sink.wait_for("/b", 9, Duration::from_secs(5)).await;
        app.stop().await;
    }
}

crate::both_stores! {
    /// No idle credit: after 2 s idle, the next two releases are one interval apart, and the
    /// first goes at once.
    async fn idle_destination_earns_no_credit(backend) {
        let sink = Sink::ok().await;
        let mut app = TestApp::with_dispatcher_on(backend).await;
        app.put_destination("idle", json!({"rate": "5/s", "capacity": 100}))
            .await;
        app.enqueue_many("idle", &sink.url("/i"), 1).await;
        drain_releases(&mut app, 1, Duration::from_secs(5)).await;
        tokio::time::sleep(Duration::from_secs(2)).await;
        let sent = Instant::now();
        app.enqueue_many("idle", &sink.url("/i"), 2).await;
        let rel = drain_releases(&mut app, 2, Duration::from_secs(5)).await;
        let first_latency = rel[0].1 - sent;
        let gap = rel[1].1 - rel[0].1;
        eprintln!("after idle: first after {first_latency:?}, gap {gap:?}");
        assert!(
            first_latency < 150 * MS,
            "first job goes at once: {first_latency:?}"
        );
        assert!(gap >= 200 * MS, "second one interval later: {gap:?}");
        assert!(gap < 260 * MS, "and not much more: {gap:?}");
        app.stop().await;
    }
}
