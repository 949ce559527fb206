//! `sluice demo`: the seed guide's experiment, live, with nothing to set up.
//!
//! Starts a local HTTP sink and a dispatcher on a throwaway embedded store, sends the same
//! jobs through a leaky destination (`burst = 1`) and a bursty one (`burst = 20`) at the
//! same rate side by side, and prints what the guide measured — total time, most
//! requests in any 100 ms, minimum gap — and a timeline of both lanes.

use std::collections::HashMap;
use std::io::Write as _;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use tokio_util::sync::CancellationToken;

use crate::config::DispatcherConfig;
use crate::destination::{DestinationConfig, DestinationName};
use crate::dispatcher::Dispatcher;
use crate::job::JobRequest;
use crate::metrics::Metrics;
use crate::rate::Rate;
use crate::store::{Store, StoreOptions};

/// What the demo sends.
#[derive(Debug, Clone)]
pub struct DemoOptions {
    /// Jobs per lane.
    pub jobs: usize,
    /// Rate of both lanes.
    pub rate: Rate,
    /// Burst of the bursty lane.
    pub burst: u32,
}

/// One lane's measurements, as the seed guide reports them.
#[derive(Debug, Clone)]
pub struct LaneStats {
    /// First to last arrival.
    pub total: Duration,
    /// Most arrivals in any inclusive 100 ms window.
    pub max_in_100ms: usize,
    /// Smallest gap between consecutive arrivals.
    pub min_gap: Duration,
}

/// Computes a lane's figures from sorted arrival instants.
pub fn lane_stats(times: &[Instant]) -> LaneStats {
    let total = match (times.first(), times.last()) {
        (Some(a), Some(b)) => *b - *a,
        _ => Duration::ZERO,
    };
    let min_gap = times
        .windows(2)
        .map(|w| w[1] - w[0])
        .min()
        .unwrap_or_default();
    LaneStats {
        total,
        max_in_100ms: max_in_window(times, Duration::from_millis(100)),
        min_gap,
    }
}

/// Most of the sorted `times` within any inclusive window of length `window`: the
/// "most requests in any 100 ms" that partners count. Tests and the benchmarks use it too.
pub fn max_in_window(times: &[Instant], window: Duration) -> usize {
    let mut best = 0;
    let mut j = 0;
    for i in 0..times.len() {
        while times[i].duration_since(times[j]) > window {
            j += 1;
        }
        best = best.max(i - j + 1);
    }
    best
}

/// A text timeline: one row per lane, one column per 100 ms (wider when the run is
/// long), each cell as tall as the number of requests that arrived in it, on one scale
/// for all lanes.
pub fn timeline(lanes: &[(&str, &[Instant])]) -> String {
    let start = lanes.iter().filter_map(|(_, t)| t.first()).min().copied();
    let end = lanes.iter().filter_map(|(_, t)| t.last()).max().copied();
    let (Some(start), Some(end)) = (start, end) else {
        return String::new();
    };
    let span = end - start;
    let mut bucket = Duration::from_millis(100);
    while span.as_nanos() / bucket.as_nanos() >= 80 {
        bucket *= 2;
    }
    let columns = (span.as_nanos() / bucket.as_nanos()) as usize + 1;
    const LEVELS: [char; 9] = [' ', '▁', '▂', '▃', '▄', '▅', '▆', '▇', '█'];
    let counts: Vec<Vec<usize>> = lanes
        .iter()
        .map(|(_, times)| {
            let mut c = vec![0usize; columns];
            for t in *times {
                let i = ((*t - start).as_nanos() / bucket.as_nanos()) as usize;
                c[i.min(columns - 1)] += 1;
            }
            c
        })
        .collect();
    let peak = counts.iter().flatten().copied().max().unwrap_or(1).max(1);
    let mut out = String::new();
    for ((name, _), c) in lanes.iter().zip(&counts) {
        let row: String = c
            .iter()
            .map(|&n| {
                if n == 0 {
                    '·'
                } else {
                    LEVELS[(n * 8).div_ceil(peak).clamp(1, 8)]
                }
            })
            .collect();
        out.push_str(&format!("  {name:<8}|{row}|\n"));
    }
    out.push_str(&format!(
        "  {:<8} one column = {} ms; full height = {peak} requests\n",
        "",
        bucket.as_millis()
    ));
    out
}

/// Runs the demo, printing progress to stderr and the results to stdout.
pub async fn run(opts: DemoOptions) -> anyhow::Result<()> {
    let dir = std::env::temp_dir().join(format!("sluice-demo-{}", uuid::Uuid::now_v7().simple()));
    std::fs::create_dir_all(&dir).context("creating a scratch directory")?;
    let result = run_in(&dir, &opts).await;
    let _ = std::fs::remove_dir_all(&dir);
    result
}

async fn run_in(dir: &std::path::Path, opts: &DemoOptions) -> anyhow::Result<()> {
    let url = format!("sqlite:{}", dir.join("demo.db").display());
    let store = Store::connect(&url, &StoreOptions::default()).await?;
    store.migrate().await?;

    // The sink: records when each request arrives, per lane.
    let arrivals: Arc<Mutex<HashMap<String, Vec<Instant>>>> = Arc::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let stop = CancellationToken::new();
    let recorded = arrivals.clone();
    let app = axum::Router::new().fallback(move |uri: axum::http::Uri| {
        let recorded = recorded.clone();
        async move {
            let at = Instant::now();
            if let Ok(mut m) = recorded.lock() {
                m.entry(uri.path().to_owned()).or_default().push(at);
            }
            "ok"
        }
    });
    let sink_stop = stop.clone();
    let sink = tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(async move { sink_stop.cancelled().await })
            .await
    });

    let lanes = [("leaky", 1u32), ("bursty", opts.burst)];
    for (name, burst) in lanes {
        let cfg = DestinationConfig {
            rate: opts.rate.clone(),
            capacity: opts.jobs as u64 * 2,
            burst: Some(burst),
            max_in_flight: None,
            allowed_base_urls: Vec::new(),
            timeout_ms: None,
            max_attempts: None,
            backoff_base_ms: None,
            backoff_cap_ms: None,
            retry_after_max_ms: None,
            throttle_floor_ms: None,
            throttle_backoff_base_ms: None,
            throttle_backoff_cap_ms: None,
            max_throttles: None,
            ratelimit_reset: None,
            adaptive_rate: None,
            paused: Some(true),
        };
        let spec = cfg.validate().map_err(|e| anyhow::anyhow!("{e}"))?;
        store
            .upsert_destination(&DestinationName::parse(name)?, &spec)
            .await?;
        let jobs = (0..opts.jobs)
            .map(|i| {
                JobRequest {
                    url: format!("http://{addr}/{name}"),
                    json: Some(serde_json::json!({ "n": i })),
                    ..Default::default()
                }
                .validate("")
                .map_err(|e| anyhow::anyhow!("{e}"))
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        store
            .enqueue(name, &jobs)
            .await
            .map_err(|e| anyhow::anyhow!("{e}"))?;
    }

    let (release_tx, mut releases) = tokio::sync::mpsc::unbounded_channel();
    let dispatcher = Dispatcher::new(
        store.clone(),
        DispatcherConfig::default(),
        Arc::new(Metrics::default()),
    )
    .with_observer(release_tx);
    let token = stop.child_token();
    let dispatch = tokio::spawn(dispatcher.run(token));
    // Let the dispatcher settle, then open both lanes at once.
    tokio::time::sleep(Duration::from_millis(200)).await;
    println!(
        "Sending {} jobs at {} through two destinations: leaky (burst 1) and bursty (burst {}).",
        opts.jobs, opts.rate, opts.burst
    );
    for (name, _) in lanes {
        store.set_paused(name, false).await?;
    }
    let started = Instant::now();
    let expected = opts.jobs * 2;
    let interactive = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let mut ticks = 0u32;
    let deadline = started + Duration::from_secs(600);
    loop {
        let (leaky, bursty) = {
            let m = arrivals
                .lock()
                .map_err(|_| anyhow::anyhow!("sink poisoned"))?;
            (
                m.get("/leaky").map_or(0, Vec::len),
                m.get("/bursty").map_or(0, Vec::len),
            )
        };
        let line = format!(
            "  {:>5.1} s   leaky {leaky:>4}/{}   bursty {bursty:>4}/{}",
            started.elapsed().as_secs_f64(),
            opts.jobs,
            opts.jobs
        );
        if interactive {
            eprint!("\r{line}");
            let _ = std::io::stderr().flush();
        } else if ticks.is_multiple_of(10) {
            eprintln!("{line}");
        }
        ticks += 1;
        if leaky + bursty >= expected {
            break;
        }
        anyhow::ensure!(Instant::now() < deadline, "the demo did not finish");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    if interactive {
        eprintln!();
    }
    stop.cancel();
    let _ = dispatch.await;
    let _ = sink.await;
    store.close().await;

    let m = arrivals
        .lock()
        .map_err(|_| anyhow::anyhow!("sink poisoned"))?
        .clone();
    let mut leaky = m.get("/leaky").cloned().unwrap_or_default();
    let mut bursty = m.get("/bursty").cloned().unwrap_or_default();
    leaky.sort();
    bursty.sort();
    let (l, b) = (lane_stats(&leaky), lane_stats(&bursty));
    let mut released: HashMap<String, Vec<Instant>> = HashMap::new();
    while let Ok(ev) = releases.try_recv() {
        released
            .entry(ev.destination.to_string())
            .or_default()
            .push(ev.at);
    }
    let sent_gap = |lane: &str| {
        let mut t = released.get(lane).cloned().unwrap_or_default();
        t.sort();
        lane_stats(&t).min_gap.as_secs_f64() * 1e3
    };
    println!();
    println!(
        "  {:<26} {:>12} {:>12}",
        "",
        "leaky",
        format!("burst {}", opts.burst)
    );
    println!(
        "  {:<26} {:>10.2} s {:>10.2} s",
        "total time",
        l.total.as_secs_f64(),
        b.total.as_secs_f64()
    );
    println!(
        "  {:<26} {:>12} {:>12}",
        "most requests in 100 ms", l.max_in_100ms, b.max_in_100ms
    );
    println!(
        "  {:<26} {:>9.2} ms {:>9.2} ms",
        "minimum gap, as sent",
        sent_gap("leaky"),
        sent_gap("bursty")
    );
    println!(
        "  {:<26} {:>9.2} ms {:>9.2} ms",
        "minimum gap, as received",
        l.min_gap.as_secs_f64() * 1e3,
        b.min_gap.as_secs_f64() * 1e3
    );
    println!();
    print!("{}", timeline(&[("leaky", &leaky), ("bursty", &bursty)]));
    println!();
    println!(
        "Same average rate: the bursty lane front-loads {} requests; the leaky lane never",
        opts.burst
    );
    println!("sends two closer than one interval. \"As sent\" is when the dispatcher released");
    println!("each request; \"as received\" adds this machine's loopback jitter.");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stats_and_timeline() {
        let t0 = Instant::now();
        let even: Vec<Instant> = (0..10)
            .map(|i| t0 + Duration::from_millis(20 * i))
            .collect();
        let s = lane_stats(&even);
        assert_eq!(s.total, Duration::from_millis(180));
        assert_eq!(s.max_in_100ms, 6);
        assert_eq!(s.min_gap, Duration::from_millis(20));
        let burst: Vec<Instant> = (0..5).map(|_| t0).collect();
        assert_eq!(lane_stats(&burst).max_in_100ms, 5);
        assert_eq!(lane_stats(&burst).min_gap, Duration::ZERO);
        let text = timeline(&[("a", &even), ("b", &burst)]);
        assert_eq!(text.lines().count(), 3);
        assert!(text.contains("|█"), "{text}");
        assert!(text.contains("full height = 5"), "{text}");
        assert!(timeline(&[]).is_empty());
    }

    #[test]
    fn window_slides_and_is_inclusive() {
        let t0 = Instant::now();
        let at: Vec<Instant> = [0, 10, 150, 160, 170, 260]
            .iter()
            .map(|&ms| t0 + Duration::from_millis(ms))
            .collect();
        let ms = Duration::from_millis;
        assert_eq!(max_in_window(&at, ms(100)), 3);
        assert_eq!(max_in_window(&at, ms(110)), 4, "150..260 holds four");
        assert_eq!(max_in_window(&at, ms(5)), 1);
        assert_eq!(max_in_window(&at, ms(300)), 6);
        assert_eq!(max_in_window(&[], ms(100)), 0);
    }
}
