//! Dispatcher behaviour that is not about timing precision: what is sent, outcomes,
//! retries, in-flight caps, deadlines, pausing and wake-ups.

use std::time::{Duration, Instant};

use serde_json::json;

use crate::harness::{check_counters, count_state, Reply, Sink, TestApp};

async fn job(app: &TestApp, id: &str) -> serde_json::Value {
    app.http
        .get(app.url(&format!("/v1/jobs/{id}")))
        .send()
        .await
        .expect("request")
        .json()
        .await
        .expect("json")
}

async fn wait_state(app: &TestApp, id: &str, state: &str, timeout: Duration) -> serde_json::Value {
    let deadline = Instant::now() + timeout;
    loop {
        let j = job(app, id).await;
        if j["state"] == state {
            return j;
        }
        assert!(Instant::now() < deadline, "job never became {state}: {j}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

crate::both_stores! {
    /// The request arrives as enqueued, with Idempotency-Key and User-Agent added.
    async fn delivers_the_request_faithfully(backend) {
        let sink = Sink::ok().await;
        let app = TestApp::with_dispatcher_on(backend).await;
        app.put_destination("d", json!({"rate": "100/s", "capacity": 10}))
            .await;
        let (s, body) = app
            .enqueue(
                "d",
                json!({"url": sink.url("/hook?x=1"), "method": "PUT",
                       "headers": {"X-Signature": "abc", "Content-Type": "text/plain"},
                       "body": "payload"}),
            )
            .await;
        assert_eq!(s, 202);
        let id = body["id"].as_str().expect("id");
        let got = sink.wait_for("/hook", 1, Duration::from_secs(5)).await;
        let a = &got[0];
        assert_eq!(a.method, "PUT");
        assert_eq!(&a.body[..], b"payload");
        assert_eq!(a.headers["x-signature"], "abc");
        assert_eq!(a.headers["content-type"], "text/plain");
        assert_eq!(a.idempotency_key(), id);
        assert!(a.headers["user-agent"]
            .to_str()
            .expect("ua")
            .starts_with("sluice/"));
        let j = wait_state(&app, id, "succeeded", Duration::from_secs(5)).await;
        assert_eq!(j["attempts"], 1);
        assert_eq!(j["last_status"], 200);
        assert_eq!(j["response_snippet"], "ok");
        assert!(j["finished_at"].is_string());

        // JSON bodies are sent as JSON.
        let (_, body) = app
            .enqueue(
                "d",
                json!({"url": sink.url("/json"), "json": {"a": [1, 2]}}),
            )
            .await;
        let got = sink.wait_for("/json", 1, Duration::from_secs(5)).await;
        assert_eq!(&got[0].body[..], br#"{"a":[1,2]}"#);
        assert_eq!(got[0].headers["content-type"], "application/json");
        wait_state(
            &app,
            body["id"].as_str().expect("id"),
            "succeeded",
            Duration::from_secs(5),
        )
        .await;
        check_counters(&app.store).await;
        app.stop().await;
    }
}

crate::both_stores! {
    /// 5xx retries with backoff until max_attempts, then dead; a 404 is dead at once;
    /// redirects are never followed.
    async fn retries_then_dead_and_permanent_failures(backend) {
        let sink = Sink::start(|a, _| match a.path.as_str() {
            "/flaky" => Reply::status(503),
            "/gone" => Reply::status(404),
            "/redirect" => Reply::status(302).header("location", "/elsewhere"),
            _ => Reply::ok(),
        })
        .await;
        let app = TestApp::with_dispatcher_on(backend).await;
        app.put_destination(
            "r",
            json!({"rate": "100/s", "capacity": 10, "max_attempts": 3,
                   "backoff_base_ms": 20, "backoff_cap_ms": 100}),
        )
        .await;
        let (_, flaky) = app.enqueue("r", json!({"url": sink.url("/flaky")})).await;
        let (_, gone) = app.enqueue("r", json!({"url": sink.url("/gone")})).await;
        let (_, redirect) = app
            .enqueue("r", json!({"url": sink.url("/redirect")}))
            .await;
        let flaky = flaky["id"].as_str().expect("id");
        let j = wait_state(&app, flaky, "dead", Duration::from_secs(10)).await;
        assert_eq!(j["attempts"], 3);
        assert_eq!(j["last_status"], 503);
        let tries = sink.arrivals_at("/flaky");
        assert_eq!(tries.len(), 3, "exactly max_attempts requests");
        assert!(
            tries.iter().all(|a| a.idempotency_key() == flaky),
            "same key on every attempt"
        );

        let j = wait_state(
            &app,
            gone["id"].as_str().expect("id"),
            "dead",
            Duration::from_secs(5),
        )
        .await;
        assert_eq!(j["attempts"], 1);
        assert_eq!(j["last_status"], 404);
        assert_eq!(sink.arrivals_at("/gone").len(), 1);

        let j = wait_state(
            &app,
            redirect["id"].as_str().expect("id"),
            "dead",
            Duration::from_secs(5),
        )
        .await;
        assert_eq!(j["last_status"], 302);
        assert!(
            sink.arrivals_at("/elsewhere").is_empty(),
            "redirect not followed"
        );
        check_counters(&app.store).await;
        app.stop().await;
    }
}

crate::both_stores! {
    /// Connection refused and timeouts are retried, then dead.
    async fn network_errors_are_retried(backend) {
        let sink = Sink::start(|_, _| Reply::ok().delay(Duration::from_millis(400))).await;
        let app = TestApp::with_dispatcher_on(backend).await;
        app.put_destination(
            "n",
            json!({"rate": "100/s", "capacity": 10, "max_attempts": 2, "timeout_ms": 100,
                   "backoff_base_ms": 10, "backoff_cap_ms": 20}),
        )
        .await;
        // Port 9 on loopback: nothing listens (connection refused).
        let (_, refused) = app
            .enqueue("n", json!({"url": "http://127.0.0.1:9/"}))
            .await;
        let (_, slow) = app.enqueue("n", json!({"url": sink.url("/slow")})).await;
        let j = wait_state(
            &app,
            refused["id"].as_str().expect("id"),
            "dead",
            Duration::from_secs(5),
        )
        .await;
        assert_eq!(j["attempts"], 2);
        assert!(
            j["last_error"]
                .as_str()
                .expect("error")
                .contains("connection"),
            "{j}"
        );
        let j = wait_state(
            &app,
            slow["id"].as_str().expect("id"),
            "dead",
            Duration::from_secs(5),
        )
        .await;
        assert!(
            j["last_error"]
                .as_str()
                .expect("error")
                .contains("timed out"),
            "{j}"
        );
        assert_eq!(sink.arrivals_at("/slow").len(), 2);
        check_counters(&app.store).await;
        app.stop().await;
    }
}

crate::both_stores! {
    /// max_in_flight = 2 against a sink that takes 500 ms: never more than 2 concurrent.
    async fn max_in_flight_is_never_exceeded(backend) {
        let sink = Sink::start(|_, _| Reply::ok().delay(Duration::from_millis(500))).await;
        let app = TestApp::with_dispatcher_on(backend).await;
        app.put_destination(
            "m",
            json!({"rate": "1000/s", "capacity": 100, "max_in_flight": 2}),
        )
        .await;
        let started = Instant::now();
        app.enqueue_many("m", &sink.url("/m"), 6).await;
        sink.wait_for("/m", 6, Duration::from_secs(10)).await;
        app.wait_idle(Duration::from_secs(5)).await;
        let took = started.elapsed();
        assert_eq!(sink.max_in_flight(), 2, "in-flight cap");
        assert!(
            took >= Duration::from_millis(1_450),
            "6 jobs, 2 at a time, 500 ms each: {took:?}"
        );
        assert!(
            took < Duration::from_secs(4),
            "slots freed promptly: {took:?}"
        );
        check_counters(&app.store).await;
        app.stop().await;
    }
}

crate::both_stores! {
    /// A job whose deadline passes before it can be released is expired and never sent.
    async fn expired_jobs_are_never_sent(backend) {
        let sink = Sink::ok().await;
        let app = TestApp::with_dispatcher_on(backend).await;
        app.put_destination("e", json!({"rate": "2/s", "capacity": 10, "paused": true}))
            .await;
        let soon = sluice::timestamp::format_us(
            (std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .expect("clock")
                .as_micros()
                + 300_000) as i64,
        );
        let (_, doomed) = app
            .enqueue("e", json!({"url": sink.url("/doomed"), "deadline": soon}))
            .await;
        let (_, fine) = app.enqueue("e", json!({"url": sink.url("/fine")})).await;
        // The destination stays paused past the deadline.
        tokio::time::sleep(Duration::from_millis(400)).await;
        app.put_destination("e", json!({"rate": "2/s", "capacity": 10, "paused": false}))
            .await;
        wait_state(
            &app,
            fine["id"].as_str().expect("id"),
            "succeeded",
            Duration::from_secs(5),
        )
        .await;
        let j = wait_state(
            &app,
            doomed["id"].as_str().expect("id"),
            "expired",
            Duration::from_secs(5),
        )
        .await;
        assert_eq!(j["attempts"], 0);
        assert!(
            sink.arrivals_at("/doomed").is_empty(),
            "expired job was sent"
        );
        check_counters(&app.store).await;
        app.stop().await;
    }
}

crate::both_stores! {
    /// not_before holds a job back; a paused destination releases nothing until resumed.
    async fn not_before_and_pause_hold_jobs(backend) {
        let sink = Sink::ok().await;
        let app = TestApp::with_dispatcher_on(backend).await;
        app.put_destination("p", json!({"rate": "100/s", "capacity": 10}))
            .await;
        let later_us = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock")
            .as_micros() as i64
            + 600_000;
        let t0 = Instant::now();
        app.enqueue(
            "p",
            json!({"url": sink.url("/later"), "not_before": sluice::timestamp::format_us(later_us)}),
        )
        .await;
        let got = sink.wait_for("/later", 1, Duration::from_secs(5)).await;
        let waited = got[0].at - t0;
        assert!(
            waited >= Duration::from_millis(550),
            "released early: {waited:?}"
        );
        assert!(
            waited < Duration::from_millis(1_500),
            "released late: {waited:?}"
        );

        let (code, out, err) = crate::harness::cli(&["destination", "pause", "p"], &app.db.url).await;
        assert_eq!(code, 0, "{out}{err}");
        app.enqueue("p", json!({"url": sink.url("/held")})).await;
        tokio::time::sleep(Duration::from_millis(600)).await;
        assert!(
            sink.arrivals_at("/held").is_empty(),
            "paused destination released a job"
        );
        let (code, _, _) = crate::harness::cli(&["destination", "resume", "p"], &app.db.url).await;
        assert_eq!(code, 0);
        sink.wait_for("/held", 1, Duration::from_secs(3)).await;
        app.stop().await;
    }
}

crate::both_stores! {
    /// An enqueue to an idle destination reaches the dispatcher through NOTIFY, not the
    /// (here very slow) fallback poll.
    async fn notify_wakes_an_idle_dispatcher(backend) {
        let sink = Sink::ok().await;
        let app = TestApp::start_on(backend, |c| c.dispatcher.poll_interval_ms = 30_000, 1).await;
        app.put_destination("w", json!({"rate": "10/s", "capacity": 10}))
            .await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        for i in 0..3 {
            let t0 = Instant::now();
            app.enqueue("w", json!({"url": sink.url("/w")})).await;
            let got = sink.wait_for("/w", i + 1, Duration::from_secs(5)).await;
            let latency = got[i].at - t0;
            assert!(
                latency < Duration::from_millis(250),
                "enqueue → release took {latency:?}"
            );
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        app.stop().await;
    }
}

crate::both_stores! {
    /// Many destinations with work at once are all served, each at its own rate, and the
    /// counters stay exact.
    async fn many_destinations_are_all_served(backend) {
        let sink = Sink::ok().await;
        let mut app = TestApp::with_dispatcher_on(backend).await;
        for d in 0..50 {
            app.put_destination(
                &format!("many-{d}"),
                json!({"rate": "20/s", "capacity": 100}),
            )
            .await;
        }
        for d in 0..50 {
            app.enqueue_many(&format!("many-{d}"), &sink.url(&format!("/many/{d}")), 4)
                .await;
        }
        app.wait_idle(Duration::from_secs(15)).await;
        assert_eq!(count_state(&app.store, "succeeded").await, 200);
        for d in 0..50 {
            let got = sink.arrivals_at(&format!("/many/{d}"));
            assert_eq!(got.len(), 4);
        }
        // Spacing per destination at the release instants (exact within one dispatcher).
        let mut by_dest: std::collections::HashMap<String, Vec<Instant>> = Default::default();
        while let Ok(ev) = app.releases.try_recv() {
            by_dest
                .entry(ev.destination.to_string())
                .or_default()
                .push(ev.at);
        }
        assert_eq!(by_dest.len(), 50);
        for (d, times) in by_dest {
            let gaps = crate::harness::gaps(&times);
            assert!(
                gaps.iter().all(|g| *g >= Duration::from_millis(50)),
                "{d}: gaps {gaps:?}"
            );
        }
        check_counters(&app.store).await;
        app.stop().await;
    }
}
