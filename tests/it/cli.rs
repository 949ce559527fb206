//! The real binary: a newcomer's path through the CLI.

use crate::harness::{cli, TestDb};

#[tokio::test]
async fn cli_creates_enqueues_lists_and_hits_capacity() {
    let db = TestDb::create().await;
    let (code, out, err) = cli(&["migrate"], &db.url).await;
    assert_eq!(code, 0, "{out}{err}");

    let (code, out, err) = cli(
        &[
            "destination",
            "set",
            "sms",
            "--rate",
            "10/s",
            "--capacity",
            "2",
            "--allowed-base-url",
            "http://127.0.0.1:9/",
        ],
        &db.url,
    )
    .await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("\"rate\": \"10/s\""), "{out}");

    let (code, id, err) = cli(
        &[
            "enqueue",
            "sms",
            "--url",
            "http://127.0.0.1:9/send",
            "-H",
            "X-Tenant: 7",
            "-d",
            "hello",
        ],
        &db.url,
    )
    .await;
    assert_eq!(code, 0, "{err}");
    let id = id.trim().to_owned();
    assert!(uuid::Uuid::parse_str(&id).is_ok(), "prints the id: {id}");

    let (code, out, _) = cli(&["jobs", "show", &id], &db.url).await;
    assert_eq!(code, 0);
    let job: serde_json::Value = serde_json::from_str(&out).expect("json");
    assert_eq!(job["state"], "queued");
    assert_eq!(job["body_bytes"], 5);
    assert!(job["headers"].to_string().contains("X-Tenant"));

    let body_file = std::env::temp_dir().join(format!("sluice-body-{id}.json"));
    std::fs::write(&body_file, "{\"a\":1}").expect("write");
    let data = format!("@{}", body_file.display());
    let (code, _, err) = cli(
        &[
            "enqueue",
            "sms",
            "--url",
            "http://127.0.0.1:9/",
            "-d",
            &data,
        ],
        &db.url,
    )
    .await;
    assert_eq!(code, 0, "{err}");
    let _ = std::fs::remove_file(&body_file);

    // Full: a clear message and exit status 75.
    let (code, _, err) = cli(&["enqueue", "sms", "--url", "http://127.0.0.1:9/"], &db.url).await;
    assert_eq!(code, 75, "{err}");
    assert!(err.contains("full"), "{err}");

    // Outside the allow-list, bad header, unknown destination: non-zero with a message.
    let (code, _, err) = cli(&["enqueue", "sms", "--url", "http://elsewhere/"], &db.url).await;
    assert_ne!(code, 0);
    assert!(err.contains("allowed_base_urls"), "{err}");
    let (code, _, err) = cli(
        &[
            "enqueue",
            "sms",
            "--url",
            "http://127.0.0.1:9/",
            "-H",
            "nocolon",
        ],
        &db.url,
    )
    .await;
    assert_ne!(code, 0);
    assert!(err.contains("Name: value"), "{err}");
    let (code, _, err) = cli(
        &["enqueue", "ghost", "--url", "http://127.0.0.1:9/"],
        &db.url,
    )
    .await;
    assert_ne!(code, 0);
    assert!(err.contains("does not exist"), "{err}");
    let (code, _, err) = cli(
        &[
            "destination",
            "set",
            "x",
            "--rate",
            "0/s",
            "--capacity",
            "1",
        ],
        &db.url,
    )
    .await;
    assert_ne!(code, 0);
    assert!(err.contains("0/s"), "{err}");

    let (code, out, _) = cli(&["destinations"], &db.url).await;
    assert_eq!(code, 0);
    assert!(out.contains("sms") && out.contains("10/s"), "{out}");

    let (code, out, _) = cli(&["jobs", "list", "--destination", "sms"], &db.url).await;
    assert_eq!(code, 0);
    assert_eq!(out.lines().count(), 3, "header + 2 jobs: {out}");

    let (code, out, _) = cli(&["jobs", "cancel", &id], &db.url).await;
    assert_eq!(code, 0);
    assert!(out.contains("cancelled"));
    let (code, _, err) = cli(&["jobs", "cancel", &id], &db.url).await;
    assert_ne!(code, 0);
    assert!(err.contains("not queued"), "{err}");

    let (code, out, _) = cli(&["destination", "pause", "sms"], &db.url).await;
    assert_eq!(code, 0);
    assert!(out.contains("paused"));
    let (code, _, err) = cli(&["destination", "pause", "ghost"], &db.url).await;
    assert_ne!(code, 0);
    assert!(err.contains("does not exist"), "{err}");
}

#[tokio::test]
async fn cli_defaults_to_the_embedded_store_and_rejects_a_missing_config() {
    // No database configured: the embedded store in the working directory.
    let dir = std::env::temp_dir().join(format!("sluice-cli-{}", uuid::Uuid::now_v7().simple()));
    std::fs::create_dir_all(&dir).expect("dir");
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args([
            "destination",
            "set",
            "x",
            "--rate",
            "1/s",
            "--capacity",
            "5",
        ])
        .env_remove("SLUICE_DATABASE_URL")
        .env_remove("DATABASE_URL")
        .current_dir(&dir)
        .output()
        .await
        .expect("run");
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        dir.join("sluice.db").exists(),
        "embedded store created in the working directory"
    );
    let _ = std::fs::remove_dir_all(&dir);

    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["--config", "/nonexistent/sluice.toml", "destinations"])
        .output()
        .await
        .expect("run");
    assert_ne!(out.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not found"));
}

/// The product as a user meets it: `sluice serve`, a destination over HTTP, jobs over
/// HTTP, a real sink receiving them evenly spaced, and a clean exit on SIGTERM.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_end_to_end() {
    let db = TestDb::create().await;
    let sink = crate::harness::Sink::ok().await;
    let mut proc = crate::harness::Proc::spawn(&["serve"], &db.url, &[]).await;
    let base = format!("http://{}", proc.addr.expect("serve prints its address"));
    let http = reqwest::Client::new();
    let r = http
        .put(format!("{base}/v1/destinations/partner"))
        .json(&serde_json::json!({"rate": "20/s", "capacity": 50}))
        .send()
        .await
        .expect("put");
    assert_eq!(r.status().as_u16(), 200);
    for i in 0..10 {
        let r = http
            .post(format!("{base}/v1/destinations/partner/jobs"))
            .json(&serde_json::json!({"url": sink.url("/in"), "json": {"i": i}}))
            .send()
            .await
            .expect("enqueue");
        assert_eq!(r.status().as_u16(), 202);
    }
    let got = sink
        .wait_for("/in", 10, std::time::Duration::from_secs(10))
        .await;
    let span = got[9].at - got[0].at;
    assert!(
        span >= std::time::Duration::from_millis(430),
        "10 jobs at 20/s took {span:?}"
    );
    let health = http
        .get(format!("{base}/healthz"))
        .send()
        .await
        .expect("health");
    assert_eq!(health.status().as_u16(), 200);
    proc.terminate(std::time::Duration::from_secs(10)).await;
}
