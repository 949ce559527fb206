//! The HTTP API: bad input, auth, destination views, job views.

use serde_json::json;

use crate::harness::{check_counters, TestApp};

crate::both_stores! {
    /// A table of bad requests, each with its status and error code. Afterwards the service
    /// still answers and no accepted job changed.
    async fn bad_inputs_get_the_right_4xx_and_change_nothing(backend) {
        let app = TestApp::start_on(backend, |c| c.api.max_body_bytes = 4_096, 0).await;
        app.put_destination(
            "guarded",
            json!({"rate": "5/s", "capacity": 10, "allowed_base_urls": ["http://127.0.0.1:9000/"]}),
        )
        .await;
        let (s, accepted) = app
            .enqueue(
                "guarded",
                json!({"url": "http://127.0.0.1:9000/ok", "body": "keep me"}),
            )
            .await;
        assert_eq!(s, 202);
        let before = app
            .store
            .list_jobs(&Default::default())
            .await
            .expect("list");

        let big = "x".repeat(10_000);
        // method, path, body, content type, status, code
        type Case = (
            &'static str,
            String,
            Option<String>,
            &'static str,
            u16,
            &'static str,
        );
        let cases: Vec<Case> = vec![
            (
                "POST",
                "/v1/destinations/guarded/jobs".into(),
                Some("{not json".into()),
                "application/json",
                400,
                "malformed_json",
            ),
            (
                "POST",
                "/v1/destinations/guarded/jobs".into(),
                Some(r#"{"url": 5}"#.into()),
                "application/json",
                422,
                "invalid_field",
            ),
            (
                "POST",
                "/v1/destinations/guarded/jobs".into(),
                Some(r#"{"method": "GET"}"#.into()),
                "application/json",
                422,
                "invalid_field",
            ),
            (
                "POST",
                "/v1/destinations/guarded/jobs".into(),
                Some(r#"{"url": "ftp://127.0.0.1:9000/"}"#.into()),
                "application/json",
                422,
                "invalid_job",
            ),
            (
                "POST",
                "/v1/destinations/guarded/jobs".into(),
                Some(r#"{"url": "not a url"}"#.into()),
                "application/json",
                422,
                "invalid_job",
            ),
            (
                "POST",
                "/v1/destinations/guarded/jobs".into(),
                Some(r#"{"url": "http://evil.example/"}"#.into()),
                "application/json",
                422,
                "invalid_job",
            ),
            (
                "POST",
                "/v1/destinations/guarded/jobs".into(),
                Some(r#"{"url": "http://127.0.0.1:9000/", "headers": {"Host": "x"}}"#.into()),
                "application/json",
                422,
                "invalid_job",
            ),
            (
                "POST",
                "/v1/destinations/guarded/jobs".into(),
                Some(r#"{"url": "http://127.0.0.1:9000/", "deadline": "tomorrow"}"#.into()),
                "application/json",
                422,
                "invalid_job",
            ),
            (
                "POST",
                "/v1/destinations/guarded/jobs".into(),
                Some(r#"{"url": "http://127.0.0.1:9000/", "surprise": 1}"#.into()),
                "application/json",
                422,
                "invalid_field",
            ),
            (
                "POST",
                "/v1/destinations/guarded/jobs".into(),
                Some(r#"{"url": "http://127.0.0.1:9000/"}"#.into()),
                "text/plain",
                415,
                "unsupported_media_type",
            ),
            (
                "POST",
                "/v1/destinations/guarded/jobs".into(),
                Some(format!(
                    r#"{{"url": "http://127.0.0.1:9000/", "body": "{big}"}}"#
                )),
                "application/json",
                413,
                "payload_too_large",
            ),
            (
                "POST",
                "/v1/destinations/nope/jobs".into(),
                Some(r#"{"url": "http://127.0.0.1:9000/"}"#.into()),
                "application/json",
                404,
                "destination_not_found",
            ),
            (
                "POST",
                "/v1/destinations/bad%20name/jobs".into(),
                Some(r#"{"url": "http://127.0.0.1:9000/"}"#.into()),
                "application/json",
                400,
                "invalid_destination_name",
            ),
            (
                "POST",
                "/v1/destinations/guarded/jobs/batch".into(),
                Some(r#"{"jobs": []}"#.into()),
                "application/json",
                422,
                "invalid_batch",
            ),
            (
                "PUT",
                "/v1/destinations/x".into(),
                Some(r#"{"rate": "0/s", "capacity": 1}"#.into()),
                "application/json",
                422,
                "invalid_field",
            ),
            (
                "PUT",
                "/v1/destinations/x".into(),
                Some(r#"{"rate": "fast", "capacity": 1}"#.into()),
                "application/json",
                422,
                "invalid_field",
            ),
            (
                "PUT",
                "/v1/destinations/x".into(),
                Some(r#"{"rate": "5/s"}"#.into()),
                "application/json",
                422,
                "invalid_field",
            ),
            (
                "PUT",
                "/v1/destinations/x".into(),
                Some(r#"{"rate": "5/s", "capacity": 0}"#.into()),
                "application/json",
                422,
                "invalid_destination",
            ),
            (
                "PUT",
                "/v1/destinations/x".into(),
                Some(r#"{"rate": "5/s", "capacity": 1, "allowed_base_urls": ["gopher://x"]}"#.into()),
                "application/json",
                422,
                "invalid_destination",
            ),
            (
                "PUT",
                "/v1/destinations/a:b:c".into(),
                Some(r#"{"rate": "5/s", "capacity": -1}"#.into()),
                "application/json",
                422,
                "invalid_field",
            ),
            (
                "GET",
                "/v1/destinations/nope".into(),
                None,
                "",
                404,
                "destination_not_found",
            ),
            (
                "GET",
                "/v1/jobs/not-a-uuid".into(),
                None,
                "",
                400,
                "invalid_job_id",
            ),
            (
                "GET",
                format!("/v1/jobs/{}", uuid::Uuid::now_v7()),
                None,
                "",
                404,
                "job_not_found",
            ),
            (
                "GET",
                "/v1/jobs?state=done".into(),
                None,
                "",
                400,
                "bad_query",
            ),
            (
                "GET",
                "/v1/jobs?limit=many".into(),
                None,
                "",
                400,
                "bad_query",
            ),
            (
                "DELETE",
                "/v1/jobs/zzz".into(),
                None,
                "",
                400,
                "invalid_job_id",
            ),
            ("GET", "/v2/anything".into(), None, "", 404, "not_found"),
            (
                "PATCH",
                "/v1/destinations/guarded".into(),
                None,
                "",
                405,
                "method_not_allowed",
            ),
        ];
        for (method, path, body, ctype, status, code) in cases {
            let mut req = app
                .http
                .request(method.parse().expect("method"), app.url(&path));
            if let Some(b) = body {
                req = req.header("content-type", ctype).body(b);
            }
            let r = req.send().await.expect("request");
            let got = r.status().as_u16();
            let text = r.text().await.expect("body");
            assert_eq!(got, status, "{method} {path}: {text}");
            let v: serde_json::Value = serde_json::from_str(&text)
                .unwrap_or_else(|_| panic!("{method} {path}: body is not JSON: {text}"));
            assert_eq!(v["error"]["code"], code, "{method} {path}: {text}");
            assert!(v["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()));
        }

        // Still serving, and the accepted job is untouched.
        let (s, _) = app
            .enqueue("guarded", json!({"url": "http://127.0.0.1:9000/again"}))
            .await;
        assert_eq!(s, 202);
        let after = app
            .store
            .get_job(accepted["id"].as_str().expect("id").parse().expect("uuid"))
            .await
            .expect("get")
            .expect("exists");
        let original = before
            .iter()
            .find(|j| j.id == after.id)
            .expect("was listed");
        assert_eq!(after.state, original.state);
        assert_eq!(after.url, original.url);
        assert_eq!(after.body_bytes, 7);
        assert!(app.store.get_destination("x").await.expect("get").is_none());
        check_counters(&app.store).await;
        app.stop().await;
    }
}

crate::both_stores! {
    async fn bearer_auth_when_tokens_are_configured(backend) {
        let token = "secret-token-0123456789";
        let app = TestApp::start_on(backend, |c| c.api.tokens = vec![token.to_owned()], 0).await;
        let get = |auth: Option<&str>| {
            let mut r = app.http.get(app.url("/v1/destinations"));
            if let Some(a) = auth {
                r = r.header("authorization", a);
            }
            async move { r.send().await.expect("request") }
        };
        let r = get(None).await;
        assert_eq!(r.status().as_u16(), 401);
        assert!(r.headers().contains_key("www-authenticate"));
        let body: serde_json::Value = r.json().await.expect("json");
        assert_eq!(body["error"]["code"], "unauthorized");
        assert_eq!(
            get(Some("Bearer wrong-token-0123456789"))
                .await
                .status()
                .as_u16(),
            401
        );
        assert_eq!(
            get(Some(token)).await.status().as_u16(),
            401,
            "scheme required"
        );
        assert_eq!(
            get(Some(&format!("Bearer {token}")))
                .await
                .status()
                .as_u16(),
            200
        );
        // Enqueue is protected too; health is not.
        let r = app
            .http
            .post(app.url("/v1/destinations/x/jobs"))
            .json(&json!({"url": "http://x/"}))
            .send()
            .await
            .expect("request");
        assert_eq!(r.status().as_u16(), 401);
        assert_eq!(
            app.http
                .get(app.url("/healthz"))
                .send()
                .await
                .expect("req")
                .status()
                .as_u16(),
            200
        );
        app.stop().await;
    }
}

crate::both_stores! {
    async fn auth_off_by_default(backend) {
        let app = TestApp::api_only_on(backend).await;
        let r = app
            .http
            .get(app.url("/v1/destinations"))
            .send()
            .await
            .expect("req");
        assert_eq!(r.status().as_u16(), 200);
        app.stop().await;
    }
}

crate::both_stores! {
    /// Destination views carry config and live figures; PUT keeps runtime state and the
    /// paused flag unless told otherwise.
    async fn destination_views_and_updates(backend) {
        let app = TestApp::api_only_on(backend).await;
        app.put_destination(
            "d1",
            json!({"rate": "50/s", "capacity": 100, "burst": 2,
            "max_in_flight": 8, "allowed_base_urls": ["http://127.0.0.1:9000/"],
            "timeout_ms": 2000, "max_attempts": 3}),
        )
        .await;
        for _ in 0..3 {
            assert_eq!(
                app.enqueue("d1", json!({"url": "http://127.0.0.1:9000/"}))
                    .await
                    .0,
                202
            );
        }
        let d: serde_json::Value = app
            .http
            .get(app.url("/v1/destinations/d1"))
            .send()
            .await
            .expect("req")
            .json()
            .await
            .expect("json");
        assert_eq!(d["rate"], "50/s");
        assert_eq!(d["interval_us"], 20_000);
        assert_eq!(d["burst"], 2);
        assert_eq!(d["capacity"], 100);
        assert_eq!(d["max_in_flight"], 8);
        assert_eq!(d["timeout_ms"], 2000);
        assert_eq!(d["max_attempts"], 3);
        assert_eq!(d["queued"], 3);
        assert_eq!(d["in_flight"], 0);
        assert_eq!(d["rejected_total"], 0);
        assert_eq!(d["paused"], false);
        assert!(d["delay_ms"].as_i64().is_some());
        assert!(d["next_slot"].as_str().is_some());

        app.put_destination("d1", json!({"rate": "5/s", "capacity": 3, "paused": true}))
            .await;
        let d = app
            .store
            .get_destination("d1")
            .await
            .expect("get")
            .expect("exists");
        assert!(d.paused);
        assert_eq!(d.queued, 3, "jobs survive a config change");
        assert_eq!(d.rate, "5/s");
        assert_eq!(d.max_in_flight, None, "PUT replaces optional settings");
        app.put_destination("d1", json!({"rate": "5/s", "capacity": 3}))
            .await;
        assert!(
            app.store
                .get_destination("d1")
                .await
                .expect("get")
                .expect("exists")
                .paused,
            "omitting paused keeps it"
        );
        assert_eq!(
            app.enqueue("d1", json!({"url": "http://127.0.0.1:9000/"}))
                .await
                .0,
            429
        );
        let d = app
            .store
            .get_destination("d1")
            .await
            .expect("get")
            .expect("exists");
        assert_eq!(d.rejected_total, 1);

        let list: serde_json::Value = app
            .http
            .get(app.url("/v1/destinations"))
            .send()
            .await
            .expect("req")
            .json()
            .await
            .expect("json");
        assert_eq!(list["destinations"].as_array().expect("array").len(), 1);

        let jobs: serde_json::Value = app
            .http
            .get(app.url("/v1/jobs?destination=d1&state=queued&limit=2"))
            .send()
            .await
            .expect("req")
            .json()
            .await
            .expect("json");
        let jobs = jobs["jobs"].as_array().expect("array");
        assert_eq!(jobs.len(), 2);
        assert_eq!(jobs[0]["state"], "queued");
        assert_eq!(jobs[0]["destination"], "d1");
        assert_eq!(jobs[0]["max_attempts"], 3, "destination default applied");
        let id = jobs[0]["id"].as_str().expect("id");
        let job: serde_json::Value = app
            .http
            .get(app.url(&format!("/v1/jobs/{id}")))
            .send()
            .await
            .expect("req")
            .json()
            .await
            .expect("json");
        assert_eq!(job["id"], id);
        assert_eq!(job["method"], "POST");
        let metrics = app
            .http
            .get(app.url("/metrics"))
            .send()
            .await
            .expect("req")
            .text()
            .await
            .expect("text");
        assert!(
            metrics.contains("sluice_destination_queued{destination=\"d1\"} 3"),
            "{metrics}"
        );
        app.stop().await;
    }
}
