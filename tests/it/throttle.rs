//! Downstream throttling (DESIGN invariant 4): 429/503 with Retry-After shifts the
//! destination's next_slot for every dispatcher; the throttled job goes back to the head
//! of its line without spending an attempt.

use std::collections::HashMap;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::json;

use crate::harness::{check_counters, count_state, Proc, Reply, Sink, TestApp};

const MS: Duration = Duration::from_millis(1);

/// Gap between the throttling response and the next request that reached the sink.
fn pause_after(sink: &Sink, path: &str, throttled_at: usize) -> Duration {
    let got = sink.arrivals_at(path);
    got[throttled_at + 1].at - got[throttled_at].at
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// The scenario: the 10th request gets `429, Retry-After: 2`; with 3 workers on
/// the destination nothing else starts for 2 s (bar requests already in flight), then
/// releases resume at the configured spacing, and every job is delivered once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_after_holds_every_worker() {
    let sink = Sink::start(|_, n| {
        if n == 9 {
            Reply::status(429).header("retry-after", "2")
        } else {
            Reply::ok()
        }
    })
    .await;
    let app = TestApp::api_only().await;
    app.put_destination(
        "t",
        json!({"rate": "10/s", "capacity": 100, "paused": true}),
    )
    .await;
    let mut workers = Vec::new();
    for _ in 0..3 {
        workers.push(Proc::spawn(&["worker"], &app.db.url, &[]).await);
    }
    let ids = app.enqueue_many("t", &sink.url("/t"), 20).await;
    app.put_destination(
        "t",
        json!({"rate": "10/s", "capacity": 100, "paused": false}),
    )
    .await;
    let got = sink.wait_for("/t", 21, Duration::from_secs(15)).await;
    app.wait_idle(Duration::from_secs(5)).await;

    let t429 = got[9].at;
    // Requests released before the 429 came back may still arrive ("in flight").
    let after: Vec<Duration> = got[10..].iter().map(|a| a.at - t429).collect();
    let in_flight = after.iter().filter(|d| **d < 50 * MS).count();
    assert!(in_flight <= 1, "requests right after the 429: {after:?}");
    let resumed: Vec<Instant> = got[10 + in_flight..].iter().map(|a| a.at).collect();
    let first = resumed[0] - t429;
    assert!(
        first >= 2_000 * MS - 20 * MS,
        "resumed after {first:?}, before Retry-After"
    );
    assert!(first < 3_000 * MS, "resumed only after {first:?}");
    // No burst of the backlog: the configured spacing, at the sink.
    for w in resumed.windows(2) {
        let gap = w[1] - w[0];
        assert!(gap >= 50 * MS, "burst after resuming: {gap:?}");
    }
    let span = resumed[resumed.len() - 1] - resumed[0];
    let expected = 100 * MS * (resumed.len() as u32 - 1);
    assert!(
        span >= expected - 20 * MS,
        "resumed faster than 10/s: {span:?} for {}",
        resumed.len()
    );

    // Delivered exactly once each (the throttled job twice at the sink: 429, then 200).
    let mut per_key: HashMap<String, usize> = HashMap::new();
    for a in &got {
        *per_key.entry(a.idempotency_key()).or_default() += 1;
    }
    assert_eq!(per_key.len(), 20);
    let throttled_id = got[9].idempotency_key();
    assert_eq!(per_key[&throttled_id], 2);
    assert!(per_key.iter().all(|(k, n)| *n == 1 || *k == throttled_id));
    assert_eq!(count_state(&app.store, "succeeded").await, 20);
    let job = app
        .store
        .get_job(throttled_id.parse().expect("uuid"))
        .await
        .expect("get")
        .expect("exists");
    assert_eq!(job.attempts, 1, "the throttle did not spend an attempt");
    assert_eq!(job.throttles, 1);
    assert_eq!(job.last_retry_after_ms, Some(2_000));
    assert!(ids.contains(&throttled_id));
    let d = app
        .store
        .get_destination("t")
        .await
        .expect("get")
        .expect("exists");
    assert_eq!(d.throttled_total, 1);
    assert_eq!(d.last_retry_after_ms, Some(2_000));
    assert!(d.throttled_until.is_some());
    check_counters(&app.store).await;
    for w in &workers {
        w.signal("TERM");
    }
    app.stop().await;
}

async fn one_throttle(
    backend: crate::harness::Backend,
    reply: Reply,
    settings: serde_json::Value,
) -> (TestApp, Sink, Duration) {
    let sink = Sink::start(move |_, n| if n == 1 { reply.clone() } else { Reply::ok() }).await;
    let app = TestApp::with_dispatcher_on(backend).await;
    let mut dest = json!({"rate": "20/s", "capacity": 100, "paused": true});
    if let (Some(d), Some(extra)) = (dest.as_object_mut(), settings.as_object()) {
        d.extend(extra.clone());
    }
    app.put_destination("f", dest.clone()).await;
    app.enqueue_many("f", &sink.url("/f"), 4).await;
    dest["paused"] = json!(false);
    app.put_destination("f", dest).await;
    sink.wait_for("/f", 5, Duration::from_secs(10)).await;
    app.wait_idle(Duration::from_secs(5)).await;
    let pause = pause_after(&sink, "/f", 1);
    eprintln!("pause after the signal: {pause:?}");
    (app, sink, pause)
}

crate::both_stores! {
    async fn retry_after_as_an_http_date(backend) {
        let date = httpdate::fmt_http_date(SystemTime::now() + Duration::from_secs(3));
        let (app, _sink, pause) =
            one_throttle(backend, Reply::status(503).header("retry-after", &date), json!({})).await;
        // Whole-second dates: between 2 and 3 s from now.
        assert!(pause >= 1_900 * MS && pause < 3_500 * MS, "{pause:?}");
        app.stop().await;
    }
}

crate::both_stores! {
    async fn retry_after_in_the_past_means_the_floor(backend) {
        let date = httpdate::fmt_http_date(SystemTime::now() - Duration::from_secs(60));
        let (app, _sink, pause) = one_throttle(
            backend,
            Reply::status(429).header("retry-after", &date),
            json!({"throttle_floor_ms": 400}),
        )
        .await;
        assert!(pause >= 380 * MS && pause < 1_000 * MS, "{pause:?}");
        app.stop().await;
    }
}

crate::both_stores! {
    async fn garbage_retry_after_falls_back_to_the_throttle_backoff(backend) {
        let (app, _sink, pause) = one_throttle(
            backend,
            Reply::status(429).header("retry-after", "banana"),
            json!({"throttle_floor_ms": 100, "throttle_backoff_base_ms": 700}),
        )
        .await;
        assert!(pause >= 680 * MS && pause < 1_500 * MS, "{pause:?}");
        let d = app
            .store
            .get_destination("f")
            .await
            .expect("get")
            .expect("exists");
        assert_eq!(
            d.throttle_streak, 0,
            "the success after it reset the streak"
        );
        assert_eq!(d.throttled_total, 1);
        app.stop().await;
    }
}

crate::both_stores! {
    async fn absurd_retry_after_is_capped(backend) {
        let (app, _sink, pause) = one_throttle(
            backend,
            Reply::status(429).header("retry-after", "99999999"),
            json!({"retry_after_max_ms": 1500}),
        )
        .await;
        assert!(pause >= 1_480 * MS && pause < 2_300 * MS, "{pause:?}");
        let jobs = app
            .store
            .list_jobs(&Default::default())
            .await
            .expect("list");
        let throttled = jobs
            .iter()
            .find(|j| j.throttles == 1)
            .expect("the throttled job");
        assert_eq!(
            throttled.last_retry_after_ms,
            Some(1_500),
            "99999999 s clamped to the cap"
        );
        assert_eq!(throttled.attempts, 1);
        app.stop().await;
    }
}

crate::both_stores! {
    /// Exhaustion announced on a *successful* response pauses the destination until the
    /// reset, read as epoch seconds because the destination says so.
    async fn x_ratelimit_reset_pauses_until_the_reset(backend) {
        let sink = Sink::start(|_, n| {
            if n == 1 {
                Reply::ok()
                    .header("x-ratelimit-remaining", "0")
                    .header("x-ratelimit-reset", &(unix_now() + 2).to_string())
            } else {
                Reply::ok()
            }
        })
        .await;
        let app = TestApp::with_dispatcher_on(backend).await;
        let dest = json!({"rate": "20/s", "capacity": 100, "ratelimit_reset": "epoch"});
        app.put_destination("x", dest).await;
        app.enqueue_many("x", &sink.url("/x"), 4).await;
        sink.wait_for("/x", 4, Duration::from_secs(10)).await;
        app.wait_idle(Duration::from_secs(5)).await;
        let pause = pause_after(&sink, "/x", 1);
        // Reset is whole seconds 2 s after the sink's clock: 1 to 2 s from the response.
        assert!(pause >= 900 * MS && pause < 3_000 * MS, "{pause:?}");
        assert_eq!(
            count_state(&app.store, "succeeded").await,
            4,
            "no job failed"
        );
        let jobs = app
            .store
            .list_jobs(&Default::default())
            .await
            .expect("list");
        assert!(jobs.iter().all(|j| j.attempts == 1 && j.throttles == 0));
        app.stop().await;
    }
}

crate::both_stores! {
    /// One destination held by Retry-After does not delay another.
    async fn a_throttled_destination_does_not_delay_another(backend) {
        let sink = Sink::start(|a, _| {
            if a.path == "/held" {
                Reply::status(429).header("retry-after", "3")
            } else {
                Reply::ok()
            }
        })
        .await;
        let app = TestApp::with_dispatcher_on(backend).await;
        app.put_destination(
            "held",
            json!({"rate": "20/s", "capacity": 100, "max_throttles": 1000}),
        )
        .await;
        app.put_destination("free", json!({"rate": "20/s", "capacity": 100}))
            .await;
        app.enqueue_many("held", &sink.url("/held"), 5).await;
        tokio::time::sleep(100 * MS).await;
        let t0 = Instant::now();
        app.enqueue_many("free", &sink.url("/free"), 10).await;
        let free = sink.wait_for("/free", 10, Duration::from_secs(5)).await;
        let took = free[9].at - t0;
        assert!(
            took < 1_200 * MS,
            "10 jobs at 20/s took {took:?} next to a throttled destination"
        );
        assert_eq!(
            sink.arrivals_at("/held").len(),
            1,
            "held destination waited"
        );
        let d = app
            .store
            .get_destination("held")
            .await
            .expect("get")
            .expect("exists");
        assert!(d.throttled, "the API shows the hold: {d:?}");
        assert!(d.delay_ms > 1_000, "and when it resumes: {}", d.delay_ms);
        app.stop().await;
    }
}

crate::both_stores! {
    /// Adaptive rate: repeated 429s lower the effective rate, successes raise it back.
    async fn adaptive_rate_backs_off_and_recovers(backend) {
        let sink = Sink::start(|_, n| {
            if n < 3 {
                Reply::status(429).header("retry-after", "0")
            } else {
                Reply::ok()
            }
        })
        .await;
        let app = TestApp::with_dispatcher_on(backend).await;
        app.put_destination(
            "a",
            json!({"rate": "100/s", "capacity": 500, "adaptive_rate": true, "throttle_floor_ms": 10}),
        )
        .await;
        app.enqueue_many("a", &sink.url("/a"), 3).await;
        sink.wait_for("/a", 4, Duration::from_secs(5)).await;
        app.wait_idle(Duration::from_secs(5)).await;
        let d = app
            .store
            .get_destination("a")
            .await
            .expect("get")
            .expect("exists");
        eprintln!("after 3 throttles: {} /s", d.effective_rate_per_second);
        assert!(
            d.effective_rate_per_second < 30.0,
            "lowered: {}",
            d.effective_rate_per_second
        );
        let lowered = d.effective_rate_per_second;
        app.enqueue_many("a", &sink.url("/a"), 60).await;
        app.wait_idle(Duration::from_secs(20)).await;
        let d = app
            .store
            .get_destination("a")
            .await
            .expect("get")
            .expect("exists");
        eprintln!("after 60 successes: {} /s", d.effective_rate_per_second);
        assert!(
            d.effective_rate_per_second > lowered * 1.5,
            "recovering: {}",
            d.effective_rate_per_second
        );
        assert!(
            d.effective_rate_per_second <= 100.0 + 1e-9,
            "never above the configured rate"
        );
        app.stop().await;
    }
}
