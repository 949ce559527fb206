//! Bounded admission (DESIGN invariant 3) and idempotency, under concurrency.

use std::sync::Arc;

use serde_json::json;

use crate::harness::{check_counters, count_state, TestApp};

crate::both_stores! {
    /// 32 producers × 50 enqueues against capacity 500 with nothing draining: exactly 500
    /// accepted, every other answer a 429 with Retry-After. `SLUICE_ADMISSION_ROUNDS` repeats
    /// it (20 while developing).
    async fn concurrent_producers_never_over_admit(backend) {
        let rounds: usize = std::env::var("SLUICE_ADMISSION_ROUNDS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(1);
        let app = Arc::new(TestApp::api_only_on(backend).await);
        for round in 0..rounds {
            let dest = format!("full-{round}");
            app.put_destination(&dest, json!({"rate": "10/s", "capacity": 500}))
                .await;
            let mut producers = Vec::new();
            for p in 0..32 {
                let app = app.clone();
                let dest = dest.clone();
                producers.push(tokio::spawn(async move {
                    let mut accepted = 0;
                    let mut rejected = 0;
                    for i in 0..50 {
                        let r = app
                            .http
                            .post(app.url(&format!("/v1/destinations/{dest}/jobs")))
                            .json(&json!({"url": "http://127.0.0.1:9/", "body": format!("{p}-{i}")}))
                            .send()
                            .await
                            .expect("request");
                        match r.status().as_u16() {
                            202 => accepted += 1,
                            429 => {
                                let ra = r
                                    .headers()
                                    .get("retry-after")
                                    .and_then(|v| v.to_str().ok())
                                    .and_then(|v| v.parse::<u64>().ok());
                                assert!(ra.is_some_and(|s| s >= 1), "429 without Retry-After");
                                let body: serde_json::Value = r.json().await.expect("json");
                                assert_eq!(body["error"]["code"], "destination_full");
                                rejected += 1;
                            }
                            s => panic!("unexpected status {s}"),
                        }
                    }
                    (accepted, rejected)
                }));
            }
            let (mut accepted, mut rejected) = (0, 0);
            for p in producers {
                let (a, r) = p.await.expect("producer");
                accepted += a;
                rejected += r;
            }
            assert_eq!(accepted, 500, "round {round}: over- or under-admitted");
            assert_eq!(rejected, 32 * 50 - 500);
            let d = app
                .store
                .get_destination(&dest)
                .await
                .expect("get")
                .expect("exists");
            assert_eq!(d.backlog, 500);
            assert_eq!(d.rejected_total, 1100);
        }
        assert_eq!(count_state(&app.store, "queued").await, 500 * rounds as i64);
        check_counters(&app.store).await;
        let app = Arc::try_unwrap(app).ok().expect("sole owner");
        app.stop().await;
    }
}

crate::both_stores! {
    /// The same idempotency key sent concurrently admits exactly one job; everyone gets its id.
    async fn concurrent_duplicate_idempotency_keys_admit_one(backend) {
        let app = Arc::new(TestApp::api_only_on(backend).await);
        app.put_destination("idem", json!({"rate": "1/s", "capacity": 100}))
            .await;
        let mut tasks = Vec::new();
        for _ in 0..24 {
            let app = app.clone();
            tasks.push(tokio::spawn(async move {
                app.enqueue(
                    "idem",
                    json!({"url": "http://127.0.0.1:9/", "idempotency_key": "order-42"}),
                )
                .await
            }));
        }
        let mut ids = std::collections::HashSet::new();
        let mut created = 0;
        for t in tasks {
            let (status, body) = t.await.expect("task");
            match status {
                202 => created += 1,
                200 => {}
                s => panic!("status {s}: {body}"),
            }
            ids.insert(body["id"].as_str().expect("id").to_owned());
        }
        assert_eq!(created, 1, "exactly one request creates the job");
        assert_eq!(ids.len(), 1, "every request sees the same job id");
        let d = app
            .store
            .get_destination("idem")
            .await
            .expect("get")
            .expect("exists");
        assert_eq!(d.backlog, 1);
        // Same key on another destination is a different job.
        app.put_destination("idem2", json!({"rate": "1/s", "capacity": 100}))
            .await;
        let (status, body) = app
            .enqueue(
                "idem2",
                json!({"url": "http://127.0.0.1:9/", "idempotency_key": "order-42"}),
            )
            .await;
        assert_eq!(status, 202);
        assert!(!ids.contains(body["id"].as_str().expect("id")));
        // A duplicate inside one batch admits one job too.
        let r = app
            .http
            .post(app.url("/v1/destinations/idem2/jobs/batch"))
            .json(&json!({"jobs": [
                {"url": "http://127.0.0.1:9/", "idempotency_key": "k"},
                {"url": "http://127.0.0.1:9/", "idempotency_key": "k"}
            ]}))
            .send()
            .await
            .expect("request");
        let body: serde_json::Value = r.json().await.expect("json");
        assert_eq!(body["jobs"][0]["id"], body["jobs"][1]["id"]);
        assert_eq!(body["jobs"][1]["created"], false);
        check_counters(&app.store).await;
        Arc::try_unwrap(app).ok().expect("owner").stop().await;
    }
}

crate::both_stores! {
    /// A full destination with a repeated key still returns the existing job (200), not 429.
    async fn idempotent_repeat_is_not_rejected_when_full(backend) {
        let app = TestApp::api_only_on(backend).await;
        app.put_destination("one", json!({"rate": "1/s", "capacity": 1}))
            .await;
        let job = json!({"url": "http://127.0.0.1:9/", "idempotency_key": "a"});
        let (s1, b1) = app.enqueue("one", job.clone()).await;
        let (s2, b2) = app.enqueue("one", job).await;
        assert_eq!((s1, s2), (202, 200));
        assert_eq!(b1["id"], b2["id"]);
        let (s3, _) = app
            .enqueue(
                "one",
                json!({"url": "http://127.0.0.1:9/", "idempotency_key": "b"}),
            )
            .await;
        assert_eq!(s3, 429);
        app.stop().await;
    }
}

crate::both_stores! {
    /// Batches are all or nothing, against capacity and validation alike.
    async fn batch_is_all_or_nothing(backend) {
        let app = TestApp::api_only_on(backend).await;
        app.put_destination(
            "b",
            json!({"rate": "1/s", "capacity": 5, "allowed_base_urls": ["http://127.0.0.1:9/"]}),
        )
        .await;
        let batch = |n: usize| json!({"jobs": (0..n).map(|_| json!({"url": "http://127.0.0.1:9/x"})).collect::<Vec<_>>()});
        let post = |body: serde_json::Value| {
            let app = &app;
            async move {
                let r = app
                    .http
                    .post(app.url("/v1/destinations/b/jobs/batch"))
                    .json(&body)
                    .send()
                    .await
                    .expect("request");
                (
                    r.status().as_u16(),
                    r.json::<serde_json::Value>().await.unwrap_or_default(),
                )
            }
        };
        assert_eq!(post(batch(3)).await.0, 202);
        let (status, body) = post(batch(3)).await;
        assert_eq!(status, 429, "{body}");
        assert_eq!(count_state(&app.store, "queued").await, 3);
        let (status, body) = post(json!({"jobs": [
            {"url": "http://127.0.0.1:9/ok"},
            {"url": "http://elsewhere.example/"}
        ]}))
        .await;
        assert_eq!(status, 422, "{body}");
        assert_eq!(body["error"]["field"], "jobs[1].url");
        assert_eq!(count_state(&app.store, "queued").await, 3);
        assert_eq!(post(batch(2)).await.0, 202);
        check_counters(&app.store).await;
        app.stop().await;
    }
}

crate::both_stores! {
    /// Cancelling a queued job frees its capacity; a second cancel is a conflict.
    async fn cancel_frees_capacity(backend) {
        let app = TestApp::api_only_on(backend).await;
        app.put_destination("c", json!({"rate": "1/s", "capacity": 2}))
            .await;
        let job = json!({"url": "http://127.0.0.1:9/"});
        let (_, first) = app.enqueue("c", job.clone()).await;
        assert_eq!(app.enqueue("c", job.clone()).await.0, 202);
        assert_eq!(app.enqueue("c", job.clone()).await.0, 429);
        let id = first["id"].as_str().expect("id");
        let r = app
            .http
            .delete(app.url(&format!("/v1/jobs/{id}")))
            .send()
            .await
            .expect("request");
        assert_eq!(r.status().as_u16(), 200);
        let body: serde_json::Value = r.json().await.expect("json");
        assert_eq!(body["state"], "cancelled");
        assert_eq!(
            app.enqueue("c", job.clone()).await.0,
            202,
            "room after cancel"
        );
        let r = app
            .http
            .delete(app.url(&format!("/v1/jobs/{id}")))
            .send()
            .await
            .expect("request");
        assert_eq!(r.status().as_u16(), 409);
        let body: serde_json::Value = r.json().await.expect("json");
        assert_eq!(body["error"]["code"], "job_state_conflict");
        let r = app
            .http
            .delete(app.url(&format!("/v1/jobs/{}", uuid::Uuid::now_v7())))
            .send()
            .await
            .expect("request");
        assert_eq!(r.status().as_u16(), 404);
        check_counters(&app.store).await;
        app.stop().await;
    }
}
